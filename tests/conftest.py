"""Fixtures that several test modules share; under pytest-xdist, one share of the CPU cores per worker."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml's addopts, so the plain `python -m pytest` too): one worker more than the cores, at
    most 8. Most tests wait on processes they start, and many of those wait themselves (for a collective's timeout,
    a Slurm job, a rank that was killed): a worker more keeps the cores busy through those waits.
    A second worker more gains nothing: on 2 cores the whole suite took 20:06 with 4 workers, 20:13 with 3,
    whose processes kept the cores ~90 % busy (2026-11-29)."""
    return min(8, (os.cpu_count() or 1) + 1)


def _share_the_cores_between_workers() -> None:
    """Under `pytest -n N`, give each worker (and every process its tests start, which inherit the variable) cores / N
    threads, unless OMP_NUM_THREADS is set already. With the default (a thread per core) in every one of N busy
    workers, OpenMP threads spin for cores they do not get: two 2-thread torch runs side by side on 2 cores took 2.7x
    as long as two 1-thread runs."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if "PYTEST_XDIST_WORKER" not in os.environ or workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported before this file (by a plugin): its thread pool reads the variable no more
        sys.modules["torch"].set_num_threads(threads)


_share_the_cores_between_workers()

# Inductor's CPU compilation (and threadpoolctl's import) set this in the process that runs them, partway through a
# session; Intel's OpenMP reads it when it loads. Set from the start, the workers' environment stays the same, and
# with it the key of the fork servers that their tests' commands are forked from (tests/litgpt_forkserver.py).
os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")

# The default precision follows the CPU's flags (bf16-mixed where bf16 is native); the suite's references are float32,
# so its processes read a cpuinfo without bf16 flags. tests/test_precision.py feeds both kinds of file itself.
CPUINFO_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cpuinfo"
os.environ.setdefault("LITGPT_CPUINFO", str(CPUINFO_FIXTURES / "no_bf16.txt"))

# Modules whose tests take longest (most of them launching training processes), heaviest first: under
# `--dist loadfile --no-loadscope-reorder` (.ci/run) the workers take modules in this order, so that no long module
# starts last while the other worker idles. Other modules keep their place after these.
LONGEST_MODULES = (
    "test_tutorials.py", "test_thunder.py", "test_fault_tolerance.py", "test_distributed.py", "test_plan.py",
    "test_expert_parallel.py", "test_tensor_parallel.py", "test_pipeline_parallel.py", "test_context_parallel.py",
    "test_tensor_parallel_generation.py",
    "test_slurm.py", "test_cluster.py", "test_litgpt_folders.py", "test_error_causes.py", "test_distill.py",
    "test_bad_input.py", "test_fsdp_prefetch.py", "test_training.py", "test_config_registry.py", "test_mla_cli.py",
    "test_convert.py", "test_download.py", "test_training_cli.py", "test_safe_loading.py", "test_compress_moe.py",
    "test_litgpt_recipes.py", "test_evaluate.py", "test_loggers.py", "test_run_folders.py", "test_strangers_files.py",
    "test_serve.py", "test_streaming_data.py", "test_hf_stream.py", "test_prepare.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_MODULES)}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[id(item)]))


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): intra-op threads
    only cost time there, a lot of it on a busy machine, and one thread makes results repeatable; restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

SLURM_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm-localhost.sh"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A working one-node Slurm on localhost (started, or found running, by scripts/slurm-localhost.sh)."""
    p = subprocess.run(["bash", str(SLURM_SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{SLURM_SCRIPT} start failed:\n{p.stdout}\n{p.stderr}"
    return socket.gethostname().split(".")[0]
