"""What one kind of training is, as data: the model, its initial weights, what trains, what a checkpoint holds, the
frozen models it holds beside it and the objective.

pretrain, finetune_full and finetune_lora (with QLoRA as an option of the last) are `Recipe` values; distillation is
`litgpt.train.recipes.distill.DistillRecipe`, a subclass with a teacher, preference optimization
`litgpt.train.recipes.dpo.DPORecipe`, one with a reference, and GRPO `litgpt.train.recipes.grpo.GRPORecipe`, one that
samples its own training data. The job (`litgpt.train.job`), the trainer and the checkpoint manager read them and
never ask which command runs: a new kind of training is a new recipe (its frozen models in `materialize_frozen`, its
loss in `objective`, and batches made from the model as it trains in the objective's `make_batches`), not a branch in
the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
from torch import nn

from litgpt.args import ActivationCheckpointing
from litgpt.checkpoint.model_files import WEIGHTS_FILE, assign_weights, copy_weights, meta_device, read_model_weights
from litgpt.config import Config
from litgpt.lora import LoRASettings, add_lora, init_lora_weights, is_lora_key, mark_only_lora_as_trainable
from litgpt.merge_lora import LORA_WEIGHTS_FILE
from litgpt.precision import Precision
from litgpt.train.loss import LossFunction, loss_function
from litgpt.train.objective import Batch, BatchLoss, Objective


@dataclass(frozen=True)
class Recipe:
    """One kind of training.

    Args:
        name: the command it belongs to (pretrain, finetune_full, finetune_lora), for logs and run names.
        config: the model's config.
        initialization: "random" draws every weight from the model's initializer (pretraining); "checkpoint" takes
            them from `initial_weights` (finetuning; LoRA adapters are drawn from theirs).
        initial_weights: a lit_model.pth loaded over the initialization: every weight, or the frozen base with LoRA.
        lora: train low-rank adapters on a frozen base instead of every weight; checkpoints hold the adapters alone.
        quantize: QLoRA: the frozen base is stored quantized (`litgpt.quantize.QUANTIZE_MODES`; under FSDP only
            ao.nf4, torchao's NF4, which FSDP2 shards and all-gathers in 4 bits).
        loss: the name of the loss in `litgpt.train.loss.LOSSES`.
        initial_adapters: LoRA adapter tensors (our names) that replace the adapters' initialization: training
            continues from an earlier adapter (finetune_lora --initial_adapter_dir).
    """

    name: str
    config: Config
    initialization: Literal["random", "checkpoint"] = "random"
    initial_weights: Optional[Path] = None
    lora: Optional[LoRASettings] = None
    quantize: Optional[str] = None
    loss: str = "cross_entropy"
    initial_adapters: Optional[dict] = None

    # What `litgpt plan` counts of this kind of training: the sequences of one sample (two for a preference pair),
    # and whether the frozen models' outputs live on into the trained model's loss (a teacher's final hidden states)
    # or are reduced within their own forward pass (a reference's log-probabilities).
    sequences_per_sample = 1
    frozen_outputs_reach_the_loss = True

    def plan_summary(self, frozen_params: str) -> str:
        """What the plan's first line adds for this kind of training (`frozen_params`: the frozen models' parameter
        count, in words)."""
        return ""

    # ---- what trains and what a checkpoint holds --------------------------------------------------------------------
    def trains(self, key: str) -> bool:
        """Whether the weight `key` trains (and so is stored in checkpoints)."""
        return self.lora is None or is_lora_key(key)

    def is_initial_key(self, key: str) -> bool:
        """Whether `initial_weights` provides the weight `key`: the whole model, or the frozen base under LoRA."""
        return self.lora is None or not is_lora_key(key)

    @property
    def checkpoint_holds_every_weight(self) -> bool:
        return self.lora is None

    @property
    def weights_file(self) -> str:
        return WEIGHTS_FILE if self.lora is None else LORA_WEIGHTS_FILE

    def frozen_configs(self) -> dict[str, Config]:
        """The frozen models this kind of training holds beside the trained one, by name (a teacher, a reference
        model): never trained nor saved."""
        return {}

    @property
    def merges_adapters(self) -> bool:
        """Whether final/ gets the adapters merged into the base, for `litgpt generate`."""
        return self.lora is not None

    def objective(self, frozen: dict[str, nn.Module], chunk_size: Optional[int] = None,
                  chunked: bool = True) -> Objective:
        """The training objective (the loss of `self.loss`) and the validation loss (the cross-entropy; a router's
        auxiliary loss is not part of it), the logits built `chunk_size` positions at a time (None: automatic), or
        whole with `chunked=False` (see `litgpt.train.loss`). `frozen`: what `materialize_frozen` made."""
        return Objective(
            train_loss=batch_loss(loss_function(self.loss, chunk_size, chunked)),
            validation_loss=validation_parts(batch_loss(loss_function("cross_entropy", chunk_size, chunked))),
        )

    # ---- the model --------------------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The model on the meta device, with requires_grad set on the parameters that train."""
        from litgpt.model import GPT

        with meta_device():
            model = GPT(self.config)
        if self.lora is not None:
            add_lora(model, self.lora)
            mark_only_lora_as_trainable(model)
        return model

    def initialize(self, model: nn.Module) -> None:
        """Draw the weights that do not come from `initial_weights` (seeded by the caller)."""
        if self.initialization == "random":
            model.init_weights()
        elif self.lora is not None:
            init_lora_weights(model)

    def materialize(self, fabric, model: nn.Module, precision: Precision,
                    activation_checkpointing: ActivationCheckpointing,
                    compile_blocks: bool, load_initial: bool, offload_activations: bool = False) -> nn.Module:
        """Take the meta model to the devices: shard, allocate, initialize, then load `initial_weights` (unless
        `load_initial` is False because a resumed checkpoint replaces every weight). `offload_activations`: its
        forward pass saves for the backward pass in host memory (`parallelize`)."""
        from litgpt.distributed.expert_parallel import held_elsewhere
        from litgpt.distributed.fsdp import FSDPStrategy
        from litgpt.distributed.parallelize import parallelize
        from litgpt.distributed.tensor_parallel import row_orders

        if self.quantize is not None and isinstance(fabric.strategy, FSDPStrategy):
            model = self._materialize_quantized_sharded(fabric, model, precision, activation_checkpointing,
                                                        compile_blocks, offload_activations)
        elif self.quantize is not None:
            model = self._materialize_quantized(fabric, model, precision, activation_checkpointing,
                                                offload_activations)
        else:
            model = parallelize(fabric, model, precision, self.initialize, activation_checkpointing, compile_blocks,
                                offload=offload_activations)
            if self.initial_weights is not None and load_initial:
                path = Path(self.initial_weights)
                copy_weights(model, read_model_weights(path), str(path), self.is_initial_key,
                             row_orders=row_orders(model), held_elsewhere=held_elsewhere(model))
        if self.initial_adapters is not None:  # a resumed checkpoint's adapters replace these afterwards
            copy_weights(model, self.initial_adapters, "the initial adapter", is_lora_key,
                         subject="The LoRA adapters", fix="Check that the adapter belongs to this base model.",
                         held_elsewhere=held_elsewhere(model))
        return model

    def _materialize_quantized(self, fabric, model: nn.Module, precision: Precision,
                               activation_checkpointing: ActivationCheckpointing,
                               offload_activations: bool) -> nn.Module:
        """QLoRA (one device): the frozen base goes from the memory-mapped file straight into quantized layers, so
        the model is never whole in memory at its stored precision."""
        from litgpt.distributed.parallelize import apply_activation_checkpointing, apply_activation_offloading
        from litgpt.nf4 import is_nf4
        from litgpt.quantize import quantize_frozen_base

        path = Path(self.initial_weights)
        assign_weights(model, read_model_weights(path), str(path), self.is_initial_key)
        with torch.no_grad():
            self.initialize(model)
        # ao.nf4 dequantizes in the compute dtype; bitsandbytes computes in the dtype the weights were stored in.
        quantize_frozen_base(model, self.quantize, fabric.device, precision.compute_dtype)
        # The one cast the model gets: what stays unquantized in 16 bits under a 16-bit -true precision (quantized
        # weights keep their layout), float32 master copies otherwise.
        if precision.weights_dtype != torch.float32:
            model.to(precision.weights_dtype)
        else:  # on the device already, as the quantized weights are (Fabric would move them itself, with a warning)
            for param in model.parameters():
                if not is_nf4(param):
                    half = param.dtype in (torch.float16, torch.bfloat16)
                    param.data = param.data.to(fabric.device, torch.float32 if half else param.dtype)
        if activation_checkpointing:
            apply_activation_checkpointing(model, activation_checkpointing)
        if offload_activations:
            apply_activation_offloading(model, fabric.device)
        return model

    def _materialize_quantized_sharded(self, fabric, model: nn.Module, precision: Precision,
                                       activation_checkpointing: ActivationCheckpointing,
                                       compile_blocks: bool, offload_activations: bool) -> nn.Module:
        """QLoRA under FSDP2 (`ao.nf4`): `parallelize` with each block's base linears quantized from the
        memory-mapped file just before the block is sharded; the rest of the base is copied in after.

        Every rank reads each whole weight of the file and quantizes it, so all ranks hold the same NF4 values a
        single process would (the double-quantization statistics cover the whole weight), and FSDP keeps this rank's
        rows (a weight whose rows do not split into whole NF4 blocks and scale groups gets zero rows appended,
        `litgpt.quantize.store_nf4`). Peak per rank while loading: its NF4 shards so far, one block's whole NF4
        weights, one weight in its stored and in its compute dtype, and torchao's quantization temporaries for that
        weight; never the model. With `cpu_offload` the shards go to CPU memory as each block is sharded.
        """
        from litgpt.checkpoint.model_files import check_weights_match
        from litgpt.distributed.expert_parallel import held_elsewhere
        from litgpt.distributed.parallelize import parallelize
        from litgpt.quantize import block_targets, store_nf4

        if self.quantize != "ao.nf4":
            raise RuntimeError(f"FSDP stores a quantized base as ao.nf4, not {self.quantize}")
        path = Path(self.initial_weights)
        state_dict = read_model_weights(path)
        expected = {key: value.shape for key, value in model.state_dict().items() if self.is_initial_key(key)}
        check_weights_match(expected, state_dict, str(path))
        dtype, shard = precision.compute_dtype, fabric.strategy.topology.fsdp_shard_size
        quantized = set()

        def quantize_block(index: int, block: nn.Module) -> None:
            for name, layer in block_targets(block):
                key = f"transformer.h.{index}.{name}.weight"
                store_nf4(block, name, layer, state_dict[key].to(fabric.device), dtype, shard)
                quantized.add(key)

        model = parallelize(fabric, model, precision, self.initialize, activation_checkpointing, compile_blocks,
                            prepare_block=quantize_block, offload=offload_activations)
        rest = {key: value for key, value in state_dict.items() if key not in quantized}
        # A pipeline rank's model holds its stages: the rest of the file is other stages' (quantized there).
        copy_weights(model, rest, str(path), lambda key: self.is_initial_key(key) and key not in quantized,
                     held_elsewhere=held_elsewhere(model))
        return model

    def materialize_frozen(self, fabric, precision: Precision, compile_blocks: bool) -> dict[str, nn.Module]:
        """The frozen models of `frozen_configs` on the devices, by name (`frozen_model`): none here."""
        return {}

    def prepare_samples(self, fabric, model: nn.Module, frozen: dict[str, nn.Module], train_data, val_data,
                        micro_batch_size: int):
        """Before training (and before a checkpoint is restored): what this kind of training derives once from its
        models and the data, e.g. a reference's log-probabilities of every sample. Returns the frozen models still
        needed and the (train, val) datasets; here all as they are."""
        return frozen, train_data, val_data

    @staticmethod
    def build_frozen(config: Config) -> nn.Module:
        """A frozen model of `config` on the meta device, without gradients (what `frozen_model` sets up)."""
        from litgpt.model import GPT

        with meta_device():
            model = GPT(config)
        return model.requires_grad_(False)

    @classmethod
    def frozen_model(cls, fabric, config: Config, weights: Path, precision: Precision, compile_blocks: bool,
                     subject: str) -> nn.Module:
        """A frozen model on the devices: built on the meta device, without gradients, stored in the compute dtype
        (it keeps no master weights), set up by `parallelize` like the trained model (sharded over the same mesh),
        its weights copied in shard by shard from `weights`, in eval mode. It never reaches the optimizer or the
        checkpoints.

        Sharded, every block and the embedding free their gathered weights after their forward (no backward will
        come to do it, whatever the sharding strategy); the root (final norm, head) stays gathered after the first
        forward, as the trained model's does from forward to backward, so a loss reads its head without another
        gather (and with --fsdp.cpu_offload, from the device)."""
        from litgpt.distributed.expert_parallel import held_elsewhere
        from litgpt.distributed.fsdp import is_sharded
        from litgpt.distributed.parallelize import parallelize
        from litgpt.distributed.tensor_parallel import row_orders

        # Whole on every pipeline rank (the last stage's loss runs it on the batch's tokens).
        model = parallelize(fabric, cls.build_frozen(config), precision, initialize=lambda model: None,
                            activation_checkpointing=False, compile_blocks=compile_blocks,
                            dtype=precision.compute_dtype, pipelined=False)
        if is_sharded(model):
            for unit in (*model.transformer.h, model.transformer.wte):
                if is_sharded(unit):  # the embedding is a unit of its own unless tied to the head
                    unit.set_reshard_after_forward(True)
        copy_weights(model, read_model_weights(weights), str(weights), subject=subject, row_orders=row_orders(model),
                     held_elsewhere=held_elsewhere(model))
        return model.eval()

    def finish(self, final_dir: Path) -> None:
        """After the run published final/ (rank 0 only): what this kind of training adds to it."""
        if self.merges_adapters:
            from litgpt.merge_lora import merge_lora

            merge_lora(final_dir)


def batch_loss(loss: LossFunction) -> BatchLoss:
    """A loss of (model, input_ids, labels, positions) as a loss of (model, batch) (`positions`: packed samples')."""

    def of_batch(model: nn.Module, batch: Batch):
        return loss(model, batch["input_ids"], batch["labels"], batch.get("positions"))

    return of_batch


def validation_parts(loss: BatchLoss, logged: tuple[str, ...] = ()) -> BatchLoss:
    """`loss` as validation reports it: "loss" is its cross-entropy part (`ce_loss` where the loss has parts, e.g. a
    router's auxiliary loss or a distillation's KD term), plus the parts named in `logged`."""

    def validation(model: nn.Module, batch: Batch):
        parts = loss(model, batch)
        return {"loss": parts.get("ce_loss", parts["loss"]), **{name: parts[name] for name in logged if name in parts}}

    return validation
