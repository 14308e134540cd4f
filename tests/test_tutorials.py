"""Every shell command of the guides in tutorials/ runs: one test per guide, its blocks in document order.

Each fenced block with the info string `bash` is a command block, run with `bash -euo pipefail -c` in one scratch
folder per guide, where `config_hub/` and `scripts/` of the repository are reachable (symlinks), so the guides read
as if run from the repository root. A block that exits non-zero fails the guide's test with the block's line number
and the tail of its output. Blocks with other info strings (`text`, `yaml`, `console`, `python`, ...) are not run,
except a `python` block annotated `<!-- test: run -->`.

Annotations: HTML comments (one per line) on the lines right before a block adapt it for the test; readers of the
rendered guide do not see them.

  <!-- test: append ARGS -->        append ARGS to every `litgpt ...` command of the block (before a trailing
                                    `# comment`; in `a && b` chains, to each part that is a litgpt command). Later
                                    flags win, so this shrinks a run: `--train.max_steps 2`.
  <!-- test: replace OLD => NEW --> replace the text OLD by NEW before running (may repeat; OLD must occur).
  <!-- test: slow -->               run the block only when tests marked slow run (`-m ''`, as CI does): multi-process
                                    or long blocks. Later blocks that use its output must be slow too.
  <!-- not run: REASON -->          never run the block; the guide says near it, in visible text, what it needs.
  <!-- test: save FILE -->          write the block (after replace) to FILE in the scratch folder instead of running
                                    it, e.g. a batch script that a later block submits.
  <!-- test: run -->                run a `python` block with this interpreter.
  <!-- test: hub REPO_ID -->        before the block, put a tiny random Llama (transformers' `save_pretrained`, with a
                                    llama-style tokenizer) into the guides' offline Hugging Face cache as
                                    REPO_ID: `litgpt download REPO_ID` then runs for real, without the hub.
  <!-- test: records FILE -->       before the block, write 32 instruction records (a JSON list of {"instruction",
                                    "input", "output"}) to FILE: where Alpaca / Alpaca2k read their data instead of
                                    downloading it.
  <!-- test: slurm -->              before the block, start the one-node Slurm cluster on localhost (conftest.py's
                                    `slurm_cluster`: `scripts/slurm-localhost.sh start`, once per session).

Every block runs with HF_HUB_OFFLINE=1 (the hub is never contacted), one Hugging Face cache (HF_HOME: a `hub`
annotation's model is built once) and one token cache (LITGPT_CACHE_DIR: the bundled corpus is tokenized once) for
all guides, a free MASTER_PORT, no SLURM_* variables of an enclosing job, the interpreter's `litgpt` script on PATH,
and before it a `litgpt` that forks each command from a server that imported torch and Lightning once
(tests/litgpt_forkserver.py; it runs the real script where the environment differs from the server's). That
`litgpt` reaches the commands of batch scripts too (sbatch passes the environment on to its job), and a
`torchrun ... -m litgpt` runs as `torchrun ... --no-python litgpt`, so that its ranks are forked as well.

The relative links of README.md, config_hub/README.md and the guides must reach existing files and headings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from litgpt_forkserver import ForkServer
from test_download import _add_to_cache
from ports import free_port
from test_slurm import slurm_env
from tokenizer_helpers import make_tokenizer_folder

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
GUIDES = sorted(path.stem for path in TUTORIALS.glob("*.md"))
# Repository folders a guide's commands refer to as if run from the repository root.
LINKED = ("config_hub", "scripts")
BLOCK_TIMEOUT_S = 600
TAIL_CHARS = 4000

ANNOTATION = re.compile(r"<!--\s*(?:test:\s*(?P<kind>[a-z]+)\b\s*(?P<value>.*?)|not run:\s*(?P<reason>.*?))\s*-->")
TAKES_VALUE = {"append": True, "replace": True, "save": True, "hub": True, "records": True,
               "slow": False, "run": False, "slurm": False}
LITGPT_COMMAND = re.compile(r"(?<![\w./-])litgpt\s+[a-z_]+")
# `-m litgpt` in a torchrun command (which may continue over lines ending in a backslash).
TORCHRUN_MODULE = re.compile(r"(\btorchrun\b(?:[^\n;&|]|\\\n)*?\s)-m litgpt\b")


@dataclass
class Block:
    guide: str
    line: int  # of the opening fence, counting from 1
    info: str
    text: str
    annotations: list[tuple[str, str]] = field(default_factory=list)

    def values(self, kind: str) -> list[str]:
        return [value for k, value in self.annotations if k == kind]

    def has(self, kind: str) -> bool:
        return any(k == kind for k, _ in self.annotations)

    @property
    def runs(self) -> bool:
        if self.has("not run"):
            return False
        return self.info == "bash" or (self.info == "python" and self.has("run"))


def parse_guide(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the annotations on the lines right before its fence."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = re.match(r"^(`{3,})\s*(\S*)\s*$", lines[index])
        if not opening:
            index += 1
            continue
        fence, info = opening.groups()
        annotations = []
        above = index - 1
        while above >= 0 and ANNOTATION.fullmatch(lines[above].strip()):
            found = ANNOTATION.fullmatch(lines[above].strip())
            if found["reason"] is not None:
                annotations.insert(0, ("not run", found["reason"]))
            else:
                annotations.insert(0, (found["kind"], found["value"]))
            above -= 1
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        assert end < len(lines), f"{path.name}:{index + 1}: the block is never closed"
        blocks.append(Block(path.stem, index + 1, info, "\n".join(lines[index + 1:end]) + "\n", annotations))
        index = end + 1
    return blocks


def check_annotations(block: Block) -> None:
    where = f"{block.guide}.md:{block.line}"
    for kind, value in block.annotations:
        if kind == "not run":
            assert value, f"{where}: `not run` needs the reason"
            continue
        assert kind in TAKES_VALUE, f"{where}: unknown annotation `test: {kind}`"
        assert bool(value) == TAKES_VALUE[kind], f"{where}: `test: {kind}` {'needs' if TAKES_VALUE[kind] else 'takes no'} value"
        if kind == "replace":
            assert " => " in value, f"{where}: `test: replace OLD => NEW` needs ' => '"
    if block.has("run"):
        assert block.info == "python", f"{where}: `test: run` is for python blocks (bash blocks always run)"


# ---- the text of a block as the test runs it --------------------------------------------------------------------------
def top_level_marks(text: str) -> tuple[list[tuple[int, int]], int]:
    """The spans of shell list/pipe operators outside quotes, and where a trailing `# comment` starts (or len)."""
    operators, quote, i = [], None, 0
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\" and quote == '"':
                i += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "\\":
            i += 1
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return operators, i
        elif text.startswith(("&&", "||"), i):
            operators.append((i, i + 2))
            i += 1
        elif char in "|;":
            operators.append((i, i + 1))
        i += 1
    return operators, len(text)


def append_to_command(command: str, args: str) -> str:
    """`args` appended to each part of one logical command line that is a litgpt command."""
    operators, end = top_level_marks(command)
    bounds = [0] + [stop for _, stop in operators]
    ends = [start for start, _ in operators] + [end]
    for start, stop in reversed(list(zip(bounds, ends))):
        part = command[start:stop]
        if LITGPT_COMMAND.search(part):
            cut = start + len(part.rstrip())
            command = command[:cut] + " " + args + command[cut:]
    return command


def append_to_litgpt_commands(text: str, args: str) -> str:
    """`args` appended to every litgpt command of a script (commands continued over lines with `\\` included)."""
    logical, current = [], []
    for line in text.splitlines():
        current.append(line)
        if not line.endswith("\\"):
            logical.append("\n".join(current))
            current = []
    if current:
        logical.append("\n".join(current))
    return "\n".join(append_to_command(command, args) for command in logical) + "\n"


def prepared_text(block: Block) -> str:
    text = block.text
    for value in block.values("replace"):
        old, new = value.split(" => ", 1)
        assert old in text, f"{block.guide}.md:{block.line}: `replace {old} => ...`: {old!r} is not in the block"
        text = text.replace(old, new)
    for args in block.values("append"):
        assert LITGPT_COMMAND.search(text), f"{block.guide}.md:{block.line}: `append` but no litgpt command"
        text = append_to_litgpt_commands(text, args)
    return TORCHRUN_MODULE.sub(r"\1--no-python litgpt", text)


# ---- fixtures the annotations ask for ----------------------------------------------------------------------------------
def add_tiny_model_to_hub_cache(hf_home: Path, repo_id: str) -> None:
    """A tiny random LlamaForCausalLM with a llama-style tokenizer, cached as `repo_id` (as huggingface_hub does)."""
    import torch
    import transformers

    if (hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))).is_dir():
        return
    source = make_tokenizer_folder(hf_home / "sources" / repo_id, "llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(transformers.AutoTokenizer.from_pretrained(source)), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    _add_to_cache(hf_home / "hub", repo_id, source)


def write_instruction_records(path: Path) -> None:
    """32 records in Alpaca's fields, drawn from the bundled stories: what the Alpaca modules read from disk."""
    from litgpt.data.tiny import TINY_DIR

    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:32]
    records = [{"instruction": "Continue the story.", "input": story[:80], "output": story[80:240]} for story in stories]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1))


def slow_tests_selected(config: pytest.Config) -> bool:
    """Whether this session's `-m` expression selects tests marked slow (an empty one selects everything)."""
    expression = config.getoption("markexpr")
    return not expression or Expression.compile(expression).evaluate(lambda name, **kwargs: name == "slow")


@dataclass
class Caches:
    """What the guides share: the token cache (the bundled corpus is tokenized once), the Hugging Face cache (each
    tiny model of a `hub` annotation is built once), and the fork server whose shim is their `litgpt` (started with
    the environment that holds both: the imports read HF_HOME)."""

    hf_home: Path
    env: dict[str, str]
    server: ForkServer | None = None

    def server_env(self) -> dict[str, str]:
        if self.server is None:
            self.server = ForkServer(self.env, cwd=self.hf_home, shim_on_path=True)
        return self.server.env


@pytest.fixture(scope="session")
def caches(tmp_path_factory):
    hf_home = tmp_path_factory.mktemp("hf_home")
    path = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    env = slurm_env(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"),
                    LITGPT_CACHE_DIR=str(tmp_path_factory.mktemp("token-cache")), PATH=path)
    shared = Caches(hf_home, env)
    yield shared
    if shared.server is not None:
        shared.server.close()


def run_block(block: Block, scratch: Path, caches: Caches, request: pytest.FixtureRequest) -> None:
    for repo_id in block.values("hub"):
        add_tiny_model_to_hub_cache(caches.hf_home, repo_id)
    for file in block.values("records"):
        write_instruction_records(scratch / file)
    if block.has("slurm"):
        request.getfixturevalue("slurm_cluster")  # conftest.py's, started once per session
    text = prepared_text(block)
    for file in block.values("save"):
        (scratch / file).parent.mkdir(parents=True, exist_ok=True)
        (scratch / file).write_text(text)
        (scratch / file).chmod(0o755)
    if block.values("save"):
        return
    command = ["bash", "-euo", "pipefail", "-c", text] if block.info == "bash" else [sys.executable, "-c", text]
    started = time.time()
    try:
        done = subprocess.run(command, cwd=scratch, env=dict(caches.server_env(), MASTER_PORT=str(free_port())),
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"tutorials/{block.guide}.md, block at line {block.line}: still running after {error.timeout} s")
    if done.returncode != 0:
        # A batch job's output goes to its log file, not to sbatch's stderr: show the logs the block wrote too.
        logs = "".join(
            f"--- {path.relative_to(scratch)} (tail)\n{path.read_text(errors='replace')[-TAIL_CHARS:]}\n"
            for path in sorted(scratch.rglob("*"))
            if path.suffix in (".out", ".log") and path.is_file() and path.stat().st_mtime >= started
        )
        pytest.fail(
            f"tutorials/{block.guide}.md, block at line {block.line} exited with {done.returncode}:\n{text}\n"
            f"--- stdout (tail)\n{done.stdout[-TAIL_CHARS:]}\n--- stderr (tail)\n{done.stderr[-TAIL_CHARS:]}\n{logs}",
            pytrace=False,
        )


@pytest.mark.parametrize("guide", GUIDES)
def test_tutorial(guide, request, tmp_path_factory, caches):
    blocks = parse_guide(TUTORIALS / f"{guide}.md")
    for block in blocks:
        check_annotations(block)
    scratch = tmp_path_factory.mktemp(guide)
    for name in LINKED:
        (scratch / name).symlink_to(ROOT / name)
    slow = slow_tests_selected(request.config)
    for block in blocks:
        if block.runs and (slow or not block.has("slow")):
            run_block(block, scratch, caches, request)


# ---- the runner itself ------------------------------------------------------------------------------------------------
def test_append_reaches_every_litgpt_command_and_nothing_else():
    script = (
        "mkdir -p logs && litgpt pretrain --config a.yaml  # a comment | with a pipe\n"
        "srun litgpt finetune_lora ckpt \\\n  --devices 8\n"
        "litgpt generate out --prompt 'a | b && c' | tee log.txt\n"
        "torchrun --nproc_per_node 8 -m litgpt pretrain; ls out/litgpt pretrain\n"
    )
    assert append_to_litgpt_commands(script, "--x 1") == (
        "mkdir -p logs && litgpt pretrain --config a.yaml --x 1  # a comment | with a pipe\n"
        "srun litgpt finetune_lora ckpt \\\n  --devices 8 --x 1\n"
        "litgpt generate out --prompt 'a | b && c' --x 1 | tee log.txt\n"
        "torchrun --nproc_per_node 8 -m litgpt pretrain --x 1; ls out/litgpt pretrain\n"
    )


def test_torchrun_runs_the_litgpt_on_path_instead_of_the_module():
    block = Block("guide", 1, "bash", (
        "torchrun --nnodes 2 --master_port 29500 \\\n  -m litgpt pretrain --devices 8\n"
        "torchrun --standalone -m litgpt distill out -m litgpt_like\n"
        "python -m litgpt generate out; echo torchrun && python -m litgpt chat out\n"
    ))
    assert prepared_text(block) == (
        "torchrun --nnodes 2 --master_port 29500 \\\n  --no-python litgpt pretrain --devices 8\n"
        "torchrun --standalone --no-python litgpt distill out -m litgpt_like\n"
        "python -m litgpt generate out; echo torchrun && python -m litgpt chat out\n"
    )


def test_parse_reads_annotations_and_line_numbers(tmp_path):
    guide = tmp_path / "guide.md"
    guide.write_text(
        "# Title\n\n<!-- test: slow -->\n<!-- test: replace 8 => 2 -->\n```bash\nlitgpt pretrain --devices 8\n```\n\n"
        "<!-- not run: needs 8 GPUs -->\n\n```bash\nnot annotated: a blank line separates it\n```\n"
        "```python\nprint(1)\n```\n"
    )
    blocks = parse_guide(guide)
    assert [(b.line, b.info, b.annotations) for b in blocks] == [
        (5, "bash", [("slow", ""), ("replace", "8 => 2")]),
        (11, "bash", []),
        (14, "python", []),
    ]
    assert prepared_text(blocks[0]) == "litgpt pretrain --devices 2\n"
    assert [b.runs for b in blocks] == [True, True, False]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (lower case, punctuation dropped, spaces to '-')."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("document", ["README.md", "config_hub/README.md", *(f"tutorials/{g}.md" for g in GUIDES)])
def test_relative_links_reach_files_and_headings(document):
    source = ROOT / document
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        assert path.exists(), f"{document} links {target}: no such file"
        if anchor:
            assert anchor in heading_anchors(path), f"{document} links {target}: no such heading"
