"""What autograd saves in one training forward pass, measured on the real model with fake tensors.

Nothing is allocated: the model is measured, not re-described. `saved_activation_bytes` takes the model as the recipe
builds it (`litgpt.train.recipe.Recipe.build_model`: on the meta device, with its LoRA adapters and only what trains
requiring gradients), gives it fake parameters (`torch._subclasses.fake_tensor.FakeTensorMode`: shapes, dtypes and
strides, no memory) and runs one forward pass under `torch.autograd.graph.saved_tensors_hooks`. The hooks see every
tensor autograd keeps for the backward pass; each distinct storage counts once (views share theirs), and a saved
parameter is not an activation (under FSDP the run's parameters stand for the gathered ones, a row of their own).
A wrapper of each block's forward says which block saved what, and what each block received as its input; blocks of
one kind (structure, rope and mask) save the same, so only two of each kind run (see `measured_once`). The result is
kept per model config and settings for the rest of the process.

The fake run executes the model's own code on fake CPU tensors. What it cannot decide by itself, and how it adjusts
for it (each adjustment is one rule in `_Kernels`, `_NativeDropout`, `math_attention` or `fused_attention_only`):

- 16-bit compute is run in bfloat16 (float16 has the same sizes). A -mixed precision on one device runs under the
  CPU's autocast, whose op lists are taken for CUDA's: for the ops of this model they agree (linear layers, matmuls
  and attention in 16 bits; norms and float32 softmax as they are).
- --quantize: the fake run keeps the frozen base linears in floating point. bitsandbytes' quantized matmul and
  torchao's `linear_nf4` save what a frozen float linear saves: the weight (not an activation), never its input.
- mixture of experts: the routed rows are sorted by expert into tensors of fixed shape (k x tokens rows), so the
  memory does not depend on which expert a token goes to, and the fake run needs no routing of its own.
- --device cuda, where kernels differ from the CPU's:
  - attention: in float32 with grouped keys (n_query_groups < n_head) no fused CUDA kernel applies, and the fake run
    selects PyTorch's math path (`sdpa_kernel(SDPBackend.MATH)`), which keeps the (batch, heads, seq, seq) softmax.
    Otherwise the CPU's flash kernel saves what CUDA's flash and memory-efficient kernels save (q, k, v, output,
    log-sum-exp), except that the memory-efficient kernel (float32, or a mask such as a sliding window) lays its
    output out as (batch, seq, heads, head size), which changes whether the projection's reshape copies it; the
    kernels' 16-byte random-number state and the memory-efficient kernel's padding of the log-sum-exp to 32 rows
    are left out. Soft-capped attention (Gemma 2) is the model's own matmuls and softmax, on every device.
  - the model's own matmul attention for short sequences (`litgpt.model.MatmulAttention`) is the CPU's only: for
    other devices the fake run turns it off (`fused_attention_only`).
  - dropout (LoRA's): CUDA's fused kernel saves a one-byte mask, the CPU's the scaled noise in the input's dtype.
  - a value head size other than the query's (latent attention: 192 and 128) takes CUDA's memory-efficient kernel,
    not the math path the CPU falls back to (`_MemoryEfficientAttention`).
  - LayerNorm keeps its mean and reciprocal deviation in float32 on CUDA, in the input's dtype on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from litgpt.config import Config
from litgpt.distributed.activation_checkpointing import is_kept
from litgpt.errors import UserError
from litgpt.precision import Precision

if TYPE_CHECKING:
    from litgpt.train.recipe import Recipe


@dataclass
class SavedActivations:
    """Bytes autograd saves in the forward pass of the model (the loss' own tensors not included).

    `per_layer`: one entry per block (a storage first saved in a block counts there); `root`: the rest (the
    embedding's indices, the final norm, the head's input, a final soft-capping). `block_inputs`: the storage of each
    block's input, what activation checkpointing keeps. With autocast (a -mixed precision on one device)
    `weight_copies` are its 16-bit copies of the weights that autograd saves (`layer_weight_copies` per block, the
    rest the head's), and `cached_weight_copies` those of the trainable weights, which autocast's cache holds until
    the forward pass ends even where checkpointing saves nothing. `kept_outputs`: per block, the outputs of the
    operations op-level checkpointing keeps (`KEPT_OPS`: matmuls, attention), and `kept_outputs_saved` the part of
    `per_layer` they make up (what a recomputation of the block need not allocate again).
    """

    per_layer: list[int]
    root: int
    weight_copies: int = 0
    layer_weight_copies: list[int] = field(default_factory=list)
    cached_weight_copies: int = 0
    block_inputs: list[int] = field(default_factory=list)
    kept_outputs: list[int] = field(default_factory=list)
    kept_outputs_saved: list[int] = field(default_factory=list)
    # What the norms saved (`litgpt.distributed.plans.dense.SEQUENCE_SPLIT_NORMS` and the final norm; a block's first norm saves the block's input), per block and in
    # the root: the part sequence parallelism splits over the positions.
    norms_saved: list[int] = field(default_factory=list)
    root_norms_saved: int = 0
    embedding: int = 0  # the part of `root` saved before the first block (the embedding's)

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.root + self.weight_copies

    def of_stage(self, layers: range, first: bool, last: bool) -> "SavedActivations":
        """What a pipeline stage's forward pass of one micro-batch saves: its blocks' (`layers`), the embedding's on
        the first stage, the final norm's and the head's on the last."""
        blocks = lambda values: [values[index] for index in layers] if values else []  # noqa: E731
        return dataclasses.replace(
            self, per_layer=blocks(self.per_layer), layer_weight_copies=blocks(self.layer_weight_copies),
            block_inputs=blocks(self.block_inputs), kept_outputs=blocks(self.kept_outputs),
            kept_outputs_saved=blocks(self.kept_outputs_saved), norms_saved=blocks(self.norms_saved),
            root=(self.embedding if first else 0) + (self.root - self.embedding if last else 0),
            root_norms_saved=self.root_norms_saved if last else 0, embedding=self.embedding if first else 0,
        )

    def split_over_sequence(self, degree: int) -> "SavedActivations":
        """What one rank saves when sequence parallelism splits the norms (and the residual stream between the
        blocks: each block's input) over `degree` ranks, and the rest is measured on the rank's piece of the model."""
        if degree == 1:
            return self
        kept = lambda whole: whole // degree  # noqa: E731
        per_layer = [layer - norms + kept(norms) for layer, norms in zip(self.per_layer, self.norms_saved)]
        return dataclasses.replace(
            self, per_layer=per_layer, root=self.root - self.root_norms_saved + kept(self.root_norms_saved),
            block_inputs=[kept(size) for size in self.block_inputs],
            norms_saved=[kept(norms) for norms in self.norms_saved], root_norms_saved=kept(self.root_norms_saved),
        )


_MEASURED: dict[tuple, SavedActivations] = {}


def saved_activation_bytes(recipe: "Recipe", *, micro_batch_size: int, seq_length: int, precision: Precision,
                           sharded: bool = False, device: str = "cuda",
                           model: Optional[torch.nn.Module] = None) -> SavedActivations:
    """What autograd saves in one forward pass of the recipe's model training with these settings, measured by
    running it on fake tensors (see the module docstring). With a -mixed precision a single device runs under autocast
    over float32 weights, FSDP (`sharded`) in 16 bits throughout. `model`: the recipe's model as `build_model` made
    it, to measure instead of building another (its parameters are replaced by fakes)."""
    key = (repr(recipe.config), repr(recipe.lora), micro_batch_size, seq_length, precision.name, sharded, device)
    if key not in _MEASURED:
        if len(_MEASURED) >= 64:
            _MEASURED.clear()
        _MEASURED[key] = _measure(recipe, micro_batch_size, seq_length, precision, sharded, device, model)
    return copy.deepcopy(_MEASURED[key])


def _measure(recipe: "Recipe", batch: int, seq: int, precision: Precision, sharded: bool, device: str,
             model: Optional[torch.nn.Module]) -> SavedActivations:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    autocast = precision.mixed and not sharded
    stored = precision.weights_dtype if autocast else precision.compute_dtype
    dtype = torch.float32 if stored == torch.float32 else torch.bfloat16  # 16 bits: same sizes
    fake = FakeTensorMode()
    model = _fake_model(recipe.build_model() if model is None else model, dtype, fake)
    tape = _SavedTensors(model, autocast)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake)
        idx = torch.zeros((batch, seq), dtype=torch.long)
        stack.enter_context(_Kernels(device, tape))
        if device == "cuda":
            stack.enter_context(_NativeDropout())
            stack.enter_context(_MemoryEfficientAttention())
        if math_attention(recipe.config, device, precision):
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if device != "cpu":
            stack.enter_context(fused_attention_only())
        if autocast:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(tape.pack, lambda tensor: tensor))
        try:
            model(idx)
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise UserError(f"The model config cannot run a forward pass of this size: {first_line}") from None
    return tape.result(recipe.config.n_layer)


def _fake_model(model: torch.nn.Module, dtype: torch.dtype, fake) -> torch.nn.Module:
    """A recipe's model (`Recipe.build_model`: what trains requires gradients) in `dtype`, with fake parameters:
    every parameter (ties kept) and buffer made a fake CPU tensor, in place."""
    cpu = torch.device("cpu")

    def fake_of(shape: torch.Size, of_dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
        # A meta tensor made a fake CPU one directly, and a parameter as nn.Parameter makes one of a tensor subclass
        # but without its detach: torch.empty under the mode and nn.Parameter took 7 times as long (DeepSeek-V3's
        # 90,000 parameters: 10 s).
        meta = torch.empty(shape, dtype=of_dtype, device="meta", requires_grad=requires_grad)
        return fake.fake_tensor_converter.from_meta_and_device(fake, meta, cpu)

    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in fakes:
                fakes[id(param)] = fake_of(param.shape, dtype, param.requires_grad)
                fakes[id(param)]._is_param = True  # an nn.Parameter to isinstance, as nn.Parameter marks a subclass
            if param is not None:
                module._parameters[name] = fakes[id(param)]
        for name, buffer in module._buffers.items():  # the routers' correction biases
            if buffer is not None:
                module._buffers[name] = fake_of(buffer.shape, buffer.dtype)
    return model


def _storage(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (views share it), for as long as the storage lives."""
    return tensor.untyped_storage()._cdata


class _SavedTensors:
    """The pack hook: counts every storage autograd saves once, by where it was first saved, parameters left out."""

    def __init__(self, model: torch.nn.Module, autocast: bool) -> None:
        self.params = {_storage(p) for p in model.parameters()}
        self.trainable = {_storage(p) for p in model.parameters() if p.requires_grad}
        self.autocast = autocast
        self.copies: set[int] = set()  # storages of autocast's copies of parameters
        self.cached = 0
        self.where: object = "embedding"  # until the first block runs; "root" after a block
        self.saved: dict[object, int] = {}
        self.saved_copies: dict[object, int] = {}
        self.saved_kept: dict[object, int] = {}
        self.inputs: list[int] = []
        self.kept: dict[int, tuple[object, int]] = {}  # `KEPT_OPS`' output storages: (block made in, bytes)
        self.seen: set[int] = set()
        self.alive: list[torch.Tensor] = []  # keeps counted storages alive, so their identities are not reused
        self.figures: dict[tuple, dict] = {}  # a block's structure and arguments -> what its last run saved
        self.runs: dict[tuple, int] = {}  # -> how many blocks of the kind ran
        self.in_norm = False
        self.norms_saved: dict[object, int] = {}
        for index, block in enumerate(model.transformer.h):
            block.forward = self.measured_once(index, block, block.forward)
        from litgpt.distributed.plans.dense import SEQUENCE_SPLIT_NORMS

        norms = [getattr(block, name, None) for block in model.transformer.h for name in SEQUENCE_SPLIT_NORMS]
        for norm in [norm for norm in norms if norm is not None] + [model.transformer.ln_f]:
            norm.forward = self.in_a_norm(norm.forward)

    def in_a_norm(self, forward):
        """`forward` of a norm, noting that what is saved meanwhile is the norm's (`SavedActivations.norms_saved`)."""

        def norm_forward(*args, **kwargs):
            self.in_norm = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.in_norm = False

        return norm_forward

    def measured_once(self, index: int, block: torch.nn.Module, forward):
        """`forward` of block `index`, which notes what the block saves. Blocks of one structure (modules, parameter
        shapes and what trains) called with the same rope and mask save the same bytes, except that the first of them
        also counts what they share (the rope cache, the mask): the first two run (a fake pass of a 32-block model
        takes seconds), the others repeat the second's figures and return a tensor like its output. Layer kinds
        (sliding windows, NoPE, dense or routed MLPs) differ in these arguments or in structure."""
        structure = (repr(block), tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                                        for name, p in block.named_parameters()))

        def measured(x, rope, mask, input_pos=None):
            self.where = index
            self.inputs.append(x.untyped_storage().nbytes())
            # The same rope and mask objects serve every layer of a kind (GPT.forward makes one per kind).
            key = (structure, id(rope), id(mask), id(input_pos), tuple(x.shape), x.dtype, x.requires_grad)
            if self.runs.get(key, 0) == 2:
                out = self.repeat(index, self.figures[key])
            else:
                self.runs[key] = self.runs.get(key, 0) + 1
                cached = self.cached
                out = forward(x, rope, mask, input_pos)
                self.figures[key] = dict(
                    saved=self.saved.get(index, 0), copies=self.saved_copies.get(index, 0),
                    norms=self.norms_saved.get(index, 0),
                    kept_saved=self.saved_kept.get(index, 0), cached=self.cached - cached,
                    kept=sum(n for where, n in self.kept.values() if where == index),
                    out=(tuple(out.shape), out.dtype, out.requires_grad),
                )
            self.where = "root"
            return out

        return measured

    def repeat(self, index: int, figures: dict) -> torch.Tensor:
        """Block `index` saves what an earlier block of its kind saved; returns a fresh tensor like that one's output
        (a storage of its own, as a block's output is, that the next block may save)."""
        for table, name in ((self.saved, "saved"), (self.saved_copies, "copies"), (self.saved_kept, "kept_saved"),
                            (self.norms_saved, "norms")):
            if figures[name]:
                table[index] = figures[name]
        self.cached += figures["cached"]
        self.kept[("repeated", index)] = (index, figures["kept"])
        shape, dtype, requires_grad = figures["out"]
        return torch.empty(shape, dtype=dtype, requires_grad=requires_grad)

    def copied(self, source: torch.Tensor, copy: torch.Tensor) -> None:
        """A cast (`_to_copy`) ran: under autocast, a 16-bit copy of a parameter is a weight copy."""
        if self.autocast and isinstance(source, torch.Tensor) and _storage(source) in self.params:
            self.copies.add(_storage(copy))
            self.alive.append(copy)
            if _storage(source) in self.trainable:  # autocast caches these until the forward pass ends
                self.cached += copy.untyped_storage().nbytes()

    def kept_output(self, output) -> None:
        """An operation op-level checkpointing keeps the outputs of ran: note their storages for the block."""
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and _storage(tensor) not in self.params:
                self.kept.setdefault(_storage(tensor), (self.where, tensor.untyped_storage().nbytes()))
                self.alive.append(tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.alive.append(tensor)
            table = self.saved_copies if key in self.copies else self.saved
            table[self.where] = table.get(self.where, 0) + tensor.untyped_storage().nbytes()
            if self.in_norm and table is self.saved:
                self.norms_saved[self.where] = self.norms_saved.get(self.where, 0) + tensor.untyped_storage().nbytes()
            if key in self.kept and self.kept[key][0] == self.where:
                self.saved_kept[self.where] = self.saved_kept.get(self.where, 0) + tensor.untyped_storage().nbytes()
        return tensor

    def result(self, n_layer: int) -> SavedActivations:
        layer_copies = [self.saved_copies.get(i, 0) for i in range(n_layer)]
        return SavedActivations(
            per_layer=[self.saved.get(i, 0) for i in range(n_layer)],
            root=self.saved.get("root", 0) + self.saved.get("embedding", 0), embedding=self.saved.get("embedding", 0),
            weight_copies=sum(self.saved_copies.values()), layer_weight_copies=layer_copies,
            cached_weight_copies=self.cached, block_inputs=self.inputs,
            kept_outputs=[sum(n for where, n in self.kept.values() if where == i) for i in range(n_layer)],
            kept_outputs_saved=[self.saved_kept.get(i, 0) for i in range(n_layer)],
            norms_saved=[self.norms_saved.get(i, 0) for i in range(n_layer)],
            root_norms_saved=self.norms_saved.get("root", 0),
        )


def math_attention(config: Config, device: str, precision: Precision) -> bool:
    """On CUDA no fused attention kernel takes float32 with grouped keys: PyTorch runs its math path."""
    return (
        device == "cuda" and precision.compute_dtype == torch.float32 and config.n_query_groups != config.n_head
        and config.attention_logit_softcapping is None
    )


def matmul_attention(config: Config, device: str, precision: Precision, seq_length: int) -> bool:
    """On a CPU, short float32 sequences, and bf16 ones where the CPU has native bf16, run the model's own matmul
    attention, which keeps the softmax of each block of queries (`litgpt.model.MatmulAttention`; plain causal attention
    of fused q/k/v only)."""
    from litgpt.model import MatmulAttention

    return (
        device == "cpu" and MatmulAttention.multiplies(precision.compute_dtype)
        and seq_length <= MatmulAttention.max_positions
        and config.attention_logit_softcapping is None and not config.attention_sinks
        and config.kv_lora_rank is None and config.sliding_window_size is None
    )


@contextlib.contextmanager
def fused_attention_only():
    """The model's attention through SDPA at every length, as on devices other than the CPU."""
    from litgpt.model import MatmulAttention

    kept, MatmulAttention.max_positions = MatmulAttention.max_positions, 0
    try:
        yield
    finally:
        MatmulAttention.max_positions = kept


class _Kernels(TorchDispatchMode):
    """Below autograd in the fake run: notes autocast's weight copies and the outputs op-level checkpointing keeps
    and, for --device cuda, gives kernels' results CUDA's dtypes and layouts."""

    def __init__(self, device: str, tape: _SavedTensors) -> None:
        super().__init__()
        self.cuda = device == "cuda"
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._to_copy.default:
            self.tape.copied(args[0], out)
        elif self.cuda and func is aten.native_layer_norm.default:
            out = (out[0], out[1].float(), out[2].float())  # CUDA keeps mean and rstd in float32
        elif self.cuda and func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            if args[0].dtype == torch.float32 or kwargs.get("attn_mask") is not None:
                # CUDA's memory-efficient kernel writes its output as (B, T, H, hs), seen as (B, H, T, hs).
                out = (out[0].transpose(1, 2).contiguous().transpose(1, 2), *out[1:])
        if is_kept(func):
            self.tape.kept_output(out)
        return out


class _NativeDropout(TorchFunctionMode):
    """CUDA's dropout: the fused kernel (`native_dropout`), which saves a one-byte mask where the CPU's dropout saves
    the scaled noise in the input's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            return self.dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return torch.nn.functional.dropout(input, p, training, inplace)


class _MemoryEfficientAttention(TorchFunctionMode):
    """CUDA's memory-efficient attention takes values of another head size than the queries' (latent attention);
    the CPU's flash kernel does not, and its math path would keep a (batch, heads, seq, seq) softmax that CUDA never
    makes. The fake run pads the values to the queries' head size for the flash kernel and cuts its output back: it
    saves q, k, v and the output (the last two at the queries' head size, a little more than CUDA keeps) and the
    log-sum-exp, as the memory-efficient kernel does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            if v.size(-1) < q.size(-1):
                padded = torch.nn.functional.pad(v, (0, q.size(-1) - v.size(-1)))
                return func(q, k, padded, *args[3:], **kwargs)[..., : v.size(-1)]
        return func(*args, **kwargs)
