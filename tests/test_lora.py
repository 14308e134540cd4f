"""LoRA adapters on a GPT: exact start, targeted layers and shapes, training only the adapters, merging, meta loading."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from litgpt.checkpoint.model_files import load_model_weights, meta_device
from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.lora import (
    LoRALinear,
    LoRASettings,
    add_lora,
    init_lora_weights,
    is_lora_key,
    load_base_weights,
    load_lora_weights,
    lora_parameter_count,
    lora_state_dict,
    mark_only_lora_as_trainable,
    merge_lora_weights,
    plain_state_dict,
)
from litgpt.model import GPT
from litgpt.moe import AdaptedLinear, Router

pytestmark = pytest.mark.usefixtures("one_torch_thread")


BASE = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=100, block_size=32, padding_multiple=64)
CONFIGS = {
    # LLaMA-style with grouped-query attention: q 64 rows, k 32, v 32.
    "llama_gqa": dict(BASE, n_query_groups=2),
    # GPT-NeoX-style: biases everywhere, LayerNorm, parallel residual, GELU MLP (fc/proj), multi-head.
    "neox": dict(
        BASE, bias=True, norm_class_name="LayerNorm", parallel_residual=True, mlp_class_name="GptNeoxMLP",
        rotary_percentage=0.25,
    ),
    # Mixture of experts with a router that must stay untouched.
    "moe": dict(
        BASE, n_query_groups=1, mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32
    ),
    # gpt-oss: biased attention and experts (adapted in the grouped kernel with their biases), sinks, biased router.
    "gpt_oss": dict(
        BASE, n_query_groups=2, bias=True, mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2,
        moe_intermediate_size=32, attention_sinks=True, router_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0,
        sliding_window_size=4, sliding_window_pattern=2,
    ),
}
ALL_TARGETS = dict(query=True, key=True, value=True, projection=True, mlp=True, head=True)


def make_model(name: str, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**{**CONFIGS[name], **overrides}))
    model.init_weights()
    return model


def randomize_adapters(model: nn.Module, seed: int = 1) -> None:
    """Give every B a non-zero value, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_key(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- settings --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(r=0), "lora_r"),
        (dict(r=-2), "lora_r"),
        (dict(dropout=1.0), "lora_dropout"),
        (dict(dropout=-0.1), "lora_dropout"),
        (dict(alpha=0), "lora_alpha"),
        (dict(query=False, value=False), "targets no layer"),
        (dict(r=0, query=False, value=False), "targets no layer"),
    ],
)
def test_settings_validation(kwargs, message):
    with pytest.raises(UserError, match=message):
        LoRASettings(**kwargs)


def test_settings_round_trip_through_hparams():
    settings = LoRASettings(r=4, alpha=8, dropout=0.0, key=True, mlp=True)
    hparams = settings.to_hparams()
    assert hparams["lora_r"] == 4 and hparams["lora_mlp"] is True and set(hparams) == {
        "lora_r", "lora_alpha", "lora_dropout", "lora_query", "lora_key", "lora_value", "lora_projection",
        "lora_mlp", "lora_head",
    }
    assert LoRASettings.from_hparams({**hparams, "learning_rate": 1e-3}) == settings
    with pytest.raises(UserError, match="lora_alpha"):
        LoRASettings.from_hparams({"lora_r": 4})


def test_head_with_tied_embeddings_is_refused():
    model = make_model("llama_gqa", tie_embeddings=True)
    with pytest.raises(UserError, match="tie"):
        add_lora(model, LoRASettings(head=True))


# ---- adapters start at zero --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_b_gives_the_base_logits_exactly(name):
    base = make_model(name)
    adapted = make_model(name)
    add_lora(adapted, LoRASettings(dropout=0.1, **ALL_TARGETS))
    x = tokens()
    for mode in ("train", "eval"):
        getattr(base, mode)(), getattr(adapted, mode)()
        assert torch.equal(base(x), adapted(x)), mode
    # B starts at zero, A is Kaiming-uniform with bound 1/sqrt(in_features).
    for key, value in lora_state_dict(adapted).items():
        if ".lora_B" in key:
            assert torch.count_nonzero(value) == 0, key
        else:
            bound = 1 / math.sqrt(value.shape[1])
            assert value.abs().max() <= bound and value.abs().max() > 0.5 * bound, key


# ---- which tensors exist ----------------------------------------------------------------------------------------------
def expected_adapters(name: str, settings: LoRASettings) -> dict[str, tuple[int, int]]:
    config = Config(**CONFIGS[name])
    r, d, hs = settings.r, config.n_embd, config.head_size
    rows = {"q": config.n_head * hs, "k": config.n_query_groups * hs, "v": config.n_query_groups * hs}
    shapes = {}

    def plain(prefix, fan_in, fan_out):
        shapes[f"{prefix}.lora_A"] = (r, fan_in)
        shapes[f"{prefix}.lora_B"] = (fan_out, r)

    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        for part, enabled in (("q", settings.query), ("k", settings.key), ("v", settings.value)):
            if enabled:
                shapes[f"{block}.attn.qkv.lora_A_{part}"] = (r, d)
                shapes[f"{block}.attn.qkv.lora_B_{part}"] = (rows[part], r)
        if settings.projection:
            plain(f"{block}.attn.proj", config.n_head * hs, d)
        if settings.mlp:
            if config.mlp_class_name == "LLaMAMoE":
                for j in range(config.n_expert):
                    size = config.moe_intermediate_size
                    plain(f"{block}.mlp.experts.{j}.fc_1", d, size)
                    plain(f"{block}.mlp.experts.{j}.fc_2", d, size)
                    plain(f"{block}.mlp.experts.{j}.proj", size, d)
            elif config.mlp_class_name == "GptNeoxMLP":
                plain(f"{block}.mlp.fc", d, config.intermediate_size)
                plain(f"{block}.mlp.proj", config.intermediate_size, d)
            else:
                plain(f"{block}.mlp.fc_1", d, config.intermediate_size)
                plain(f"{block}.mlp.fc_2", d, config.intermediate_size)
                plain(f"{block}.mlp.proj", config.intermediate_size, d)
    if settings.head:
        plain("lm_head", d, config.padded_vocab_size)
    return shapes


SWITCHES = [
    dict(),  # the default: query and value
    dict(query=False, value=False, key=True),
    dict(query=True, key=True, value=True),
    dict(query=False, value=False, projection=True),
    dict(query=False, value=False, mlp=True),
    dict(query=False, value=False, head=True),
    dict(ALL_TARGETS, r=3),
]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(k for k, v in s.items() if v is True) or "default")
def test_switches_create_exactly_the_expected_adapters(name, switches):
    settings = LoRASettings(**switches)
    model = make_model(name)
    plain_keys = list(model.state_dict())
    add_lora(model, settings)
    shapes = {key: tuple(value.shape) for key, value in lora_state_dict(model).items()}
    assert shapes == expected_adapters(name, settings)
    assert lora_parameter_count(model) == sum(math.prod(shape) for shape in shapes.values())
    # The base keys are unchanged, in the same order.
    assert [key for key in model.state_dict() if not is_lora_key(key)] == plain_keys
    if name == "moe":
        assert type(model.transformer.h[0].mlp.gate) is Router  # the router never gets an adapter


def test_qkv_parts_write_only_their_rows():
    config = Config(**CONFIGS["llama_gqa"])
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    for part, (start, stop) in {"query": (0, q), "key": (q, q + kv), "value": (q + kv, q + 2 * kv)}.items():
        model = make_model("llama_gqa")
        switches = {**dict(query=False, key=False, value=False), part: True}
        add_lora(model, LoRASettings(dropout=0.0, **switches))
        randomize_adapters(model)
        qkv = model.transformer.h[0].attn.qkv
        x = torch.randn(3, config.n_embd)
        delta = qkv(x) - nn.functional.linear(x, qkv.weight, qkv.bias)
        assert delta[:, start:stop].abs().min() > 0
        assert torch.count_nonzero(delta[:, :start]) == 0 and torch.count_nonzero(delta[:, stop:]) == 0
        weight_delta = qkv.merged_weight() - qkv.weight
        assert torch.count_nonzero(weight_delta[:start]) == 0 and torch.count_nonzero(weight_delta[stop:]) == 0


# ---- training only the adapters -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama_gqa", "moe"])
def test_training_changes_only_the_adapters(name):
    model = make_model(name)
    add_lora(model, LoRASettings(r=4, alpha=8, dropout=0.0, **ALL_TARGETS))
    mark_only_lora_as_trainable(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(lora_state_dict(model))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    batch = tokens(batch=2, length=13, seed=3)
    losses = []
    for _ in range(5):
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        for param_name, param in model.named_parameters():
            # An expert that no token was routed to in this batch gets no gradient either.
            if is_lora_key(param_name) and ".experts." not in param_name:
                assert param.grad is not None, param_name
            elif not is_lora_key(param_name):
                assert param.grad is None, param_name
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    for key, value in model.state_dict().items():
        changed = not torch.equal(value, before[key])
        assert changed == is_lora_key(key) or ".experts." in key and not changed, key


# ---- merging ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_merged_plain_model_equals_the_adapted_model(name):
    adapted = make_model(name)
    add_lora(adapted, LoRASettings(r=4, alpha=32, **ALL_TARGETS))
    randomize_adapters(adapted)
    adapted.eval()
    x = tokens()
    expected = adapted(x)
    base_logits = make_model(name).eval()(x)
    assert (expected - base_logits).abs().max() > 1e-2  # the adapters do matter

    plain = GPT(Config(**CONFIGS[name])).eval()
    state = plain_state_dict(adapted)
    assert not any(is_lora_key(key) for key in state)
    load_model_weights(plain, state, source="the merged weights")
    torch.testing.assert_close(plain(x), expected, atol=1e-5, rtol=0)

    # In place: the adapters are folded in and skipped from then on; merging twice changes nothing.
    merge_lora_weights(adapted)
    merge_lora_weights(adapted)
    torch.testing.assert_close(adapted(x), expected, atol=1e-5, rtol=0)
    merged_state = {key: value for key, value in adapted.state_dict().items() if not is_lora_key(key)}
    assert list(merged_state) == list(state)
    for key in state:
        torch.testing.assert_close(merged_state[key], state[key], atol=1e-6, rtol=0, msg=key)


def test_plain_state_dict_leaves_the_model_as_it_was():
    model = make_model("llama_gqa")
    add_lora(model, LoRASettings(**ALL_TARGETS))
    randomize_adapters(model)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    plain_state_dict(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# ---- meta device, loading ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_load_base_weights_then_init(tie):
    base = make_model("llama_gqa", tie_embeddings=tie)
    base_state = base.state_dict()
    with meta_device():
        model = GPT(Config(**CONFIGS["llama_gqa"], tie_embeddings=tie))
    settings = LoRASettings(query=True, key=True, value=True, projection=True, mlp=True, head=not tie)
    add_lora(model, settings)
    assert all(param.is_meta for param in model.parameters())
    load_base_weights(model, base_state, source="base.pth")
    assert not any(param.is_meta for name, param in model.named_parameters() if not is_lora_key(name))
    assert all(param.is_meta for name, param in model.named_parameters() if is_lora_key(name))
    init_lora_weights(model)
    assert not any(param.is_meta for param in model.parameters())
    if tie:
        assert model.lm_head.weight is model.transformer.wte.weight
    # The base tensors are taken as they are (assign), not copied.
    assert model.transformer.h[0].attn.qkv.weight.data_ptr() == base_state["transformer.h.0.attn.qkv.weight"].data_ptr()
    x = tokens()
    assert torch.equal(model.eval()(x), base.eval()(x))
    # The adapters train: a step moves the logits away from the base.
    mark_only_lora_as_trainable(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(x).logsumexp(-1).mean().backward()
    optimizer.step()
    assert not torch.equal(model.eval()(x), base(x))


def test_load_base_weights_names_the_first_mismatch():
    model = make_model("llama_gqa")
    add_lora(model, LoRASettings())
    good = make_model("llama_gqa", seed=5).state_dict()
    load_base_weights(model, good, source="good.pth")
    assert torch.equal(model.transformer.h[1].mlp.proj.weight, good["transformer.h.1.mlp.proj.weight"])

    missing = dict(good)
    del missing["transformer.h.1.attn.qkv.weight"]
    with pytest.raises(UserError, match=r"missing \(first: transformer\.h\.1\.attn\.qkv\.weight\)") as info:
        load_base_weights(model, missing, source="bad.pth")
    assert "bad.pth" in str(info.value) and "\n" not in str(info.value)

    with pytest.raises(UserError, match=r"unexpected \(first: transformer\.h\.0\.attn\.qkv\.lora_A_q"):
        load_base_weights(model, {**good, **lora_state_dict(model)}, source="bad.pth")

    other = make_model("llama_gqa", n_embd=32).state_dict()
    with pytest.raises(UserError, match=r"lm_head\.weight has shape \(128, 32\), the config expects \(128, 64\)"):
        load_base_weights(model, other, source="bad.pth")
    misshapen = {**good, "transformer.h.1.mlp.fc_2.weight": torch.zeros(3, 64)}
    with pytest.raises(UserError, match=r"transformer\.h\.1\.mlp\.fc_2\.weight has shape \(3, 64\)"):
        load_base_weights(model, misshapen, source="bad.pth")


def test_lora_state_dict_is_small_and_loads_back():
    model = make_model("llama_gqa")
    add_lora(model, LoRASettings(r=2))
    randomize_adapters(model)
    adapters = lora_state_dict(model)
    assert all(is_lora_key(key) for key in adapters)
    total = sum(p.numel() for p in model.parameters())
    assert lora_parameter_count(model) == sum(v.numel() for v in adapters.values()) < total / 20

    fresh = make_model("llama_gqa")
    add_lora(fresh, LoRASettings(r=2))
    load_lora_weights(fresh, {k: v.clone() for k, v in adapters.items()}, source="adapters.pth")
    x = tokens()
    torch.testing.assert_close(fresh.eval()(x), model.eval()(x), atol=0, rtol=0)

    wrong_rank = make_model("llama_gqa")
    add_lora(wrong_rank, LoRASettings(r=4))
    with pytest.raises(UserError, match="lora_A_q has shape"):
        load_lora_weights(wrong_rank, adapters, source="adapters.pth")
    with pytest.raises(UserError, match="missing"):
        load_lora_weights(fresh, {}, source="adapters.pth")


def test_adding_twice_is_refused():
    model = make_model("llama_gqa")
    add_lora(model, LoRASettings())
    assert isinstance(model.transformer.h[0].attn.qkv, LoRALinear)
    with pytest.raises(RuntimeError, match="already"):
        add_lora(model, LoRASettings())


# ---- independent references: a hand computation and peft -----------------------------------------------------------
# float32 results agree with the references to a few float32 ulps (eps = 1.19e-7) of the largest value compared:
# measured on these layers, max |difference| / max |expected| is at most 2.5e-7 (largest absolute difference 4.8e-6,
# with outputs up to ~19; 1e-7 against peft on a single layer, 1.3e-7 for the merged weights). The bound is 4x that
# and orders of magnitude below the size of the updates (> 0.1), so a wrong scale, row or factor fails.
F32_RELATIVE_TO_MAX = 1e-6


def assert_f32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 `actual` equals `expected` (float32 or float64) up to float32 rounding of its largest value."""
    expected = expected.detach().double()
    atol = F32_RELATIVE_TO_MAX * expected.abs().max().item()
    torch.testing.assert_close(actual.detach().double(), expected, atol=atol, rtol=0)


def random_factors(layer: LoRALinear, seed: int = 2) -> None:
    """Non-zero A and B for every part of `layer`, as training would leave them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if is_lora_key(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def hand_forward(x, weight, bias, updates, scaling):
    """W x + b + scaling * B A x in float64, where `updates` lists (row start, row stop, A, B)."""
    x, out = x.double(), x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    for start, stop, a, b in updates:
        out[..., start:stop] += scaling * ((x @ a.double().T) @ b.double().T)
    return out


def hand_merge(weight, updates, scaling):
    """W + scaling * B A over the rows each update writes, in float64."""
    merged = weight.detach().double().clone()
    for start, stop, a, b in updates:
        merged[start:stop] += scaling * (b.detach().double() @ a.detach().double())
    return merged


def qkv_rows(config: Config) -> dict[str, tuple[int, int]]:
    """The fused projection stacks all query heads, then the key heads of each group, then the value heads."""
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}


@pytest.mark.parametrize("r, alpha", [(1, 1), (4, 16), (8, 4), (3, 7.5)])
def test_scaling_is_alpha_over_r(r, alpha):
    settings = LoRASettings(r=r, alpha=alpha, dropout=0.0, mlp=True)
    assert settings.scaling == alpha / r
    model = make_model("llama_gqa")
    add_lora(model, settings)
    for layer in (model.transformer.h[0].attn.qkv, model.transformer.h[1].mlp.proj):
        assert layer.r == r and layer.scaling == alpha / r


def test_a_single_part_adapter_is_what_the_experts_kernels_read():
    """The MoE kernels read an expert's adapter through `litgpt.moe.AdaptedLinear`: a plain adapter provides it, a
    plain linear layer and the fused q/k/v adapter (one factor pair per part) do not."""
    layer = LoRALinear(nn.Linear(24, 40), r=4, alpha=8, dropout=0.1)
    assert isinstance(layer, AdaptedLinear)
    assert (layer.r, layer.scaling, layer.merged) == (4, 2.0, False)
    assert layer.lora_A.shape == (4, 24) and layer.lora_B.shape == (40, 4)
    assert isinstance(layer.lora_dropout, nn.Dropout)
    assert not isinstance(nn.Linear(24, 40), AdaptedLinear)
    assert not isinstance(LoRALinear(nn.Linear(24, 40), r=4, alpha=8, parts={"_q": (0, 8)}), AdaptedLinear)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("r, alpha", [(4, 8), (2, 32), (3, 1.5)])
def test_linear_forward_and_merge_equal_the_hand_computation(r, alpha, bias):
    torch.manual_seed(0)
    base = nn.Linear(24, 40, bias=bias)
    weight, bias_value = base.weight.detach().clone(), None if base.bias is None else base.bias.detach().clone()
    layer = LoRALinear(base, r=r, alpha=alpha, dropout=0.0)
    random_factors(layer)
    a, b = layer.lora_A.detach(), layer.lora_B.detach()
    x = torch.randn(3, 5, 24)
    expected = hand_forward(x, weight, bias_value, [(0, 40, a, b)], alpha / r)
    assert (expected - hand_forward(x, weight, bias_value, [], 1.0)).abs().max() > 0.1  # the update matters
    assert_f32_close(layer(x), expected)
    assert_f32_close(layer.merged_weight(), hand_merge(weight, [(0, 40, a, b)], alpha / r))
    # Dropout acts in training only: in eval mode a layer with dropout computes the same.
    with_dropout = LoRALinear(nn.Linear(24, 40, bias=bias), r=r, alpha=alpha, dropout=0.5)
    with_dropout.load_state_dict(layer.state_dict())
    assert_f32_close(with_dropout.eval()(x), expected)
    assert not torch.allclose(with_dropout.train()(x).double(), expected, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_and_merge_equal_peft(bias):
    from peft import LoraConfig, inject_adapter_in_model

    class Plain(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

    torch.manual_seed(0)
    r, alpha = 4, 12
    base = nn.Linear(32, 48, bias=bias)
    theirs = Plain(nn.Linear(32, 48, bias=bias))
    theirs.lin.load_state_dict(base.state_dict())
    peft_config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["lin"])
    theirs = inject_adapter_in_model(peft_config, theirs)
    ours = LoRALinear(base, r=r, alpha=alpha, dropout=0.0)
    random_factors(ours)
    with torch.no_grad():
        theirs.lin.lora_A["default"].weight.copy_(ours.lora_A)
        theirs.lin.lora_B["default"].weight.copy_(ours.lora_B)
    assert theirs.lin.scaling["default"] == ours.scaling == alpha / r
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = theirs.lin(x)
        assert (expected - theirs.lin.base_layer(x)).abs().max() > 0.1  # the update matters
        assert_f32_close(ours(x), expected)
        assert_f32_close(ours.merged_weight(), theirs.lin.base_layer.weight + theirs.lin.get_delta_weight("default"))


@pytest.mark.parametrize("n_query_groups", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("parts", [("q", "v"), ("q", "k", "v"), ("k",)])
def test_fused_qkv_equals_peft_on_separate_projections_and_the_hand_merge(n_query_groups, parts):
    """The fused q/k/v projection with per-part adapters computes what three separate q/k/v projections with peft's
    LoRA on the same parts compute, and merges to W + alpha/r B A on each part's rows (the others unchanged)."""
    from peft import LoraConfig, inject_adapter_in_model

    r, alpha = 4, 24
    model = make_model("llama_gqa", n_query_groups=n_query_groups, n_layer=1)
    config = model.config
    base_weight, base_bias = model.transformer.h[0].attn.qkv.weight.detach().clone(), None
    switches = {"query": "q" in parts, "key": "k" in parts, "value": "v" in parts}
    add_lora(model, LoRASettings(r=r, alpha=alpha, dropout=0.0, **switches))
    qkv = model.transformer.h[0].attn.qkv
    random_factors(qkv)
    rows = qkv_rows(config)
    assert (rows["v"][1], rows["k"][1] - rows["k"][0]) == (config.qkv_size, n_query_groups * config.head_size)

    class Separate(nn.Module):
        def __init__(self):
            super().__init__()
            for part, (start, stop) in rows.items():
                projection = nn.Linear(config.n_embd, stop - start, bias=False)
                projection.weight.data.copy_(base_weight[start:stop])
                setattr(self, f"{part}_proj", projection)

    targets = [f"{part}_proj" for part in parts]
    theirs = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets),
                                     Separate())
    updates = []
    with torch.no_grad():
        for part in parts:
            a, b = getattr(qkv, f"lora_A_{part}"), getattr(qkv, f"lora_B_{part}")
            getattr(theirs, f"{part}_proj").lora_A["default"].weight.copy_(a)
            getattr(theirs, f"{part}_proj").lora_B["default"].weight.copy_(b)
            updates.append((*rows[part], a.detach(), b.detach()))
        x = torch.randn(2, 5, config.n_embd)
        expected = torch.cat([getattr(theirs, f"{part}_proj")(x) for part in rows], dim=-1)
        assert_f32_close(qkv(x), expected)
        assert_f32_close(qkv(x), hand_forward(x, base_weight, base_bias, updates, alpha / r))

    merged = hand_merge(base_weight, updates, alpha / r)
    for part, (start, stop) in rows.items():
        changed = (merged[start:stop] - base_weight[start:stop].double()).abs().max()
        assert (changed > 1e-2) == (part in parts), part
    assert_f32_close(qkv.merged_weight(), merged)
    assert_f32_close(plain_state_dict(model)["transformer.h.0.attn.qkv.weight"], merged)
    merge_lora_weights(model)
    assert_f32_close(qkv.weight, merged)
