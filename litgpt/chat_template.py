"""How a conversation becomes the model's tokens: the checkpoint's own chat template where it has one, else the prompt
style of its config.

`ChatTemplate` is the Jinja template that lays out a list of messages as the model was trained to read them (what
`transformers`' `apply_chat_template`, vLLM and TRL use). It comes from the checkpoint folder, as transformers reads
it: `chat_template.jinja` (and named ones in `additional_chat_templates/`), else the "chat_template" of
tokenizer_config.json (a string, or a list of named templates of which "default" is taken, "tool_use" when tools are
given and there is one). It is rendered with what transformers gives a template: the messages with all their fields
(`tool_calls`, `reasoning_content`, ...), `tools`, `documents`, `add_generation_prompt`, the special tokens' text
(`bos_token`, `eos_token`, ...) and any other keyword (`enable_thinking`, `reasoning_effort`, ...).

A template is a file from someone else, so it runs in Jinja's immutable sandbox with the options and helpers
transformers sets (trim_blocks, lstrip_blocks, loop controls, the `{% generation %}` tag, `raise_exception`,
`strftime_now`, the `tojson` filter, a `dict` and a `namespace` that refuse Python internals): it can read the
messages, never Python's attributes or the file system.

`ChatFormat` is the one entry point `litgpt serve`, `litgpt chat` and the finetuning data use: token ids of a
conversation (`prompt_ids`) and the token sequences that end a reply (`stop_sequences`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from litgpt.errors import UserError
from litgpt.prompts import ROLES, PromptStyle

if TYPE_CHECKING:
    from litgpt.config import Config
    from litgpt.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The special tokens transformers hands a template by name (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The names a message's reasoning comes under; templates read "reasoning_content" (gpt-oss: "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What a template may raise on a conversation it cannot lay out (besides Jinja's own errors).
_RENDER_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError,
                  RecursionError)


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat templates and the special tokens' text they may write.

    Args:
        source: the default template's Jinja text.
        where: the file it came from, for messages ("chat_template.jinja", "tokenizer_config.json").
        special_tokens: `bos_token`, `eos_token`, ... -> their text, as transformers passes them.
        named: the other templates by name ("tool_use", "rag", ...).
    """

    source: str
    where: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    named: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path) -> Optional["ChatTemplate"]:
        """The folder's templates, or None if it has none."""
        folder = Path(checkpoint_dir)
        config = _read_json_object(folder / TOKENIZER_CONFIG)
        templates, where = _read_templates(folder, config)
        if not templates:
            return None
        if "default" not in templates:
            raise UserError(f"{str(folder / where)!r} names chat templates {', '.join(sorted(templates))} but none "
                            "\"default\": name the one to use \"default\".")
        named = {name: text for name, text in templates.items() if name != "default"}
        return cls(templates["default"], where, _special_token_texts(folder, config), named)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Optional[Sequence[Mapping[str, Any]]] = None,
               documents: Optional[Sequence[Mapping[str, Any]]] = None, **template_kwargs: Any) -> str:
        """The text of `messages` (dicts with "role", "content" and any other field); with `add_generation_prompt`,
        followed by what opens the assistant's reply. `tools` (JSON schemas), `documents` and `template_kwargs` are
        passed to the template as transformers passes them."""
        from jinja2 import TemplateError

        source = self.named["tool_use"] if tools is not None and "tool_use" in self.named else self.source
        variables = {**self.special_tokens, **_plain(template_kwargs)}
        try:
            return _compiled(source, self.where).render(
                messages=template_messages(messages), tools=_plain(_checked_tools(tools)),
                documents=_plain(_checked_documents(documents)), add_generation_prompt=add_generation_prompt,
                **variables)
        except (TemplateError,) + _RENDER_ERRORS as error:
            reason = " ".join(str(error).split())  # one line
            raise UserError(f"The chat template of {self.where} cannot lay out this conversation: "
                            f"{type(error).__name__}: {reason}") from None


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as a template sees them: plain dicts of JSON values without the fields set to None (which templates
    handle as absent), the reasoning under each of its names."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("A conversation must be a non-empty list of messages.")
    result = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise UserError(f"Message {index} of the conversation must be an object with \"role\" and \"content\", "
                            f"not {type(message).__name__}.")
        message = {key: value for key, value in _plain(message).items() if value is not None}
        reasoning = next((message[name] for name in REASONING_FIELDS if name in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        result.append(message)
    return result


def _checked_tools(tools: Any) -> Optional[list]:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in tools):
        raise UserError("Tools must be a list of JSON schemas (objects such as {\"type\": \"function\", "
                        "\"function\": {\"name\", \"description\", \"parameters\"}}).")
    return list(tools)


def _checked_documents(documents: Any) -> Optional[list]:
    if documents is None:
        return None
    if not isinstance(documents, (list, tuple)) or not all(isinstance(item, Mapping) for item in documents):
        raise UserError("Documents must be a list of objects (e.g. with \"title\" and \"text\").")
    return list(documents)


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types: a template then sees no object with methods of its own (a str or dict
    subclass, a dataclass, a pydantic model), and anything else only as "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


# ---- reading the folder ---------------------------------------------------------------------------------------------
def _read_json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{str(path)!r} is not valid JSON ({error}).") from None
    if not isinstance(values, dict):
        raise UserError(f"{str(path)!r} must hold a JSON object.")
    return values


def _read_templates(folder: Path, config: dict) -> tuple[dict[str, str], str]:
    """name -> template text, and the file they come from: the .jinja files (which transformers prefers), else
    tokenizer_config.json's "chat_template"."""
    templates = {}
    if (folder / TEMPLATE_FILE).is_file():
        templates["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATE_DIR).is_dir():
        for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name[: -len(".jinja")]] = path.read_text(encoding="utf-8")
    if templates:
        return templates, TEMPLATE_FILE if "default" in templates else TEMPLATE_DIR
    template = config.get("chat_template")
    if template is None:
        return {}, TOKENIZER_CONFIG
    if isinstance(template, str):
        return {"default": template}, TOKENIZER_CONFIG
    if isinstance(template, list) and all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                          and isinstance(item.get("template"), str) for item in template):
        return {item["name"]: item["template"] for item in template}, TOKENIZER_CONFIG
    raise UserError(f"{str(folder / TOKENIZER_CONFIG)!r}: \"chat_template\" must be a string or a list of "
                    "{\"name\", \"template\"} objects.")


def _special_token_texts(folder: Path, config: dict) -> dict[str, str]:
    """The special tokens' text as transformers loads them: tokenizer_config.json's, overridden by
    special_tokens_map.json's where the config does not list its added tokens (transformers 5 reads the map only
    then)."""
    values = {name: config[name] for name in SPECIAL_TOKEN_NAMES if name in config}
    if "added_tokens_decoder" not in config:
        special_map = _read_json_object(folder / SPECIAL_TOKENS_MAP)
        values.update({name: special_map[name] for name in SPECIAL_TOKEN_NAMES if name in special_map})
    texts = {}
    for name, value in values.items():
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            texts[name] = value
    return texts


# ---- the sandbox ----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _compile_source(source: str):
    return _environment().from_string(source)


def _compiled(source: str, where: str):
    from jinja2 import TemplateError

    try:
        return _compile_source(source)
    except TemplateError as error:
        raise UserError(f"The chat template of {where} is not a valid Jinja template: {error}") from None


@lru_cache(maxsize=1)
def _environment():
    """Jinja's immutable sandbox set up as transformers sets it up for chat templates."""
    from jinja2 import TemplateError, ext, nodes, utils
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks what the assistant wrote (for transformers' assistant
        masks); the body renders as it is."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    def refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"A chat template may not set {name!r} on a namespace (names starting with _ "
                                "are refused).")

    class SafeNamespace(utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: B902 (the signature of Namespace, which takes a `self` keyword too)
            values = dict(*args[1:], **kwargs)
            for name in values:
                refuse_private(name)
            utils.Namespace.__init__(args[0], values)

        def __setitem__(self, name, value):
            refuse_private(name)
            utils.Namespace.__setitem__(self, name, value)

    class SafeDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself (whose attributes lead to Python's
        internals)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which no model was trained on.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationTag, ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, dict=SafeDict(), namespace=SafeNamespace,
                               strftime_now=lambda format: datetime.now().strftime(format))
    return environment


# ---- the entry point ------------------------------------------------------------------------------------------------
class ChatFormat:
    """A checkpoint's way of laying out conversations: its chat template when the folder has one, else the prompt
    style of its config (LitGPT's folders have no template).

    Args:
        tokenizer: the checkpoint's tokenizer.
        style: the config's prompt style; with a template, its end-of-turn tokens still end replies.
        template: the folder's chat template, or None.
    """

    def __init__(self, tokenizer: "Tokenizer", style: PromptStyle, template: Optional[ChatTemplate] = None) -> None:
        self.tokenizer, self.style, self.template = tokenizer, style, template

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path, tokenizer: "Tokenizer",
                        config: Optional["Config"]) -> "ChatFormat":
        style = PromptStyle.from_config(config) if config is not None else PromptStyle()
        return cls(tokenizer, style, ChatTemplate.from_checkpoint(checkpoint_dir))

    @property
    def description(self) -> str:
        """What lays the conversation out, for messages: "the chat template of tokenizer_config.json" or
        "prompt style 'chatml'"."""
        if self.template is not None:
            return f"the chat template of {self.template.where}"
        return f"prompt style {self.style.name!r}"

    @property
    def multi_turn(self) -> bool:
        """Whether earlier turns are shown to the model (a template always can; some prompt styles cannot)."""
        return self.template is not None or self.style.multi_turn

    def prompt_text(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Optional[Sequence[Mapping[str, Any]]] = None, **template_kwargs: Any) -> str:
        """The text of the conversation, as the template or the prompt style writes it."""
        if self.template is not None:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        **template_kwargs)
        if tools is not None:
            folder = getattr(self.tokenizer, "checkpoint_dir", None)
            raise UserError(f"The checkpoint{'' if folder is None else ' ' + repr(str(folder))} has no chat template, "
                            f"so it cannot be given tools (its {self.description} has no place for them): add the "
                            f"model's {TEMPLATE_FILE} to the folder, or leave the tools out.")
        return self.style.apply_messages(style_pairs(messages), add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                   tools: Optional[Sequence[Mapping[str, Any]]] = None, **template_kwargs: Any) -> list[int]:
        """Token ids of the conversation: a template's text tokenized as `apply_chat_template(tokenize=True)` does
        (nothing added, since the template writes its BOS; special tokens' text becomes their ids), a prompt style's
        text as the tokenizer encodes a prompt (with its BOS)."""
        text = self.prompt_text(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                **template_kwargs)
        if self.template is not None:
            return encode_rendered(self.tokenizer, text)
        ids = self.tokenizer.encode(text)
        return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]

    def stop_sequences(self) -> list[list[int]]:
        """Token sequences that end a reply: every end-of-sequence id of the tokenizer and the prompt style's
        end-of-turn tokens (a chat model's config names its style also when its folder has a template)."""
        stops: list[list[int]] = []
        for sequence in self.style.stop_tokens(self.tokenizer):
            sequence = [int(i) for i in sequence]
            if sequence and sequence not in stops:
                stops.append(sequence)
        return stops

    def __repr__(self) -> str:
        return f"ChatFormat({self.description})"


def style_pairs(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(role, text) pairs of messages for a prompt style, which knows only text messages of the roles in ROLES."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("A conversation must be a non-empty list of messages.")
    pairs = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise UserError(f"Message {index} of the conversation must be an object with \"role\" and \"content\".")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise UserError(f"Message {index} has role {role!r}: without a chat template the checkpoint knows only "
                            f"the roles {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise UserError(f"Message {index}: without a chat template the checkpoint lays out only text content "
                            f"(a string), not {type(content).__name__}.")
        pairs.append((role, content))
    return pairs


def encode_rendered(tokenizer: "Tokenizer", text: str) -> list[int]:
    """The ids of a template's text as transformers tokenizes it: nothing added around it."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    ids = tokenizer.encode(text, bos=False, eos=False)
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


def encode_rendered_with_offsets(tokenizer: "Tokenizer", text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode_rendered` with each token's (start, end) character span in `text`."""
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    return list(encoding.ids), [tuple(span) for span in encoding.offsets]
