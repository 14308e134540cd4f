"""A checkpoint's own chat template: the Jinja template that lays out a list of messages as the model was trained to
read them (what `transformers`' `apply_chat_template`, vLLM and TRL use).

It comes from the checkpoint folder: `chat_template.jinja`, else the "chat_template" of tokenizer_config.json (a
string, or a list of named templates of which "default" is taken). A template is a file from someone else, so it is
rendered in Jinja's immutable sandbox: it can read the messages and call the few helpers templates expect
(`raise_exception`, `strftime_now`, the `tojson` filter), never Python's attributes or the file system.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from litgpt.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens' text it may write (`bos_token`, `eos_token`).

    Args:
        source: the Jinja text.
        where: the file it came from, for error messages.
        bos_token, eos_token: the text of the tokenizer's BOS and EOS tokens ("" where it has none).
    """

    source: str
    where: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path, bos_token: str = "",
                        eos_token: str = "") -> Optional["ChatTemplate"]:
        """The folder's template (chat_template.jinja first, then tokenizer_config.json), or None if it has none."""
        folder = Path(checkpoint_dir)
        if (folder / TEMPLATE_FILE).is_file():
            return cls((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE), bos_token,
                       eos_token)
        config_path = folder / TOKENIZER_CONFIG
        if not config_path.is_file():
            return None
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise UserError(f"{str(config_path)!r} is not valid JSON ({error}).") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
            template = named.get("default")
        if template is None:
            return None
        if not isinstance(template, str):
            raise UserError(f"{str(config_path)!r}: \"chat_template\" must be a string or a list of named templates.")
        return cls(template, f"{str(config_path)!r} (chat_template)", bos_token, eos_token)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of `messages` ({"role", "content"} dicts); with `add_generation_prompt`, followed by what opens
        the assistant's reply."""
        from jinja2 import TemplateError

        try:
            return self._compiled().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as error:
            raise UserError(f"The chat template of {self.where} failed on a conversation: {error}") from None

    def _compiled(self):
        compiled = _COMPILED.get(self.source)
        if compiled is None:
            compiled = _COMPILED[self.source] = _compile(self.source, self.where)
        return compiled


_COMPILED: dict[str, Any] = {}


def _compile(source: str, where: str):
    """The template compiled in an immutable sandbox, with the helpers Hugging Face templates call."""
    from jinja2 import TemplateError, ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(source)
    except TemplateError as error:
        raise UserError(f"The chat template of {where} is not a valid Jinja template: {error}") from None
