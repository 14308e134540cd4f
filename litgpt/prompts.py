"""Prompt styles: how a model expects an instruction or a conversation to be laid out as text.

A style turns a user's prompt (or a list of chat messages) into the exact string the model was tuned on, and names
the token sequences that end the model's reply. Styles are looked up by name (`PromptStyle.from_name("llama3")`) or
from a model config (`PromptStyle.from_config(config)`, which reads `config.prompt_style`).

The strings never contain the tokenizer's beginning-of-sequence token: the tokenizer adds it when it encodes the
prompt, so that it is added exactly once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

from litgpt.errors import UserError

if TYPE_CHECKING:
    from litgpt.config import Config

# A chat message: ("user", "Hi") or {"role": "user", "content": "Hi"}.
Message = Union[tuple[str, str], Mapping[str, str]]
ROLES = ("system", "user", "assistant")


def normalize_messages(messages: Iterable[Message]) -> list[tuple[str, str]]:
    """Messages as (role, text) pairs, checking the roles."""
    result = []
    for message in messages:
        if isinstance(message, Mapping):
            role, text = message["role"], message["content"]
        else:
            role, text = message
        if role not in ROLES:
            raise UserError(f"Unknown chat role {role!r}; use one of {', '.join(ROLES)}.")
        result.append((role, text))
    return result


class PromptStyle:
    """The plain style: the prompt is used as it is, and only the tokenizer's end-of-sequence ids stop a reply."""

    name = "default"
    # Whether `apply_messages` lays out a whole conversation (False: it uses the last user message only).
    multi_turn = False

    def apply(self, prompt: str, **kwargs: Any) -> str:
        return prompt

    def apply_messages(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Format a conversation ending with a user message.

        Styles without a chat template have no way to show earlier turns, so they format the last user message.
        """
        pairs = normalize_messages(messages)
        users = [text for role, text in pairs if role == "user"]
        if not users:
            raise UserError("A conversation needs at least one user message.")
        return self.apply(users[-1])

    def stop_tokens(self, tokenizer: Any) -> tuple[list[int], ...]:
        """Token sequences that end a reply: every end-of-sequence id of the tokenizer."""
        return tuple([i] for i in tokenizer_stop_ids(tokenizer))

    # ---- lookup ----------------------------------------------------------------------------------------------------
    @staticmethod
    def from_name(name: str) -> "PromptStyle":
        styles = prompt_styles()
        if name not in styles:
            raise UserError(f"Unknown prompt style {name!r}. Known prompt styles: {', '.join(sorted(styles))}.")
        return styles[name]()

    @staticmethod
    def from_config(config: "Config") -> "PromptStyle":
        return PromptStyle.from_name(config.prompt_style)

    @staticmethod
    def for_finetuning(config: "Config") -> Optional["PromptStyle"]:
        """The style instruction data is laid out in unless the user picks one: a chat model's own; None for a base
        model (style "default", which has no template), so that the data module uses its default, alpaca."""
        return None if config.prompt_style == PromptStyle.name else PromptStyle.from_config(config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def tokenizer_stop_ids(tokenizer: Any) -> list[int]:
    """All end-of-sequence ids of a litgpt Tokenizer (its `stop_ids`, else its `eos_id`)."""
    ids = getattr(tokenizer, "stop_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_id", None)
        ids = [] if eos is None else [eos]
    return [int(i) for i in ids]


def special_token_sequence(tokenizer: Any, text: str) -> list[int]:
    """The ids that `text` (usually one special token such as "<|im_end|>") encodes to, without BOS or EOS."""
    ids = tokenizer.encode(text, bos=False, eos=False)
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


class Alpaca(PromptStyle):
    """The Stanford Alpaca instruction format; `input` adds the optional context section."""

    name = "alpaca"

    def apply(self, prompt: str, *, input: str = "", **kwargs: Any) -> str:
        if input:
            return (
                "Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{prompt}\n\n### Input:\n{input}\n\n### Response:\n"
            )
        return (
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{prompt}\n\n### Response:\n"
        )


class ChatStyle(PromptStyle):
    """A style with a chat template: `apply(prompt, system=...)` is a one-turn conversation.

    Subclasses implement `render(pairs, add_generation_prompt)` over (role, text) pairs and name their end-of-turn
    tokens in `end_of_turn`.
    """

    multi_turn = True
    default_system: Optional[str] = None
    end_of_turn: tuple[str, ...] = ()

    def apply(self, prompt: str, *, system: Optional[str] = None, **kwargs: Any) -> str:
        messages: list[Message] = []
        if system is not None:
            messages.append(("system", system))
        messages.append(("user", prompt))
        return self.apply_messages(messages)

    def apply_messages(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        pairs = normalize_messages(messages)
        if not any(role == "user" for role, _ in pairs):
            raise UserError("A conversation needs at least one user message.")
        if self.default_system is not None and pairs[0][0] != "system":
            pairs.insert(0, ("system", self.default_system))
        return self.render(pairs, add_generation_prompt)

    def render(self, pairs: list[tuple[str, str]], add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def stop_tokens(self, tokenizer: Any) -> tuple[list[int], ...]:
        stops = [[i] for i in tokenizer_stop_ids(tokenizer)]
        for token in self.end_of_turn:
            sequence = special_token_sequence(tokenizer, token)
            if sequence and sequence not in stops:
                stops.append(sequence)
        return tuple(stops)


class ChatML(ChatStyle):
    """<|im_start|>role\\ntext<|im_end|>\\n per message (Qwen, many community models)."""

    name = "chatml"
    end_of_turn = ("<|im_end|>",)

    def render(self, pairs, add_generation_prompt):
        text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in pairs)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Llama3(ChatStyle):
    """Llama 3 headers: <|start_header_id|>role<|end_header_id|>\\n\\ntext<|eot_id|>."""

    name = "llama3"
    end_of_turn = ("<|eot_id|>",)

    def render(self, pairs, add_generation_prompt):
        text = "".join(
            f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>" for role, content in pairs
        )
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")


class Phi3(ChatStyle):
    """<|role|>\\ntext<|end|>\\n per message, the reply opened by <|assistant|>."""

    name = "phi3"
    end_of_turn = ("<|end|>",)

    def render(self, pairs, add_generation_prompt):
        text = "".join(f"<|{role}|>\n{content}<|end|>\n" for role, content in pairs)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


class TinyLlama(ChatStyle):
    """The Zephyr layout TinyLlama-Chat was tuned on: <|role|>\\ntext</s>\\n, with a default system message."""

    name = "tinyllama"
    default_system = "You are a friendly chatbot who always gives helpful, detailed, and polite answers."

    def render(self, pairs, add_generation_prompt):
        text = "".join(f"<|{role}|>\n{content}</s>\n" for role, content in pairs)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


class Harmony(ChatStyle):
    """gpt-oss' harmony format: <|start|>role<|message|>text<|end|> per message, the reply opened by
    <|start|>assistant. A system message is harmony's developer message ("# Instructions"); earlier replies are
    their final channel. The model writes its reasoning (analysis channel) and then its answer, ended by <|return|>
    (or <|call|> for a tool call). Harmony's own system message (model identity, date, reasoning effort) is left
    out: the model then reasons at its default effort."""

    name = "harmony"
    end_of_turn = ("<|return|>", "<|call|>")

    def render(self, pairs, add_generation_prompt):
        parts = []
        for role, content in pairs:
            if role == "system":
                parts.append(f"<|start|>developer<|message|># Instructions\n\n{content}\n\n<|end|>")
            elif role == "assistant":
                parts.append(f"<|start|>assistant<|channel|>final<|message|>{content}<|end|>")
            else:
                parts.append(f"<|start|>{role}<|message|>{content}<|end|>")
        return "".join(parts) + ("<|start|>assistant" if add_generation_prompt else "")


def fold_system(pairs: list[tuple[str, str]], fold) -> list[tuple[str, str]]:
    """For templates without a system role: merge a leading system message into the first user message."""
    if pairs and pairs[0][0] == "system":
        system = pairs[0][1]
        rest = pairs[1:]
        if rest and rest[0][0] == "user":
            return [("user", fold(system, rest[0][1]))] + rest[1:]
        return rest
    return pairs


def check_alternation(pairs: list[tuple[str, str]], style: str) -> None:
    for index, (role, _) in enumerate(pairs):
        expected = "user" if index % 2 == 0 else "assistant"
        if role != expected:
            raise UserError(
                f"The {style} prompt style needs the conversation to alternate user/assistant starting with user "
                f"(after an optional system message); message {index + 1} is {role!r}."
            )


class Llama2(ChatStyle):
    """[INST] ... [/INST] turns; the system message sits in <<SYS>> markers inside the first turn.

    Every turn after the first starts a new sequence, "</s><s>[INST] ...": the tokenizer adds the very first <s>.
    """

    name = "llama2"

    def render(self, pairs, add_generation_prompt):
        pairs = fold_system(pairs, lambda system, user: f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}")
        check_alternation(pairs, self.name)
        parts = []
        for index, (role, content) in enumerate(pairs):
            if role == "user":
                parts.append(("<s>" if index else "") + f"[INST] {content.strip()} [/INST]")
            else:
                parts.append(f" {content.strip()} </s>")
        return "".join(parts)


class Mistral(ChatStyle):
    """[INST] ... [/INST] turns, each reply directly after [/INST] and closed by </s>.

    Mistral's template has no system role; a system message is put before the first instruction.
    """

    name = "mistral"

    def render(self, pairs, add_generation_prompt):
        pairs = fold_system(pairs, lambda system, user: f"{system}\n\n{user}")
        check_alternation(pairs, self.name)
        parts = []
        for role, content in pairs:
            if role == "user":
                parts.append(f"[INST] {content} [/INST]")
            else:
                parts.append(f"{content}</s>")
        return "".join(parts)


class MistralV3(ChatStyle):
    """The layout of Mistral's v3 tokenizer (Mistral 7B Instruct v0.3, Mathstral, Mistral Large 2, Mixtral 8x22B
    Instruct): "[INST] text[/INST]" turns, each reply after a space and closed by </s>. A system message opens the
    last instruction."""

    name = "mistral-v3"

    def render(self, pairs, add_generation_prompt):
        system = pairs[0][1] if pairs[0][0] == "system" else None
        turns = pairs[1:] if system is not None else pairs
        check_alternation(turns, self.name)
        parts = []
        for index, (role, content) in enumerate(turns):
            if role == "user":
                last = index == len(turns) - 1
                text = f"{system}\n\n{content}" if system is not None and last else content
                parts.append(f"[INST] {text}[/INST]")
            else:
                parts.append(f" {content.strip()}</s>")
        return "".join(parts)


class Gemma(ChatStyle):
    """<start_of_turn>user|model\\ntext<end_of_turn>\\n; Gemma has no system role, so it opens the first turn."""

    name = "gemma"
    end_of_turn = ("<end_of_turn>",)

    def render(self, pairs, add_generation_prompt):
        pairs = fold_system(pairs, lambda system, user: f"{system}\n\n{user}")
        check_alternation(pairs, self.name)
        text = "".join(
            f"<start_of_turn>{'model' if role == 'assistant' else 'user'}\n{content.strip()}<end_of_turn>\n"
            for role, content in pairs
        )
        return text + ("<start_of_turn>model\n" if add_generation_prompt else "")


# ---- the layouts of models LitGPT 0.5.13 also names ------------------------------------------------------------
class Qwen25(ChatML):
    """ChatML with the system message Qwen2.5's template adds to a conversation that has none."""

    name = "qwen2.5"
    default_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


class Qwen25Math(ChatML):
    """ChatML with Qwen2.5-Math-Instruct's default system message."""

    name = "qwen2.5-math"
    default_system = "Please reason step by step, and put your final answer within \\boxed{}."


class QwQPreview(ChatML):
    """ChatML with QwQ-32B-Preview's default system message."""

    name = "qwq-preview"
    default_system = (
        "You are a helpful and harmless assistant. You are Qwen developed by Alibaba. You should think step-by-step."
    )


def answer_only(text: str, strip_newlines: bool = True) -> str:
    """A reasoning model's earlier reply as its template shows it again: the text after its thinking (</think>)."""
    answer = text.split("</think>")[-1]
    return answer.lstrip("\n") if strip_newlines else answer


class ChatMLThinking(ChatML):
    """ChatML for reasoning models (QwQ-32B, Qwen3 -Thinking-2507): earlier replies keep only their answer, and the
    new reply opens with <think>."""

    name = "chatml-thinking"

    def render(self, pairs, add_generation_prompt):
        pairs = [(role, answer_only(text) if role == "assistant" else text) for role, text in pairs]
        return super().render(pairs, add_generation_prompt) + ("<think>\n" if add_generation_prompt else "")


class DeepSeekR1(ChatStyle):
    """DeepSeek-R1's layout (and its distilled models'): the system message first, then <｜User｜>text and
    <｜Assistant｜>answer<｜end▁of▁sentence｜> turns (earlier answers without their thinking); the reply opens with
    <think>."""

    name = "deepseek-r1"
    end_of_turn = ("<｜end▁of▁sentence｜>",)

    def render(self, pairs, add_generation_prompt):
        systems = [text for role, text in pairs if role == "system"]
        parts = [systems[-1] if systems else ""]  # the template keeps the last system message
        for role, content in pairs:
            if role == "user":
                parts.append(f"<｜User｜>{content}")
            elif role == "assistant":
                parts.append(f"<｜Assistant｜>{answer_only(content, strip_newlines=False)}<｜end▁of▁sentence｜>")
        return "".join(parts) + ("<｜Assistant｜><think>\n" if add_generation_prompt else "")


class Falcon3(ChatStyle):
    """<|role|>\ntext\n per message; a reply ends with <|endoftext|> (Falcon3's end-of-sequence token)."""

    name = "falcon3"
    end_of_turn = ("<|endoftext|>",)

    def render(self, pairs, add_generation_prompt):
        parts = []
        for index, (role, content) in enumerate(pairs):
            if role == "assistant":
                parts.append(f"<|assistant|>\n{content}<|endoftext|>" + ("\n" if index < len(pairs) - 1 else ""))
            else:
                parts.append(f"<|{role}|>\n{content}\n")
        return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


class Salamandra(ChatML):
    """ChatML with the default system message of Salamandra's template (at its default date)."""

    name = "salamandra"
    default_system = (
        "I am Salamandra, an AI language model developed at the Barcelona Supercomputing Centre (BSC) by the Language "
        "Technologies Unit. My knowledge base was last updated on August 2023. Today Date: 2024-09-30\n"
        "Soy Salamandra, un modelo lingüístico de IA desarrollado en el Barcelona Supercomputing Centre (BSC) por la "
        "Language Technologies Unit. Mi base de conocimientos se actualizó por última vez en agosto de 2023.\n"
        "Soc Salamandra, un model de llenguatge d'IA desenvolupat al Barcelona Supercomputing Centre (BSC) per la "
        "Language Technologies Unit."
    )


class CodeLlama70B(ChatStyle):
    """Code Llama 70B Instruct: "Source: role\\n\\n text <step> " per message, then the reply's header (which its
    template always adds); <step> ends a turn."""

    name = "codellama-70b"
    end_of_turn = ("<step>",)

    def render(self, pairs, add_generation_prompt):
        check_alternation(pairs[1:] if pairs[0][0] == "system" else pairs, self.name)
        text = "".join(f"Source: {role}\n\n {content.strip()} <step> " for role, content in pairs)
        return text + "Source: assistant\nDestination: user\n\n "


class Platypus(PromptStyle):
    """The instruction format Platypus models were tuned on (single turn)."""

    name = "platypus"

    def apply(self, prompt: str, **kwargs: Any) -> str:
        return f"### Instruction:\n\n{prompt}\n\n### Response:\n"


class FreeWilly2(PromptStyle):
    """FreeWilly2's System/User/Assistant sections (single turn), with its model card's system message by default."""

    name = "freewilly2"
    default_system = "This is a system prompt, please behave and help the user."

    def apply(self, prompt: str, *, system: Optional[str] = None, **kwargs: Any) -> str:
        system = self.default_system if system is None else system
        return f"### System:\n{system}\n\n### User:\n{prompt}\n\n### Assistant:\n"


def prompt_styles() -> dict[str, type[PromptStyle]]:
    """Every prompt style by name."""
    styles = (PromptStyle, Alpaca, ChatML, Llama2, Llama3, Mistral, MistralV3, Phi3, Gemma, TinyLlama, Qwen25,
              Qwen25Math, QwQPreview, ChatMLThinking, DeepSeekR1, Falcon3, Salamandra, CodeLlama70B, Platypus,
              FreeWilly2, Harmony)
    return {style.name: style for style in styles}
