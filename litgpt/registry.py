"""Extensions found by name, never imported by the core: `--compiler NAME` looks NAME up among the Python entry
points of the group `litgpt.compilers` (this project registers `thunder`, see pyproject.toml; another package can
register its own). The entry point is a function that takes the command's arguments and runs it."""

from __future__ import annotations

from typing import Callable

from litgpt.errors import UserError

COMPILER_GROUP = "litgpt.compilers"


def load_compiler(name: str) -> Callable:
    """The entry point that runs `litgpt pretrain` with the compiler `name`."""
    from importlib.metadata import entry_points

    found = [point for point in entry_points(group=COMPILER_GROUP) if point.name == name]
    if not found:
        raise UserError(
            f"--compiler {name} needs an extension that is not installed (no {COMPILER_GROUP!r} entry point named "
            f"{name!r}): install it with `pip install 'litgpt[{name}]'` (from a checkout: pip install -e '.[{name}]')."
        )
    return found[0].load()
