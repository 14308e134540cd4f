"""Class paths from a config or the command line (`class_path: pkg.module.Class`) may only name installed code.

Importing a module runs its top-level code, so a class path read from a YAML file must not reach the standard library
(os, subprocess) or a file lying in the working directory. The parser (jsonargparse) imports a `--data` class path
while it parses, before any check of ours could run on the built object: `check_class_paths` reads the arguments and
their --config files first. `--optimizer` (a plain mapping to the parser) gets the same `may_import` when the
optimizer is built, before its module is imported (`litgpt.train.optimizer.optimizer_class`).
"""

from __future__ import annotations

import functools
from pathlib import Path

from litgpt.errors import UserError

# The arguments the parser builds from a class path, importing its module (`data: litgpt.data.Alpaca`).
CLASS_OPTIONS = ("data",)


@functools.cache
def installed_packages() -> frozenset[str]:
    """The top-level import names of the installed distributions (litgpt, torch, bitsandbytes, ...)."""
    from importlib.metadata import packages_distributions

    return frozenset(packages_distributions())


def may_import(module_name: str) -> bool:
    """Whether `module_name` belongs to an installed distribution, whose code may run on import."""
    top = module_name.partition(".")[0]
    # Most names are those of their distribution (torch, litgpt, bitsandbytes): its own list of top-level names
    # answers at once, where mapping every installed distribution takes half a second.
    return top in _top_level_names_of_distribution(top) or top in installed_packages()


def _top_level_names_of_distribution(name: str) -> frozenset[str]:
    """The import names that the installed distribution called `name` provides (none if there is no such one), read
    from its top_level.txt or, without one, from the files it installed (as `packages_distributions` does)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        found = distribution(name)
    except (PackageNotFoundError, ValueError):
        return frozenset()
    declared = (found.read_text("top_level.txt") or "").split()
    if declared:
        return frozenset(declared)
    return frozenset(Path(file.parts[0]).stem if len(file.parts) == 1 else file.parts[0] for file in found.files or ())


def check_class_path(class_path: object, option: str) -> None:
    """Refuse a class path whose module `may_import` does not allow, before anything imports it."""
    parts = class_path.split(".") if isinstance(class_path, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        # A short name ("Alpaca") is looked up among the classes already imported; anything else is no import path.
        return
    module_name = class_path.rpartition(".")[0]
    if not may_import(module_name):
        raise UserError(
            f"--{option} {class_path!r} is refused: a class path may only name a module of litgpt or of an installed "
            f"package, and {module_name!r} is neither (importing it would run its code); make a module of your own "
            "an installed package (`pip install -e FOLDER`) to use it."
        )


def check_class_paths(args: list[str]) -> None:
    """Check every class path the parser would import from `args`: in --config files, in an option's value (a class
    path, a mapping with class_path, or a YAML file of one) and in --OPTION.class_path."""
    position = 0
    while position < len(args):
        key, equals, value = args[position].removeprefix("--").partition("=")
        has_value = equals or (position + 1 < len(args) and not args[position + 1].startswith("--"))
        if args[position].startswith("--") and has_value:
            if not equals:
                value, position = args[position + 1], position + 1
            if key == "config":
                config = _read_yaml(Path(value))
                for option in CLASS_OPTIONS if isinstance(config, dict) else ():
                    _check_value(config.get(option), option, Path(value).parent, frozenset())
            elif key.partition(".")[0] in CLASS_OPTIONS and key.endswith(".class_path"):
                check_class_path(value, key.removesuffix(".class_path"))
            elif key in CLASS_OPTIONS:
                _check_value(_parsed(value), key, Path.cwd(), frozenset())
        position += 1


def _check_value(value: object, key: str, base: Path, seen: frozenset) -> None:
    """Check the class paths in a parsed value found under `key`; a YAML file named where a class may stand (relative
    to `base`, the folder of the config that names it, or the working directory) is read and checked too."""
    if isinstance(value, dict):
        if "class_path" in value:
            check_class_path(value["class_path"], key)
        for name, item in value.items():
            _check_value(item, f"{key}.{name}", base, seen)
    elif isinstance(value, list):
        for item in value:
            _check_value(item, key, base, seen)
    elif isinstance(value, str) and key in CLASS_OPTIONS:
        file = next((p for p in (base / value, Path(value)) if p.is_file()), None)
        if file is None:
            check_class_path(value, key)
        elif file.resolve() not in seen:  # a file that names itself is read once
            _check_value(_read_yaml(file), key, file.parent, seen | {file.resolve()})


def _parsed(value: str) -> object:
    """A command-line value as the parser reads it: YAML/JSON text, or the string itself (a class path or file)."""
    import yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _read_yaml(path: Path) -> object:
    """A YAML file's content; None when it cannot be read (the parser then reports it)."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
