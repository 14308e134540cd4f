"""The processes tests start as ranks of a group of their own, forked from multiprocessing's fork server.

A spawned rank is a fresh interpreter that imports torch, litgpt and the test module again: about 5 s of CPU each on
this machine, for ranks that then run for a second. The fork server is such an interpreter too, started once per
pytest worker, that imports PRELOADS and nothing else: it never runs a torch operation (no thread pool exists to be
copied into a child), and each rank forked from it starts as a spawned one would, its imports already done.
"""

from __future__ import annotations

import multiprocessing

# Every test module that starts ranks this way (the fork server imports them once: the ranks' functions live there).
PRELOADS = ("torch", "torch.distributed.tensor", "litgpt.model", "litgpt.distributed.parallelize",
            "test_tensor_parallel", "test_context_parallel", "test_expert_parallel",
            "test_tensor_parallel_generation", "test_architecture", "test_fsdp_prefetch", "test_moe")


def rank_start_method() -> str:
    """The start method to give multiprocessing or torch.multiprocessing for ranks, its fork server's imports set."""
    multiprocessing.set_forkserver_preload(list(PRELOADS))
    return "forkserver"


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context to start ranks with."""
    return multiprocessing.get_context(rank_start_method())
