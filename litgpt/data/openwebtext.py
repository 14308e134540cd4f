"""OpenWebText (Gokaslan & Cohen, 2019): about 8 million web pages linked from Reddit, an open copy of GPT-2's
WebText.

Two ways to get it, both from the Hugging Face dataset `Skylion007/openwebtext`:

- Files already on disk, used without the network: the repo's archives `subsets/urlsf_subset00.tar` ...
  `urlsf_subset20.tar` under `data_path` (each a tar of `.xz` archives, each a tar of one `.txt` file per page).
  Runs of three or more newlines become two and the text is stripped, as the dataset's loading script does.
- Otherwise the `datasets` library (`pip install datasets`) downloads and caches the dataset under
  `data_path/hf_datasets`, and its "text" column is used.

Each page is one document; a deterministic `val_split_fraction` of them (chosen by a hash of `seed` and the page's
position) is the validation set.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from litgpt.data.token_cache import Corpus, TokenCorpus, in_validation
from litgpt.errors import UserError

REPO_ID = "Skylion007/openwebtext"
SUBSETS = "subsets/urlsf_subset*.tar"
_MANY_NEWLINES = re.compile(r"\n\n\n+")


def archive_documents(path: Path) -> Iterator[str]:
    """The pages of one `urlsf_subsetNN.tar` archive, in archive order, read as a stream."""
    with tarfile.open(path, mode="r|*") as outer:
        for member in outer:
            if not (member.isfile() and member.name.endswith(".xz")):
                continue
            with tarfile.open(fileobj=outer.extractfile(member), mode="r|xz") as inner:
                for page in inner:
                    if not (page.isfile() and page.name.endswith(".txt")):
                        continue
                    text = inner.extractfile(page).read().decode("utf-8", errors="replace")
                    yield _MANY_NEWLINES.sub("\n\n", text).strip()


@dataclass
class OpenWebText(TokenCorpus):
    """The OpenWebText corpus.

    Args:
        data_path: Folder holding `subsets/urlsf_subset*.tar` of the dataset repo; without them, the folder where the
            `datasets` library caches its download.
        val_split_fraction: Share of the pages held out for validation (0.0005: about 4,000 pages).
        seed: Seed of that split.
        cache_dir: Folder for the token caches (default: keyed folders under ~/.cache/litgpt/tokens).
    """

    data_path: Path = Path("data/openwebtext")
    val_split_fraction: float = 0.0005
    seed: int = 42
    cache_dir: Optional[Path] = None

    def archives(self) -> list[Path]:
        return sorted(Path(self.data_path).glob(SUBSETS))

    def download(self) -> None:
        if not self.archives():
            self._hf_dataset()

    def corpora(self) -> dict[str, Corpus]:
        in_validation(0, self.val_split_fraction, self.seed)  # checks the fraction before anything is read
        options: dict[str, Any] = {"val_split_fraction": self.val_split_fraction, "seed": self.seed}
        archives = self.archives()
        if archives:
            files = archives

            def pages() -> Iterator[str]:
                for path in archives:
                    yield from archive_documents(path)

        else:
            dataset = self._hf_dataset()
            files = [Path(entry["filename"]) for entry in dataset.cache_files]
            options["dataset_fingerprint"] = getattr(dataset, "_fingerprint", None)

            def pages() -> Iterator[str]:
                for batch in dataset.iter(batch_size=1000):
                    yield from batch["text"]

        def documents(want_val: bool) -> Iterator[str]:
            for index, text in enumerate(pages()):
                if in_validation(index, self.val_split_fraction, self.seed) == want_val:
                    yield text

        return {
            "train": Corpus("openwebtext-train", files, lambda: documents(False), options),
            "val": Corpus("openwebtext-val", files, lambda: documents(True), options),
        }

    def _hf_dataset(self) -> Any:
        dataset = getattr(self, "_dataset", None)
        if dataset is not None:
            return dataset
        where = Path(self.data_path) / SUBSETS
        try:
            import datasets
        except ImportError:
            raise UserError(
                f"OpenWebText is downloaded with the `datasets` library: `pip install datasets`. Or download the "
                f"archives subsets/urlsf_subset00.tar ... urlsf_subset20.tar of https://huggingface.co/datasets/{REPO_ID} "
                f"and put them at {str(where)!r}."
            ) from None
        try:
            dataset = datasets.load_dataset(REPO_ID, split="train", cache_dir=str(Path(self.data_path) / "hf_datasets"))
        except Exception as error:  # offline, unreachable, changed repo: the same advice
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(
                f"Could not load the Hugging Face dataset {REPO_ID} with `datasets` ({first}). Download its archives "
                f"subsets/urlsf_subset*.tar yourself and put them at {str(where)!r}."
            ) from None
        self._dataset = dataset
        return dataset
