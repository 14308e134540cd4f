"""--precision fp8-mixed: torchao's float8 linear layers with rowwise (or tensorwise) scales in the transformer blocks.

The CPU runs torchao's float8 matmuls (slowly), so the layer is checked against float8 products computed by hand,
and real training runs (one process, two FSDP processes, two tensor-parallel ones) against bf16-mixed and against
each other. Speed is a GPU matter: benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_distributed import SMALL, command_args, final_weights, inputs, litgpt, losses  # noqa: F401 (a fixture)

from litgpt.config import Config
from litgpt.errors import UserError
from litgpt.model import GPT
from litgpt.precision import Precision

pytest.importorskip("torchao.float8")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def rowwise_float8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows cast to float8 e4m3 with one power-of-two scale each (the largest that keeps the row's amax in
    range), and those scales: the rowwise recipe's cast, from its definition."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def tensorwise_float8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x cast to float8 e4m3 with one scale for the whole tensor (the largest that keeps its amax in range, not
    rounded), and that scale: the tensorwise recipe's cast, from its definition."""
    scale = E4M3_MAX / x.float().abs().amax().clamp(min=1e-12)
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def row_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference of a row, relative to that row's largest expected magnitude."""
    return ((actual - expected).abs() / expected.abs().amax(dim=-1, keepdim=True)).amax().item()


@pytest.mark.parametrize("recipe, cast, other_cast", [("rowwise", rowwise_float8, tensorwise_float8),
                                                      ("tensorwise", tensorwise_float8, rowwise_float8)])
def test_float8_layer_multiplies_as_a_float8_product_by_hand(recipe, cast, other_cast):
    from litgpt.distributed.float8 import convert_to_float8

    torch.manual_seed(0)
    model = GPT(Config(**SMALL))
    model.to(torch.bfloat16)
    layer = model.transformer.h[0].mlp.fc_1
    # Rows of different magnitudes: one scale per row and one for the whole tensor cast them differently.
    x = torch.randn(8, 64, dtype=torch.bfloat16) * torch.logspace(-2, 1, 8, dtype=torch.bfloat16)[:, None]
    plain = layer(x).float()
    convert_to_float8(model, recipe)
    layer = model.transformer.h[0].mlp.fc_1

    def by_hand(cast) -> torch.Tensor:
        (x_fp8, x_scale), (w_fp8, w_scale) = cast(x), cast(layer.weight)
        return (x_fp8.float() / x_scale) @ (w_fp8.float() / w_scale).T

    ours = layer(x).float()
    # float8 rounds each operand to 3 bits of mantissa: far from bf16's product and from the other recipe's, and
    # equal to this recipe's hand computation up to the bf16 rounding of the output.
    error = row_relative_error(ours, by_hand(cast))
    assert error <= 2**-8
    assert row_relative_error(ours, plain) > max(0.02, 10 * error)
    assert row_relative_error(ours, by_hand(other_cast)) > max(0.02, 10 * error)
    # With gradients off (validation, generation during a run) it multiplies in the weights' dtype.
    with torch.inference_mode():
        torch.testing.assert_close(layer(x).float(), plain)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), plain)
    # torch.compile traces it whole (no graph break, which would split every block at each of its linear layers).
    assert torch._dynamo.explain(layer)(x).graph_break_count == 0


def test_fp8_mixed_converts_the_blocks_plain_linear_layers_with_sizes_of_16():
    from torchao.float8.float8_linear import Float8Linear

    from litgpt.distributed.float8 import convert_to_float8

    model = GPT(Config(**{**SMALL, "intermediate_size": 120}))  # 120: the MLP's three layers cannot multiply in fp8
    keys = {k: v.shape for k, v in model.state_dict().items()}
    convert_to_float8(model)
    float8 = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
    assert float8 == [f"transformer.h.{i}.attn.{layer}" for i in (0, 1) for layer in ("proj", "qkv")]
    assert type(model.lm_head) is torch.nn.Linear and type(model.transformer.h[0].mlp.fc_1) is torch.nn.Linear
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # checkpoints keep bf16-mixed's tensors


def test_fp8_mixed_refuses_a_model_with_no_layer_it_can_convert():
    from litgpt.distributed.float8 import convert_to_float8

    model = GPT(Config(**{**SMALL, "n_embd": 40, "n_head": 5, "n_query_groups": 5, "intermediate_size": 72}))
    with pytest.raises(UserError, match="no linear layer .* multiples of 16"):
        convert_to_float8(model)


def test_fp8_mixed_is_bf16_mixed_around_the_float8_matmuls(monkeypatch):
    precision = Precision.resolve("fp8-mixed")
    assert precision.float8 and precision.mixed and precision.autocast_name == "bf16-mixed"
    assert precision.weights_dtype == torch.float32 and precision.sharded_compute_dtype == torch.bfloat16
    assert not Precision.resolve("bf16-mixed").float8
    assert precision.float8_recipe == "rowwise"
    assert Precision.resolve("fp8-mixed", float8_recipe="tensorwise").float8_recipe == "tensorwise"
    with pytest.raises(UserError, match="float8_recipe tensorwise is a scaling recipe of --precision fp8-mixed; "
                                        "this run is bf16-mixed"):
        Precision.resolve("bf16-mixed", float8_recipe="tensorwise")
    precision.check_devices(on_cpu=True, sharded=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    with pytest.raises(UserError, match="compute capability 8.9 or newer.* this one is 8.0"):
        precision.check_devices(on_cpu=False, sharded=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    precision.check_devices(on_cpu=False, sharded=False)


def fp8_run(inputs, name: str, *extra) -> tuple:
    out_dir = inputs["root"] / name
    result = litgpt(*command_args("pretrain", inputs, out_dir), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir, result


@pytest.fixture(scope="module")
def rowwise_one(inputs) -> tuple:  # noqa: F811
    """One process's fp8-mixed run with the default (rowwise) recipe: its folder and result."""
    return fp8_run(inputs, "fp8-one", "--devices", "1", "--precision", "fp8-mixed")


@pytest.mark.slow
def test_fp8_mixed_pretrains_close_to_bf16_mixed_on_one_and_two_processes(inputs, rowwise_one):
    """One process: the losses follow bf16-mixed's without equalling them, the checkpoint holds bf16-mixed's float32
    tensors and the run generates its sample. Two FSDP processes (weights gathered in bf16, each matmul's own float8
    casts) train as one: each micro-batch is one sample on either side, so every rowwise scale sees the same rows."""
    bf16, _ = fp8_run(inputs, "bf16", "--devices", "1", "--precision", "bf16-mixed")
    one, result = rowwise_one
    printed = result.stdout + result.stderr
    assert "fp8-mixed: 10 linear layers of the blocks multiply in float8 (rowwise scales)" in printed
    assert json.loads((one / "metrics.json").read_text())["precision"] == "fp8-mixed"
    assert losses(one) == pytest.approx(losses(bf16), abs=0.02) and losses(one) != losses(bf16)
    ours, reference = final_weights(one, "lit_model.pth"), final_weights(bf16, "lit_model.pth")
    assert ours.keys() == reference.keys() and all(t.dtype == torch.float32 for t in ours.values())
    two, result = fp8_run(inputs, "fp8-two", "--devices", "2", "--precision", "fp8-mixed")
    assert "fp8-mixed: 10 linear layers of the blocks multiply in float8" in result.stdout + result.stderr
    # Weights are not compared element by element: Adam turns any last-bit difference of a near-zero gradient (FSDP
    # gathers the weights in bf16 before their float8 cast) into an lr-sized step, as it does under bf16-mixed.
    assert losses(two) == pytest.approx(losses(one), abs=2e-3)


@pytest.mark.slow
def test_fp8_mixed_tensorwise_trains_as_one_process_under_tensor_parallelism(inputs, rowwise_one):
    """--train.float8_recipe tensorwise reaches the layers, and tensor parallelism splits the float8 layers (it used
    to split the plain ones, which the float8 ones then replaced: a traceback at the first matmul). Its amax is
    reduced over the group, so two tensor-parallel processes train as one."""
    recipe = ["--precision", "fp8-mixed", "--train.float8_recipe", "tensorwise"]
    one, result = fp8_run(inputs, "tensorwise-one", "--devices", "1", *recipe)
    assert "float8 (tensorwise scales)" in result.stdout + result.stderr
    split, result = fp8_run(inputs, "tensorwise-tp2", "--devices", "2", "--parallel.tensor", "2", *recipe)
    assert "float8 (tensorwise scales)" in result.stdout + result.stderr
    assert losses(split) == pytest.approx(losses(one), abs=2e-3) and losses(one) != losses(rowwise_one[0])


def test_fp8_mixed_with_quantize_is_one_line(inputs, tmp_path):
    result = litgpt(*command_args("finetune_lora", inputs, tmp_path / "out"), "--precision", "fp8-mixed",
                    "--quantize", "bnb.nf4")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("litgpt finetune_lora: error: --precision fp8-mixed multiplies")
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
