"""Activation offloading (`--train.offload_activations`): gradients and trained weights equal a run without it, with
and without activation checkpointing; what the hooks move (every block input a checkpoint saves, never a parameter)
and what stays behind on the device, counted storage by storage; what `litgpt plan` plans for it."""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
from data_helpers import write_story_files
from test_activation_checkpointing import CONFIGS, LLAMA, LiveTensors, build, held_after_forward, training_step

from litgpt.args import ActivationCheckpointing, EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.distributed import activation_offloading
from litgpt.distributed.activation_offloading import is_parameter_data, offload_activations
from litgpt.distributed.parallelize import apply_activation_checkpointing
from litgpt.plan import format_plan, plan_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- gradients -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "full", "every:2", "ops"])
@pytest.mark.parametrize("name", ["llama", "llama-lora", "moe"])
def test_gradients_equal_a_run_without_offloading(name, mode):
    """float32 on the CPU: the backward pass reads host copies of what it saved (with their strides), so the loss
    and every gradient are bit for bit those of the same model without offloading."""
    config, lora = CONFIGS[name]
    plain = build(config, lora)
    offloaded = copy.deepcopy(plain)  # before the forwards are wrapped: a copy would call the original's
    if mode != "none":
        apply_activation_checkpointing(plain, mode)
        apply_activation_checkpointing(offloaded, mode)
    offload_activations(offloaded)
    expected_loss, expected = training_step(plain)
    with moved_tensors() as moved:
        loss, grads = training_step(offloaded)
    assert moved, "nothing was offloaded"
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys() and expected
    for key in expected:
        assert torch.equal(grads[key], expected[key]), key


# ---- what moves ------------------------------------------------------------------------------------------------------
class moved_tensors:
    """Records every call of the hooks' `pack`: (bytes, moved to the host, parameter data) of each saved tensor, and
    the host copies; holds no saved tensor itself (that would keep it alive)."""

    def __enter__(self):
        self.calls, self.host_copies, self._pack = [], [], activation_offloading.pack
        activation_offloading.pack = self.pack
        return self

    def __exit__(self, *exc) -> None:
        activation_offloading.pack = self._pack

    def pack(self, tensor):
        packed = self._pack(tensor)
        moved = packed is not tensor
        self.calls.append((tensor.untyped_storage().data_ptr(), tensor.nbytes, moved, is_parameter_data(tensor)))
        if moved:
            self.host_copies.append(packed[-1])
        return packed

    def __bool__(self) -> bool:
        return any(moved for *_, moved, _ in self.calls)


def offloaded_forward(config: Config, mode: str, batch: int, seq: int):
    """One forward pass of the offloaded model with checkpointing `mode`: (the recorded packs, the block inputs'
    storages and bytes, the bytes the forward pass leaves alive on the "device" apart from the host copies, the
    parameters, the rotary tables and the logits)."""
    model = build(config, None)
    if mode != "none":
        apply_activation_checkpointing(model, mode)
    offload_activations(model)
    inputs = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(
            lambda module, args: inputs.append((args[0].untyped_storage().data_ptr(), args[0].nbytes))
        )
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    with moved_tensors() as packs, LiveTensors() as live:
        logits = model(tokens)
    rope_tables = [table for tables in model._rope_cache.values() for table in tables]
    kept = [*model.parameters(), *rope_tables, *packs.host_copies, logits]
    on_device = live.alive_bytes({t.untyped_storage()._cdata for t in kept})
    logits.sum().backward()
    return packs, inputs, on_device


@pytest.mark.parametrize("mode", ["full", "every:2"])
def test_checkpointed_blocks_inputs_move_and_parameters_never_do(mode):
    """With checkpointing, each checkpointed block's input is what its checkpoint saves: the hooks get it and move
    it. Parameters (and the transposed weights linear layers save) reach the hooks and stay. Afterwards nothing the
    forward pass saved is left on the device: the bytes alive are the host copies alone."""
    config, batch, seq = Config(**LLAMA), 2, 32
    packs, inputs, on_device = offloaded_forward(config, mode, batch, seq)
    moved = {pointer for pointer, _, was_moved, _ in packs.calls if was_moved}
    checkpointing = ActivationCheckpointing.parse(mode)
    checkpointed_inputs = [pointer for index, (pointer, _) in enumerate(inputs) if checkpointing.checkpoints(index)]
    assert checkpointed_inputs and set(checkpointed_inputs) <= moved
    assert all(not was_moved for *_, was_moved, parameter in packs.calls if parameter)
    assert any(parameter for *_, parameter in packs.calls)  # the weights were offered, and kept
    assert all(parameter for *_, was_moved, parameter in packs.calls if not was_moved)
    assert on_device == 0


def test_full_checkpointing_moves_its_block_inputs_and_the_root():
    """Counted against the run without offloading (`held_after_forward`: what the same forward pass leaves alive):
    everything it holds is moved, plus the token indices the embedding saves (made before the forward pass)."""
    config, batch, seq = Config(**LLAMA), 2, 32
    packs, inputs, _ = offloaded_forward(config, "full", batch, seq)
    moved_bytes = sum(nbytes for _, nbytes, was_moved, _ in packs.calls if was_moved)
    assert moved_bytes == held_after_forward(config, "full", batch, seq) + batch * seq * 8
    assert sum(nbytes for _, nbytes in inputs) == config.n_layer * batch * seq * config.n_embd * 4


def test_ops_keeps_its_cached_outputs_on_the_device():
    """Op-level checkpointing run eagerly caches the matmul and attention outputs it keeps outside autograd: they
    stay on the device, as much as the run without offloading holds beyond full checkpointing."""
    config, batch, seq = Config(**LLAMA), 2, 32
    _, _, on_device = offloaded_forward(config, "ops", batch, seq)
    assert on_device == held_after_forward(config, "ops", batch, seq) - held_after_forward(config, "full", batch, seq)


# ---- the plan --------------------------------------------------------------------------------------------------------
def plans(mode: str, offload: bool, config: Config):
    train = TrainArgs(micro_batch_size=2, max_seq_length=64, activation_checkpointing=mode, offload_activations=offload)
    return plan_for(config, precision="bf16-true", device="cuda", train=train)


def test_the_plan_moves_what_the_blocks_save_to_the_host():
    """Against the plans without offloading (whose activations the checkpointing tests match to real forward
    passes): the host holds what the blocks saved (with ops their inputs; the outputs ops keeps stay), the device the
    rest of the model's and one block's brought back, and the peak drops."""
    config = Config(**{**LLAMA, "n_layer": 6})
    plain = {mode: plans(mode, False, config) for mode in ("none", "full", "every:2", "ops")}
    offloaded = {mode: plans(mode, True, config) for mode in plain}
    block_input = 2 * 64 * config.n_embd * 2  # batch x seq x n_embd in 16 bits
    root = plain["full"].activations - config.n_layer * block_input
    layer = plain["none"].activations_per_layer
    for mode in ("none", "every:2", "full"):  # everything the blocks kept moves
        assert offloaded[mode].host_activations == plain[mode].activations - root, mode
    assert offloaded["full"].host_activations == offloaded["ops"].host_activations == config.n_layer * block_input
    assert offloaded["none"].activations == max(root, layer) and offloaded["full"].activations == root
    kept_by_ops = plain["ops"].activations - plain["full"].activations
    assert offloaded["ops"].activations == root + kept_by_ops
    for mode, plan in offloaded.items():
        assert plan.peak < plain[mode].peak, mode
        assert plan.host_memory_per_node == plan.host_activations and plain[mode].host_memory_per_node == 0
        text = format_plan(plan)
        assert "activation offloading on" in text and "host memory per node" in text
        assert plan.row_details["activations"].endswith("the blocks' saved tensors on the host")


# ---- through the training command ------------------------------------------------------------------------------------
def test_pretraining_with_offloading_trains_the_same_weights(tmp_path):
    """The option reaches `parallelize` from TrainArgs: two steps of AdamW with offloading, with and without
    checkpointing, end in the same losses and weights as the run without it."""
    from litgpt.data import TextFiles
    from litgpt.data.tiny import TOKENIZER_DIR
    from litgpt.io import load_state_dict
    from litgpt.pretrain import setup

    texts = write_story_files(tmp_path / "texts", 40)
    config = Config(name="offload", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=3, n_embd=64,
                    n_head=4, n_query_groups=2, intermediate_size=128)
    final, losses = {}, {}
    for run in ((False, False), (False, True), ("full", True)):
        out = tmp_path / f"run-{run[0]}-{run[1]}"
        with moved_tensors() as moved:
            setup(model_config=config, out_dir=out, data=TextFiles(texts, cache_dir=tmp_path / "cache"), devices=1,
                  train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, lr_warmup_steps=1,
                                  save_interval=None, max_seq_length=32, activation_checkpointing=run[0],
                                  offload_activations=run[1]),
                  eval=EvalArgs(interval=1000, max_iters=1, final_validation=False), tokenizer_dir=TOKENIZER_DIR,
                  seed=3, precision="32-true")
        assert bool(moved) == run[1]
        final[run] = load_state_dict(out / "final" / "lit_model.pth")
        (log,) = out.rglob("metrics.csv")
        losses[run] = [row["loss"] for row in csv.DictReader(log.open()) if row["loss"]]
    reference = (False, False)
    assert len(losses[reference]) == 2
    for run in ((False, True), ("full", True)):
        assert losses[run] == losses[reference], run
        assert final[run].keys() == final[reference].keys()
        for key in final[reference]:
            assert torch.equal(final[run][key], final[reference][key]), (run, key)



def test_qlora_with_offloading_trains_the_same_adapters(tmp_path):
    """The quantized path (`Recipe._materialize_quantized`, not `parallelize`) offloads too: LoRA over a 4-bit base,
    with checkpointing, the same adapters as without the option; the 4-bit weights are never copied."""
    from checkpoint_helpers import write_random_checkpoint

    from litgpt.data import JSON
    from litgpt.data.tiny import TINY_DIR
    from litgpt.finetune.lora import setup

    config = Config(name="offload-qlora", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=2,
                    n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128, prompt_style="alpaca")
    base = write_random_checkpoint(tmp_path / "base", config)
    records = [{"instruction": "Tell a story.", "output": story[:120]}
               for story in (TINY_DIR / "val.txt").read_text().split("\n\n")[:8]]
    (tmp_path / "data.json").write_text(json.dumps(records))
    adapters = {}
    for offload in (False, True):
        out = tmp_path / f"run-{offload}"
        with moved_tensors() as moved:
            setup(base, out_dir=out, quantize="bnb.nf4", devices=1, lora_dropout=0.1, lora_mlp=True, seed=3,
                  data=JSON(tmp_path / "data.json", val_split_fraction=0.25), precision="32-true",
                  train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, lr_warmup_steps=1,
                                  save_interval=None, max_seq_length=64, activation_checkpointing="full",
                                  offload_activations=offload),
                  eval=EvalArgs(interval=1000, max_iters=1, final_validation=False, max_new_tokens=None))
        assert bool(moved) == offload
        assert not any(parameter for *_, was_moved, parameter in moved.calls if was_moved)
        adapters[offload] = torch.load(out / "final" / "lit_model.pth.lora", weights_only=True)
    assert adapters[True].keys() == adapters[False].keys() and adapters[False]
    for key in adapters[False]:
        assert torch.equal(adapters[True][key], adapters[False][key]), key

# ---- with torch.compile ------------------------------------------------------------------------------------------------
def test_offloading_compiles_the_blocks_instead_of_the_whole_loss():
    """The whole compiled loss would trace the model's forward pass, and dynamo cannot trace saved-tensor hooks (it
    would run eager): with the option, one CPU process compiles each block, as GPUs do."""
    from dataclasses import replace

    from litgpt.train.launch import set_compilation
    from test_compile import TINY, job_of

    job = job_of(Config(**TINY), 1000)
    job.train = replace(job.train, offload_activations=True)
    set_compilation(job, "torch", torch.device("cpu"), 1)
    assert (job.compile_loss, job.compile_blocks) == (False, True)


@pytest.mark.slow  # 20-100 s of compilation on 2 cores
@pytest.mark.parametrize("mode", ["none", "full"])
def test_compiled_blocks_offload_what_their_graphs_save(mode):
    """Blocks compiled after checkpointing (`parallelize`'s order), the hooks around them: each compiled block's
    saved tensors reach the hooks and move, without a graph break, and three steps give the losses and weights of the
    same compiled model without offloading."""
    from torch._dynamo.utils import counters

    from litgpt.distributed.parallelize import compile_each_block
    from litgpt.model import GPT
    from test_compile import TINY, train_losses

    torch.manual_seed(0)
    plain = GPT(Config(**TINY))
    offloaded = copy.deepcopy(plain)
    for model in (plain, offloaded):
        if mode != "none":
            apply_activation_checkpointing(model, mode)
        compile_each_block(model)
    offload_activations(offloaded)
    torch._dynamo.reset()
    counters.clear()
    expected = train_losses(plain, 3)
    with moved_tensors() as moved:
        got = train_losses(offloaded, 3)
    assert moved and not any(parameter for *_, was_moved, parameter in moved.calls if was_moved)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert got == expected
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name


def test_an_extension_compiler_is_refused():
    """An extension compiler (Thunder) runs its own forward pass, which the hooks would not wrap: one UserError
    before anything is built."""
    from dataclasses import replace

    from litgpt.args import FSDPArgs
    from litgpt.errors import UserError
    from litgpt.train.launch import run_fabric
    from test_compile import TINY, job_of

    class Extension:
        def check(self, job, fsdp):
            raise AssertionError("the option is refused before the extension checks the job")

    job = job_of(Config(**TINY), 10)
    job.train = replace(job.train, offload_activations=True)
    with pytest.raises(UserError, match="^--train.offload_activations works with --compiler auto, none or torch"):
        run_fabric(job, devices=1, num_nodes=1, fsdp=FSDPArgs(), run_name="offload", compiler=Extension())
