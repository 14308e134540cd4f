"""QLoRA: a bitsandbytes- or torchao-quantized frozen base with float adapters that train.

Tests that need bitsandbytes or torchao are skipped, with the reason, only when it cannot be imported
(`pip install 'litgpt[quantize]'` installs both). The sharded (FSDP) runs are in test_distributed.py.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.lora import LoRALinear, LoRASettings, add_lora, lora_state_dict, mark_only_lora_as_trainable, merge_lora_weights
from litgpt.model import GPT
from litgpt.moe import Router
from litgpt.nf4 import is_nf4
from litgpt import quantize
from litgpt.precision import Precision
from litgpt.quantize import (
    QUANTIZE_MODES, check_nf4_precision, check_nf4_shapes, check_quantize_mode, quantize_frozen_base, storage_mode,
    weight_bytes,
)

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
if HAVE_BNB:
    try:
        import bitsandbytes as bnb
    except Exception as error:  # installed but broken
        HAVE_BNB, BNB_PROBLEM = False, f"bitsandbytes does not import: {error}"
else:
    BNB_PROBLEM = "bitsandbytes is not installed (pip install 'litgpt[quantize]')"
needs_bnb = pytest.mark.skipif(not HAVE_BNB, reason=BNB_PROBLEM if not HAVE_BNB else "")
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (pip install 'litgpt[quantize]')")
BNB_MODES = [mode for mode in QUANTIZE_MODES if mode.startswith("bnb.")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> GPT:
    values = dict(n_layer=2, n_embd=128, n_head=4, n_query_groups=2, vocab_size=100, block_size=32, padding_multiple=64)
    torch.manual_seed(seed)
    model = GPT(Config(**{**values, **overrides}))
    model.init_weights()
    return model.to(dtype)


def loss_of(model: GPT, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


BATCH = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(0))


# ---- without bitsandbytes ---------------------------------------------------------------------------------------------
def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    model = make_model()
    with pytest.raises(UserError, match=r"pip install 'litgpt\[quantize\]'"):
        quantize_frozen_base(model, "bnb.nf4")
    assert type(model.transformer.h[0].attn.qkv) is nn.Linear  # nothing was changed


def test_unknown_mode():
    with pytest.raises(UserError, match="bnb.nf4-dq"):
        check_quantize_mode("bnb.nf3")


# ---- with bitsandbytes ------------------------------------------------------------------------------------------------
@needs_bnb
@pytest.mark.parametrize("dtype, mode, at_least", [
    (torch.float32, "bnb.nf4", 6.8),  # 32 bits -> 4 bits + one float32 scale per 64 weights
    (torch.bfloat16, "bnb.nf4", 3.4),  # 16 bits -> 4.5 bits
    (torch.bfloat16, "bnb.nf4-dq", 3.7),  # the scales themselves in 8 bits: about 4.13 bits
    (torch.bfloat16, "bnb.int8", 1.9),
])
def test_quantized_base_takes_a_fraction_of_the_memory(dtype, mode, at_least):
    model = make_model(dtype=dtype, n_layer=4, n_embd=256)
    add_lora(model, LoRASettings(query=True, key=True, value=True, projection=True, mlp=True))
    before = weight_bytes(model.transformer.h)
    quantize_frozen_base(model, mode)
    after = weight_bytes(model.transformer.h)
    assert before / after >= at_least, (before, after)
    assert before / after < at_least * 1.25, (before, after)
    # The adapters stay in the model's float dtype.
    assert all(value.dtype == dtype for value in lora_state_dict(model).values())


def assert_only_the_adapters_train(model: nn.Module, frozen_value) -> None:
    """Ten AdamW steps on the trainable parameters: the loss falls, exactly the LoRA adapters get gradients, and every
    frozen weight (as `frozen_value(param)` reads it) is unchanged."""
    frozen = {name: frozen_value(param) for name, param in model.named_parameters() if not param.requires_grad}
    assert frozen and all(".lora_" not in name for name in frozen)
    trainable = [param for param in model.parameters() if param.requires_grad]
    assert len(trainable) == len(lora_state_dict(model))
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(10):
        loss = loss_of(model, BATCH)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    for name, param in model.named_parameters():
        if name in frozen:
            assert param.grad is None and torch.equal(frozen_value(param), frozen[name]), name
        else:
            assert param.grad is not None, name


@needs_bnb
def test_nf4_qlora_trains_the_adapters_only():
    model = make_model()
    reference = make_model()
    add_lora(model, LoRASettings(r=8, alpha=16, dropout=0.0, mlp=True, projection=True))
    quantize_frozen_base(model, "bnb.nf4")
    mark_only_lora_as_trainable(model)

    qkv = model.transformer.h[0].attn.qkv
    assert isinstance(qkv, LoRALinear) and qkv.weight is None
    assert isinstance(qkv.base_layer, bnb.nn.Linear4bit) and qkv.base_layer.weight.dtype == torch.uint8
    # The head and everything outside the blocks stay as they were.
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32

    # Before training the quantized model is close to the float one (4-bit noise only).
    with torch.no_grad():
        quantized_logits, float_logits = model(BATCH), reference(BATCH)
    assert ((quantized_logits - float_logits).norm() / float_logits.norm()) < 0.2

    assert_only_the_adapters_train(model, frozen_value=lambda param: param.detach().clone())
    assert any(torch.count_nonzero(value) for key, value in lora_state_dict(model).items() if ".lora_B" in key)

    with pytest.raises(UserError, match="quantized"):
        merge_lora_weights(model)


@needs_bnb
@pytest.mark.parametrize("mode", BNB_MODES)
def test_every_mode_works(mode):
    """Every mode quantizes, trains and generates here: a refusal (UserError "cannot run") fails the test. The refusal
    itself is tested with a broken layer in test_a_mode_the_device_cannot_run_is_a_user_error."""
    model = make_model(n_layer=1)
    reference = make_model(n_layer=1)
    add_lora(model, LoRASettings(r=4, dropout=0.0))
    quantize_frozen_base(model, mode)
    quantized_type = bnb.nn.Linear8bitLt if mode == "bnb.int8" else bnb.nn.Linear4bit
    assert isinstance(model.transformer.h[0].attn.qkv.base_layer, quantized_type)
    mark_only_lora_as_trainable(model)
    loss = loss_of(model, BATCH)
    loss.backward()
    assert model.transformer.h[0].attn.qkv.lora_B_q.grad is not None
    with torch.no_grad():
        error = (model(BATCH) - reference(BATCH)).norm() / reference(BATCH).norm()
    assert error < 0.25, error
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    model.eval()
    with torch.no_grad():  # inference after training (the path generation takes)
        assert torch.isfinite(model(BATCH)).all()


@needs_bnb
def test_plain_model_router_and_head_stay_float():
    model = make_model(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=64)
    quantize_frozen_base(model, "bnb.nf4-dq")
    mlp = model.transformer.h[0].mlp
    assert type(mlp.gate) is Router and mlp.gate.weight.dtype == torch.float32
    assert isinstance(mlp.experts[3].fc_2, bnb.nn.Linear4bit)
    assert isinstance(model.transformer.h[1].attn.proj, bnb.nn.Linear4bit)
    assert type(model.lm_head) is nn.Linear
    assert torch.isfinite(model(BATCH)).all()
    # The names of the base weights do not change.
    assert "transformer.h.0.mlp.experts.3.fc_2.weight" in dict(model.named_parameters())
    with pytest.raises(RuntimeError, match="already quantized"):
        quantize_frozen_base(model, "bnb.nf4-dq")


@needs_bnb
def test_a_mode_the_device_cannot_run_is_a_user_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device\nsecond line")

    quantize._probe.cache_clear()
    monkeypatch.setattr(quantize, "quantized_linear", broken)
    model = make_model(n_layer=1)
    try:
        with pytest.raises(UserError, match=r"cannot run --quantize bnb\.fp4 with float32 weights on cpu: no kernel") as info:
            quantize_frozen_base(model, "bnb.fp4")
    finally:
        quantize._probe.cache_clear()
    assert "\n" not in str(info.value)
    assert type(model.transformer.h[0].attn.qkv) is nn.Linear


@needs_bnb
def test_meta_model_is_refused():
    with torch.device("meta"):
        model = GPT(Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100, padding_multiple=64))
    with pytest.raises(RuntimeError, match="meta"):
        quantize_frozen_base(model, "bnb.nf4")


# ---- torchao NF4 (ao.nf4), the mode FSDP can shard -------------------------------------------------------------------
def nf4_bytes_by_hand(numel: int, itemsize: int) -> int:
    """torchao's NF4 layout: 4 bits per weight, an int8 scaler per 64 weights, a scale (in the weight's dtype) per
    256 scalers (fewer in a small layer: whole scaler groups cover the weight), the scalers' mean and the 16 codes."""
    blocks = numel // 64
    scaler_block = next(size for size in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % size == 0)
    return numel // 2 + blocks + (blocks // scaler_block) * itemsize + itemsize + 16 * itemsize


@needs_torchao
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ao_nf4_stores_about_4_bits_per_weight(dtype):
    model = make_model(dtype=dtype, n_layer=2, n_embd=256)
    add_lora(model, LoRASettings(query=True, value=True, mlp=True))
    shapes = {name: param.shape for name, param in model.named_parameters()}
    quantize_frozen_base(model, "ao.nf4")
    nf4 = {name: param for name, param in model.named_parameters() if is_nf4(param)}
    # Every linear weight of the blocks, and nothing else, is NF4: frozen, in its dtype, shaped as before.
    layers = ("attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj")
    assert set(nf4) == {f"transformer.h.{i}.{layer}.weight" for i in range(2) for layer in layers}
    assert all(not p.requires_grad and p.dtype == dtype and p.shape == shapes[name] for name, p in nf4.items())
    itemsize = torch.finfo(dtype).bits // 8
    expected = sum(nf4_bytes_by_hand(p.numel(), itemsize) for p in nf4.values())
    assert weight_bytes(nn.ParameterList(nf4.values())) == expected
    bits = 8 * expected / sum(p.numel() for p in nf4.values())
    assert 4.125 < bits < 4.2, bits
    # Adapters, norms, embeddings and head stay float.
    assert all(p.dtype == dtype for name, p in model.named_parameters() if name not in nf4)


@needs_torchao
def test_ao_nf4_qlora_is_close_to_float_and_trains_the_adapters_only():
    model, reference = make_model(n_embd=256), make_model(n_embd=256)
    add_lora(model, LoRASettings(r=8, alpha=16, dropout=0.0, mlp=True, projection=True))
    quantize_frozen_base(model, "ao.nf4", dtype=torch.bfloat16)  # dequantized in bf16, fed float32 inputs
    mark_only_lora_as_trainable(model)
    with torch.no_grad():
        quantized_logits, float_logits = model(BATCH), reference(BATCH)
    assert quantized_logits.dtype == torch.float32
    assert 0 < ((quantized_logits - float_logits).norm() / float_logits.norm()) < 0.2

    assert_only_the_adapters_train(
        model, frozen_value=lambda param: param.get_original_weight() if is_nf4(param) else param.detach().clone()
    )
    with pytest.raises(UserError, match="quantized"):
        merge_lora_weights(model)
    with pytest.raises(RuntimeError, match="already quantized"):
        quantize_frozen_base(model, "ao.nf4")


@needs_torchao
def test_ao_nf4_needs_a_multiple_of_64_weights():
    check_nf4_shapes(make_model(n_embd=128))
    with pytest.raises(UserError, match=r"cannot store transformer\.h\.0\.attn\.qkv\.weight \(108, 36\): NF4 needs a"):
        check_nf4_shapes(make_model(n_embd=36, n_head=4, n_query_groups=4))


@pytest.mark.parametrize("shape, shard, rows", [
    ((512, 256), 2, 512),  # 256 rows a rank: 1,024 blocks of 64, four whole groups of 256 scalers
    ((704, 256), 2, 768),  # 352 rows a rank = 5.5 groups; whole groups need a multiple of 64 rows a rank
    ((256, 704), 2, 512),  # 704 weights a row: a group of 16,384 weights is 256 rows (gcd 64)
    ((704, 256), 1, 704),  # one rank holds the weight as it is
    ((128, 64), 2, 256),  # 128 blocks, one group of 128 scalers (8,192 weights): 128 rows a rank
    ((14336, 4096), 8, 14336),  # Llama 3 8B's MLP: 1,792 rows a rank, 448 groups
])
def test_nf4_stored_rows_split_into_whole_blocks_and_scale_groups(shape, shard, rows):
    assert quantize.nf4_stored_rows(shape, shard) == rows


@needs_torchao
@pytest.mark.parametrize("shape, shard", [((704, 256), 2), ((256, 704), 2), ((96, 128), 4)])
def test_ao_nf4_rows_appended_for_sharding_leave_the_weight_as_quantized_alone(shape, shard):
    """A weight stored with zero rows appended (so that FSDP2 splits it into whole NF4 blocks and scale groups)
    dequantizes to exactly what torchao's NF4 of the weight alone does; each rank's piece is an NF4 tensor of whole
    blocks; the layer returns its own rows, equal to the plain NF4 layer's."""
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    weight, bias, x = torch.randn(shape), torch.randn(shape[0]), torch.randn(3, 5, shape[1])
    alone = to_nf4(weight, 64, quantize.nf4_scaler_block(weight.numel()))
    rows = quantize.nf4_stored_rows(shape, shard)
    stored = quantize.frozen_nf4(weight, torch.float32, rows)
    assert rows > shape[0] and stored.shape == (rows, shape[1]) and is_nf4(stored)
    assert torch.equal(stored.get_original_weight()[: shape[0]], alone.get_original_weight())
    pieces = torch.chunk(stored, shard)  # how FSDP2 splits a parameter over its ranks
    assert all(is_nf4(piece) and piece.shape == (rows // shard, shape[1]) for piece in pieces)
    gathered = torch.cat([piece.get_original_weight() for piece in pieces])
    assert torch.equal(gathered[: shape[0]], alone.get_original_weight())
    layer = quantize.NF4Linear(stored, nn.Parameter(bias), shape[0])
    expected = nn.functional.linear(x, alone.get_original_weight(), bias)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)


@needs_torchao
def test_store_nf4_appends_rows_only_to_the_weights_whose_rows_do_not_split():
    """`store_nf4` as the sharded training commands call it before a block is sharded over 2 ranks: an MLP 704 wide
    gets weights with rows appended (a plain layer becomes an `NF4Linear` under the same keys, a LoRA layer keeps
    its adapters); the attention weights, which split, keep their rows; the block computes what the same block
    quantized alone does."""
    model = make_model(n_layer=1, n_embd=256, intermediate_size=704)
    add_lora(model, LoRASettings(query=True, value=True, mlp=True))
    model.transformer.h[0].mlp.fc_1 = nn.Linear(256, 704, bias=False)  # a layer without adapters beside them
    reference = make_model(n_layer=1, n_embd=256, intermediate_size=704)
    add_lora(reference, LoRASettings(query=True, value=True, mlp=True))
    reference.transformer.h[0].mlp.fc_1 = nn.Linear(256, 704, bias=False)
    for parameter in model.parameters():  # adapters that change the output (B starts at zero)
        nn.init.normal_(parameter.data, std=0.02)
    reference.load_state_dict(model.state_dict())
    keys = set(model.state_dict())
    quantize_frozen_base(reference, "ao.nf4")
    block = model.transformer.h[0]
    for name, layer in quantize.block_targets(block):
        quantize.store_nf4(block, name, layer, layer.weight.detach(), torch.float32, shard=2)
    mlp = block.mlp
    assert isinstance(mlp.fc_1, quantize.NF4Linear) and mlp.fc_1.weight.shape == (768, 256)
    assert isinstance(mlp.fc_2, LoRALinear) and mlp.fc_2.weight.shape == (768, 256)
    assert mlp.proj.weight.shape == (512, 704) and mlp.proj.lora_A.shape == (8, 704)
    assert is_nf4(block.attn.qkv.weight) and block.attn.qkv.weight.shape == (512, 256)
    assert set(model.state_dict()) == keys
    model.eval(), reference.eval()  # no adapter dropout
    x = torch.randn(2, 7, 256)
    torch.testing.assert_close(mlp(x), reference.transformer.h[0].mlp(x), rtol=0, atol=1e-5)


def test_only_nf4_modes_can_be_sharded():
    assert storage_mode("bnb.int8", sharded=False) == "bnb.int8"
    assert [storage_mode(mode, sharded=True) for mode in ("ao.nf4", "bnb.nf4", "bnb.nf4-dq")] == ["ao.nf4"] * 3
    for mode in ("bnb.fp4", "bnb.int8"):
        message = rf"--quantize {mode} cannot be sharded by FSDP.*ao\.nf4, bnb\.nf4, bnb\.nf4-dq"
        with pytest.raises(UserError, match=message):
            storage_mode(mode, sharded=True)


def test_missing_torchao_says_how_to_install(monkeypatch):
    for name in ("torchao", "torchao.quantization"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"ao\.nf4 needs the torchao package: pip install 'litgpt\[quantize\]'"):
        check_quantize_mode("ao.nf4")
    with pytest.raises(UserError, match="needs the torchao package"):
        check_quantize_mode("bnb.nf4", sharded=True)  # stored as torchao NF4 under FSDP


@needs_torchao
def test_a_true_16_bit_precision_would_dequantize_nf4_outside_fsdp():
    """What Fabric does for bf16-true (`module.to(torch.bfloat16)`) leaves a dequantized copy beside an NF4 weight
    that is a plain parameter, even one in bf16 already; so that combination is refused, sharding is not."""
    layer = nn.Linear(512, 512, bias=False)
    layer.weight = quantize.frozen_nf4(layer.weight, torch.bfloat16)
    with pytest.raises(RuntimeError, match="data pointer"):
        layer.weight.untyped_storage().data_ptr()  # a wrapper: its data are the NF4 pieces
    layer.to(torch.bfloat16)
    assert is_nf4(layer.weight) and layer.weight.untyped_storage().data_ptr()  # now it holds a real bf16 copy too
    assert layer.weight.untyped_storage().nbytes() == 512 * 512 * 2
    with pytest.raises(UserError, match="--precision bf16-true would dequantize torchao's NF4 weights"):
        check_nf4_precision(Precision("bf16-true"), sharded=False)
    for precision in ("32-true", "bf16-mixed"):
        check_nf4_precision(Precision(precision), sharded=False)
    check_nf4_precision(Precision("bf16-true"), sharded=True)
