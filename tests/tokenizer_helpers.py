"""Small tokenizers trained on the spot, saved as real Hugging Face tokenizer folders (no download).

`make_tokenizer_folder(path, style)` writes tokenizer.json, tokenizer_config.json, special_tokens_map.json and
generation_config.json laid out as the published repos of three tokenizer families have them:

- "llama":  sentencepiece-like byte-fallback BPE (Metaspace "▁" words, <0x..> byte tokens), `<unk>`/`<s>`/`</s>`,
            BOS added by a TemplateProcessing post-processor and `add_bos_token: true` (Llama 2, Mistral).
- "gpt2":   byte-level BPE with `<|endoftext|>` as bos, eos and unk, nothing added around the text (Pythia / GPT-NeoX).
- "chatml": byte-level BPE split by a regex, special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, eos
            `<|im_end|>` and two eos ids in generation_config.json (Qwen2).

Each vocabulary has a few hundred entries; the trained tokenizer is kept in memory so that later calls only write files.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

STYLES = ("llama", "gpt2", "chatml")

# A few paragraphs of varied text: prose, code, numbers, punctuation, accents, a little of other scripts.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog did not mind; it was asleep in the warm afternoon sun, "
    "dreaming of the long walks it would take tomorrow along the river.",
    "Language models read text as a sequence of tokens. A tokenizer splits the text into pieces that are common "
    "enough to have their own entry in the vocabulary, and falls back to smaller pieces for rare words.",
    "def train(model, data, steps=1000):\n    for step in range(steps):\n        loss = model(data[step])\n"
    "        loss.backward()\n    return model\n",
    "In 2023 the team trained 7 models with 1.5, 3, 7 and 13 billion parameters for 300,000 steps at a learning "
    "rate of 3e-4. Results: 81.2% on the first benchmark, 64.0% on the second!",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Café, naïve, résumé and façade keep their accents; "
    "l'été dernier, nous sommes allés à la mer.",
    "Questions? Answers! Lists: apples, pears, plums. Quotes \"like this\" and 'like that' -- and (parentheses) "
    "[brackets] {braces} <angles> #hash @at $dollar & ampersand * star / slash \\ backslash | pipe ~ tilde "
    "^ caret",
    "\tIndented with a tab\n\n  two spaces\n    four spaces\nThe end of the line.\r\nWindows line end.",
    "東京は日本の首都です。中文文本也在这里。 Ελληνικά και русский текст тоже.",
]

# The pre-tokenization pattern of Qwen2's tokenizer.json (and of transformers' Qwen2Tokenizer), which splits off
# English contractions, runs of letters with at most one leading non-letter, single digits, punctuation runs and
# whitespace; it must be this exact pattern for transformers to tokenize the folder as it is written.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer_folder(path: Path, style: str) -> Path:
    """Write a tokenizer of the given style ("llama", "gpt2" or "chatml") into `path` (created if needed)."""
    if style not in STYLES:
        raise ValueError(f"Unknown tokenizer style {style!r}; choose one of {', '.join(STYLES)}.")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name, text in _files(style):
        (path / name).write_text(text, encoding="utf-8")
    return path


@lru_cache(maxsize=None)
def _files(style: str) -> tuple[tuple[str, str], ...]:
    tokenizer, tokenizer_config, special_tokens_map, generation_config = {
        "llama": _llama,
        "gpt2": _gpt2,
        "chatml": _chatml,
    }[style]()
    tokenizer_config["added_tokens_decoder"] = {
        str(index): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for index, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    generation_config["transformers_version"] = "4.45.0"
    return (
        ("tokenizer.json", tokenizer.to_str(pretty=True)),
        ("tokenizer_config.json", _dump(tokenizer_config)),
        ("special_tokens_map.json", _dump(special_tokens_map)),
        ("generation_config.json", _dump(generation_config)),
    )


def _dump(values: dict) -> str:
    return json.dumps(values, indent=2, ensure_ascii=False) + "\n"


def _token_dict(content: str, typed: bool = False) -> dict:
    """A special token spelled out as sentencepiece repos do: tokenizer_config.json tags it `"__type": "AddedToken"`,
    special_tokens_map.json does not."""
    values = {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"__type": "AddedToken", **values} if typed else values


def _llama():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # Train on words ("▁the", "▁quick", ...); the saved tokenizer then treats the whole text as one piece, as the
    # sentencepiece conversion does, so merges never cross a word start.
    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=330, show_progress=False, special_tokens=[])
    trainer_tokenizer.train_from_iterator(CORPUS, trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    vocab: dict[str, int] = {}
    for token in specials + byte_tokens + sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in trained["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])

    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": _token_dict("<s>", typed=True),
        "clean_up_tokenization_spaces": False,
        "eos_token": _token_dict("</s>", typed=True),
        "legacy": False,
        "model_max_length": 4096,
        "pad_token": None,
        "padding_side": "left",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": _token_dict("<unk>", typed=True),
        "use_default_system_prompt": False,
    }
    special_tokens_map = {
        "bos_token": _token_dict("<s>"),
        "eos_token": _token_dict("</s>"),
        "unk_token": _token_dict("<unk>"),
    }
    generation_config = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": 0}
    return tokenizer, tokenizer_config, special_tokens_map, generation_config


def _byte_level_trainer(vocab_size: int, special_tokens: list[str]):
    from tokenizers import pre_tokenizers, trainers

    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )


def _gpt2():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    # Pythia numbers its two special tokens first: <|endoftext|> = 0, <|padding|> = 1.
    tokenizer.train_from_iterator(CORPUS, _byte_level_trainer(480, ["<|endoftext|>", "<|padding|>"]))

    eos = "<|endoftext|>"
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": eos,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "model_max_length": 2048,
        "pad_token": None,
        "tokenizer_class": "GPTNeoXTokenizer",
        "unk_token": eos,
    }
    special_tokens_map = {"bos_token": eos, "eos_token": eos, "unk_token": eos}
    eos_id = tokenizer.token_to_id(eos)
    generation_config = {"_from_model_config": True, "bos_token_id": eos_id, "eos_token_id": eos_id}
    return tokenizer, tokenizer_config, special_tokens_map, generation_config


def _chatml():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.train_from_iterator(CORPUS, _byte_level_trainer(500, []))
    # Qwen's special tokens follow the byte-level vocabulary.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])

    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": _token_dict("<|im_end|>"),
        "pad_token": _token_dict("<|endoftext|>"),
    }
    endoftext, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    generation_config = {
        "bos_token_id": endoftext,
        "do_sample": True,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        "temperature": 0.7,
        "top_p": 0.8,
    }
    return tokenizer, tokenizer_config, special_tokens_map, generation_config
