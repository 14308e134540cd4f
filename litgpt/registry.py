"""The interface of compiler and strategy extensions, and finding them by name; the core never imports one.

`--compiler NAME` on any training command looks NAME up among the Python entry points of the group
`litgpt.compilers` (this project registers `thunder`, see pyproject.toml; another package can register its own). The
entry point is a `CompilerExtension`: a class (or factory) whose instance checks the job the core built and gives the
Fabric strategy that runs it. That strategy is an `ExtensionStrategy`: it brings its own checkpoint IO, says whether
the loss must run on whole logits, and gives the text sample an eager model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from litgpt.errors import UserError

if TYPE_CHECKING:
    from torch import nn

    from litgpt.args import FSDPArgs
    from litgpt.checkpoint.interface import CheckpointIO

COMPILER_GROUP = "litgpt.compilers"
CORE_COMPILERS = ("auto", "none", "torch")


@runtime_checkable
class ExtensionStrategy(Protocol):
    """A Fabric strategy from an extension, as the core uses it once `fabric.setup` has set up the model."""

    # How the strategy's model and optimizer reach litgpt's checkpoint formats (set up with the module). Lightning's
    # own `checkpoint_io` is another thing, hence the prefix.
    litgpt_checkpoint_io: "CheckpointIO"
    # True when the set-up module's output head cannot be applied outside it (a module compiled whole): the loss then
    # takes the model's whole logits instead of building them chunk by chunk from its hidden states.
    litgpt_loss_on_logits: bool

    def sampling_model(self, module: "nn.Module") -> "nn.Module":
        """An eager model with the current full weights, for the text sample (collective: every rank calls it)."""


@runtime_checkable
class CompilerExtension(Protocol):
    """What `--compiler NAME` finds: it checks the job the core built and gives the Fabric strategy that runs it."""

    def check(self, job, fsdp: "FSDPArgs") -> None:
        """UserError for what this extension cannot run (before any process starts)."""

    def strategy(self, world_size: int, strategy: str, timeout: float) -> ExtensionStrategy:
        """The Fabric strategy for `world_size` processes (`strategy`: --strategy auto|fsdp|ddp; `timeout`: seconds
        a collective may wait)."""


def load_compiler(name: str) -> CompilerExtension:
    """The compiler extension registered as `name`, instantiated with its default options."""
    from importlib.metadata import entry_points

    registered = {point.name: point for point in entry_points(group=COMPILER_GROUP)}
    if name not in registered:
        known = ", ".join([*CORE_COMPILERS, *sorted(registered)])
        raise UserError(
            f"--compiler {name} is not one of {known}, and no installed extension registers it (an entry point "
            f"{name!r} in the group {COMPILER_GROUP!r}): install the one that does, e.g. `pip install "
            f"'litgpt[{name}]'` (from a checkout: pip install -e '.[{name}]')."
        )
    try:
        factory: Callable[[], CompilerExtension] = registered[name].load()
    except ImportError as error:
        raise UserError(f"--compiler {name}: its extension ({registered[name].value}) cannot be imported: {error}. "
                        f"Reinstall it, e.g. `pip install -e '.[{name}]'`.") from None
    extension = factory()
    if not isinstance(extension, CompilerExtension):
        raise UserError(f"--compiler {name}: {registered[name].value} is no litgpt compiler extension (it has no "
                        "check and strategy methods).")
    return extension
