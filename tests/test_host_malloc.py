"""A CPU training process keeps the memory its steps free for the next ones (`litgpt.host_malloc`), unless the
user set glibc's malloc. Measured in fresh processes: the setting is process-wide and applies to later allocations."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Training steps of an MLP whose activations are 32 MiB each (the size up to which glibc's own threshold rises): the
# page faults of four steps after two.
STEPS = """
import resource, sys, torch
from litgpt.host_malloc import keep_freed_memory

kept = keep_freed_memory() if sys.argv[1] == "keep" else None
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
optimizer = torch.optim.AdamW(model.parameters())
x = torch.randn(4096, 256)
def step():
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
step(), step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""
ACTIVATION_PAGES = 4096 * 2048 * 4 // 4096


def run_steps(keep: bool, **malloc_settings: str) -> tuple[str, int]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    result = subprocess.run([sys.executable, "-c", STEPS, "keep" if keep else "default"],
                            env={**env, **malloc_settings}, capture_output=True, text=True, check=True, timeout=120)
    kept, faults = result.stdout.split()
    return kept, int(faults)


def test_the_steps_reuse_the_memory_earlier_steps_freed():
    kept, faults = run_steps(keep=True)
    _, default_faults = run_steps(keep=False)
    assert kept == "True"
    assert default_faults > 4 * ACTIVATION_PAGES  # glibc's default: every step faults its activations in anew
    assert faults < default_faults / 5, (faults, default_faults)


@pytest.mark.parametrize("setting", [{"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}])
def test_a_users_own_malloc_settings_are_left_alone(setting):
    kept, faults = run_steps(keep=True, **setting)
    assert kept == "False"
    assert faults > 4 * ACTIVATION_PAGES
