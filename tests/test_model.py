"""Model behaviour that the conversion tests do not reach: meta-device init, rope scaling, masks."""

from __future__ import annotations

import pytest
import torch

from litgpt.config import Config
from litgpt.model import GPT, attention_mask
from litgpt.rope import rope_frequencies

SMALL = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, block_size=32, padding_multiple=64)


def test_padded_vocab_and_defaults():
    config = Config(**SMALL)
    assert config.padded_vocab_size == 128 and config.head_size == 16 and config.intermediate_size == 256
    assert config.qkv_size == (4 + 2 * 2) * 16


def test_meta_init_equals_eager_init():
    """A model built on the meta device and materialized equals one built in place from the same seed."""
    config = Config(**SMALL, tie_embeddings=True)
    eager = GPT(config)
    torch.manual_seed(7)
    eager.init_weights()
    with torch.device("meta"):
        lazy = GPT(config)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    torch.manual_seed(7)
    lazy.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(eager(tokens), lazy(tokens))


def test_init_statistics():
    config = Config(**SMALL)
    model = GPT(config)
    model.init_weights()
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.002
    residual = model.transformer.h[0].attn.proj.weight.std().item()
    assert abs(residual - 0.02 / (2 * config.n_layer) ** 0.5) < 0.002
    assert torch.all(model.transformer.h[0].norm_1.weight == 1)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
)
def test_rope_frequencies_equal_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, rope_parameters={**scaling, "rope_theta": 10000.0}
    )
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    ours = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    inv_freq, factor = rope_frequencies(128, 10000.0, ours)
    torch.testing.assert_close(inv_freq, expected.float())
    assert factor == pytest.approx(expected_factor)


def test_sliding_window_mask_by_hand():
    mask = attention_mask(5, 5, None, window=2, device="cpu")
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)
    # Decoding position 4 with a cache of 5 keys.
    assert torch.equal(attention_mask(1, 5, torch.tensor([4]), None, "cpu"), torch.ones(1, 5, dtype=torch.bool))
    assert attention_mask(5, 5, None, None, "cpu") is None


def test_softcapping_with_large_cap_equals_plain_attention():
    """The manual attention path (used for soft-capping) agrees with SDPA when the cap is too large to bite."""
    torch.manual_seed(0)
    plain = GPT(Config(**SMALL, sliding_window_size=3))
    plain.init_weights()
    capped = GPT(Config(**SMALL, sliding_window_size=3, attention_logit_softcapping=1e6))
    capped.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 100, (2, 12))
    torch.testing.assert_close(plain(tokens), capped(tokens), atol=1e-5, rtol=1e-5)


def test_sequence_longer_than_block_size():
    model = GPT(Config(**SMALL))
    with pytest.raises(ValueError, match="exceeds the model's block size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def _hf_moe_block(config: Config, moe):
    """transformers' own sparse MoE block with the weights of litgpt's `moe` copied in: Mixtral's (which always
    renormalizes the top-k router weights) or Qwen3-MoE's (norm_topk_prob off). Experts are fused tensors in
    transformers 5: gate_up_proj[e] = [w1 (gate); w3 (up)] and down_proj[e] = w2, litgpt's fc_1, fc_2 and proj."""
    if config.moe_renormalize:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hf_config = MixtralConfig(
            hidden_size=config.n_embd, intermediate_size=config.moe_intermediate_size, num_local_experts=config.n_expert,
            num_experts_per_tok=config.n_expert_per_token, hidden_act="silu", router_jitter_noise=0.0,
        )
        block = MixtralSparseMoeBlock(hf_config)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        hf_config = Qwen3MoeConfig(
            hidden_size=config.n_embd, moe_intermediate_size=config.moe_intermediate_size, num_experts=config.n_expert,
            num_experts_per_tok=config.n_expert_per_token, norm_topk_prob=False, hidden_act="silu",
        )
        block = Qwen3MoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([expert.fc_1.weight, expert.fc_2.weight]))
            block.experts.down_proj[e].copy_(expert.proj.weight)
    return block.eval()


@pytest.mark.parametrize(
    "n_expert, k, renormalize",
    [(3, 1, True), (4, 2, True), (8, 3, True), (4, 2, False), (8, 3, False)],
)
def test_moe_equals_transformers(n_expert, k, renormalize):
    """litgpt's LLaMAMoE (softmax over all experts, top-k, optionally renormalized) computes what transformers'
    Mixtral / Qwen3-MoE blocks compute with the same weights, to float32 precision."""
    torch.manual_seed(0)
    config = Config(**SMALL, mlp_class_name="LLaMAMoE", n_expert=n_expert, n_expert_per_token=k,
                    moe_intermediate_size=32, moe_renormalize=renormalize)
    model = GPT(config)
    model.init_weights()
    moe = model.transformer.h[0].mlp
    with torch.no_grad():  # weights that give outputs of order one and a router that prefers different experts
        for name, param in moe.named_parameters():
            param.normal_(0, 0.5 if name == "gate.weight" else 0.2)
    hf = _hf_moe_block(config, moe)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        chosen = moe.gate(x.reshape(-1, 64)).topk(k, dim=-1).indices
        assert set(chosen.flatten().tolist()) == set(range(n_expert))  # every expert gets tokens
        expected = hf(x)
        # float32 rounding only: measured max abs difference 1.9e-6 with outputs up to ~6, i.e. 3.1e-7 of the largest
        # output (float32 eps 1.2e-7); the bound is 1e-6 of it, ~3x the measured difference.
        torch.testing.assert_close(moe(x), expected, atol=1e-6 * expected.abs().max().item(), rtol=0)
        if k > 1:  # the renormalization matters: the other convention is far off
            other = _hf_moe_block(Config(**{**config.__dict__, "moe_renormalize": not renormalize}), moe)
            assert (other(x) - expected).abs().max() > 0.1


# ---- the norm and the gated MLP keep less for the backward pass, with autograd's results -------------------------------
def _composite_rms_norm(x, weight, eps, unit_offset):
    """RMSNorm as plain ops (transformers' order: float32 math, cast back, then the scale), left to autograd."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def _saved_bytes(fn, x, *weights) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of fn(x), x and `weights` left out."""
    storages = {}
    skip = {t.untyped_storage().data_ptr() for t in (x, *weights)}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values())


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_equals_its_composite_and_keeps_less(unit_offset, dtype, atol):
    from litgpt.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.normal_(0.3, 0.5)
    norm.to(dtype)
    x = torch.randn(2, 7, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 7, 64, dtype=dtype)
    ours = norm(x)
    ours_grads = torch.autograd.grad(ours, (x, norm.weight), grad)
    # The reference runs in float64 from the same inputs: the forward pass is bit for bit the composite's.
    reference = _composite_rms_norm(x, norm.weight, 1e-5, unit_offset)
    assert torch.equal(ours, reference)
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    n64 = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + 1e-5)
    out64 = n64 * (1.0 + w64) if unit_offset else w64 * n64
    reference_grads = torch.autograd.grad(out64, (x64, w64), grad.double())
    for got, want in zip(ours_grads, reference_grads):
        torch.testing.assert_close(got.double(), want, atol=atol * want.abs().max().item(), rtol=0)
    # Kept for the backward pass: the input (a leaf here, not counted) and one float32 per row.
    assert _saved_bytes(norm, x, norm.weight) == 2 * 7 * 4
    composite = _saved_bytes(lambda t: _composite_rms_norm(t, norm.weight, 1e-5, unit_offset), x, norm.weight)
    assert composite >= 2 * 7 * 64 * 4  # at least the float32 copy of the input


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gated_mlp_equals_its_composite_and_keeps_less(approximate, dtype):
    from litgpt.model import build_mlp

    config = Config(n_embd=32, intermediate_size=96, n_head=4, n_layer=1, bias=False,
                    mlp_class_name="LLaMAMLP" if approximate is None else "GemmaMLP",
                    gelu_approximate=approximate or "none")
    torch.manual_seed(0)
    mlp = build_mlp(config).to(dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 5, 32, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, 32, dtype=dtype)

    def composite(t):
        a = mlp.fc_1(t)
        act = torch.nn.functional.silu(a) if approximate is None else torch.nn.functional.gelu(a, approximate=approximate)
        return mlp.proj(act * mlp.fc_2(t))

    params = (x, *mlp.parameters())
    ours, reference = mlp(x), composite(x)
    assert torch.equal(ours, reference)
    ours_grads = torch.autograd.grad(ours, params, grad)
    reference_grads = torch.autograd.grad(reference, params, grad)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for got, want in zip(ours_grads, reference_grads):
        torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=0)
    # One tensor of the MLP's width (activation(gate)) fewer.
    width_bytes = 3 * 5 * 96 * x.element_size()
    assert _saved_bytes(composite, x) - _saved_bytes(mlp, x) == width_bytes


@pytest.mark.parametrize("no_rope_layers", [None, [0]])
@pytest.mark.parametrize("T", [24, 520])  # the CPU's matmul attention, and SDPA's kernel beyond its 512 positions
def test_attention_keeps_no_view_of_the_fused_qkv_output(no_rope_layers, T):
    """What attention saves for its backward pass holds q, k and v apart: a view of the fused projection's output
    would keep all of it alive (here q is 4x the keys, as in Llama 3). With RoPE only v is a view of it, without
    RoPE (a NoPE layer) q and k are too."""
    config = Config(n_layer=1, n_embd=64, n_head=8, n_query_groups=2, vocab_size=100, block_size=T,
                    no_rope_layers=no_rope_layers, bias=False)
    model = GPT(config)
    attn = model.transformer.h[0].attn
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages, recording = {}, []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if recording and ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    attn.register_forward_pre_hook(lambda module, args: (skip.add(args[0].untyped_storage().data_ptr()),
                                                         recording.append(True)) and None)
    attn.register_forward_hook(lambda *_: recording.clear())
    idx = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx).sum().backward()
    assert config.qkv_size == 96 and storages  # (q 64 + k 16 + v 16) per position
    assert 2 * T * config.qkv_size * 4 not in storages.values()
    assert 2 * T * config.n_query_groups * config.head_size * 4 in storages.values()  # v alone
    logits = model(idx)
    with torch.no_grad():  # the copies change no value: without gradients attention reads the views
        torch.testing.assert_close(logits.detach(), model(idx), rtol=1e-6, atol=1e-6)
