"""Data: the data modules that `--data NAME` picks and the bundled tiny corpus.

Pretraining (text tokenized once into a memory-mapped token cache, cut into windows of max_seq_length + 1 tokens):
`Tiny` (bundled, in `litgpt/data/tiny/`), `TextFiles` (your folder of .txt files), `TinyStories`, `OpenWebText`,
`RedPajama`.

Pretraining at scale (token ids prepared once into litdata's optimized folders, local or in an object store, each
rank streaming its own share, resumed exactly from every rank's loader position): `LitData`, `TinyLlama`,
`MicroLlama` (`lit_data.py`, over `streaming.py`); `HFDataset` (a Hugging Face dataset from the hub or a local
folder, streamed, split by node and rank, tokenized on the fly and packed).

Finetuning (instruction or chat records, prompt laid out by a prompt style, prompt tokens masked from the loss):
`JSON` (your .json/.jsonl files), `Alpaca`, `Alpaca2k`, `AlpacaGPT4`, `Dolly`, `LIMA`.

Preference optimization (`litgpt dpo`: a prompt with a chosen and a rejected answer): `Preference` (JSON/JSONL files
or a Hugging Face dataset, in TRL's text or conversational format).

LitGPT's names that are not carried here (`Deita`, `FLAN`, `LongForm`,
`litgpt_only.py`) parse with LitGPT's init args and stop with one line naming the module to use instead.

`base.MicroBatches` turns any of their datasets into resumable micro-batches. `scripts/make_tiny_corpus.py` (in the
repository, not in the installed package) regenerates the bundled corpus and its tokenizer.
"""

from litgpt.data.alpaca import Alpaca, Alpaca2k, AlpacaGPT4
from litgpt.data.base import DataModule, MicroBatches
from litgpt.data.dolly import Dolly
from litgpt.data.hf_dataset import HFDataset
from litgpt.data.json_data import JSON, SFTDataModule, SFTDataset
from litgpt.data.lima import LIMA
from litgpt.data.lit_data import LitData, MicroLlama, TinyLlama
from litgpt.data.litgpt_only import FLAN, Deita, LongForm
from litgpt.data.openwebtext import OpenWebText
from litgpt.data.preference import Preference
from litgpt.data.redpajama import RedPajama
from litgpt.data.text_files import TextFiles
from litgpt.data.tiny import Tiny
from litgpt.data.tinystories import TinyStories
from litgpt.data.token_cache import TokenCorpus, TokenWindows

__all__ = [
    "Alpaca",
    "Alpaca2k",
    "AlpacaGPT4",
    "DataModule",
    "Deita",
    "Dolly",
    "FLAN",
    "HFDataset",
    "JSON",
    "LIMA",
    "LitData",
    "LongForm",
    "MicroLlama",
    "MicroBatches",
    "OpenWebText",
    "Preference",
    "RedPajama",
    "SFTDataModule",
    "SFTDataset",
    "TextFiles",
    "Tiny",
    "TinyLlama",
    "TinyStories",
    "TokenCorpus",
    "TokenWindows",
]
