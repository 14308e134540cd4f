"""A quantized base layer's backward pass dequantizes its weight a slice of columns at a time (`litgpt.sliced_linear`):
the slices against the libraries' own dequantization (bit for bit), the layer's output and input gradient against
the libraries' own linear functions, and what the backward pass holds against `litgpt plan`'s count."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from live_bytes import LiveBytes

from litgpt import sliced_linear
from litgpt.nf4 import NF4Dequantizer, linear_of_rows
from litgpt.plan.quantized import dequantize_bytes

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
BNB_4BIT = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4"]
# (rows, columns): rows of whole 64-blocks; a row length that is not a multiple of 64 (blocks straddle rows, so no
# column slices); MLP-like shapes both ways
SHAPES = [(256, 128), (130, 96), (704, 256), (192, 704)]
DTYPES = [torch.float32, torch.bfloat16]


def nf4_weight(shape, dtype):
    from litgpt.quantize import frozen_nf4

    return frozen_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)), dtype)


def bnb_layer(shape, dtype, mode):
    from litgpt.quantize import quantized_linear

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    return quantized_linear(weight, None, mode, torch.device("cpu"))


def bnb_whole(layer) -> torch.Tensor:
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def row_ranges(rows: int) -> list[tuple[int, int]]:
    return [(0, rows), (0, 1), (1, 3), (5, rows)]  # ranges that start or end inside a 64-block too


def column_ranges(columns: int) -> list[tuple[int, int]]:
    return [(0, 64), (64, columns), (0, columns)] if columns % 64 == 0 else []


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 4,096 weights, so that these small weights are cut into several."""
    monkeypatch.setattr(sliced_linear, "SLICE_NUMEL", 4096)


# ---- slices, bit for bit -----------------------------------------------------------------------------------------------
@needs_torchao
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_slices_are_torchaos_dequantization_bit_for_bit(shape, dtype):
    weight = nf4_weight(shape, dtype)
    whole = weight.get_original_weight()
    dequantizer = NF4Dequantizer(weight)
    for start, stop in row_ranges(shape[0]):
        assert torch.equal(dequantizer.rows(start, stop), whole[start:stop])
    for start, stop in column_ranges(shape[1]):
        assert torch.equal(dequantizer.columns(start, stop), whole[:, start:stop])


@needs_bnb
@pytest.mark.parametrize("mode", BNB_4BIT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bnb_slices_are_bitsandbytes_dequantization_bit_for_bit(shape, dtype, mode):
    from litgpt.quantize import Bnb4bitDequantizer

    layer = bnb_layer(shape, dtype, mode)
    whole = bnb_whole(layer)
    assert whole.shape == shape and whole.dtype == dtype
    dequantizer = Bnb4bitDequantizer(layer.weight)
    for start, stop in row_ranges(shape[0]) if shape[1] % 64 == 0 else [(0, shape[0])]:
        assert torch.equal(dequantizer.rows(start, stop), whole[start:stop])
    for start, stop in column_ranges(shape[1]):
        assert torch.equal(dequantizer.columns(start, stop), whole[:, start:stop])


# ---- the layer against the libraries' linear functions ----------------------------------------------------------------
def output_and_input_grad(function, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = function(x)
    (grad_x,) = torch.autograd.grad(out, x, grad)
    return out, grad_x


def assert_close_in(dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of the sums' terms (BLAS blocks a matmul by its shape): one rounding of `dtype`."""
    assert got.dtype == want.dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@needs_torchao
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_an_nf4_layer_computes_what_torchaos_linear_does(shape, dtype):
    """The layer's output and its input's gradient against torchao's `F.linear` on the NF4 tensor, with the rows a
    layer stored with rows appended computes (`NF4Linear`) too."""
    weight = nf4_weight(shape, dtype)
    generator = torch.Generator().manual_seed(1)
    for rows in (shape[0], shape[0] - 3):
        x = torch.randn(3, 5, shape[1], generator=generator).to(dtype)
        grad = torch.randn(3, 5, rows, generator=generator).to(dtype)
        got = output_and_input_grad(lambda x: linear_of_rows(x, weight, None, rows), x, grad)
        want = output_and_input_grad(lambda x: F.linear(x, weight)[..., :rows], x, grad)
        for ours, torchao in zip(got, want):
            assert_close_in(dtype, ours, torchao)


@needs_torchao
def test_an_nf4_layer_under_autocast_computes_in_autocasts_dtype():
    """A float32 input under CPU autocast: multiplied in bfloat16 as `F.linear` is, its gradient float32."""
    weight = nf4_weight((128, 64), torch.bfloat16)
    x = torch.randn(2, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_of_rows(x, weight, None, 128)
        want = F.linear(x.to(torch.bfloat16), weight.get_original_weight())
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32
    expected = (torch.ones(2, 128, dtype=torch.bfloat16) @ weight.get_original_weight()).float()
    assert torch.equal(x.grad, expected)


@needs_bnb
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("mode", BNB_4BIT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_bnb_layer_computes_what_bitsandbytes_linear4bit_does(shape, dtype, mode):
    """The layer against bitsandbytes' own `Linear4bit.forward` (its `MatMul4Bit`, which dequantizes the weight
    whole in the backward pass), float32 inputs cast to the layer's compute dtype and back."""
    import bitsandbytes as bnb

    layer = bnb_layer(shape, dtype, mode)
    assert isinstance(layer, bnb.nn.Linear4bit)
    generator = torch.Generator().manual_seed(1)
    x, grad = torch.randn(3, 5, shape[1], generator=generator), torch.randn(3, 5, shape[0], generator=generator)
    got = output_and_input_grad(layer, x, grad)
    want = output_and_input_grad(lambda x: bnb.nn.Linear4bit.forward(layer, x), x, grad)
    assert torch.equal(got[0], want[0])  # the forward pass is bitsandbytes' own
    assert_close_in(dtype, got[1], want[1])


@needs_bnb
def test_a_bnb_layer_with_a_trainable_bias_gives_it_bitsandbytes_gradient():
    """The base's bias is frozen in QLoRA; one that trains is left to bitsandbytes' own pass, which computes its
    gradient (the sliced pass returns the input's only)."""
    import bitsandbytes as bnb

    from litgpt.quantize import quantized_linear

    weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    layer = quantized_linear(weight, torch.zeros(128), "bnb.nf4", torch.device("cpu"))
    layer.bias.requires_grad_(True)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).square().sum().backward()
    got = layer.bias.grad.clone()
    layer.bias.grad = None
    bnb.nn.Linear4bit.forward(layer, x).square().sum().backward()
    assert got.abs().sum() > 0 and torch.equal(got, layer.bias.grad)


# ---- what the backward pass holds ----------------------------------------------------------------------------------
def backward_peak(function, x: torch.Tensor) -> int:
    """Bytes the backward pass of `function` at x holds at once beyond its input's gradient."""
    x = x.detach().clone().requires_grad_()
    out = function(x)
    grad = torch.ones_like(out)
    with LiveBytes() as live:
        (grad_x,) = torch.autograd.grad(out, x, grad)
    return live.peak - grad_x.numel() * grad_x.element_size()


@needs_torchao
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("shape", [(256, 128), (130, 96)])
def test_the_nf4_backward_holds_one_slice_as_the_plan_counts(shape):
    """Column slices of 4,096 weights where the rows split into 64-blocks (a fraction of what torchao's whole
    dequantization holds: 14 bytes a weight); the whole weight where they do not."""
    weight = nf4_weight(shape, torch.bfloat16)
    x = torch.randn(4, shape[1], dtype=torch.bfloat16)
    ours = backward_peak(lambda x: linear_of_rows(x, weight, None, shape[0]), x)
    assert ours == pytest.approx(dequantize_bytes(shape, "ao.nf4", 2, 2), rel=0.05)
    torchaos = backward_peak(lambda x: F.linear(x, weight), x)
    assert torchaos == pytest.approx(weight.numel() * 14, rel=0.05)
    if shape[1] % 64 == 0:
        assert ours < torchaos / 4  # half the weight in a slice here: 4 bytes a weight against 14


@needs_bnb
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("mode", BNB_4BIT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bnb_backward_holds_one_slice_as_the_plan_counts(dtype, mode):
    import bitsandbytes as bnb

    shape = (512, 256)
    layer = bnb_layer(shape, dtype, mode)
    x = torch.randn(4, shape[1], dtype=dtype)
    ours = backward_peak(layer, x)
    assert ours == pytest.approx(dequantize_bytes(shape, mode, dtype.itemsize, dtype.itemsize), rel=0.1)
    whole = backward_peak(lambda x: bnb.nn.Linear4bit.forward(layer, x), x)
    assert whole >= layer.weight.quant_state.shape.numel() * dtype.itemsize
    assert ours < whole / 2  # a quarter of the weight in a slice here


def test_slices_cover_every_index_once_at_steps_within_the_bound(monkeypatch):
    monkeypatch.setattr(sliced_linear, "SLICE_NUMEL", 1000)
    assert sliced_linear.slices(10, 1, 300) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sliced_linear.slices(320, 64, 4) == [(0, 192), (192, 320)]  # 250 columns fit: 192, a multiple of 64
    assert sliced_linear.slices(128, 64, 100) == [(0, 64), (64, 128)]  # at least one step, even above the bound


@needs_torchao
@needs_bnb
@pytest.mark.parametrize("fmt", ["ao.nf4", "bnb.nf4"])
def test_the_backward_holds_the_planned_bytes_in_resident_memory(fmt):
    """What the process really allocates, temporaries inside an op included (which the dispatch-level count above
    cannot see: indexing the NF4 pairs with [] would copy the int32 codes to int64): benchmarks/qlora_layer_memory.py's
    measurement in a fresh process, of a weight of 2 slices, against the plan and against the library's own layer."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "qlora_layer_memory.py"
    shape = (4096, 4096)  # 16M weights: two slices of columns

    def measured(path: str) -> dict:
        env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"}
        argv = [sys.executable, str(script), "--worker", "--format", fmt, "--path", path, "--tokens", "64",
                "--rows", str(shape[0]), "--columns", str(shape[1])]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    ours, library = measured("litgpt"), measured("library")
    planned = dequantize_bytes(shape, fmt, 2, 2)
    assert ours["backward_bytes"] == pytest.approx(planned, rel=0.15, abs=2**20)
    assert ours["backward_bytes"] < library["backward_bytes"] * 0.7  # one slice of two (bitsandbytes: whole, 2 bytes)
