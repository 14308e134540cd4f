"""The layering the training core promises: every import (deferred ones included) goes down the layers that
docs/architecture.md draws, no modules import each other round a circle, every module is in its table; the core never
imports an extension, which it finds by name; the config stays light; the distributed runtime reads every launcher's
ranks and orders work on node-local disks; the training commands are recipes of one job."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import rank_start_method

from litgpt.config import Config
from litgpt.distributed import runtime
from litgpt.errors import UserError
from litgpt.lora import LoRASettings
from litgpt.train.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (a deferred import is an import too), except
    imports for type checking only."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for branch in ast.walk(tree)
                   if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                   for node in ast.walk(branch)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from litgpt import model`
    return names


def litgpt_modules() -> dict[str, Path]:
    """Each module of the package by its path below litgpt/ ("train/job.py"; a package's __init__ as "train/")."""
    modules = {}
    for path in (ROOT / "litgpt").rglob("*.py"):
        relative = path.relative_to(ROOT / "litgpt").as_posix()
        if relative != "__init__.py":
            modules[relative.removesuffix("__init__.py")] = path
    return modules


def module_name(relative: str) -> str:
    return "litgpt." + relative.removesuffix(".py").removesuffix("/").replace("/", ".")


def import_graph() -> dict[str, set[str]]:
    """module -> the litgpt modules it imports (both as paths below litgpt/), a package's own modules aside."""
    modules = litgpt_modules()
    by_name = {module_name(relative): relative for relative in modules}
    graph = {}
    for relative, path in modules.items():
        targets = set()
        for name in imported_modules(path):
            while name and name not in by_name:  # `from litgpt.x import y` names y: its module is litgpt.x
                name = name.rpartition(".")[0]
            if name and by_name[name] != relative and not relative.startswith(by_name[name]):
                targets.add(by_name[name])
        graph[relative] = targets
    return graph


def documented_layers() -> list[list[str]]:
    """The layer table of docs/architecture.md: per layer, the module paths and folders (with a trailing /)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+ ", line)]
    return [re.findall(r"`([^`]+)`", row.split("|")[2]) for row in rows]


def layer_of(relative: str, layers: list[list[str]]) -> int:
    """The layer of a module: the layer naming it, else the lowest layer naming a folder it is in."""
    for index, names in enumerate(layers):
        if relative in names:
            return index
    for index, names in enumerate(layers):
        if any(name.endswith("/") and relative.startswith(name) for name in names):
            return index
    raise AssertionError(f"litgpt/{relative} is in no layer of docs/architecture.md")


def test_every_import_goes_down_the_documented_layers():
    layers = documented_layers()
    assert len(layers) >= 5
    upward = [f"{source} (layer {layer_of(source, layers) + 1}) imports {target} (layer {layer_of(target, layers) + 1})"
              for source, targets in import_graph().items() for target in sorted(targets)
              if layer_of(target, layers) > layer_of(source, layers)]
    assert upward == []


def test_no_modules_import_each_other_round_a_circle():
    graph = import_graph()
    circles, state = [], {}  # state: 1 while a module's imports are being walked, 2 when done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                walk(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert circles == []


def test_the_import_reader_sees_deferred_imports_and_circles(tmp_path):
    """The reader the two tests above rely on: an import inside a function counts; one for type checking does not."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import litgpt.train.job\n"
                    "def f():\n    from litgpt.model import GPT\n")
    assert imported_modules(path) == {"typing", "typing.TYPE_CHECKING", "litgpt.model", "litgpt.model.GPT"}


def test_every_module_is_in_the_module_table_of_the_architecture_doc():
    """docs/architecture.md's module table names each module, or the folder of a family of them (configs/, data/,
    train/recipes/, plan/, serving/, ...)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`]+\.py|[^`]+/)`", table))
    # A package's __init__ ("train/") is its folder: named with the modules in it.
    missing = [relative for relative in litgpt_modules()
               if relative not in named and not any(name.endswith("/") and relative.startswith(name) for name in named)
               and not (relative.endswith("/") and any(name.startswith(relative) for name in named))]
    assert missing == []


def test_no_module_of_the_core_imports_an_extension():
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "litgpt").rglob("*.py")
                 if any(name == "extensions" or name.startswith("extensions.") for name in imported_modules(path))]
    assert offenders == []


def test_the_training_modules_load_without_the_extension_or_torch_for_the_config():
    code = (
        "import sys\n"
        "import litgpt.config\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules), 'litgpt.config imported torch'\n"
        "import litgpt.pretrain, litgpt.finetune.full, litgpt.finetune.lora, litgpt.train.job, litgpt.train.trainer\n"
        "import litgpt.checkpoint.manager, litgpt.distributed.fabric, litgpt.plan\n"
        "assert not any(m == 'extensions' or m.startswith('extensions.') for m in sys.modules)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_compiler_is_found_by_name_and_a_missing_one_says_how_to_install_it():
    from extensions.thunder.pretrain import ThunderCompiler
    from litgpt.registry import CompilerExtension, load_compiler

    thunder = load_compiler("thunder")
    assert isinstance(thunder, ThunderCompiler) and isinstance(thunder, CompilerExtension)
    with pytest.raises(UserError, match=r"pip install 'litgpt\[tvm\]'"):
        load_compiler("tvm")


def test_an_unknown_compiler_on_the_command_line_is_one_line_naming_the_registered_ones(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "litgpt", "pretrain", "--config", "config_hub/pretrain/tiny.yaml", "--compiler", "tvm",
         "--out_dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
    assert "--compiler tvm is not one of auto, none, torch, thunder" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher's variables in the environment: each test sets those it plays."""
    for name in {*runtime.GLOBAL_RANK_VARIABLES, *runtime.LOCAL_RANK_VARIABLES, *runtime.NODE_RANK_VARIABLES,
                 "WORLD_SIZE", "SLURM_NTASKS", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"}:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        # torchrun on the second node of 2 x 4
        ({"RANK": "6", "LOCAL_RANK": "2", "GROUP_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, (6, 2, 1, 8)),
        # srun on the second node of 2 x 2
        ({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4"}, (3, 1, 1, 4)),
        # Fabric's own launcher sets NODE_RANK and LOCAL_RANK
        ({"NODE_RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 1, 0, 2)),
        # one plain process
        ({}, (0, 0, 0, 1)),
    ],
)
def test_ranks_come_from_every_launcher(monkeypatch, no_launcher, environ, expected):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert (runtime.global_rank(), runtime.local_rank(), runtime.node_rank(), runtime.world_size()) == expected


def test_printing_once_per_run_and_once_per_node(monkeypatch, no_launcher, capsys):
    """Two nodes of two processes (torchrun's variables): the run's first process prints per run, each node's first
    per node, with the node named."""
    printed = {}
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        monkeypatch.setenv("GROUP_RANK", str(rank // 2))
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        runtime.print_once("per run")
        runtime.print_once_per_node("per node")
        printed[rank] = capsys.readouterr().out.splitlines()
    assert printed == {0: ["per run", "[node 0] per node"], 1: [], 2: ["[node 1] per node"], 3: []}


def node_local_worker(rank: int, world: int, per_node: int, port: int, log: str) -> None:
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "NODE_RANK": str(rank // per_node),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with runtime.node_local_first("writing the log"):
            with open(log, "a") as f:
                f.write(f"{rank} enter {time.monotonic()}\n")
            time.sleep(0.3)
            with open(log, "a") as f:
                f.write(f"{rank} leave {time.monotonic()}\n")
        dist.barrier()  # rank 0's process hosts the store the others wait on: it leaves last
    finally:
        dist.destroy_process_group()


def test_node_local_first_runs_rank_zero_then_each_nodes_first_then_the_rest(tmp_path):
    """Four real processes as two nodes of two: rank 0 alone, then rank 2 (node 1's first) and rank 1 (node 0's
    other), then rank 3 (node 1's other)."""
    log = tmp_path / "order.txt"
    port = 29500 + os.getpid() % 1000
    mp.start_processes(node_local_worker, args=(4, 2, port, str(log)), nprocs=4, join=True,
                       start_method=rank_start_method())
    events = {}
    for line in log.read_text().splitlines():
        rank, what, when = line.split()
        events[(int(rank), what)] = float(when)
    assert events[(0, "leave")] < min(events[(1, "enter")], events[(2, "enter")])
    assert events[(2, "leave")] < events[(3, "enter")]  # node 1's others wait for node 1's first, not for the run


def test_the_recipes_say_what_trains_and_what_a_checkpoint_holds():
    config = Config(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32, padded_vocab_size=32)
    full = Recipe(name="finetune_full", config=config, initialization="checkpoint")
    lora = Recipe(name="finetune_lora", config=config, initialization="checkpoint",
                  lora=LoRASettings(r=2, alpha=4, dropout=0.0, query=True, key=False, value=True, projection=False,
                                    mlp=False, head=False))
    full_model, lora_model = full.build_model(), lora.build_model()
    assert all(p.is_meta and p.requires_grad for p in full_model.parameters())
    trainable = {name for name, p in lora_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert {key for key in lora_model.state_dict() if lora.trains(key)} == trainable
    assert all(full.trains(key) for key in full_model.state_dict())
    # The base file provides exactly the weights that do not train under LoRA.
    assert {key for key in lora_model.state_dict() if lora.is_initial_key(key)} == \
        set(lora_model.state_dict()) - trainable
    assert (full.weights_file, lora.weights_file) == ("lit_model.pth", "lit_model.pth.lora")
    assert full.checkpoint_holds_every_weight and not lora.checkpoint_holds_every_weight


def test_the_recipe_loss_on_whole_logits_is_the_mean_cross_entropy_over_labelled_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 6, 0, 1]])
    model = lambda input_ids: logits  # noqa: E731 - the loss only calls the model
    objective = Recipe(name="pretrain", config=Config()).objective({}, chunked=False)
    loss = objective.train_loss(model, {"input_ids": None, "labels": labels})["loss"]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    picked = [-log_probs[b, t, labels[b, t]] for b in range(2) for t in range(5) if labels[b, t] != -100]
    assert torch.allclose(loss.double(), torch.stack(picked).mean(), atol=1e-6)
