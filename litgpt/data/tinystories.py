"""TinyStories (Eldan & Li, 2023): short stories written by GPT-4 in the words of a small child.

The files are those of the Hugging Face dataset `roneneldan/TinyStories`: `TinyStoriesV2-GPT4-train.txt` (about
2.2 GB) and `TinyStoriesV2-GPT4-valid.txt`, stories separated by `<|endoftext|>`. They are downloaded into
`data_path` unless they are there already; each story is one document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from litgpt.data.text_files import delimited_documents
from litgpt.data.token_cache import Corpus, TokenCorpus, hub_download
from litgpt.errors import UserError

REPO_ID = "roneneldan/TinyStories"
TRAIN_FILE = "TinyStoriesV2-GPT4-train.txt"
VAL_FILE = "TinyStoriesV2-GPT4-valid.txt"
SEPARATOR = "<|endoftext|>"


@dataclass
class TinyStories(TokenCorpus):
    """The TinyStories V2 (GPT-4) stories.

    Args:
        data_path: Folder holding (or to receive) the two .txt files of the dataset repo.
        cache_dir: Folder for the token caches (default: keyed folders under ~/.cache/litgpt/tokens).
        seed: LitGPT's shuffle seed, read so that its recipes work; no effect here (the run's --seed orders the
            samples).
    """

    data_path: Path = Path("data/tinystories")
    cache_dir: Optional[Path] = None
    seed: Optional[int] = None

    def download(self) -> None:
        hub_download(REPO_ID, [TRAIN_FILE, VAL_FILE], self.data_path)

    def corpora(self) -> dict[str, Corpus]:
        result = {}
        for split, name in (("train", TRAIN_FILE), ("val", VAL_FILE)):
            path = Path(self.data_path) / name
            if not path.is_file():
                raise UserError(
                    f"{str(path)!r} is missing: prepare() downloads it, or put the file of the Hugging Face dataset "
                    f"{REPO_ID} there yourself."
                )
            result[split] = Corpus(
                f"tinystories-{split}",
                [path],
                lambda path=path: delimited_documents(path, SEPARATOR),
                {"separator": SEPARATOR},
            )
        return result
