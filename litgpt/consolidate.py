"""`litgpt consolidate`: turn a sharded checkpoint (torch.distributed.checkpoint folder) into one lit_model.pth."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from litgpt.errors import UserError


def main(checkpoint_dir: Path, out_dir: Optional[Path] = None, overwrite: bool = False) -> None:
    """Write the weights of a sharded checkpoint as one file that `generate`, `chat` and the converters read.

    Needs memory for the whole model in this one process; the optimizer state stays behind. Every file is written
    under a temporary name and renamed when complete, the weights last: a failure leaves no half-written file and
    replaces nothing.

    Args:
        checkpoint_dir: A step-XXXXXX folder of a run with --fsdp.state_dict_type sharded (it holds sharded/).
        out_dir: Where to write the weights with the config and tokenizer (default: into checkpoint_dir itself).
        overwrite: Replace a weights file that out_dir already holds.
    """
    from litgpt.checkpoint.model_files import CONFIG_FILE, copy_tokenizer_files, WEIGHTS_FILE
    from litgpt.checkpoint.store import consolidated_weights, SHARDED_DIR, TRAINING_STATE_FILE
    from litgpt.config import PROMPT_STYLE_FILE
    from litgpt.io import atomic_copy, load_state_dict, save_state_dict

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"Folder {str(checkpoint_dir)!r} does not exist; pass a step-XXXXXX folder of a run.")
    if not (checkpoint_dir / SHARDED_DIR).is_dir():
        raise UserError(
            f"{str(checkpoint_dir)!r} is not a sharded checkpoint (it has no {SHARDED_DIR}/ folder); a full checkpoint "
            f"already holds its weights in one file."
        )
    weights_file = WEIGHTS_FILE
    if (checkpoint_dir / TRAINING_STATE_FILE).is_file():
        weights_file = load_state_dict(checkpoint_dir / TRAINING_STATE_FILE).get("weights_file", WEIGHTS_FILE)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint_dir
    if (out_dir / weights_file).exists() and not overwrite:
        raise UserError(f"{str(out_dir / weights_file)!r} exists already: pass --overwrite true to replace it, or "
                        "choose another --out_dir.")
    weights = consolidated_weights(checkpoint_dir)
    try:
        if out_dir != checkpoint_dir:
            for name in (CONFIG_FILE, PROMPT_STYLE_FILE, "hyperparameters.yaml"):
                if (checkpoint_dir / name).is_file():
                    atomic_copy(checkpoint_dir / name, out_dir / name)
            copy_tokenizer_files(checkpoint_dir, out_dir)
        save_state_dict(weights, out_dir / weights_file)  # last: a folder with the weights has everything else
    except OSError as error:  # disk full, quota, read-only: nothing was replaced by a half-written file
        raise UserError(f"Could not write into {str(out_dir)!r}: {error.strerror or error}. No file there was "
                        "replaced by an incomplete one; make room and run it again.") from None
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"Wrote {len(weights)} tensors ({size / 2**20:,.1f} MiB) to {out_dir / weights_file}")
