"""A data file shipped inside an installed package, found without importing the package (the ones
read here have __init__ modules that import things this project never installs or uses)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_file(package: str, resource: str, error: type[Exception], install: str) -> Path:
    """`resource` inside `package`'s folder; `error` naming `install` when the package or file is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise error(f"the `{package}` package is not installed; it ships {resource}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / resource
    if not path.is_file():
        raise error(f"{path} is missing: this `{package}` version does not ship {resource}")
    return path
