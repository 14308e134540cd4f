"""Rank 0 leads, the other ranks follow: generation on a model split by tensor parallelism (`litgpt generate`,
`litgpt serve`) runs the one-process code on rank 0 alone (sampling, stop conditions, the HTTP server, the batching
engine's scheduling), while every forward pass must run on every rank together (each holds its share of every layer,
and the passes meet in collectives).

Rank 0's calls of the methods that run passes are announced to the followers before they run (`Leader.mirror`), and
the followers make the same calls on their own objects (`follow`), in the same order. The followers never sample: the
tokens they run next come with the next call, so they run what rank 0 sampled under any temperature, top-k or top-p.

The calls travel over a gloo group of their own (pickled, their tensors on the CPU: a pass's token ids, positions and
cache slots), whose timeout is long: a follower of an idle server waits for the next request as long as it takes. A
leader that dies closes the group's connections, and its followers stop with an error.
"""

from __future__ import annotations

import datetime
import functools
import signal
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# How long a follower waits for the leader's next call (a server may be idle for days).
FOLLOWER_PATIENCE = datetime.timedelta(days=365)


def calls_group():
    """The gloo group over every rank that carries the leader's calls (collective: every rank makes it)."""
    return dist.new_group(backend="gloo", timeout=FOLLOWER_PATIENCE)


def on_cpu(values) -> list:
    return [value.cpu() if isinstance(value, torch.Tensor) else value for value in values]


class Leader:
    """Rank 0's side: `mirror` an object's methods so that each call is announced to the followers, then made;
    `stop` ends the followers' loop. Calls made inside an announced call (the head inside a forward pass) are the
    followers' business already: they are not announced again."""

    def __init__(self, group) -> None:
        self.group = group
        self.lock = threading.Lock()  # one announced call at a time, in the order the followers make them
        self.inside = threading.local()
        self.stopped = False

    def mirror(self, obj: Any, name: str, methods: tuple[str, ...]) -> None:
        """Announce every call of `obj`'s `methods` (the followers' counterpart of `obj` is `name` in `follow`)."""
        for method in methods:
            setattr(obj, method, self.announced(name, method, getattr(obj, method)))

    def announced(self, name: str, method: str, call: Callable) -> Callable:
        @functools.wraps(call)
        def announce_then_call(*args, **kwargs):
            if getattr(self.inside, "call", False):
                return call(*args, **kwargs)
            with self.lock:
                if self.stopped:
                    raise RuntimeError(f"{name}.{method} called after the followers were stopped.")
                self.send((name, method, on_cpu(args), dict(zip(kwargs, on_cpu(kwargs.values())))))
                self.inside.call = True
                try:
                    return call(*args, **kwargs)
                finally:
                    self.inside.call = False

        return announce_then_call

    def send(self, call: Optional[tuple]) -> None:
        dist.broadcast_object_list([call], group=self.group, group_src=0)

    def stop(self) -> None:
        """End the followers' loop (once; a later call does nothing)."""
        with self.lock:
            if not self.stopped:
                self.send(None)
                self.stopped = True


def follow(objects: dict[str, Any], group, device: torch.device) -> None:
    """A follower's loop: make each call rank 0 announces on `objects[name]`, its tensors moved to `device`, until
    rank 0 stops."""
    while True:
        received = [None]
        dist.broadcast_object_list(received, group=group, group_src=0)
        if received[0] is None:
            return
        name, method, args, kwargs = received[0]
        move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value  # noqa: E731
        getattr(objects[name], method)(*map(move, args), **{key: move(value) for key, value in kwargs.items()})


def lead_or_follow(rank: int, objects: dict[str, Any], methods: dict[str, tuple[str, ...]], lead: Callable[[], None],
                   device: torch.device) -> None:
    """Collective: rank 0 mirrors the `methods` of `objects` and runs `lead()`, then stops the followers (also when
    `lead` fails); every other rank follows, in inference mode. A follower ignores Ctrl-C (a terminal sends it to
    every process): the leader stops it."""
    group = calls_group()
    if rank == 0:
        leader = Leader(group)
        for name, obj in objects.items():
            leader.mirror(obj, name, methods[name])
        try:
            lead()
        finally:
            leader.stop()
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with torch.inference_mode():
        follow(objects, group, device)
