"""What the checkpoint builders here share: a data file shipped inside an installed package, found
without importing the package (the ones read here have __init__ modules that import things this
project never installs or uses), and `build_once`, which builds a cache folder once and renames it
into place (tiny.py, smollm2.py, qwen3_tokenizer.py, qwen3_checkpoint.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence


def package_file(package: str, resource: str, error: type[Exception], install: str) -> Path:
    """`resource` inside `package`'s folder; `error` naming `install` when the package or file is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise error(f"the `{package}` package is not installed; it ships {resource}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / resource
    if not path.is_file():
        raise error(f"{path} is missing: this `{package}` version does not ship {resource}")
    return path


def build_once(out: Path, build: Callable[[Path], None], files: Sequence[str]) -> Path:
    """`out`, built by `build(tmp)` into a temporary sibling folder and renamed into place unless every
    name in `files` is already there. The rename is atomic, so a reader never sees half a folder; a
    concurrent builder that wins the race leaves ours to be removed, and a failed build leaves nothing."""
    out = Path(out)
    if all((out / f).is_file() for f in files):
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        tmp.rename(out)
    except OSError:
        if not all((out / f).is_file() for f in files):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
