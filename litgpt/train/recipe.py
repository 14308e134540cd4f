"""What one kind of training is, as data: the model, its initial weights, what trains, what a checkpoint holds, the
loss.

pretrain, finetune_full, finetune_lora (with QLoRA as an option of the last) and distill are `Recipe` values; the job
(`litgpt.train.job`), the trainer and the checkpoint manager read them and never ask which command runs. A new kind of
training adds fields here and a case to the methods that read them, not a branch in the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
from torch import nn

from litgpt.args import ActivationCheckpointing, KDArgs
from litgpt.checkpoint.model_files import WEIGHTS_FILE, assign_weights, copy_weights, meta_device, read_model_weights
from litgpt.config import Config
from litgpt.lora import LoRASettings, add_lora, init_lora_weights, is_lora_key, mark_only_lora_as_trainable
from litgpt.merge_lora import LORA_WEIGHTS_FILE
from litgpt.precision import PRECISION_DTYPES
from litgpt.train.loss import LossFunction, distillation_loss_function, loss_function


@dataclass(frozen=True)
class TeacherSettings:
    """The frozen teacher a student is distilled from (`litgpt distill`).

    Args:
        config: the teacher's config.
        weights: its lit_model.pth, read again by every run and every resume: nothing of the teacher is saved.
        kd: the distillation loss (`litgpt.train.loss.distillation_loss`).
    """

    config: Config
    weights: Path
    kd: KDArgs


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
        teacher: distillation: the loss is the KD loss against this frozen teacher (never trained nor saved), built
            by `materialize_teacher`.
    """

    name: str
    config: Config
    initialization: Literal["random", "checkpoint"] = "random"
    initial_weights: Optional[Path] = None
    lora: Optional[LoRASettings] = None
    quantize: Optional[str] = None
    loss: str = "cross_entropy"
    teacher: Optional[TeacherSettings] = None

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

    @property
    def merges_adapters(self) -> bool:
        """Whether final/ gets the adapters merged into the base, for `litgpt generate`."""
        return self.lora is not None

    def loss_function(self, chunk_size: Optional[int] = None, chunked: bool = True,
                      teacher: Optional[nn.Module] = None) -> LossFunction:
        """loss(model, input_ids, labels, positions=None) -> Losses: the training objective of one micro-batch
        (`positions`: packed samples', `litgpt.data.packing`), its logits built `chunk_size` positions at a time
        (None: automatic), or whole with `chunked=False` (see `litgpt.train.loss`); with a teacher, against `teacher`
        as `materialize_teacher` made it."""
        if self.teacher is not None:
            return distillation_loss_function(teacher, self.teacher.kd, chunk_size, chunked)
        return loss_function(self.loss, chunk_size, chunked)

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

    def materialize(self, fabric, model: nn.Module, precision: str, activation_checkpointing: ActivationCheckpointing,
                    compile_blocks: bool, load_initial: bool) -> nn.Module:
        """Take the meta model to the devices: shard, allocate, initialize, then load `initial_weights` (unless
        `load_initial` is False because a resumed checkpoint replaces every weight)."""
        from litgpt.distributed.fsdp import FSDPStrategy
        from litgpt.distributed.parallelize import parallelize

        if self.quantize is not None and isinstance(fabric.strategy, FSDPStrategy):
            return self._materialize_quantized_sharded(fabric, model, precision, activation_checkpointing,
                                                       compile_blocks)
        if self.quantize is not None:
            return self._materialize_quantized(fabric, model, precision, activation_checkpointing)
        model = parallelize(fabric, model, precision, self.initialize, activation_checkpointing, compile_blocks)
        if self.initial_weights is not None and load_initial:
            path = Path(self.initial_weights)
            copy_weights(model, read_model_weights(path), str(path), self.is_initial_key)
        return model

    def _materialize_quantized(self, fabric, model: nn.Module, precision: str,
                               activation_checkpointing: ActivationCheckpointing) -> nn.Module:
        """QLoRA (one device): the frozen base goes from the memory-mapped file straight into quantized layers, so
        the model is never whole in memory at its stored precision."""
        from litgpt.distributed.parallelize import apply_activation_checkpointing
        from litgpt.nf4 import is_nf4
        from litgpt.quantize import check_nf4_precision, quantize_frozen_base

        if self.quantize == "ao.nf4":
            check_nf4_precision(precision, sharded=False)
        path = Path(self.initial_weights)
        assign_weights(model, read_model_weights(path), str(path), self.is_initial_key)
        with torch.no_grad():
            self.initialize(model)
        # ao.nf4 dequantizes in the compute dtype (the dtype a -true precision's Fabric casts the module to, which
        # then leaves the NF4 weights alone); bitsandbytes computes in the dtype the weights were stored in.
        quantize_frozen_base(model, self.quantize, fabric.device, PRECISION_DTYPES[precision])
        if precision in ("32-true", "bf16-mixed"):  # float32 master copies of what stays unquantized
            for param in model.parameters():
                if param.dtype in (torch.float16, torch.bfloat16) and not is_nf4(param):
                    param.data = param.data.float()
        if activation_checkpointing:
            apply_activation_checkpointing(model, activation_checkpointing)
        return model

    def _materialize_quantized_sharded(self, fabric, model: nn.Module, precision: str,
                                       activation_checkpointing: ActivationCheckpointing,
                                       compile_blocks: bool) -> nn.Module:
        """QLoRA under FSDP2 (`ao.nf4`): `parallelize` with each block's base linears quantized from the
        memory-mapped file just before the block is sharded; the rest of the base is copied in after.

        Every rank reads each whole weight of the file and quantizes it, so all ranks hold the same NF4 values a
        single process would (the double-quantization statistics cover the whole weight), and FSDP keeps this rank's
        rows. Peak per rank while loading: its NF4 shards so far, one block's whole NF4 weights, one weight in its
        stored and in its compute dtype, and torchao's quantization temporaries for that weight; never the model.
        With `cpu_offload` the shards go to CPU memory as each block is sharded.
        """
        from litgpt.checkpoint.model_files import check_weights_match
        from litgpt.distributed.parallelize import parallelize
        from litgpt.quantize import block_targets, check_nf4_precision, check_nf4_shapes, frozen_nf4

        if self.quantize != "ao.nf4":
            raise RuntimeError(f"FSDP stores a quantized base as ao.nf4, not {self.quantize}")
        shard = fabric.strategy.topology.mesh_shape[1]
        check_nf4_shapes(model, shard)
        check_nf4_precision(precision, sharded=shard > 1)
        path = Path(self.initial_weights)
        state_dict = read_model_weights(path)
        expected = {key: value.shape for key, value in model.state_dict().items() if self.is_initial_key(key)}
        check_weights_match(expected, state_dict, str(path))
        dtype = PRECISION_DTYPES[precision]
        quantized = set()

        def quantize_block(index: int, block: nn.Module) -> None:
            for name, layer in block_targets(block):
                key = f"transformer.h.{index}.{name}.weight"
                layer.weight = frozen_nf4(state_dict[key].to(fabric.device), dtype)
                quantized.add(key)

        model = parallelize(fabric, model, precision, self.initialize, activation_checkpointing, compile_blocks,
                            prepare_block=quantize_block)
        rest = {key: value for key, value in state_dict.items() if key not in quantized}
        copy_weights(model, rest, str(path), lambda key: self.is_initial_key(key) and key not in quantized)
        return model

    def materialize_teacher(self, fabric, precision: str, compile_blocks: bool) -> Optional[nn.Module]:
        """The frozen teacher on the devices (None without one): built on the meta device, without gradients, in the
        run's compute dtype (bf16 under bf16-mixed too: it keeps no master weights), set up by the student's
        `parallelize` (sharded over the same mesh), its weights copied in shard by shard from `teacher.weights`, and
        in eval mode. It never reaches the optimizer or the checkpoints.

        Sharded, every block frees its gathered weights after its forward (no backward will come to do it, whatever
        the sharding strategy); the root (embeddings, final norm, head) stays gathered after the first forward, as
        the student's does from forward to backward, so the loss reads the teacher's head without another gather
        (and with --fsdp.cpu_offload, from the device)."""
        if self.teacher is None:
            return None
        from litgpt.distributed.fsdp import is_sharded
        from litgpt.distributed.parallelize import parallelize
        from litgpt.model import GPT

        with meta_device():
            teacher = GPT(self.teacher.config)
        teacher.requires_grad_(False)
        teacher.to(PRECISION_DTYPES[precision])
        teacher = parallelize(fabric, teacher, precision, initialize=lambda model: None,
                              activation_checkpointing=False, compile_blocks=compile_blocks)
        if is_sharded(teacher):
            for block in teacher.transformer.h:
                block.set_reshard_after_forward(True)
        path = Path(self.teacher.weights)
        copy_weights(teacher, read_model_weights(path), str(path), subject="The teacher's weights")
        return teacher.eval()

    def finish(self, final_dir: Path) -> None:
        """After the run published final/ (rank 0 only): what this kind of training adds to it."""
        if self.merges_adapters:
            from litgpt.merge_lora import merge_lora

            merge_lora(final_dir)
