"""LitGPT 0.5.13's own code as a test reference: its wheel unpacked into a cache folder and run in a subprocess.

LitGPT's package is also named `litgpt`, so it never shares a process with ours: `run_litgpt(code, payload)` runs
`code` with only the unpacked wheel on PYTHONPATH and returns what the code prints as JSON. Its Python API
(`litgpt.config.Config`, `litgpt.model.GPT`, `litgpt.generate.base.generate`, `litgpt.utils.save_config`,
`litgpt.prompts.save_prompt_style`) works with our torch and lightning; its CLI is not needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

LITGPT_VERSION = "0.5.13"
SHARED_WHEEL = Path(f"/work/shared_ref/litgpt-{LITGPT_VERSION}-py3-none-any.whl")


def litgpt_reference_dir() -> Path:
    """A folder holding LitGPT 0.5.13's `litgpt` package (unpacked once per machine), or skip the test.

    The wheel comes from /work/shared_ref when present, else from PyPI (`pip download litgpt==0.5.13 --no-deps`).
    """
    cache = Path(os.environ.get("LITGPT_REFERENCE_DIR", Path(tempfile.gettempdir()) / f"litgpt-{LITGPT_VERSION}-ref"))
    if (cache / "litgpt" / "model.py").is_file():
        return cache
    with tempfile.TemporaryDirectory() as scratch:
        wheel = SHARED_WHEEL
        if not wheel.is_file():
            download = subprocess.run(
                [sys.executable, "-m", "pip", "download", f"litgpt=={LITGPT_VERSION}", "--no-deps", "-d", scratch],
                capture_output=True, text=True,
            )
            wheels = list(Path(scratch).glob("litgpt-*.whl"))
            if download.returncode != 0 or not wheels:
                pytest.skip(f"LitGPT {LITGPT_VERSION}'s wheel is not available: {download.stderr.strip()[-200:]}")
            wheel = wheels[0]
        staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staging)
        try:
            staging.rename(cache)  # atomic: a parallel worker that lost the race keeps the winner's copy
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return cache


def run_litgpt(code: str, payload, timeout: float = 600) -> object:
    """Run `code` under LitGPT 0.5.13 with `payload` as JSON in sys.argv[1]; return the JSON its last line prints."""
    env = {**os.environ, "PYTHONPATH": str(litgpt_reference_dir()), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as cwd:  # not our repository: `import litgpt` must find LitGPT's
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps(payload)], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=timeout,
        )
    assert result.returncode == 0, f"LitGPT {LITGPT_VERSION} failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_litgpt_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """LitGPT 0.5.13's own command line (`litgpt ARGS` as LitGPT's users type it)."""
    env = {**os.environ, "PYTHONPATH": str(litgpt_reference_dir()), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-m", "litgpt", *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)


# LitGPT's greedy decode with its KV cache (its generate) and by full forward passes (its model alone).
GREEDY = r"""
def greedy(model, prompt_ids, max_new_tokens):
    prompt = torch.tensor(prompt_ids)
    with torch.no_grad():
        ids = prompt.clone()
        for _ in range(max_new_tokens):
            ids = torch.cat((ids, model(ids[None])[0, -1].argmax()[None]))
        model.max_seq_length = len(prompt_ids) + max_new_tokens
        model.set_kv_cache(batch_size=1)
        tokens = generate(model, prompt, model.max_seq_length, temperature=0.0, include_prompt=False)
        model.clear_kv_cache()
    return {"tokens": tokens.tolist(), "no_cache_tokens": ids[len(prompt_ids):].tolist()}
"""

# Builds each requested model with LitGPT's Config and GPT (random weights, norms perturbed so that a wrong norm
# convention shows), saves the folder as LitGPT does (`save_config`, its training runs' {"model": state dict} or its
# converter's plain state dict, `save_prompt_style`, hyperparameters.yaml) and greedy-decodes with LitGPT's generate.
WRITE_FOLDERS = r'''
import json, sys, shutil
from pathlib import Path
import torch, yaml
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.utils import save_config
from litgpt.prompts import save_prompt_style
from litgpt.generate.base import generate
''' + GREEDY + r'''
results = []
for job in json.loads(sys.argv[1]):
    folder = Path(job["folder"])
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(job.get("seed", 0))
    config = Config(**job["config"])
    model = GPT(config)
    model.apply(model._init_weights)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    state = model.state_dict()
    torch.save({"model": state} if job.get("wrapped") else state, folder / "lit_model.pth")
    save_config(config, folder)
    if job.get("prompt_style"):
        save_prompt_style(job["prompt_style"], folder)
    (folder / "hyperparameters.yaml").write_text(yaml.safe_dump(job.get("hyperparameters", {})))
    for file in Path(job.get("tokenizer_dir", "")).glob("*") if job.get("tokenizer_dir") else ():
        shutil.copy2(file, folder / file.name)
    model.eval()
    results.append(greedy(model, job["prompt"], job["max_new_tokens"]))
print(json.dumps(results))
'''

# Loads each folder as LitGPT's commands do (check_valid_checkpoint_dir, Config.from_file, load_checkpoint's
# state-dict handling, prompt_style.yaml or the name's style) and greedy-decodes with LitGPT's generate; also reports
# the full forward pass's greedy continuation (no KV cache) and the prompt style LitGPT picks.
READ_FOLDERS = r'''
import json, sys
from pathlib import Path
import torch
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.utils import check_valid_checkpoint_dir, lazy_load
from litgpt.prompts import PromptStyle, has_prompt_style, load_prompt_style
from litgpt.generate.base import generate
''' + GREEDY + r'''
results = []
for job in json.loads(sys.argv[1]):
    folder = Path(job["folder"])
    check_valid_checkpoint_dir(folder, raise_error=True, ignore_tokenizer_files=job.get("no_tokenizer", False))
    config = Config.from_file(folder / "model_config.yaml")
    model = GPT(config)
    state = lazy_load(folder / "lit_model.pth")
    model.load_state_dict(state.get("model", state), strict=True)
    model.eval()
    style = load_prompt_style(folder) if has_prompt_style(folder) else PromptStyle.from_config(config)
    results.append({**greedy(model, job["prompt"], job["max_new_tokens"]), "prompt_style": type(style).__name__})
print(json.dumps(results))
'''

# LitGPT's Config fields and defaults; its config.py alone (importing the package would load lightning: seconds).
CONFIG_FIELDS = r'''
import dataclasses, importlib.util, json, os
spec = importlib.util.spec_from_file_location("litgpt_config", os.environ["PYTHONPATH"] + "/litgpt/config.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fields = dataclasses.fields(module.Config)
print(json.dumps({f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields}))
'''
