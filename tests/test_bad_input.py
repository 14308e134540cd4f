"""The catalogue of bad input: every command, fed something wrong, exits with code 1 and one line that names the
problem, prints no traceback, and leaves every file on disk as it was.

Each case runs the real `litgpt` CLI in a process of its own against fixtures built once for the module in one
folder (`world`); the whole folder is hashed before and after each case, so a case that writes, deletes or creates
anything there (an out_dir, a cache, a half-written file) fails. The processes are forked from one server that has
imported torch and Lightning once (tests/litgpt_forkserver.py: `python -m litgpt`'s entry point, exit code, stderr
and exit handlers as in a fresh interpreter), instead of starting Python and importing Lightning anew each time
(~8 s of CPU per training command). The heavier half stays marked slow: most training commands and a few of the
lighter cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_helpers import write_random_checkpoint
from hf_models import save_hf_model
from litgpt_forkserver import run_litgpt

from litgpt.io import save_state_dict
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(name="bad-input", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=1, n_embd=32, n_head=2,
            intermediate_size=64, prompt_style="alpaca")
# More processes than this machine has cores (64 here, as an issue asks; more on a larger machine).
TOO_MANY_DEVICES = str(max(64, 2 * (os.cpu_count() or 1)))
LONG_PROMPT = "once upon a time " * 40  # 160+ tokens for a 64-token context


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Every input the cases read, good and bad, in one folder."""
    root = tmp_path_factory.mktemp("bad_input")
    base = write_random_checkpoint(root / "base", Config(**TINY))
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:20]
    (root / "data.json").write_text(json.dumps([{"instruction": "Go on.", "output": s[:80]} for s in stories]))
    (root / "bad.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    (root / "bad.json").write_text('[{"instruction": "a", "output": "b"},\n {"instruction": "c" "output": "d"}]\n')
    (root / "empty.json").write_text("[]\n")
    (root / "no_output.json").write_text(json.dumps([{"instruction": "a"}] * 4))
    (root / "empty_dir").mkdir()
    (root / "bad.yaml").write_text("train:\n  max_steps: [1, 2\n")
    (root / "unknown_key.yaml").write_text(f"checkpoint_dir: {root / 'hf'}\nno_such_option: 3\n")

    def variant(name: str, **config_changes) -> Path:
        folder = root / name
        shutil.copytree(base, folder)
        values = {**yaml.safe_load((folder / "model_config.yaml").read_text()), **config_changes}
        (folder / "model_config.yaml").write_text(yaml.safe_dump(values))
        return folder

    variant("mismatched", n_embd=64)  # weights of n_embd 32 under a config of 64
    variant("small_vocab", vocab_size=100, padded_vocab_size=128)  # the bundled tokenizer has 4096 tokens
    (variant("bad_tokenizer") / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (variant("bad_config") / "model_config.yaml").write_text("n_embd: [32\n")
    weights = (base / "lit_model.pth").read_bytes()
    (variant("truncated") / "lit_model.pth").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(base, root / "held_run" / "final")  # an out_dir that already holds a run

    save_hf_model("llama", root / "hf")
    (root / "hf_badjson").mkdir()
    (root / "hf_badjson" / "config.json").write_text('{"model_type": "llama",')
    (root / "hf_bert").mkdir()
    (root / "hf_bert" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    shutil.copytree(root / "hf", root / "hf_more_layers")
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    (root / "hf_more_layers" / "config.json").write_text(json.dumps({**hf_config, "num_hidden_layers": 4}))

    # LoRA run folders: adapters of the wrong layout, a malformed hyperparameters.yaml, a base that is gone.
    lora_run = root / "lora_run"
    lora_run.mkdir()
    save_state_dict({"transformer.h.0.attn.qkv.lora_A": torch.zeros(8, 32)}, lora_run / "lit_model.pth.lora")
    hparams = {"checkpoint_dir": str(base), "lora_r": 8, "lora_alpha": 16}
    (lora_run / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))
    shutil.copytree(lora_run, root / "lora_bad_yaml")
    (root / "lora_bad_yaml" / "hyperparameters.yaml").write_text("lora_r: [8\n")
    shutil.copytree(lora_run, root / "lora_no_base")
    gone = {**hparams, "checkpoint_dir": str(root / "gone")}
    (root / "lora_no_base" / "hyperparameters.yaml").write_text(yaml.safe_dump(gone))
    return root


def tree_state(root: Path) -> dict[str, str]:
    """Every folder and file under `root`, files with the SHA-256 of their content."""
    state = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            state[name] = "link:" + os.readlink(path)
        elif path.is_dir():
            state[name] = "folder"
        else:
            state[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def clean_environment(root: Path) -> dict[str, str]:
    """This machine as a plain CPU box outside any launcher, with every cache inside `root`."""
    launcher = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in launcher}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf_home"),
            "LITGPT_CACHE_DIR": str(root / "cache")}


TRAIN = ["--train.max_steps", "1", "--eval.max_iters", "1"]
JSON_DATA = ["--data", "JSON", "--data.json_path", "{w}/data.json", "--data.val_split_fraction", "0.2"]
FINETUNE = [*JSON_DATA, *TRAIN, "--out_dir", "{w}/out"]
OIB_BATCH = ["--train.optimizer_in_backward", "true", "--train.global_batch_size", "2", "--train.micro_batch_size", "2"]
SMALL_MODEL = json.dumps({k: v for k, v in TINY.items() if k not in ("prompt_style", "padded_vocab_size")})


def case(case_id: str, args: list[str], message: str, slow: bool = False):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(args, message, id=case_id, marks=marks)


CASES = [
    # ---- names, flags and --config files (jsonargparse and the registry) -------------------------------------------
    case("pretrain-unknown-model-name", ["pretrain", "Llama-3.2-1b", "--out_dir", "{w}/out"],
         "Unknown model name 'Llama-3.2-1b'. Did you mean 'Llama-3.2-1B'"),
    case("pretrain-no-model", ["pretrain", "--out_dir", "{w}/out"], "Name a model to pretrain", slow=True),
    case("config-malformed-yaml", ["pretrain", "--config", "{w}/bad.yaml"], "bad.yaml' is not valid YAML"),
    case("config-missing-file", ["pretrain", "--config", "{w}/nonexistent.yaml"], "File does not exist", slow=True),
    case("config-unknown-option", ["convert_to_litgpt", "--config", "{w}/unknown_key.yaml"],
         "'no_such_option' is not accepted"),
    case("model-config-heads-do-not-divide", ["pretrain", "--model_config", json.dumps({"n_embd": 30, "n_head": 4}),
                                               "--out_dir", "{w}/out"], "n_embd (30) is not divisible by n_head (4)"),
    case("model-config-unknown-field", ["pretrain", "--model_config", json.dumps({"name": "x", "n_wings": 2})],
         "'n_wings' is not accepted", slow=True),
    case("unknown-command", ["genrate"], "Did you mean 'generate'?"),
    case("flag-wrong-type", ["finetune_lora", "{w}/base", *FINETUNE, "--train.micro_batch_size", "two"],
         'Parser key "train.micro_batch_size": Expected a <class \'int\'>'),
    case("flag-unknown", ["convert_to_litgpt", "{w}/hf", "--no_such_flag", "3"],
         "unrecognized arguments: --no_such_flag"),
    case("logger-unknown", ["finetune_lora", "{w}/base", *FINETUNE, "--logger_name", "nosuch"],
         'Parser key "logger_name"'),
    case("quantize-unknown-finetune", ["finetune_lora", "{w}/base", *FINETUNE, "--quantize", "bnb.nf5"],
         'Parser key "quantize"'),
    case("max-steps-zero", ["finetune_full", "{w}/base", *JSON_DATA, "--train.max_steps", "0", "--out_dir", "{w}/out"],
         "--train.max_steps must be at least 1, got 0", slow=True),
    case("loss-chunk-size-negative", ["pretrain", "--model_config", SMALL_MODEL, "--train.loss_chunk_size", "-1",
                                      "--out_dir", "{w}/out"], "--train.loss_chunk_size must be at least 1, got -1"),
    # ---- training: checkpoints, devices, batch arithmetic, data ---------------------------------------------------
    case("finetune-missing-checkpoint", ["finetune_lora", "{w}/nothing"], "nothing' does not exist", slow=True),
    case("finetune-hf-folder-not-converted", ["finetune_lora", "{w}/hf", *FINETUNE],
         "It looks like a Hugging Face folder: run `litgpt convert_to_litgpt", slow=True),
    case("finetune-precision-unknown", ["finetune_lora", "{w}/base", *FINETUNE, "--precision", "fp8"],
         "--precision 'fp8' is not one of", slow=True),
    case("float8-recipe-without-fp8", ["finetune_lora", "{w}/base", *FINETUNE, "--precision", "bf16-mixed",
                                       "--train.float8_recipe", "tensorwise"],
         "--train.float8_recipe tensorwise is a scaling recipe of --precision fp8-mixed; this run is bf16-mixed",
         slow=True),
    case("devices-more-than-cores", ["finetune_lora", "{w}/base", *FINETUNE, "--devices", TOO_MANY_DEVICES],
         f"--devices {TOO_MANY_DEVICES} asks for more CPU processes than this machine has cores"),
    case("num-nodes-without-launcher", ["finetune_full", "{w}/base", *FINETUNE, "--num_nodes", "2"],
         "--num_nodes 2 needs a launcher", slow=True),
    case("out-dir-holds-a-run", ["finetune_full", "{w}/base", *JSON_DATA, *TRAIN, "--out_dir", "{w}/held_run"],
         "already holds a run", slow=True),
    case("resume-not-a-checkpoint", ["finetune_lora", "{w}/base", *FINETUNE, "--resume", "{w}/base"],
         "is not a checkpoint folder with training_state.pth", slow=True),
    case("resume-missing-folder", ["finetune_lora", "{w}/base", *FINETUNE, "--resume", "{w}/nothing/step-000001"],
         "--resume '{w}/nothing/step-000001' is not a checkpoint folder", slow=True),
    case("lora-r-zero", ["finetune_lora", "{w}/base", *FINETUNE, "--lora_r", "0"], "lora_r must be an integer >= 1",
         slow=True),
    case("initial-checkpoint-missing", ["pretrain", "--model_config", SMALL_MODEL, "--initial_checkpoint_dir",
                                        "{w}/nothing", "--out_dir", "{w}/out"], "nothing' does not exist", slow=True),
    case("batch-not-a-multiple", ["finetune_lora", "{w}/base", *FINETUNE, "--train.global_batch_size", "3",
                                  "--train.micro_batch_size", "2"], "(3) must be a multiple of", slow=True),
    case("seq-length-over-block-size", ["finetune_lora", "{w}/base", *FINETUNE, "--train.max_seq_length", "4096"],
         "longer than the model's block size 64", slow=True),
    case("mismatched-checkpoint-finetune", ["finetune_full", "{w}/mismatched", *FINETUNE],
         "lit_model.pth do not match the model config", slow=True),
    case("optimizer-unknown", ["finetune_lora", "{w}/base", *FINETUNE, "--optimizer", "NoSuchOptimizer"],
         "'NoSuchOptimizer' is not an optimizer class", slow=True),
    # --train.optimizer_in_backward steps each parameter in the backward pass: what needs every gradient is refused
    case("optimizer-in-backward-accumulates", ["finetune_lora", "{w}/base", *FINETUNE, "--train.optimizer_in_backward",
                                               "true"], "but this run accumulates 16 micro-batches per step"),
    case("optimizer-in-backward-clips", ["pretrain", "--model_config", SMALL_MODEL, "--tokenizer_dir", "{w}/base",
                                         *OIB_BATCH, *TRAIN, "--out_dir", "{w}/out"],
         "cannot clip the gradient norm (--train.max_norm 1.0)", slow=True),
    case("optimizer-in-backward-skips", ["finetune_full", "{w}/base", *FINETUNE, *OIB_BATCH, "--train.on_nonfinite",
                                         "skip"], "--train.on_nonfinite skip cannot skip it", slow=True),
    case("optimizer-in-backward-closure", ["finetune_full", "{w}/base", *FINETUNE, *OIB_BATCH, "--optimizer",
                                           "LBFGS"], "--optimizer LBFGS needs a closure", slow=True),
    case("tokenizer-larger-than-vocab-pretrain",
         ["pretrain", "--model_config", json.dumps({**json.loads(SMALL_MODEL), "vocab_size": 100}), "--tokenizer_dir",
          "{w}/base", *TRAIN, "--out_dir", "{w}/out"], "has 4096 tokens but the model has only 512 embedding rows",
         slow=True),
    case("empty-text-folder", ["pretrain", "--config", str(ROOT / "config_hub" / "pretrain" / "tiny.yaml"), "--data",
                               "TextFiles", "--data.train_data_path", "{w}/empty_dir", "--tokenizer_dir", "{w}/base",
                               *TRAIN, "--out_dir", "{w}/out"], "empty_dir' has no .txt files", slow=True),
    case("empty-json-dataset", ["finetune_full", "{w}/base", "--data", "JSON", "--data.json_path", "{w}/empty.json",
                                "--data.val_split_fraction", "0.2", *TRAIN, "--out_dir", "{w}/out"],
         "empty.json", slow=True),
    case("malformed-jsonl", ["finetune_lora", "{w}/base", "--data", "JSON", "--data.json_path", "{w}/bad.jsonl",
                             "--data.val_split_fraction", "0.5", *TRAIN, "--out_dir", "{w}/out"],
         "bad.jsonl', line 2: invalid JSON", slow=True),
    case("malformed-json", ["finetune_lora", "{w}/base", "--data", "JSON", "--data.json_path", "{w}/bad.json",
                            "--data.val_split_fraction", "0.5", *TRAIN, "--out_dir", "{w}/out"],
         "bad.json': invalid JSON at line 2, column 22", slow=True),
    case("json-sample-without-output", ["finetune_lora", "{w}/base", "--data", "JSON", "--data.json_path",
                                        "{w}/no_output.json", "--data.val_split_fraction", "0.5", *TRAIN,
                                        "--out_dir", "{w}/out"], 'record 0 (counting from 0): missing "output"',
         slow=True),
    case("json-data-missing", ["finetune_lora", "{w}/base", "--data", "JSON", "--data.json_path", "{w}/missing.json",
                               "--data.val_split_fraction", "0.5", *TRAIN, "--out_dir", "{w}/out"],
         "missing.json' does not exist", slow=True),
    # ---- generate and chat ------------------------------------------------------------------------------------------
    case("prompt-longer-than-context", ["generate", "{w}/base", "--prompt", LONG_PROMPT, "--max_new_tokens", "2"],
         "but the model's context (block_size) is 64 tokens"),
    case("tokenizer-larger-than-vocab-generate", ["generate", "{w}/small_vocab"],
         "has 4096 tokens but the model has only 128 embedding rows"),
    case("mismatched-checkpoint-generate", ["generate", "{w}/mismatched"],
         "lm_head.weight has shape (4096, 32), the config expects (4096, 64)"),
    case("malformed-model-config-yaml", ["generate", "{w}/bad_config"],
         "model_config.yaml' is not valid YAML: while parsing a flow sequence"),
    case("corrupt-tokenizer-json", ["generate", "{w}/bad_tokenizer"], "tokenizer.json' is not a valid tokenizer file"),
    case("truncated-weights", ["generate", "{w}/truncated"], "Could not load '{w}/truncated/lit_model.pth' safely"),
    case("generate-precision-unknown", ["generate", "{w}/base", "--precision", "fp8"], "Unknown precision 'fp8'",
         slow=True),
    case("generate-device-missing", ["generate", "{w}/base", "--device", "cuda:7"], "Device 'cuda:7'"),
    case("generate-negative-temperature", ["generate", "{w}/base", "--temperature", "-1"],
         "temperature must be a finite number >= 0", slow=True),
    case("chat-missing-checkpoint", ["chat", "{w}/nothing"], "Checkpoint folder '{w}/nothing' does not exist"),
    case("chat-top-p-over-one", ["chat", "{w}/base", "--top_p", "2"], "top_p must be in (0, 1]", slow=True),
    case("chat-quantize-unknown", ["chat", "{w}/base", "--quantize", "int3"], "Unknown quantization 'int3'"),
    # ---- download and conversion ----------------------------------------------------------------------------------
    case("download-unknown-name", ["download", "nosuchmodel", "--checkpoint_dir", "{w}/out"],
         "'nosuchmodel' is not a Hugging Face repo id (ORG/NAME) nor a registered model name"),
    case("download-dtype-unknown", ["download", "org/model", "--dtype", "float8", "--checkpoint_dir", "{w}/out"],
         "--dtype 'float8' is not one of"),
    case("convert-not-a-hf-folder", ["convert_to_litgpt", "{w}/empty_dir"], "has no config.json"),
    case("convert-malformed-config-json", ["convert_to_litgpt", "{w}/hf_badjson"], "config.json' is not valid JSON"),
    case("convert-unsupported-architecture", ["convert_to_litgpt", "{w}/hf_bert"],
         "model_type 'bert', which litgpt does not support"),
    case("convert-weights-do-not-fit-config", ["convert_to_litgpt", "{w}/hf_more_layers"],
         "lacks 'model.layers.3.input_layernorm.weight'"),
    case("convert-model-name-mismatch", ["convert_to_litgpt", "{w}/hf", "--model_name", "pythia-14m"],
         "--model_name 'pythia-14m' does not match", slow=True),
    case("convert-back-mismatched-checkpoint", ["convert_from_litgpt", "{w}/mismatched", "{w}/out"],
         "has shape (4096, 32)"),
    case("convert-back-into-a-full-folder", ["convert_from_litgpt", "{w}/base", "{w}/hf"],
         "already exists and is not empty", slow=True),
    # ---- consolidate, plan, merge_lora ------------------------------------------------------------------------------
    case("consolidate-full-checkpoint", ["consolidate", "{w}/base"], "is not a sharded checkpoint"),
    case("consolidate-missing-folder", ["consolidate", "{w}/nothing"], "nothing' does not exist"),
    case("plan-unknown-model", ["plan", "NoSuchModel"], "Unknown model name 'NoSuchModel'"),
    case("plan-seq-length-over-block-size", ["plan", "tiny-llama-1.1b", "--train.max_seq_length", "99999"],
         "--train.max_seq_length 99999 is longer than the model's block size 2048", slow=True),
    case("merge-plain-checkpoint", ["merge_lora", "{w}/base"], "and no lit_model.pth.lora: it is a plain checkpoint"),
    case("merge-malformed-hyperparameters", ["merge_lora", "{w}/lora_bad_yaml"],
         "hyperparameters.yaml' is not valid YAML"),
    case("merge-base-gone", ["merge_lora", "{w}/lora_no_base"], "does not exist at '{w}/gone'",
         slow=True),
    case("merge-adapters-do-not-fit", ["merge_lora", "{w}/lora_run"], "The LoRA adapters in"),
]


@pytest.mark.parametrize(("args", "message"), CASES)
def test_bad_input(world, args, message):
    before = tree_state(world)
    command = [arg.replace("{w}", str(world)) for arg in args]
    result = run_litgpt(command, cwd=world, env=clean_environment(world), timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("litgpt")]  # litgpt's own lines
    assert len(errors) == 1, result.stderr
    assert message.replace("{w}", str(world)) in errors[0], errors[0]
    after = tree_state(world)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"files on disk changed: {changed}"


def test_the_catalogue_is_complete():
    """At least 40 distinct bad inputs, over every command that takes input."""
    commands = {param.values[0][0] for param in CASES}
    assert len(CASES) >= 40 and len({param.id for param in CASES}) == len(CASES)
    assert {"pretrain", "finetune_full", "finetune_lora", "merge_lora", "generate", "chat", "download",
            "convert_to_litgpt", "convert_from_litgpt", "consolidate", "plan"} <= commands
