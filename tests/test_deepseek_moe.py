"""The DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5): shared experts, sigmoid scores with a
correction bias, group-limited top-k, scaled weights and dense first layers, against transformers' own blocks;
its config fields, their contradictions, and the GLM-4.5 checkpoint's multi-token prediction layer."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import build_hf_model, save_hf_model
from test_moe import outputs_and_grads

from litgpt.config import Config
from litgpt.convert.families.configs import config_from_hf, config_to_hf
from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint
from litgpt.errors import UserError
from litgpt.mlp import LLaMAMLP
from litgpt.model import GPT
from litgpt.moe import LLaMAMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = dict(n_layer=3, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, padded_vocab_size=128, block_size=32,
            mlp_class_name="LLaMAMoE", intermediate_size=96, moe_intermediate_size=32, n_expert=8,
            n_expert_per_token=3)
# DeepSeek-V3's routing, as GLM-4.5 has it: 4 groups of 2 experts, 2 groups per token, 3 experts among them.
NOAUX_TC = dict(moe_n_shared_expert=2, moe_score_function="sigmoid", moe_expert_bias=True, moe_n_group=4,
                moe_topk_group=2, moe_routed_scaling=2.5, moe_first_dense_layers=1)
# DeepSeek-V2's group_limited_greedy: softmax, groups by their best probability, not renormalized.
GROUP_LIMITED_GREEDY = dict(moe_n_shared_expert=1, moe_n_group=4, moe_topk_group=2, moe_group_score="max",
                            moe_renormalize=False, moe_routed_scaling=16.0)


def make_moe(**fields) -> LLaMAMoE:
    torch.manual_seed(0)
    moe = LLaMAMoE(Config(**{**BASE, **fields}))
    with torch.no_grad():
        for name, param in moe.named_parameters():
            param.normal_(0, 0.5 if name == "gate.weight" else 0.2)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.normal_(0, 0.5)
    return moe


def hf_block(moe: LLaMAMoE):
    """transformers' Glm4MoeMoE (sigmoid routers) or DeepseekV2Moe (softmax) with the weights of `moe` copied in."""
    c = moe.config
    common = dict(hidden_size=c.n_embd, moe_intermediate_size=c.moe_intermediate_size, n_routed_experts=c.n_expert,
                  num_experts_per_tok=c.n_expert_per_token, n_shared_experts=c.moe_n_shared_expert,
                  n_group=c.moe_n_group, topk_group=c.moe_topk_group, routed_scaling_factor=c.moe_routed_scaling,
                  norm_topk_prob=c.moe_renormalize)
    if c.moe_score_function == "sigmoid":
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

        block = Glm4MoeMoE(Glm4MoeConfig(**common))
    else:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        block = DeepseekV2Moe(DeepseekV2Config(**common, topk_method="group_limited_greedy"))
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        if moe.gate.e_score_correction_bias is not None:
            block.gate.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([expert.fc_1.weight, expert.fc_2.weight]))
            block.experts.down_proj[e].copy_(expert.proj.weight)
        for ours, theirs in (("fc_1", "gate_proj"), ("fc_2", "up_proj"), ("proj", "down_proj")):
            getattr(block.shared_experts, theirs).weight.copy_(getattr(moe.shared_experts, ours).weight)
    return block.eval()


@pytest.mark.parametrize("fields", [NOAUX_TC, GROUP_LIMITED_GREEDY], ids=["noaux_tc", "group_limited_greedy"])
def test_moe_equals_transformers_forward_and_gradients(fields):
    moe = make_moe(**fields)
    hf = hf_block(moe)
    x = torch.randn(2, 9, 64)
    out, x_grad, grads = outputs_and_grads(LLaMAMoE.__call__, moe, x)
    hf_out, hf_x_grad, _ = outputs_and_grads(lambda _, x: hf(x), moe, x)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, hf_out, **close)
    torch.testing.assert_close(x_grad, hf_x_grad, **close)
    torch.testing.assert_close(grads["gate.weight"], hf.gate.weight.grad, **close)
    for e in range(moe.config.n_expert):
        fc_1, fc_2 = hf.experts.gate_up_proj.grad[e].split(32)
        torch.testing.assert_close(grads[f"experts.{e}.fc_1.weight"], fc_1, **close)
        torch.testing.assert_close(grads[f"experts.{e}.fc_2.weight"], fc_2, **close)
        torch.testing.assert_close(grads[f"experts.{e}.proj.weight"], hf.experts.down_proj.grad[e], **close)
    for ours, theirs in (("fc_1", "gate_proj"), ("fc_2", "up_proj"), ("proj", "down_proj")):
        hf_grad = getattr(hf.shared_experts, theirs).weight.grad
        torch.testing.assert_close(grads[f"shared_experts.{ours}.weight"], hf_grad, **close)
    assert moe.gate.e_score_correction_bias is None or "gate.e_score_correction_bias" not in grads  # a buffer


def test_routing_by_hand():
    """One token through the router, computed by hand: sigmoid scores, bias for the choice only, groups by the sum
    of their top two, weights renormalized then scaled."""
    moe = make_moe(**NOAUX_TC)
    x = torch.randn(1, 64)
    scores = torch.sigmoid(x @ moe.gate.weight.T)[0]
    choice = scores + moe.gate.e_score_correction_bias
    groups = [sorted(choice[2 * g : 2 * g + 2].tolist()) for g in range(4)]
    best_groups = sorted(range(4), key=lambda g: -sum(groups[g]))[:2]
    allowed = [e for e in range(8) if e // 2 in best_groups]
    chosen = sorted(allowed, key=lambda e: -choice[e].item())[:3]
    expected = scores[chosen] / scores[chosen].sum() * 2.5
    weights, experts, _ = moe.route(x)
    assert experts[0].tolist() == chosen
    torch.testing.assert_close(weights[0], expected)


def test_correction_bias_changes_the_chosen_experts_of_the_tiny_glm4_moe():
    """The tiny transformers case of tests/hf_models.py: its random correction bias changes the choice."""
    hf = build_hf_model("glm4_moe")
    router = hf.model.layers[1].mlp.gate
    chosen = []
    router.register_forward_hook(lambda module, args, out: chosen.append(out[2].sort(dim=-1).values))
    tokens = torch.randint(0, 211, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf(tokens)
        router.e_score_correction_bias.zero_()
        hf(tokens)
    assert (chosen[0] != chosen[1]).any(dim=-1).float().mean() > 0.2


def test_dense_first_layers_and_shared_experts():
    model = GPT(Config(**BASE, **NOAUX_TC))
    kinds = [type(block.mlp) for block in model.transformer.h]
    assert kinds == [LLaMAMLP, LLaMAMoE, LLaMAMoE]
    assert model.transformer.h[0].mlp.fc_1.out_features == 96
    assert model.transformer.h[1].mlp.shared_experts.fc_1.out_features == 2 * 32
    state = model.state_dict()
    assert state["transformer.h.1.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert not any(name.endswith("e_score_correction_bias") for name, _ in model.named_parameters())


def test_init_weights_zeroes_the_correction_bias():
    with torch.device("meta"):
        model = GPT(Config(**BASE, **NOAUX_TC))
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.equal(model.transformer.h[2].mlp.gate.e_score_correction_bias, torch.zeros(8))


def test_router_aux_loss_of_a_sigmoid_router_by_hand():
    """n_expert * sum_e f_e * P_e over both MoE layers, with P_e the mean of each token's sigmoid scores divided by
    their sum and f_e the share of the top-3 choices (one group, zero bias: the top 3 scores)."""
    torch.manual_seed(0)
    model = GPT(Config(**{**BASE, **NOAUX_TC, "moe_n_group": 1, "moe_topk_group": 1}, router_aux_loss_coef=0.1))
    model.init_weights()
    logits = []
    for block in model.transformer.h[1:]:
        block.mlp.gate.weight.data.normal_(0, 0.5)
        block.mlp.gate.register_forward_hook(lambda module, args, out: logits.append(out))
    model(torch.randint(0, 100, (2, 7)))
    scores = torch.cat(logits).sigmoid()
    fraction = torch.bincount(scores.topk(3, dim=-1).indices.flatten(), minlength=8) / scores.size(0)
    probability = (scores / scores.sum(-1, keepdim=True)).mean(0)
    expected = 0.1 * 8 * (fraction * probability).sum()
    torch.testing.assert_close(model.router_aux_loss(), expected)


def test_fields_survive_save_and_from_file(tmp_path):
    config = Config(**BASE, **NOAUX_TC, moe_group_score="max")
    config.save(tmp_path / "model_config.yaml")
    assert Config.from_file(tmp_path / "model_config.yaml") == config


def glm4_moe_json(**changes) -> dict:
    hf = config_to_hf(Config(**BASE, **NOAUX_TC, hf_model_type="glm4_moe", attn_bias=True, norm_qk=True,
                             rotary_percentage=0.5, head_size=32))
    return {**hf, **changes}


def test_config_json_round_trip():
    hf = glm4_moe_json()
    assert (hf["n_group"], hf["topk_group"], hf["first_k_dense_replace"], hf["n_shared_experts"]) == (4, 2, 1, 2)
    config = config_from_hf(hf)
    assert config_to_hf(config) == hf
    assert config.moe_routed_scaling == 2.5 and config.moe_expert_bias and config.rotary_percentage == 0.5


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(topk_group=5), "topk_group (5) must be between 1 and n_group (4)"),
        (dict(n_group=3), "n_routed_experts (8) is not divisible by n_group (3)"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok (5) exceeds the 4 experts of topk_group (2)"),
        (dict(first_k_dense_replace=7), "first_k_dense_replace (7) exceeds num_hidden_layers"),
    ],
)
def test_contradicting_config_json_names_the_fields(changes, named):
    with pytest.raises(UserError, match=r"^config\.json: " + named.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(glm4_moe_json(**changes))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(moe_n_group=4, moe_topk_group=5), "moe_topk_group"),
        (dict(moe_n_group=3), "moe_n_group"),
        (dict(moe_n_group=4, moe_topk_group=1, n_expert_per_token=3), "n_expert_per_token"),
        (dict(moe_first_dense_layers=4), "moe_first_dense_layers"),
    ],
)
def test_contradicting_config_fields_name_them(fields, named):
    with pytest.raises(UserError, match=named):
        Config(**{**BASE, **fields})


def test_multi_token_prediction_layer_is_skipped_with_a_note(tmp_path, capsys):
    """GLM-4.5's published checkpoint holds its MTP layer as model.layers.{num_hidden_layers}: left out, said so."""
    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    save_hf_model("glm4_moe", hf_dir)
    weights = load_file(hf_dir / "model.safetensors")
    weights.update({key.replace("layers.2.", "layers.3."): value.clone() for key, value in weights.items()
                    if key.startswith("model.layers.2.")})
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UserError, match="weights its config.json does not explain"):
        convert_hf_checkpoint(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    convert_hf_checkpoint(hf_dir)
    assert "Skipped the 1 multi-token prediction layer(s)" in capsys.readouterr().out


# The published config.json of zai-org/GLM-4.5 and GLM-4.5-Air, written out by hand (the keys that describe the
# architecture); GLM-4.6's differs from GLM-4.5's in max_position_embeddings alone.
GLM_4_5_JSON = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", attention_bias=True, head_dim=128, hidden_act="silu",
    hidden_size=5120, partial_rotary_factor=0.5, intermediate_size=12288, max_position_embeddings=131072,
    moe_intermediate_size=1536, norm_topk_prob=True, num_attention_heads=96, n_group=1, topk_group=1,
    n_routed_experts=160, n_shared_experts=1, routed_scaling_factor=2.5, num_experts_per_tok=8,
    first_k_dense_replace=3, num_hidden_layers=92, num_key_value_heads=8, rms_norm_eps=1e-5, rope_scaling=None,
    rope_theta=1000000, num_nextn_predict_layers=1, tie_word_embeddings=False, use_qk_norm=True, vocab_size=151552,
)
GLM_4_5_AIR_JSON = dict(
    GLM_4_5_JSON, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
    routed_scaling_factor=1.0, first_k_dense_replace=1, num_hidden_layers=46, use_qk_norm=False,
)


@pytest.mark.parametrize(
    ("name", "published"),
    [("GLM-4.5", GLM_4_5_JSON), ("GLM-4.5-Base", GLM_4_5_JSON), ("GLM-4.5-Air", GLM_4_5_AIR_JSON),
     ("GLM-4.5-Air-Base", GLM_4_5_AIR_JSON), ("GLM-4.6", dict(GLM_4_5_JSON, max_position_embeddings=202752))],
)
def test_named_glm_configs_equal_their_published_config_json(name, published):
    from litgpt.convert.hf_to_litgpt import architecture_differences

    assert architecture_differences(Config.from_name(name), config_from_hf(published)) == ""


def test_compress_moe_refuses_a_group_limited_router_in_one_line():
    from litgpt.compress_moe import CalibrationArgs, check_request

    with pytest.raises(UserError, match=r"within 4 groups of experts \(moe_n_group\)") as info:
        check_request(Config(**BASE, **NOAUX_TC), 4, "top_routed", CalibrationArgs())
    assert "\n" not in str(info.value)
    check_request(Config(**{**BASE, **NOAUX_TC, "moe_n_group": 1, "moe_topk_group": 1}), 4, "top_routed",
                  CalibrationArgs())


def test_plan_counts_the_dense_layer_and_the_shared_experts():
    """`litgpt plan`'s parameter count against one written out by hand: embeddings and head, attention with q/k/v
    biases and QK-norm, the dense first layer, then per MoE layer the router, 8 routed and 2 shared experts' width."""
    from litgpt.args import TrainArgs
    from litgpt.plan import plan_for

    config = Config(**BASE, **NOAUX_TC, attn_bias=True, norm_qk=True, head_size=16)
    attention = 64 * (4 + 2 * 2) * 16 + (4 + 2 * 2) * 16 + 4 * 16 * 64 + 2 * 16
    norms = 2 * 64
    dense = 3 * 64 * 96
    moe = 8 * 64 + 8 * 3 * 64 * 32 + 3 * 64 * (2 * 32)
    expected = 2 * 128 * 64 + 64 + 3 * (attention + norms) + dense + 2 * moe
    plan = plan_for(config, precision="32-true", train=TrainArgs(micro_batch_size=1, max_seq_length=32), device="cpu")
    assert plan.total_params == expected == sum(p.numel() for p in GPT(config).parameters())


def test_the_correction_bias_stays_float32_in_a_16_bit_model(tmp_path):
    """model.to(bfloat16) and `convert_to_litgpt --dtype bfloat16` keep it as transformers does (a bfloat16 bias
    would round differences of a thousandth away, and with them the choice of experts)."""
    moe = make_moe(**NOAUX_TC)
    bias = moe.gate.e_score_correction_bias.clone() + 1e-3
    moe.gate.e_score_correction_bias.copy_(bias)
    moe.bfloat16()
    assert moe.gate.weight.dtype == torch.bfloat16 and moe.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.e_score_correction_bias, bias)
    with torch.device("meta"):
        meta = GPT(Config(**BASE, **NOAUX_TC)).bfloat16()
    assert meta.transformer.h[1].mlp.gate.e_score_correction_bias.dtype == torch.float32

    hf_dir = tmp_path / "hf"
    hf = save_hf_model("glm4_moe", hf_dir)
    convert_hf_checkpoint(hf_dir, dtype="bfloat16")
    from litgpt.io import load_state_dict

    weights = load_state_dict(hf_dir / "lit_model.pth")
    key = "transformer.h.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(weights[key], hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert weights["transformer.h.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_a_sigmoid_router_computes_its_logits_in_float32_under_autocast():
    """As transformers' DeepseekV3/Glm4Moe routers do; a softmax router (Mixtral's) computes them in autocast's dtype."""
    moe = make_moe(**NOAUX_TC)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = moe.gate(x)
        softmax_logits = make_moe().gate(x)
    assert logits.dtype == torch.float32 and softmax_logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, x @ moe.gate.weight.T, rtol=0, atol=1e-5)
