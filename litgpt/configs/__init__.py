"""The registry of named model configs: one module per family, each a list of `Config` keyword dicts.

Every value is taken from the published Hugging Face `config.json` of the model (`hf_config` names the repo).
A family module lists the values its sizes share once and stamps out the sizes with `variants`; chat/instruct
twins of a base model come from `tuned`. A module may also map LitGPT 0.5.13's spelling of a name it registers
under another spelling (LitGPT's "Gemma-2-2b" for "gemma-2-2b") in `LITGPT_NAMES`; both spellings resolve.
"""

from __future__ import annotations

import copy
import importlib
from functools import lru_cache
from typing import Callable, Iterable, Union

FAMILIES = ("pythia", "llama", "mistral", "qwen", "phi", "gemma", "smollm", "falcon", "stablelm", "phi_legacy", "olmo1", "gpt_oss", "olmo2", "glm", "deepseek")
FAMILIES += ("llama_community", "falcon3", "salamandra")  # the rest of LitGPT 0.5.13's names


def variants(org: str, common: dict, *sizes: dict) -> list[dict]:
    """One config per entry of `sizes`: the family's `common` values overlaid with the size's own.

    `hf_config` defaults to the repo `org/name`; a size may set `hf_config` itself when the names differ.
    """
    out = []
    for size in sizes:
        values = {**copy.deepcopy(common), **copy.deepcopy(size)}
        values.setdefault("hf_config", {"org": org, "name": values["name"]})
        out.append(values)
    return out


def tuned(
    configs: Iterable[dict], rename: Union[str, Callable[[str], str]], prompt_style: str, **changes
) -> list[dict]:
    """The fine-tuned twins of `configs`: same architecture, a chat prompt style, and name and repo name changed
    by `rename` (a suffix to append, or a function of the name)."""
    if isinstance(rename, str):
        suffix = rename
        rename = lambda name: name + suffix  # noqa: E731
    out = []
    for base in configs:
        values = {**copy.deepcopy(base), **copy.deepcopy(changes), "prompt_style": prompt_style}
        values["name"] = rename(base["name"])
        values["hf_config"] = {**base["hf_config"], "name": rename(base["hf_config"]["name"])}
        out.append(values)
    return out


@lru_cache(maxsize=None)
def _registry() -> dict[str, dict]:
    registry: dict[str, dict] = {}
    for family in FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
        for values in module.CONFIGS:
            name = values["name"]
            if name in registry:
                raise RuntimeError(f"Model config {name!r} is registered twice (second time in {module.__name__}).")
            registry[name] = values
    return registry


@lru_cache(maxsize=None)
def _litgpt_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for family in FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
        names.update(getattr(module, "LITGPT_NAMES", {}))
    return names


def configs_by_name() -> dict[str, dict]:
    """Every registered model: name -> the keyword arguments of `litgpt.config.Config` (a fresh copy per call)."""
    return copy.deepcopy(_registry())


def litgpt_names() -> dict[str, str]:
    """LitGPT 0.5.13's spelling of a registered model whose name here differs -> the name here."""
    return dict(_litgpt_names())


def canonical_name(name: str) -> str:
    """The registered name for `name` given in LitGPT's spelling; any other name as it is."""
    return _litgpt_names().get(name, name)


def configs_by_family() -> list[tuple[str, list[str]]]:
    """(title, registered names) per family module, the title being the first sentence of its docstring (up to the
    address of the hub organization)."""
    out = []
    for family in FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
        first_paragraph = (module.__doc__ or family).strip().split("\n\n")[0]
        title = " ".join(first_paragraph.split()).split(": http")[0].rstrip(".")
        out.append((title, [values["name"] for values in module.CONFIGS]))
    return out
