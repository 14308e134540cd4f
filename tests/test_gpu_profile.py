"""benchmarks/gpu_profile.py's reading of a profiler trace (the GPU part itself runs on a lent GPU machine): the
kernels summed by kind, the matmuls by shape with their rate, idle time, against sums done by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def load_gpu_profile():
    """benchmarks/gpu_profile.py as a module, without putting benchmarks/ on sys.path (its thunder.py would then
    shadow the thunder package for every later test in the process)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("gpu_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_profile = load_gpu_profile()
kind_of, matmul_flops, summarize_trace = gpu_profile.kind_of, gpu_profile.matmul_flops, gpu_profile.summarize_trace


def op(ext_id, name, dims, ts):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": 5,
            "args": {"External id": ext_id, "Input Dims": dims, "Input type": ["c10::BFloat16"] * len(dims)}}


def kernel(name, ts, dur, ext_id=None, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {} if ext_id is None else {"External id": ext_id}}


@pytest.mark.parametrize(("name", "category", "kind"), [
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "kernel", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "kernel", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>", "kernel",
     "attention"),
    ("triton_poi_fused__unsafe_view_add_mul_rsub_sigmoid_silu_view_2", "kernel", "inductor"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>", "kernel",
     "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>", "kernel", "other aten"),
    ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", "copies"),
])
def test_kernels_are_told_apart_by_name(name, category, kind):
    assert kind_of(name, category) == kind


def test_matmul_flops_of_mm_addmm_and_bmm():
    assert matmul_flops("aten::mm", [[8192, 2048], [2048, 1024]]) == 2 * 8192 * 2048 * 1024
    assert matmul_flops("aten::addmm", [[1024], [16, 2048], [2048, 1024]]) == 2 * 16 * 2048 * 1024  # (bias, a, b)
    assert matmul_flops("aten::mm", [[8192, 2048], [2048, 1024], [8192, 1024]]) == 2 * 8192 * 2048 * 1024  # out=
    assert matmul_flops("aten::_scaled_mm", [[64, 32], [32, 16], [64, 1], [1, 16]]) == 2 * 64 * 32 * 16
    assert matmul_flops("aten::bmm", [[4, 32, 64], [4, 64, 16]]) == 2 * 4 * 32 * 64 * 16
    assert matmul_flops("aten::mm", []) == 0.0


def test_a_trace_is_summed_per_step_by_kind_and_by_matmul_shape(tmp_path):
    events = [
        op(1, "aten::mm", [[1024, 2048], [2048, 4096]], 0), kernel("nvjet_tst_128x256", 10, 400, 1),
        op(2, "aten::mm", [[1024, 2048], [2048, 4096]], 500), kernel("nvjet_tst_128x256", 500, 400, 2),
        kernel("triton_red_fused_0", 1000, 100),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1100, 300),
        kernel("Memcpy DtoD", 1400, 100, cat="gpu_memcpy"),
        # 500 us idle, then the second step's kernel
        kernel("void at::native::elementwise_kernel<128, 4>", 2000, 200),
        {"ph": "X", "cat": "python_function", "name": "irrelevant", "ts": 0, "dur": 9999, "args": {}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize_trace(path, steps=2)
    assert summary["gpu_span_ms_per_step"] == round((2200 - 10) / 2 / 1000, 2)
    assert summary["kernel_ms_per_step"] == round(1500 / 2 / 1000, 2)
    assert summary["idle_fraction"] == round(1 - 1500 / 2190, 3)
    assert summary["ms_per_step_by_kind"] == {"matmul": 0.4, "attention": 0.15, "other aten": 0.1, "inductor": 0.05,
                                              "copies": 0.05}
    (shape,) = summary["matmuls_by_shape"]
    assert shape["calls_per_step"] == 1.0 and shape["ms_per_step"] == 0.4
    # two products of 2 x 1024 x 2048 x 4096 FLOP in 800 us
    assert shape["tflops"] == round(2 * 2 * 1024 * 2048 * 4096 / 800e-6 / 1e12, 1)
    assert summary["busiest_kernels"][0] == {"kind": "matmul", "kernel": "nvjet_tst_128x256", "ms_per_step": 0.4,
                                             "calls_per_step": 1.0}


def test_a_trace_without_gpu_kernels_says_so(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [op(1, "aten::mm", [[2, 2], [2, 2]], 0)]}))
    assert summarize_trace(path, steps=3) == {"error": "no GPU kernels in the trace"}
