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

    registered = {point.name: point for point in entry_points(group=COMPILER_GROUP)}
    if name not in registered:
        known = ", ".join(["auto", "none", "torch", *sorted(registered)])
        raise UserError(
            f"--compiler {name} is not one of {known}, and no installed extension registers it (an entry point "
            f"{name!r} in the group {COMPILER_GROUP!r}): install the one that does, e.g. `pip install "
            f"'litgpt[{name}]'` (from a checkout: pip install -e '.[{name}]')."
        )
    try:
        return registered[name].load()
    except ImportError as error:
        raise UserError(f"--compiler {name}: its extension ({registered[name].value}) cannot be imported: {error}. "
                        f"Reinstall it, e.g. `pip install -e '.[{name}]'`.") from None
