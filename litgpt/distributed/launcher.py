"""Fabric's launcher of ranks 1.. as child processes, with a watcher that lets rank 0 say why the run stops."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


class RankLauncher(_SubprocessScriptLauncher):
    """Fabric's launcher of ranks 1.. as child processes, with a patient watcher (`watch_ranks`) instead of one that
    SIGKILLs rank 0 the moment a child fails, before rank 0 can print why it stops and exit with code 1."""

    def launch(self, function: Callable, *args, **kwargs):
        from lightning.fabric.strategies.launchers.subprocess_script import _set_num_threads_if_needed

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._call_children_scripts()
        threading.Thread(target=watch_ranks, args=(self.procs,), daemon=True, name="litgpt-rank-watcher").start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def watch_ranks(children: list, grace_seconds: float = 10.0) -> None:
    """Once a child rank has failed, give this process and the other children `grace_seconds` to stop by themselves
    (a collective fails at once when a peer is gone); then SIGKILL what is left, so that no rank outlives the run."""
    while not any(child.poll() for child in children):
        if all(child.returncode == 0 for child in children):
            return
        time.sleep(1.0)
    time.sleep(grace_seconds)
    for child in children:
        if child.poll() is None:
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)
