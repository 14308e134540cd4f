"""Small litgpt checkpoints that tests build themselves."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from litgpt.io import save_state_dict
from litgpt.config import Config
from litgpt.data.tiny import TOKENIZER_DIR
from litgpt.model import GPT


def write_random_checkpoint(folder: Path, config: Config, seed: int = 0) -> Path:
    """A randomly initialized model saved as a checkpoint folder, with the bundled 4096-token tokenizer."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy2(file, folder / file.name)
    return folder
