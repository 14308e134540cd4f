"""litgpt.tokenizer.Tokenizer against transformers.AutoTokenizer on small tokenizers trained for the test."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch

from litgpt.errors import UserError
from litgpt.tokenizer import IncrementalDecoder, Tokenizer
from tokenizer_helpers import STYLES, make_tokenizer_folder

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    " leading space",
    "trailing spaces  ",
    "  multiple   inner    spaces ",
    "tabs\tand\nnewlines\n\n\r\nmixed \t \n ",
    "emoji 🤗🚀👍🏽 and a family 👨‍👩‍👧",
    "CJK 東京 中文 한국어, Ελληνικά, русский, עברית, العربية",
    "accents: café naïve Über façade",
    "decomposed e\u0301 and ligature ﬁ",
    "code: def f(x):\n    return x ** 2  # square",
    "numbers 3.14159 1,000,000 2024-01-01 0x1F",
    "<s>literal</s> special <unk> tokens",
    "<|endoftext|>chatml<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "zero\u200bwidth\x00nul and \ufffd replacement",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: make_tokenizer_folder(root / style, style) for style in STYLES}


@pytest.fixture(scope="module")
def hf_tokenizers(folders):
    import transformers
    return {style: transformers.AutoTokenizer.from_pretrained(folder) for style, folder in folders.items()}


def _copy_folder(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def _edit_json(path: Path, **changes) -> None:
    values = json.loads(path.read_text())
    values.update(changes)
    path.write_text(json.dumps(values))


# ---- the helper ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_helper_writes_a_hugging_face_folder(tmp_path, style):
    from tokenizer_helpers import _files

    _files.cache_clear()
    folder = make_tokenizer_folder(tmp_path / "tok", style)
    # The tokenizer is trained once per style and kept in memory: a second folder only writes the same files.
    assert (_files.cache_info().hits, _files.cache_info().misses) == (0, 1)
    again = make_tokenizer_folder(tmp_path / "again", style)
    assert (_files.cache_info().hits, _files.cache_info().misses) == (1, 1)
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in folder.iterdir()}
    names = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"} <= names
    assert 300 <= Tokenizer(folder).vocab_size <= 1000
    with pytest.raises(ValueError, match="llama"):
        make_tokenizer_folder(tmp_path / "other", "bert")


# ---- parity with transformers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_encode_decode_match_transformers(folders, hf_tokenizers, style):
    tokenizer, hf = Tokenizer(folders[style]), hf_tokenizers[style]
    assert tokenizer.vocab_size == len(hf)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert ids.tolist() == hf.encode(text), text
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids.tolist(), skip_special_tokens=skip)
        plain = tokenizer.encode(text, bos=False, eos=False).tolist()
        assert tokenizer.decode(plain) == hf.decode(plain)


@pytest.mark.parametrize("style", STYLES)
def test_special_ids_match_transformers(folders, hf_tokenizers, style):
    tokenizer, hf = Tokenizer(folders[style]), hf_tokenizers[style]
    assert tokenizer.bos_id == hf.bos_token_id
    assert tokenizer.eos_id == hf.eos_token_id
    for token in ("<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        if token in hf.get_vocab():
            assert tokenizer.token_to_id(token) == hf.convert_tokens_to_ids(token)
            assert tokenizer.id_to_token(tokenizer.token_to_id(token)) == token


@pytest.mark.parametrize("style", STYLES)
def test_split_special_tokens_matches_transformers(tmp_path, folders, style):
    import transformers
    folder = _copy_folder(folders[style], tmp_path / style)
    _edit_json(folder / "tokenizer_config.json", split_special_tokens=True)
    tokenizer, hf = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS[-3:]:
        assert tokenizer.encode(text).tolist() == hf.encode(text)


@pytest.mark.parametrize("style", STYLES)
def test_template_wins_over_the_add_flags_as_in_transformers(tmp_path, folders, style):
    import transformers
    folder = _copy_folder(folders[style], tmp_path / style)
    _edit_json(folder / "tokenizer_config.json", add_bos_token=True, add_eos_token=True)
    tokenizer, hf = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in ("Hello world", ""):
        assert tokenizer.encode(text).tolist() == hf.encode(text)


# ---- round trips ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_decode_round_trips(folders, style):
    tokenizer = Tokenizer(folders[style])
    for text in TEXTS:
        decoded = tokenizer.decode(tokenizer.encode(text, bos=False))
        if style == "llama":
            # The sentencepiece convention: one space is put in front of the text and taken off again, so a text
            # that starts with spaces comes back with one less (as with transformers and sentencepiece).
            expected = text[1:] if text.startswith(" ") else text
        else:
            expected = unicodedata.normalize("NFC", text)  # byte-level tokenizers normalize to NFC first
        assert decoded == expected, text


@pytest.mark.parametrize("style", STYLES)
def test_decode_accepts_tensors_lists_and_ints(folders, style):
    tokenizer = Tokenizer(folders[style])
    ids = tokenizer.encode("Hello world", bos=False)
    assert tokenizer.decode(ids) == tokenizer.decode(ids.tolist()) == "Hello world"
    assert tokenizer.decode(ids[0]) == tokenizer.decode(int(ids[0])) == tokenizer.decode(ids[:1])
    assert tokenizer.decode(ids.to(torch.int32)) == "Hello world"
    assert tokenizer.decode([]) == ""
    with pytest.raises(ValueError, match="1-d"):
        tokenizer.decode(ids.view(1, -1))


# ---- bos / eos / stop ids ------------------------------------------------------------------------------------------
def test_llama_style_adds_bos_by_default(folders):
    tokenizer = Tokenizer(folders["llama"])
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.stop_ids) == (bos, eos, (eos,))
    ids = tokenizer.encode("Hello").tolist()
    assert ids[0] == bos and ids[-1] != eos
    assert tokenizer.encode("Hello", bos=True).tolist() == ids
    assert tokenizer.encode("Hello", bos=False).tolist() == ids[1:]
    assert tokenizer.encode("Hello", eos=True).tolist() == ids + [eos]
    assert tokenizer.encode("", bos=False).tolist() == []
    assert tokenizer.encode("").tolist() == [bos]


def test_gpt2_style_adds_nothing(folders):
    tokenizer = Tokenizer(folders["gpt2"])
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.stop_ids) == (endoftext, endoftext, (endoftext,))
    ids = tokenizer.encode("Hello").tolist()
    assert endoftext not in ids
    assert tokenizer.encode("Hello", bos=True).tolist() == [endoftext] + ids
    assert tokenizer.encode("Hello", bos=True, eos=True).tolist() == [endoftext] + ids + [endoftext]
    assert tokenizer.encode("").tolist() == []


def test_chatml_style_stops_on_every_eos_id(folders):
    tokenizer = Tokenizer(folders["chatml"])
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.bos_id is None
    assert tokenizer.eos_id == im_end
    assert tokenizer.stop_ids == (im_end, endoftext)
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").tolist()[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.encode("hi", bos=False).tolist() == tokenizer.encode("hi").tolist()
    with pytest.raises(UserError, match="no BOS token"):
        tokenizer.encode("hi", bos=True)
    with pytest.raises(UserError, match="not in the vocabulary"):
        tokenizer.token_to_id("<|eot_id|>")


def test_generation_config_eos_ids_and_string_tokens(tmp_path, folders):
    folder = _copy_folder(folders["gpt2"], tmp_path / "tok")
    _edit_json(folder / "tokenizer_config.json", eos_token={"content": "<|padding|>", "special": True})
    _edit_json(folder / "generation_config.json", eos_token_id=[0, 1, 0])
    tokenizer = Tokenizer(folder)
    assert tokenizer.eos_id == 1
    assert tokenizer.stop_ids == (1, 0)
    # Without any tokenizer file naming them, the ids of generation_config.json are used.
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink()
    _edit_json(folder / "generation_config.json", bos_token_id=1, eos_token_id=0)
    tokenizer = Tokenizer(folder)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.stop_ids) == (1, 0, (0,))


def test_add_flags_apply_when_tokenizer_json_has_no_post_processor(tmp_path, folders):
    folder = _copy_folder(folders["llama"], tmp_path / "tok")
    _edit_json(folder / "tokenizer.json", post_processor=None)
    tokenizer = Tokenizer(folder)
    assert tokenizer.encode("Hello").tolist()[0] == tokenizer.bos_id
    _edit_json(folder / "tokenizer_config.json", add_bos_token=False, add_eos_token=True)
    tokenizer = Tokenizer(folder)
    ids = tokenizer.encode("Hello").tolist()
    assert ids[0] != tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.encode("Hello", eos=False).tolist() == ids[:-1]


def test_max_length_truncates(folders):
    tokenizer = Tokenizer(folders["llama"])
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert len(ids) > 5
    assert tokenizer.encode("The quick brown fox jumps over the lazy dog.", max_length=5).tolist() == ids[:5].tolist()
    assert tokenizer.encode("The quick brown fox", max_length=0).tolist() == []


def test_truncation_and_padding_saved_in_tokenizer_json_are_ignored(tmp_path, folders):
    folder = _copy_folder(folders["gpt2"], tmp_path / "tok")
    _edit_json(
        folder / "tokenizer.json",
        truncation={"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
        padding={"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 1,
                 "pad_type_id": 0, "pad_token": "<|padding|>"},
    )
    assert Tokenizer(folder).encode("Hello world").tolist() == Tokenizer(folders["gpt2"]).encode("Hello world").tolist()


# ---- streaming -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_incremental_decoder_reproduces_the_full_decode(folders, style):
    tokenizer = Tokenizer(folders[style])
    text = "Grüße 🤗🚀 東京 and 한국어 👨‍👩‍👧 done."
    ids = tokenizer.encode(text).tolist()
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.step(token_id) for token_id in ids] + [decoder.finish()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)
    assert "" in pieces  # some tokens only carry part of a character and wait for the rest
    # Decoding token by token would break those characters.
    assert "".join(tokenizer.decode([token_id]) for token_id in ids) != tokenizer.decode(ids)
    assert "".join(tokenizer.decode_stream(torch.tensor(ids))) == tokenizer.decode(ids)


@pytest.mark.parametrize("style", STYLES)
def test_incremental_decoder_after_a_prompt_keeps_the_leading_space(folders, style):
    tokenizer = Tokenizer(folders[style])
    prompt = tokenizer.encode("Hello")
    generated = tokenizer.encode(" world, 東京 🤗", bos=False)
    pieces = list(tokenizer.decode_stream(generated, prompt_ids=prompt, skip_special_tokens=True))
    assert "".join(pieces) == " world, 東京 🤗"
    assert pieces[0].startswith(" ")


def test_incremental_decoder_flushes_an_incomplete_character(folders):
    tokenizer = Tokenizer(folders["llama"])
    emoji_bytes = tokenizer.encode("🤗", bos=False).tolist()[-4:]
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.step(token_id) for token_id in emoji_bytes[:2]] == ["", ""]
    assert decoder.finish() == tokenizer.decode(emoji_bytes[:2])
    assert decoder.finish() == ""


# ---- bad input -----------------------------------------------------------------------------------------------------
def test_missing_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Tokenizer(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        Tokenizer(tmp_path / "file")


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"no tokenizer\.json.*litgpt download") as error:
        Tokenizer(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_malformed_tokenizer_json(tmp_path, folders):
    folder = _copy_folder(folders["llama"], tmp_path / "tok")
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text()[:500])
    with pytest.raises(UserError, match=r"tokenizer\.json.*not a valid tokenizer file.*download"):
        Tokenizer(folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(UserError, match="not a valid tokenizer file"):
        Tokenizer(folder)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "special_tokens_map.json"])
def test_malformed_config_files(tmp_path, folders, name):
    folder = _copy_folder(folders["chatml"], tmp_path / "tok")
    (folder / name).write_text("{oops")
    with pytest.raises(UserError, match=f"{name}.*not valid JSON"):
        Tokenizer(folder)
    (folder / name).write_text("[1, 2]")
    with pytest.raises(UserError, match="JSON object"):
        Tokenizer(folder)


def test_wrongly_typed_special_tokens(tmp_path, folders):
    folder = _copy_folder(folders["chatml"], tmp_path / "tok")
    _edit_json(folder / "generation_config.json", eos_token_id="<|im_end|>")
    with pytest.raises(UserError, match="eos_token_id must be a token id"):
        Tokenizer(folder)
    folder = _copy_folder(folders["chatml"], tmp_path / "tok2")
    _edit_json(folder / "tokenizer_config.json", eos_token=7)
    with pytest.raises(UserError, match="eos_token must be a string"):
        Tokenizer(folder)


def test_sentencepiece_only_folder_that_cannot_be_converted(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(UserError, match=r"sentencepiece tokenizer\.model.*tokenizer\.json"):
        Tokenizer(tmp_path)


def test_encode_rejects_non_strings(folders):
    with pytest.raises(TypeError, match="str"):
        Tokenizer(folders["gpt2"]).encode([1, 2])
