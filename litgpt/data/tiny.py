"""The bundled tiny corpus: short generated children's stories that ship with litgpt (no download).

`litgpt/data/tiny/` holds `train.txt` and `val.txt` (stories separated by one blank line, none inside a story, as
the repository's `scripts/make_tiny_corpus.py` writes them) and `tokenizer/`, a 4096-entry BPE tokenizer trained on
them (`TOKENIZER_DIR`). Each story is one document: `<s> story </s>` with that tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from litgpt.data.text_files import blank_line_documents
from litgpt.data.token_cache import Corpus, TokenCorpus
from litgpt.errors import UserError

TINY_DIR = Path(__file__).parent / "tiny"
TOKENIZER_DIR = TINY_DIR / "tokenizer"


@dataclass
class Tiny(TokenCorpus):
    """The bundled tiny story corpus.

    Args:
        cache_dir: Folder for the token caches (default: keyed folders under ~/.cache/litgpt/tokens).
    """

    cache_dir: Optional[Path] = None
    # The tokenizer the corpus was made with: pretraining uses it when no --tokenizer_dir is given.
    tokenizer_dir: ClassVar[Path] = TOKENIZER_DIR

    def corpora(self) -> dict[str, Corpus]:
        result = {}
        for split, name in (("train", "train.txt"), ("val", "val.txt")):
            path = TINY_DIR / name
            if not path.is_file():
                raise UserError(
                    f"The bundled corpus file {str(path)!r} is missing. Regenerate it from a litgpt checkout with "
                    "`python scripts/make_tiny_corpus.py`."
                )
            result[split] = Corpus(f"tiny-{split}", [path], lambda path=path: blank_line_documents(path))
        return result
