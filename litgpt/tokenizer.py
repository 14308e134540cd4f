"""The tokenizer of a checkpoint folder: `tokenizer.json` run by the `tokenizers` library, with the special tokens and
options of `tokenizer_config.json`, `special_tokens_map.json` and `generation_config.json`.

`Tokenizer.encode(text)` gives the ids `transformers.AutoTokenizer.from_pretrained(folder).encode(text)` gives, and
`decode(ids)` the text its `decode(ids)` gives, for folders whose tokenizer.json describes the tokenizer. What is
followed from transformers:

- the special tokens the post-processor of tokenizer.json puts around the text (transformers 5 ignores the
  `add_bos_token`/`add_eos_token` flags of tokenizer_config.json then; they are only followed here when tokenizer.json
  has no post-processor, where transformers 5 would add nothing);
- truncation and padding stored in tokenizer.json are ignored (transformers only applies them on request);
- `split_special_tokens` (special tokens written in the text are then tokenized as plain text);
- `clean_up_tokenization_spaces` for WordPiece and Unigram models (transformers skips it for BPE).

A few transformers tokenizer classes (LlamaTokenizer, Qwen2Tokenizer, GPTNeoXTokenizer, ...) rebuild the normalizer,
pre-tokenizer and decoder in code from the vocabulary instead of using those of tokenizer.json. For current repos
both agree; for old ones (Llama 2's tokenizer.json prepends "▁" after every special token, the rebuilt one only at
the start) text holding special tokens can tokenize differently. This module always follows tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
from tokenizers import Tokenizer as _Backend

from litgpt.errors import UserError
from litgpt.safe_paths import inside

IdsLike = Union[torch.Tensor, Sequence[int], int]

# The spaces transformers removes before punctuation and English contractions when `clean_up_tokenization_spaces`
# is set (only for WordPiece and Unigram models).
_CLEANUP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Tokenizer:
    """Text <-> token ids for the model in `checkpoint_dir`.

    Attributes:
        checkpoint_dir: The folder the tokenizer was read from.
        bos_id: Id of the beginning-of-sequence token, or None when the tokenizer has none.
        eos_id: Id of the end-of-sequence token named by the tokenizer config, or None.
        stop_ids: Every id that ends generation: `eos_id` and all ids of `eos_token_id` in generation_config.json
            (chat models list several, e.g. end-of-turn and end-of-text).
        vocab_size: Number of token ids, added (special) tokens included; every id `encode` returns is below it.
    """

    def __init__(self, checkpoint_dir: Union[Path, str]) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.exists():
            raise UserError(
                f"Tokenizer folder {str(checkpoint_dir)!r} does not exist. Pass the checkpoint folder of the model "
                "(e.g. checkpoints/ORG/NAME, as written by `litgpt download ORG/NAME`)."
            )
        if not checkpoint_dir.is_dir():
            raise UserError(
                f"{str(checkpoint_dir)!r} is not a folder; pass the checkpoint folder that holds tokenizer.json."
            )
        self.checkpoint_dir = checkpoint_dir
        self._config = _read_json_object(checkpoint_dir / "tokenizer_config.json")
        self._special_map = _read_json_object(checkpoint_dir / "special_tokens_map.json")
        self._generation = _read_json_object(checkpoint_dir / "generation_config.json")

        self.backend = _load_backend(checkpoint_dir)
        # transformers applies the truncation and padding saved in tokenizer.json only when asked to.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = bool(self._config.get("split_special_tokens", False))

        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.bos_id: Optional[int] = self._special_id("bos")
        self.eos_id: Optional[int] = self._special_id("eos")
        stop_ids = [self.eos_id] + _ids_from_generation_config(
            self._generation.get("eos_token_id"), checkpoint_dir / "generation_config.json", "eos_token_id"
        )
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in stop_ids if i is not None))
        self._prefix, self._suffix = self._template_ids()
        self._cleanup = bool(self._config.get("clean_up_tokenization_spaces", False)) and (
            type(self.backend.model).__name__ in ("WordPiece", "Unigram", "WordLevel")
        )

    # ---- special tokens -------------------------------------------------------------------------------------------
    def _special_id(self, kind: str) -> Optional[int]:
        """The id of the bos/eos token from tokenizer_config.json, special_tokens_map.json or generation_config.json.

        A token set to null in a tokenizer file means the tokenizer has none (Qwen has no BOS token, even though its
        generation_config.json names one).
        """
        key = f"{kind}_token"
        for source, name in ((self._config, "tokenizer_config.json"), (self._special_map, "special_tokens_map.json")):
            if key not in source:
                continue
            content = _token_content(source[key], self.checkpoint_dir / name, key)
            if content is None:
                return None
            token_id = self.backend.token_to_id(content)
            if token_id is not None:
                return token_id
        ids = _ids_from_generation_config(
            self._generation.get(f"{key}_id"), self.checkpoint_dir / "generation_config.json", f"{key}_id"
        )
        return ids[0] if ids else None

    def _template_ids(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after the text of a single sequence."""
        if self.backend.post_processor is None:
            # Nothing in tokenizer.json says what goes around the text: follow tokenizer_config.json's flags, as the
            # sentencepiece tokenizers they come from did. (With a post-processor, transformers ignores the flags.)
            prefix = [self.bos_id] if self._config.get("add_bos_token") and self.bos_id is not None else []
            suffix = [self.eos_id] if self._config.get("add_eos_token") and self.eos_id is not None else []
            return prefix, suffix
        # Post-processors wrap any single sequence the same way: find the probe's ids inside the processed ones.
        for text in ("a b", "Hello", "1", ".", ""):
            probe = self.backend.encode(text, add_special_tokens=False)
            processed = self.backend.post_process(probe, add_special_tokens=True).ids
            if probe.ids or not text:
                break
        inner = probe.ids
        if not inner:  # nothing of the probes is in the vocabulary: count what is added as a prefix
            return processed, []
        for start in range(len(processed) - len(inner) + 1):
            if processed[start : start + len(inner)] == inner:
                return processed[:start], processed[start + len(inner) :]
        raise UserError(
            f"The post-processor of {str(self.checkpoint_dir / 'tokenizer.json')!r} changes the text's own tokens, "
            "which litgpt does not support."
        )

    def token_to_id(self, token: str) -> int:
        """The id of `token` (a vocabulary entry such as "<|im_end|>")."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise UserError(
                f"Token {token!r} is not in the vocabulary of the tokenizer in {str(self.checkpoint_dir)!r}."
            )
        return token_id

    def id_to_token(self, token_id: int) -> Optional[str]:
        """The vocabulary entry of `token_id`, or None when there is no such id."""
        return self.backend.id_to_token(int(token_id))

    # ---- encode / decode ------------------------------------------------------------------------------------------
    def encode(
        self,
        text: str,
        bos: Optional[bool] = None,
        eos: Optional[bool] = None,
        max_length: int = -1,
        device: Optional[Union[torch.device, str]] = None,
    ) -> torch.Tensor:
        """Token ids of `text` as a 1-D int64 tensor.

        Args:
            text: The text; special tokens written in it (e.g. "<|im_start|>") become their ids.
            bos: None adds the BOS token when the tokenizer does so by itself (as `AutoTokenizer.encode` would);
                True makes sure the ids start with it; False leaves it out.
            eos: Likewise for an EOS token at the end (None: only when the tokenizer appends one by itself).
            max_length: Keep only the first `max_length` ids; negative keeps all.
            device: Where to put the tensor (default: CPU).
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(text).__name__}.")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        prefix = _with_edge(self._prefix, self.bos_id, bos, at_start=True, name="BOS", where=self.checkpoint_dir)
        suffix = _with_edge(self._suffix, self.eos_id, eos, at_start=False, name="EOS", where=self.checkpoint_dir)
        ids = prefix + ids + suffix
        if max_length >= 0:
            ids = ids[:max_length]
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def decode(self, ids: IdsLike, skip_special_tokens: bool = False) -> str:
        """The text of token ids (a 1-D tensor, a list or one id), as `AutoTokenizer.decode(ids)` gives it."""
        text = self.backend.decode(_as_id_list(ids), skip_special_tokens=skip_special_tokens)
        if self._cleanup:
            for old, new in _CLEANUP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def decode_stream(
        self, ids: Iterable[Union[int, torch.Tensor]], prompt_ids: IdsLike = (), skip_special_tokens: bool = False
    ) -> Iterator[str]:
        """Yield the text of `ids` piece by piece as they arrive (e.g. from generation); see `IncrementalDecoder`."""
        decoder = IncrementalDecoder(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
        for token_id in ids:
            piece = decoder.step(token_id)
            if piece:
                yield piece
        rest = decoder.finish()
        if rest:
            yield rest

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.checkpoint_dir)!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, stop_ids={self.stop_ids})"
        )


class IncrementalDecoder:
    """Turns token ids arriving one at a time into text pieces whose concatenation is the full decode.

    Decoding each token alone breaks characters spread over several byte tokens and loses the space a sentencepiece
    token carries at the start. Instead, the text of a short window of recent tokens is decoded with and without the
    new ones; the difference is emitted once it no longer ends in an incomplete character (U+FFFD).

    Args:
        tokenizer: The tokenizer.
        prompt_ids: Ids that come before the new ones and whose text is not emitted (the prompt), so that the first
            new token gets its leading space right.
        skip_special_tokens: Leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: IdsLike = (), skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = _as_id_list(prompt_ids)
        self._start = 0  # the window starts at a token whose text began a complete piece
        self._done = len(self.ids)  # ids before this one have had their text emitted (or belong to the prompt)

    def step(self, token_id: Union[int, torch.Tensor]) -> str:
        """Append one id; return the text it completes ("" while a character is still incomplete)."""
        self.ids.extend(_as_id_list(token_id))
        return self._emit(final=False)

    def finish(self) -> str:
        """Return the text still held back (an incomplete character at the very end decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._done == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._start : self._done], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self._start :], skip_special_tokens=self.skip_special_tokens)
        if not final and (after.endswith("\ufffd") or len(after) < len(before)):
            return ""  # the last character is still incomplete
        self._start, self._done = self._done, len(self.ids)
        return after[len(before) :]


# ---- helpers -------------------------------------------------------------------------------------------------------
def _load_backend(checkpoint_dir: Path):
    path = checkpoint_dir / "tokenizer.json"
    if path.is_file():
        try:
            return _Backend.from_file(str(path))
        except Exception as error:  # the Rust library raises a plain Exception for every parse error
            raise UserError(
                f"{str(path)!r} is not a valid tokenizer file ({_first_line(error)}). It may be corrupt or cut short: "
                "download the tokenizer again with `litgpt download ORG/NAME --tokenizer_only true`."
            ) from None
    if (checkpoint_dir / "tokenizer.model").is_file():
        return _convert_sentencepiece(checkpoint_dir)
    raise UserError(
        f"{str(checkpoint_dir)!r} has no tokenizer.json (nor a sentencepiece tokenizer.model). Copy the tokenizer "
        "files of the model into it, or fetch them with `litgpt download ORG/NAME --tokenizer_only true`."
    )


def _convert_sentencepiece(checkpoint_dir: Path):
    """A `tokenizers` tokenizer converted from a folder that only has a sentencepiece tokenizer.model."""
    how_to_fix = (
        "Install `transformers`, `sentencepiece` and `protobuf` so that litgpt can convert it, or save a "
        "tokenizer.json there with `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`."
    )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(
            f"{str(checkpoint_dir)!r} only has a sentencepiece tokenizer.model, no tokenizer.json. {how_to_fix}"
        ) from None
    # Older transformers open a `*_file` entry of tokenizer_config.json as written (/etc/..., ../..).
    config_path = checkpoint_dir / "tokenizer_config.json"
    for key, value in _read_json_object(config_path).items():
        if key.endswith("_file") and value is not None:
            inside(checkpoint_dir, value, source=config_path)
    import logging

    transformers_logger = logging.getLogger("transformers")
    level = transformers_logger.level
    transformers_logger.setLevel(logging.ERROR)  # its warnings about fallbacks would repeat what is said below
    try:
        # Never the code a downloaded repo may ship (auto_map): only transformers' own tokenizer classes.
        converted = AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True, trust_remote_code=False)
        backend = converted.backend_tokenizer
    except Exception as error:  # missing sentencepiece/protobuf, unreadable model file, ...
        raise UserError(
            f"Could not convert the sentencepiece tokenizer.model in {str(checkpoint_dir)!r} "
            f"({type(error).__name__}: {_first_line(error)}). {how_to_fix}"
        ) from None
    finally:
        transformers_logger.setLevel(level)
    return backend


def _read_json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{str(path)!r} is not valid JSON ({error}). Download the file again.") from None
    if not isinstance(values, dict):
        raise UserError(f"{str(path)!r} must hold a JSON object. Download the file again.")
    return values


def _token_content(value: Any, path: Path, key: str) -> Optional[str]:
    """A special token as tokenizer files write it: a string, or a dict with "content" (an AddedToken)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise UserError(f"{str(path)!r}: {key} must be a string or an object with \"content\", not {value!r}.")


def _ids_from_generation_config(value: Any, path: Path, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UserError(f"{str(path)!r}: {key} must be a token id or a list of token ids, not {value!r}.")
    return list(values)


def _with_edge(
    template: list[int], token_id: Optional[int], wanted: Optional[bool], at_start: bool, name: str, where: Path
) -> list[int]:
    """The template's ids at one end of the text, with the bos/eos token forced in (True) or out (False)."""
    if wanted is None:
        return list(template)
    has_it = bool(template) and token_id is not None and template[0 if at_start else -1] == token_id
    if wanted:
        if token_id is None:
            raise UserError(f"The tokenizer in {str(where)!r} has no {name} token to add.")
        if has_it:
            return list(template)
        return [token_id] + template if at_start else template + [token_id]
    if has_it:
        return template[1:] if at_start else template[:-1]
    return list(template)


def _as_id_list(ids: IdsLike) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 1:
            raise ValueError(f"Expected a 0-d or 1-d tensor of token ids, got shape {tuple(ids.shape)}.")
        values = ids.tolist()
        return [values] if isinstance(values, int) else values
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_vocab_fits(tokenizer: Tokenizer, config, tokenizer_dir) -> None:
    """Every id the tokenizer can produce must have an embedding row in the model."""
    if tokenizer.vocab_size > config.padded_vocab_size:
        raise UserError(
            f"The tokenizer in {str(tokenizer_dir)!r} has {tokenizer.vocab_size} tokens but the model has only "
            f"{config.padded_vocab_size} embedding rows: use the model's own tokenizer or a config with a larger "
            "vocab_size."
        )
