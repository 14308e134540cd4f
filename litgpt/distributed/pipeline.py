"""Pipeline parallelism (`--parallel.pipeline N`): the model's blocks are cut into N x stages-per-rank stages of
consecutive blocks, each a module of its own (`StageModule`: the first also holds the embedding, the last the final
norm and the output head, the blocks keep their one-process names `transformer.h.{i}`), and each rank of a pipeline
group runs its stages, placed by the schedule (looped, or in a V for ZBVZeroBubble). The rest of `parallelize`
(activation checkpointing, compilation, FSDP over the data-parallel mesh) then applies to each stage module.

A rank's model is a `PipelineModel`: its stages' modules under the one-process names (so optimizers, checkpoints and
torch.distributed.checkpoint see the one-process layout, and a checkpoint reshards across meshes), beside the whole
model on the meta device whose other stages are only shapes (`held_by_other_stages`). A step's micro-batches run
through `torch.distributed.pipelining`'s schedule (`build_schedule`); validation runs them forward stage by stage
(`Pipeline.forward`). A head tied to the embedding becomes two parameters, the last stage's and the first stage's
copy of it (`TiedEmbedding`). The model file knows nothing of this.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from litgpt.errors import UserError
from litgpt.model import GPT
from litgpt.moe import LLaMAMoE

Losses = dict[str, torch.Tensor]


class Pipeline:
    """This rank's pipeline group (the 1-D `mesh`) and where the stages run: `stages_per_rank` x the group's size of
    them, stage s on pipeline rank s mod N (looped), or for ZBVZeroBubble s < N on rank s and the others on rank
    2N - 1 - s (a V)."""

    def __init__(self, mesh, topology) -> None:
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.schedule, self.stages_per_rank = topology.pipeline_schedule, topology.stages_per_rank
        self.n_stages = self.size * self.stages_per_rank
        self.device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
        # The data-parallel rank 0 of this pipeline rank: its full checkpoint tensors go to pipeline rank 0.
        self.collects = dist.get_rank() % (topology.world_size // self.size) == 0
        self._loss_names: dict[str, list[str]] = {}

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs `stage`."""
        return stage_rank(stage, self.size, self.schedule)

    @property
    def local_stages(self) -> list[int]:
        return [stage for stage in range(self.n_stages) if self.stage_rank(stage) == self.rank]

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def summed_norm(self, norm: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of every stage's gradients from this rank's stages' `norm` (a DTensor over FSDP's mesh, or whole):
        raised to `norm_type`, summed over the pipeline group."""
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        power = norm.float().to(self.device) ** norm_type
        dist.all_reduce(power, group=self.group)
        return power ** (1.0 / norm_type)

    def gather_on_first(self, piece: object) -> list:
        """Every pipeline rank's `piece` (tensors on the CPU), in pipeline-rank order, on pipeline rank 0; [] on the
        others."""
        pieces = [None] * self.size if self.rank == 0 else None
        dist.gather_object(piece, pieces, group_dst=0, group=self.group)
        return pieces if self.rank == 0 else []

    def from_last_stage(self, losses: Optional[Losses], kind: str) -> Losses:
        """The last stage's `losses` (None on the other ranks) on every rank of the group, as float32 tensors; the
        names travel once per `kind` (training, validation), the values every time."""
        source = self.stage_rank(self.n_stages - 1)
        if kind not in self._loss_names:
            names = [list(losses) if losses is not None else None]
            dist.broadcast_object_list(names, group_src=source, group=self.group, device=self.device)
            self._loss_names[kind] = names[0]
        names = self._loss_names[kind]
        if losses is None:
            values = torch.empty(len(names), device=self.device)
        else:
            values = torch.stack([losses[name].detach().float() for name in names]).to(self.device)
        dist.broadcast(values, group_src=source, group=self.group)
        return dict(zip(names, values))


def stage_rank(stage: int, degree: int, schedule: str) -> int:
    """The pipeline rank (of `degree`) that runs `stage` under `schedule`: stage mod degree (looped), or for
    ZBVZeroBubble the stages from `degree` on back down the ranks (a V)."""
    if schedule == "ZBVZeroBubble" and stage >= degree:
        return 2 * degree - 1 - stage
    return stage % degree


class StageBlocks(nn.ModuleList):
    """Some of a model's blocks under their one-process indices (`h.{i}`), iterated and indexed by their place."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, position: int) -> nn.Module:
        return list(self._modules.values())[position]


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """The blocks of each stage: consecutive, as even as they split, the first stages one more where they do not."""
    size, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for stage in range(n_stages):
        bounds.append(bounds[-1] + size + (stage < extra))
    return [range(start, end) for start, end in zip(bounds, bounds[1:])]


class StageModule(nn.Module):
    """Stage `index` of `n_stages` of the GPT `gpt`: its blocks (`layers`), with the token embedding on the first
    stage and the final norm and output head on the last, all the GPT's own modules under their names. Its forward
    takes token ids (first stage) or the previous stage's residual stream and returns the residual stream in
    `boundary_dtype` (what travels to the next stage), or on the last stage the final norm's output, which the loss
    turns into logits chunk by chunk as it does for the whole model.

    With mixture-of-experts layers whose routers have a load-balancing loss (`carries_router_stats`), the routing
    statistics of every layer so far travel beside the residual stream (`router_stats_so_far`): the last stage's
    loss takes the whole model's load-balancing loss from them, and its gradient flows back to each stage's routers
    through the probabilities' sums, as one process's does."""

    def __init__(self, gpt: GPT, index: int, n_stages: int, layers: range, boundary_dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.index = gpt.config, index
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.boundary_dtype = boundary_dtype
        # Under tensor parallelism's sequence parallelism each rank's residual stream (what the stages exchange) holds
        # 1/sequence_shards of the positions.
        self.sequence_shards = 1
        self.carries_router_stats = carries_router_stats(gpt.config)
        # Not submodules (the blocks hold them): the MoE layers whose routing this stage adds up.
        self.moe_layers = [gpt.transformer.h[i].mlp for i in layers if isinstance(gpt.transformer.h[i].mlp, LLaMAMoE)]
        parts: dict[str, nn.Module] = {"wte": gpt.transformer.wte} if self.is_first else {}
        parts["h"] = StageBlocks({i: gpt.transformer.h[i] for i in layers})
        if self.is_last:
            parts["ln_f"] = gpt.transformer.ln_f
            self.lm_head = gpt.lm_head
        self.transformer = nn.ModuleDict(parts)
        object.__setattr__(self, "gpt", gpt)  # not a submodule: its rotary tables and masks, never its weights

    def forward(self, x: torch.Tensor, *router_stats: torch.Tensor, sample_positions: Optional[torch.Tensor] = None,
                counted_positions: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
        """`counted_positions` (one per row, the same in a micro-batch): how many of the positions are the batch's
        own, the rest padding that the routing statistics leave out."""
        positions = x.size(1) if self.is_first else x.size(1) * self.sequence_shards
        device = x.device
        if self.is_first:
            x = self.gpt.embed(x)
        counted = None if counted_positions is None else int(counted_positions[0])
        for layer in self.moe_layers:
            layer.router_stats = None  # each MoE layer records this pass' routing
            if counted is not None:
                layer.counted_positions = None if counted == positions else counted
        layer_inputs = self.gpt.layer_inputs(x, positions, positions, sample_positions=sample_positions)
        for name, block in self.transformer.h.named_children():
            x = block(x, *layer_inputs[int(name)])
        x = self.transformer.ln_f(x) if self.is_last else x.to(self.boundary_dtype)
        if not self.carries_router_stats:
            return x
        return x, *self.router_stats_so_far(router_stats, device)

    def router_stats_so_far(self, received: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(router probabilities summed per expert, [assignments per expert | tokens]) over every MoE layer up to
        this stage's last, in float32: the previous stages' (`received`; zeros on the first stage) plus this stage's
        layers'. The sums always take a gradient (a leaf on the first stage), so every stage sends one back."""
        n_expert = self.config.n_expert
        if received:
            probability, counts = received
        else:
            probability = torch.zeros(n_expert, device=device, requires_grad=True)
            counts = torch.zeros(n_expert + 1, device=device)
        stats = [layer.router_stats for layer in self.moe_layers]
        probability = probability + sum((s.prob_sum.float() for s in stats), torch.zeros_like(counts[:-1]))
        for s in stats:
            counts = counts + torch.cat((s.counts.float(), counts.new_tensor([s.rows])))
        return probability, counts


class PipelineModel(nn.Module):
    """A pipeline rank's model: its stages' modules (`stages`, in stage order, each set up on its own) registered
    under the one-process names (the head first, as `GPT` registers it), and the whole `gpt` on the meta device
    beside them (not registered). It is never called: its stages run through `build_schedule`'s schedule and
    `Pipeline.forward`."""

    def __init__(self, gpt: GPT, stages: list[StageModule], pipeline: Pipeline,
                 one_process_keys: Optional[list[str]] = None) -> None:
        super().__init__()
        self.config, self.pipeline = gpt.config, pipeline
        # The whole model's state-dict keys in order, every expert of the MoE layers listed: taken before expert
        # parallelism leaves this rank's stages some of them (default: the model's keys now).
        self.one_process_keys = one_process_keys or list(gpt.state_dict(keep_vars=True))
        if any(stage.is_last for stage in stages):
            self.lm_head = gpt.lm_head
        parts: dict[str, nn.Module] = {"wte": gpt.transformer.wte} if any(stage.is_first for stage in stages) else {}
        blocks = {int(name): block for stage in stages for name, block in stage.transformer.h.named_children()}
        parts["h"] = StageBlocks(dict(sorted(blocks.items())))
        if any(stage.is_last for stage in stages):
            parts["ln_f"] = gpt.transformer.ln_f
        self.transformer = nn.ModuleDict(parts)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "gpt", gpt)
        self.tie = TiedEmbedding(self) if gpt.config.tie_embeddings else None

    def forward(self, *args, **kwargs):
        raise RuntimeError("A pipeline rank's model runs through its schedule (litgpt.distributed.pipeline), not whole.")

    @property
    def sequence_shards(self) -> int:
        """How many pieces the positions of the residual stream between stages are split in (tensor parallelism's
        sequence parallelism): a micro-batch's positions must be a multiple of it."""
        return self.stages[0].sequence_shards

    def boundary(self, batch: int, positions: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Empty tensors like what a stage sends the next for a micro-batch of (batch, positions), those that take a
        gradient marked so: the residual stream (in its dtype, its positions split by `sequence_shards`), and with
        `carries_router_stats` the routing statistics so far (`StageModule.router_stats_so_far`)."""
        stage = self.stages[0]
        hidden = torch.empty(batch, positions // self.sequence_shards, self.config.n_embd, device=device,
                             dtype=stage.boundary_dtype, requires_grad=True)
        if not stage.carries_router_stats:
            return (hidden,)
        n_expert = self.config.n_expert
        return (hidden, torch.empty(n_expert, device=device, requires_grad=True),
                torch.empty(n_expert + 1, device=device))

    def in_one_process_order(self, state: dict) -> dict:
        """`state` (keyed by state-dict name) in the order of the whole model's state dict (`one_process_keys`)."""
        return {key: state[key] for key in self.one_process_keys if key in state}

    def gather_weights(self, weights: dict) -> dict:
        """Every stage's full `weights` (on each pipeline rank's collecting rank, `Pipeline.collects`) in one
        process's layout on the run's rank zero; {} elsewhere."""
        pieces = self.pipeline.gather_on_first(weights)
        return self.in_one_process_order({key: value for piece in pieces for key, value in piece.items()})

    def gather_optimizer_state(self, state: dict) -> dict:
        """Every stage's full optimizer `state` ({"state", "param_groups"}, keyed by parameter name, on each pipeline
        rank's collecting rank) in one process's layout on the run's rank zero, each parameter group holding every
        stage's parameters; {} elsewhere."""
        pieces = [piece for piece in self.pipeline.gather_on_first(state) if piece]
        if not pieces:
            return {}
        groups = [{**group, "params": list(self.in_one_process_order(
            {name: None for piece in pieces for name in piece["param_groups"][index]["params"]}))}
            for index, group in enumerate(pieces[0]["param_groups"])]
        merged = {name: value for piece in pieces for name, value in piece["state"].items()}
        return {"state": self.in_one_process_order(merged), "param_groups": groups}


class TiedEmbedding:
    """The output head tied to the token embedding (`tie_embeddings`) of a `PipelineModel`: the first stage's
    embedding and the last stage's head are two parameters, on two pipeline ranks (or on one rank's two stages, in a
    V), each sharded alike over the data-parallel ranks. The head's is the parameter the optimizer steps, its state
    named `lm_head.weight` as one process names the tied one; the embedding's is its copy, which the optimizer never
    sees (`optimized`): after the backward pass the copy's gradient is added to the head's (`add_copy_gradient`),
    after each optimizer step the head's weights are copied into it (`copy_head`). One process's weights, gradient
    and optimizer state, with one exchange of each rank's shard a step in each direction."""

    def __init__(self, model: "PipelineModel") -> None:
        self.model, self.pipeline = model, model.pipeline
        self.embedding_rank = self.pipeline.stage_rank(0)
        self.head_rank = self.pipeline.stage_rank(self.pipeline.n_stages - 1)

    @property
    def embedding(self) -> Optional[nn.Parameter]:
        """The copy, on the rank of the first stage; None elsewhere."""
        return self.model.transformer.wte.weight if "wte" in self.model.transformer else None

    @property
    def head(self) -> Optional[nn.Parameter]:
        """The parameter the optimizer steps, on the rank of the last stage; None elsewhere."""
        return self.model.lm_head.weight if hasattr(self.model, "lm_head") else None

    def optimized(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """`parameters` without the copy."""
        return [p for p in parameters if p is not self.embedding]

    def add_copy_gradient(self) -> None:
        """The embedding's gradient (this step's, of every micro-batch) added to the head's, then dropped."""
        here = self.embedding if self.embedding is not None else self.head
        if here is None or not here.requires_grad:  # a middle stage, or frozen (LoRA leaves the head out)
            return
        source = None if self.embedding is None else _local(self.embedding.grad)
        target = None if self.head is None else _local(self.head.grad)
        self._move(source, target, self.embedding_rank, self.head_rank, add=True)
        if self.embedding is not None:
            self.embedding.grad = None

    @torch.no_grad()
    def copy_head(self) -> None:
        """The head's weights into the embedding (after each optimizer step)."""
        source = None if self.head is None else _local(self.head)
        target = None if self.embedding is None else _local(self.embedding)
        self._move(source, target, self.head_rank, self.embedding_rank, add=False)

    @torch.no_grad()
    def copy_embedding(self) -> None:
        """The embedding's weights into the head: after initialization, where one process's tied weight holds the
        embedding's draw (drawn after the head's)."""
        source = None if self.embedding is None else _local(self.embedding)
        target = None if self.head is None else _local(self.head)
        self._move(source, target, self.embedding_rank, self.head_rank, add=False)

    def _move(self, source: Optional[torch.Tensor], target: Optional[torch.Tensor], source_rank: int,
              target_rank: int, add: bool) -> None:
        """`source` (this rank's shard, on pipeline rank `source_rank`) copied, or added (`add`), into `target`
        (the same shard, on `target_rank`)."""
        if source_rank == target_rank:
            received = source
        elif self.pipeline.rank == source_rank:
            dist.send(source.contiguous(), dst=self.pipeline.global_rank(target_rank), group=self.pipeline.group)
            return
        elif self.pipeline.rank == target_rank:
            received = torch.empty_like(target)
            dist.recv(received, src=self.pipeline.global_rank(source_rank), group=self.pipeline.group)
        else:
            return
        if received is None:  # neither end of the pipeline
            return
        if add:
            target.add_(received)
        else:
            target.copy_(received)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def keep_tied_copy(model: nn.Module, optimizer) -> None:
    """After each step of `optimizer`, a pipeline rank's model with a tied head copies it into its embedding
    (`TiedEmbedding.copy_head`); nothing for any other model."""
    tie = model.tie if isinstance(model, PipelineModel) else None
    if tie is not None:
        getattr(optimizer, "optimizer", optimizer).register_step_post_hook(lambda *_: tie.copy_head())


def carries_router_stats(config) -> bool:
    """Whether the stages of a model of `config` pass routing statistics along: mixture-of-experts layers with a
    load-balancing loss (a coefficient above 0)."""
    return config.mlp_class_name == "LLaMAMoE" and bool(config.router_aux_loss_coef)


def split_into_stages(gpt: GPT, pipeline: Pipeline, boundary_dtype: torch.dtype) -> list[StageModule]:
    """This rank's stage modules of `gpt` (on the meta device), in stage order. A head tied to the embedding gets a
    parameter of its own (`TiedEmbedding` keeps the two equal): they live on the first and the last stage, each set
    up on its own."""
    if gpt.lm_head.weight is gpt.transformer.wte.weight:
        embedding = gpt.transformer.wte.weight
        gpt.lm_head.weight = nn.Parameter(torch.empty_like(embedding, device="meta"),
                                          requires_grad=embedding.requires_grad)
    layers = stage_layers(gpt.config.n_layer, pipeline.n_stages)
    return [StageModule(gpt, index, pipeline.n_stages, layers[index], boundary_dtype)
            for index in pipeline.local_stages]


def pipeline_of(model: nn.Module) -> Optional[Pipeline]:
    """The `Pipeline` of a pipeline rank's model; None for any other model."""
    return model.pipeline if isinstance(model, PipelineModel) else None


def held_by_other_stages(model: nn.Module) -> dict[str, torch.Size]:
    """The shapes of the state-dict keys that other pipeline ranks hold (a full checkpoint has them); {} for a model
    that is not a `PipelineModel`."""
    if not isinstance(model, PipelineModel):
        return {}
    mine = set(model.state_dict(keep_vars=True))
    return {key: value.shape for key, value in model.gpt.state_dict(keep_vars=True).items() if key not in mine}


# ---- running the stages --------------------------------------------------------------------------------------------
SCHEDULE_CLASSES = {"1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
                    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble", "ZBVZeroBubble": "ScheduleZBVZeroBubble"}


def check_microbatches(schedule: str, stages: int, degree: int, microbatches: int) -> None:
    """UserError unless `microbatches` per optimizer step keep the schedule's `stages` busy (`degree` devices):
    1F1B needs at least one per stage, the interleaved ones at least one per device and whole rounds of them."""
    fix = ("raise --train.global_batch_size or lower --train.micro_batch_size (the micro-batches per step are the "
           "global batch over the micro-batch size times the data-parallel devices)")
    needed = stages if schedule == "1F1B" else degree
    if microbatches < needed:
        raise UserError(f"--parallel.pipeline_schedule {schedule} over {stages} stages needs at least {needed} "
                        f"micro-batches per optimizer step, but the run has {microbatches}: {fix}.")
    rounds = microbatches // degree
    if schedule != "1F1B" and microbatches % rounds:
        raise UserError(f"--parallel.pipeline_schedule {schedule} runs the micro-batches in rounds of "
                        f"{microbatches // rounds} over {degree} devices, and {microbatches} micro-batches per step do "
                        f"not split into {rounds} of them: use a multiple of {degree}; {fix}.")


def build_schedule(model: PipelineModel, microbatches: int, microbatch_shape: tuple[int, int],
                   loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The `torch.distributed.pipelining` schedule of this rank's stages for `microbatches` micro-batches of
    `microbatch_shape` (batch, positions) per step: the stages' inputs and outputs are declared (no inference pass),
    `loss(last stage's output, target)` runs on the last stage, and the gradients are divided by the number of
    micro-batches (each micro-batch's loss is a mean, as gradient accumulation divides it)."""
    import torch.distributed.pipelining as pipelining

    pipeline = model.pipeline
    batch, positions = microbatch_shape
    # What travels between stages, with the gradients to send back.
    boundary = model.boundary(batch, positions, torch.device("meta"))
    tokens = (torch.empty(batch, positions, dtype=torch.long, device="meta"),)
    stages = [
        pipelining.PipelineStage(
            stage, stage.index, pipeline.n_stages, pipeline.device, group=pipeline.group,
            input_args=tokens if stage.is_first else boundary, output_args=boundary,
        )
        for stage in model.stages
    ]
    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[pipeline.schedule])
    if pipeline.schedule == "1F1B":
        return schedule_class(stages[0], microbatches, loss_fn=loss, scale_grads=True)
    return schedule_class(stages, microbatches, loss_fn=loss, scale_grads=True)


def forward(model: PipelineModel, input_ids: torch.Tensor,
            **kwargs) -> Optional[Union[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """The last stage's output for `input_ids` (B, T), run forward stage by stage (validation: no schedule, any
    shape whose T is a multiple of `sequence_shards`), on the rank that runs the last stage; None on the others.
    `kwargs` go to every stage."""
    pipeline, x = model.pipeline, None
    stages = {stage.index: stage for stage in model.stages}
    for index in range(pipeline.n_stages):
        owner, previous = pipeline.stage_rank(index), pipeline.stage_rank(index - 1) if index else None
        if index and owner != previous and pipeline.rank == previous:
            for tensor in x:
                dist.send(tensor.contiguous(), dst=pipeline.global_rank(owner), group=pipeline.group)
        elif index and owner != previous and pipeline.rank == owner:
            x = tuple(tensor.detach() for tensor in model.boundary(*input_ids.shape, input_ids.device))
            for tensor in x:
                dist.recv(tensor, src=pipeline.global_rank(previous), group=pipeline.group)
        if owner == pipeline.rank:
            x = stages[index](*((input_ids,) if index == 0 else x), **kwargs)
            x = x if isinstance(x, tuple) else (x,)
    if pipeline.stage_rank(pipeline.n_stages - 1) != pipeline.rank:
        return None
    return x if len(x) > 1 else x[0]
