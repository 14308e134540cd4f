"""Pipeline parallelism in the plan (--parallel.pipeline): which stages each device runs, and what of its
micro-batches each of those stages holds at every action of the schedule.

The stages and their blocks are `litgpt.distributed.pipeline`'s own (`stage_layers`, `stage_rank`). The order of
the actions is torch.distributed.pipelining's: the schedule class's `pipeline_order` (every rank's forward and
backward passes, which its runtime runs in that order with the communication added), laid out by the class itself
over placeholders of the stages, without processes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `n_stages`, its blocks `layers`; the first also holds the embedding, the last the final norm
    and the output head."""

    index: int
    n_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.n_stages - 1


def device_stages(rank: int, degree: int, stages_per_rank: int, schedule: str, n_layer: int) -> list[Stage]:
    """The stages pipeline rank `rank` of `degree` runs, in stage order, as training places them."""
    from litgpt.distributed.pipeline import stage_layers, stage_rank

    n_stages = degree * stages_per_rank
    layers = stage_layers(n_layer, n_stages)
    return [Stage(index, n_stages, layers[index]) for index in range(n_stages)
            if stage_rank(index, degree, schedule) == rank]


class _StagePlaceholder:
    """What a schedule class reads of its `PipelineStage`s to lay out its order: the stage's place in the pipeline."""

    def __init__(self, index: int, n_stages: int, degree: int) -> None:
        from torch import nn

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, degree, 0
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = nn.Module()


def schedule_actions(schedule: str, degree: int, stages_per_rank: int,
                     microbatches: int) -> dict[int, list[tuple[str, int]]]:
    """Every pipeline rank's compute actions in the order it runs them, as (kind, stage): F a forward pass, B a
    backward pass, I a backward pass to the inputs only and W the weights' gradients of an earlier I (zero bubble);
    torch's `pipeline_order` of the schedule `litgpt.distributed.pipeline.build_schedule` builds."""
    import torch.distributed.pipelining as pipelining

    from litgpt.distributed.pipeline import SCHEDULE_CLASSES

    n_stages = degree * stages_per_rank
    stages = [_StagePlaceholder(stage.index, n_stages, degree)
              for stage in device_stages(0, degree, stages_per_rank, schedule, n_stages)]
    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    built = schedule_class(stages[0] if schedule == "1F1B" else stages, microbatches)
    return {rank: [(action.computation_type.value, action.stage_index) for action in actions if action is not None]
            for rank, actions in built.pipeline_order.items()}


@dataclass(frozen=True)
class Held:
    """At one action of a rank's schedule (`kind` on `stage`), per local stage: the micro-batches whose saved
    activations it holds (`activations`), those of them whose weights' gradients wait for their W pass
    (`awaiting_weights`), and the stages whose gradients exist (a backward pass of theirs has run)."""

    kind: str
    stage: int
    activations: dict[int, int]
    awaiting_weights: dict[int, int]
    with_gradients: frozenset[int]


def held_at_each_action(actions: list[tuple[str, int]]) -> list[Held]:
    """What a rank holds at each of its `actions`: after a forward pass (its activations added), before a backward
    pass (nothing freed yet). A full backward pass frees its micro-batch's activations; a zero-bubble I pass keeps
    them all (torch differentiates the inputs with retain_graph, for the W pass) and adds the gradients the W pass
    starts from; W frees both."""
    activations, awaiting, with_gradients, held = Counter(), Counter(), set(), []
    for kind, stage in actions:
        if kind == FORWARD:
            activations[stage] += 1
        held.append(Held(kind, stage, dict(activations), dict(awaiting), frozenset(with_gradients)))
        if kind == BACKWARD:
            activations[stage] -= 1
            with_gradients.add(stage)
        elif kind == BACKWARD_INPUT:
            awaiting[stage] += 1
        elif kind == BACKWARD_WEIGHT:
            activations[stage] -= 1
            awaiting[stage] -= 1
            with_gradients.add(stage)
    return held


def most_in_flight(actions: list[tuple[str, int]]) -> dict[int, int]:
    """The most micro-batches whose activations each stage of a rank holds at once."""
    most: Counter = Counter()
    for held in held_at_each_action(actions):
        for stage, count in held.activations.items():
            most[stage] = max(most[stage], count)
    return dict(most)
