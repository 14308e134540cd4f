"""Activation checkpointing settings (`--train.activation_checkpointing`: false, full, every:N, ops): the one parser,
gradients equal to a run that keeps everything, the memory each setting keeps (counted tensor by tensor, against
hand computations and against `litgpt plan`), and the setting reaching training through the command line."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_helpers import write_story_files
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from litgpt.args import ActivationCheckpointing, EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.distributed.parallelize import apply_activation_checkpointing
from litgpt.errors import UserError
from litgpt.lora import LoRASettings, add_lora, init_lora_weights, mark_only_lora_as_trainable
from litgpt.model import GPT
from litgpt.plan import plan_for

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(n_layer=4, n_embd=64, n_head=4, n_query_groups=2, vocab_size=512, padded_vocab_size=512, block_size=64,
             intermediate_size=96, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")
CONFIGS = {
    "llama": (Config(**LLAMA), None),
    # LoRA's dropout draws random masks: the recomputation must draw the same ones.
    "llama-lora": (Config(**LLAMA), LoRASettings(r=4, dropout=0.2, key=True, projection=True, mlp=True, head=True)),
    "moe": (Config(**{**LLAMA, "mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2,
                      "moe_intermediate_size": 32, "norm_qk": True}), None),
    # soft-capped attention runs as the model's own matmuls and softmax; LayerNorm with biases, parallel residual
    "gemma2": (Config(**{**LLAMA, "mlp_class_name": "GemmaMLP", "norm_unit_offset": True,
                         "attention_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                         "post_attention_norm": True, "post_mlp_norm": True}), None),
    "pythia": (Config(**{**LLAMA, "n_query_groups": 4, "norm_class_name": "LayerNorm",
                         "mlp_class_name": "GptNeoxMLP", "parallel_residual": True, "rotary_percentage": 0.25,
                         "bias": True}), None),
}
MODES = ["full", "every:2", "every:3", "ops"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the setting -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [(False, "none"), (None, "none"), ("none", "none"), ("false", "none"), (True, "full"), ("true", "full"),
     ("full", "full"), (1, "full"), ("every:1", "full"), (2, "every:2"), ("2", "every:2"), ("every:4", "every:4"),
     ("Every:3", "every:3"), ("ops", "ops"), (" OPS ", "ops")],
)
def test_settings_parse_to_one_value(value, expected):
    setting = ActivationCheckpointing.parse(value)
    assert str(setting) == expected
    assert bool(setting) == (expected != "none")
    assert ActivationCheckpointing.parse(setting) is setting
    assert ActivationCheckpointing.parse(str(setting)) == setting  # its spelling reads back


def test_which_blocks_a_setting_checkpoints():
    blocks = range(7)
    assert [i for i in blocks if ActivationCheckpointing.parse("every:3").checkpoints(i)] == [0, 3, 6]
    assert [i for i in blocks if ActivationCheckpointing.parse(2).checkpoints(i)] == [0, 2, 4, 6]
    assert all(ActivationCheckpointing.parse(mode).checkpoints(i) for mode in ("full", "ops") for i in blocks)
    assert not any(ActivationCheckpointing.parse(False).checkpoints(i) for i in blocks)


@pytest.mark.parametrize("value", ["sometimes", "selective:2", "2.5", 0, -1, "every:0", "every:", "every:x"])
def test_bad_settings_are_one_user_error(value):
    with pytest.raises(UserError) as error:
        ActivationCheckpointing.parse(value)
    message = str(error.value)
    assert "\n" not in message and message.startswith("--train.activation_checkpointing")
    assert ("N >= 1" in message) if str(value).startswith("every") or isinstance(value, int) else ("ops" in message)
    with pytest.raises(UserError, match="^--train.activation_checkpointing"):  # the planner runs the same check
        plan_for(Config(**LLAMA), train=TrainArgs(max_seq_length=16, activation_checkpointing=value), device="cpu")


@pytest.mark.parametrize(
    ("flag", "yaml_value", "expected"),
    [("true", "true", "full"), ("false", "false", "none"), ("2", "2", "every:2"), ("every:3", "every:3", "every:3"),
     ("ops", "ops", "ops"), ("full", "full", "full")],
)
def test_the_command_line_and_yaml_files_take_every_setting(tmp_path, flag, yaml_value, expected):
    """`litgpt finetune_full`'s own parser (TrainArgs as jsonargparse reads it), from a flag and from a YAML recipe."""
    from jsonargparse import ArgumentParser

    from litgpt.finetune.full import setup

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(setup, as_positional=True)
    parser.add_argument("--config", action="config")
    from_flag = parser.parse_args(["ckpt", "--train.activation_checkpointing", flag])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"checkpoint_dir: ckpt\ntrain:\n  activation_checkpointing: {yaml_value}\n")
    from_yaml = parser.parse_args(["--config", str(recipe)])
    for parsed in (from_flag, from_yaml):
        assert str(ActivationCheckpointing.parse(parsed.train.activation_checkpointing)) == expected


def test_a_bad_setting_stops_the_command_before_lightning_loads(tmp_path):
    """Through the real command line: one line, exit code 1, nothing written, Lightning never imported."""
    code = (
        "import sys\n"
        "from litgpt.__main__ import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as stop:\n"
        "    print(stop.code, any(m.split('.')[0] == 'lightning' for m in sys.modules))\n"
    )
    args = ["pretrain", "--config", "config_hub/pretrain/tiny.yaml", "--out_dir", str(tmp_path / "out"),
            "--train.activation_checkpointing", "every:0"]
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.stdout.split() == ["1", "False"], result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
    assert "--train.activation_checkpointing every:0" in result.stderr and "N >= 1" in result.stderr
    assert not (tmp_path / "out").exists()


# ---- gradients -------------------------------------------------------------------------------------------------------
def build(config: Config, lora) -> GPT:
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    if lora is not None:
        add_lora(model, lora)
        init_lora_weights(model)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # nonzero, so the adapters' inputs get gradients too
                torch.nn.init.normal_(param, std=0.02)
        mark_only_lora_as_trainable(model)
    return model


def training_step(model: GPT, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (2, 33), generator=generator)
    torch.manual_seed(seed)  # the dropout masks
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_equal_a_run_that_keeps_everything(name, mode):
    """float32 on the CPU: the recomputation runs the same kernels on the same inputs, so the loss and every gradient
    are bit for bit those of the plain model."""
    config, lora = CONFIGS[name]
    plain = build(config, lora)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, mode)
    expected_loss, expected = training_step(plain)
    loss, grads = training_step(checkpointed)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys() and expected
    for key in expected:
        assert torch.equal(grads[key], expected[key]), key


# ---- memory ----------------------------------------------------------------------------------------------------------
class LiveTensors(TorchDispatchMode):
    """Every storage an operation creates while active (views share one), and, later, the bytes still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.made.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(n for key, (ref, n) in self.made.items() if not ref.expired() and key not in exclude)


def held_after_forward(config: Config, mode, batch: int, seq: int) -> int:
    """Bytes the forward pass leaves alive for the backward pass: what autograd and the checkpoints hold, the logits,
    the parameters and the model's rotary tables (built in the first forward pass, then kept) not counted."""
    model = build(config, None)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    with LiveTensors() as live:
        logits = model(tokens)
    rope_tables = [table for tables in model._rope_cache.values() for table in tables]
    model_storages = {t.untyped_storage()._cdata for t in [*model.parameters(), *rope_tables]}
    held = live.alive_bytes(model_storages) - logits.untyped_storage().nbytes()
    logits.sum().backward()  # the recomputation finds everything it needs
    return held


def test_what_each_setting_keeps():
    """none > ops > every:2 > full, each by the amount a hand computation gives."""
    config, batch, seq = Config(**LLAMA), 2, 32
    held = {mode: held_after_forward(config, mode, batch, seq) for mode in ("none", "full", "every:2", "ops")}
    assert held["none"] > held["ops"] > held["every:2"] > held["full"]
    # every:2 checkpoints blocks 0 and 2 of the 4 identical ones: half of them keep everything, half their input.
    assert 2 * held["every:2"] == held["none"] + held["full"]
    # ops keeps, on top of each block's input, the float32 outputs of its matmuls and of attention.
    tokens, c, hs = batch * seq, config.n_embd, config.head_size
    qkv = tokens * (config.n_head + 2 * config.n_query_groups) * hs
    # float32 on the CPU: the model's matmul attention (`MatmulAttention`), one block of queries at 32 positions: the
    # scores' matmul and the weighted values' are kept
    attention = tokens * c + batch * config.n_head * seq * seq
    per_block = qkv + attention + tokens * c + 2 * tokens * config.intermediate_size + tokens * c  # proj, fc 1|2, proj
    assert held["ops"] - held["full"] == config.n_layer * per_block * 4
    # full keeps each block's input (batch x seq x n_embd): the difference to none is the rest of every block.
    assert held["full"] < held["none"] / 5


@pytest.mark.parametrize("mode", ["full", "every:2", "ops"])
def test_the_plan_counts_what_training_keeps(mode):
    """`litgpt plan` (fake tensors) plans the activations the real forward pass leaves alive, to the byte; the plan
    also counts the token indices the embedding saves (made before the forward pass here)."""
    config, batch, seq = Config(**LLAMA), 2, 32
    train = TrainArgs(micro_batch_size=batch, max_seq_length=seq, activation_checkpointing=mode)
    plan = plan_for(config, precision="32-true", train=train, device="cpu")
    assert plan.activation_checkpointing == mode
    assert plan.activations == held_after_forward(config, mode, batch, seq) + batch * seq * 8


def test_the_plan_orders_the_settings_and_names_what_each_keeps():
    config = Config(**{**LLAMA, "n_layer": 6})
    plans = {mode: plan_for(config, precision="bf16-true", device="cpu",
                            train=TrainArgs(micro_batch_size=2, max_seq_length=64, activation_checkpointing=mode))
             for mode in ("none", "every:3", "every:2", "full", "ops")}
    activations = [plans[mode].activations for mode in ("none", "every:3", "every:2", "full")]
    assert activations == sorted(activations, reverse=True) and len(set(activations)) == 4
    assert plans["none"].activations > plans["ops"].activations > plans["full"].activations
    assert "every:3 (one block in 3)" in format_line(plans["every:3"])
    assert plans["every:3"].row_details["activations"] == "2 block inputs + 4 blocks + head"
    assert plans["ops"].row_details["buffers"].startswith("1 block recomputed")


def format_line(plan) -> str:
    from litgpt.plan import format_plan

    return format_plan(plan).splitlines()[3]


# ---- through the training commands -----------------------------------------------------------------------------------
@contextlib.contextmanager
def attention_calls():
    """Counts the forward calls of every attention module (torch's global module hook): a recomputed block runs its
    attention once more in the backward pass."""
    from litgpt.model import CausalSelfAttention

    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: calls.append(1) if isinstance(module, CausalSelfAttention) else None
    )
    try:
        yield calls
    finally:
        handle.remove()


def test_pretraining_with_each_setting_trains_the_same_weights(tmp_path):
    """The setting reaches `parallelize` from TrainArgs: the checkpointed blocks run again in each backward pass,
    and two steps of AdamW end in the same weights in every mode."""
    from litgpt.data import TextFiles
    from litgpt.data.tiny import TOKENIZER_DIR
    from litgpt.io import load_state_dict
    from litgpt.pretrain import setup

    texts = write_story_files(tmp_path / "texts", 40)
    config = Config(name="ac", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=3, n_embd=64,
                    n_head=4, n_query_groups=2, intermediate_size=128)
    final, calls = {}, {}
    for mode in (False, "every:2", "ops"):
        out = tmp_path / f"run-{mode}"
        with attention_calls() as calls[mode]:
            setup(model_config=config, out_dir=out, data=TextFiles(texts, cache_dir=tmp_path / "cache"), devices=1,
                  train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, lr_warmup_steps=1,
                                  save_interval=None, max_seq_length=32, activation_checkpointing=mode),
                  eval=EvalArgs(interval=1000, max_iters=1, final_validation=False), tokenizer_dir=TOKENIZER_DIR,
                  seed=3)
        final[mode] = load_state_dict(out / "final" / "lit_model.pth")
    # 2 steps of one micro-batch: every:2 recomputes blocks 0 and 2 of 3, ops all 3
    assert len(calls["every:2"]) - len(calls[False]) == 2 * 2 and len(calls["ops"]) - len(calls[False]) == 2 * 3
    for mode in ("every:2", "ops"):
        assert final[mode].keys() == final[False].keys()
        for key in final[False]:
            assert torch.equal(final[mode][key], final[False][key]), (mode, key)


def test_qlora_with_each_setting_trains_the_same_adapters(tmp_path):
    """The quantized path (`Recipe._materialize_quantized`) applies the setting too: LoRA over a 4-bit base, with
    dropout, two steps, the same adapters in every mode."""
    import json

    from checkpoint_helpers import write_random_checkpoint

    from litgpt.data import JSON
    from litgpt.data.tiny import TINY_DIR
    from litgpt.finetune.lora import setup

    config = Config(name="ac-qlora", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=64,
                    n_head=4, n_query_groups=2, intermediate_size=128, prompt_style="alpaca")
    base = write_random_checkpoint(tmp_path / "base", config)
    records = [{"instruction": "Tell a story.", "output": story[:120]}
               for story in (TINY_DIR / "val.txt").read_text().split("\n\n")[:8]]
    (tmp_path / "data.json").write_text(json.dumps(records))
    adapters, calls = {}, {}
    for mode in (False, "ops", "every:2"):
        out = tmp_path / f"run-{mode}"
        with attention_calls() as calls[mode]:
            setup(base, out_dir=out, quantize="bnb.nf4", devices=1, lora_dropout=0.1, lora_mlp=True, seed=3,
                  data=JSON(tmp_path / "data.json", val_split_fraction=0.25),
                  train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, lr_warmup_steps=1,
                                  save_interval=None, max_seq_length=64, activation_checkpointing=mode),
                  eval=EvalArgs(interval=1000, max_iters=1, final_validation=False, max_new_tokens=None))
        adapters[mode] = torch.load(out / "final" / "lit_model.pth.lora", weights_only=True)
    assert len(calls["ops"]) - len(calls[False]) == 2 * 2 and len(calls["every:2"]) - len(calls[False]) == 2 * 1
    for mode in ("ops", "every:2"):
        assert adapters[mode].keys() == adapters[False].keys() and adapters[False]
        for key in adapters[False]:
            assert torch.equal(adapters[mode][key], adapters[False][key]), (mode, key)
