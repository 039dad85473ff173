"""load_config: dataclass defaults -> YAML file -> `key=value` overrides, as a checked Config.

    cfg = load_config("configs/tiny.yaml", ["trainer.lr=1e-4", "buffer.max_staleness=0"])

Unknown keys and wrong types fail in the merge (OmegaConf struct mode); ranges and choices fail in
the sections' `__post_init__`. Every failure is raised as ConfigError with the dotted key and the
allowed values. A key that was removed (REMOVED_KEYS) fails by name, with why it went. Code
receives plain dataclasses (`OmegaConf.to_object`), never a DictConfig. A `builtin:` model.hf_dir
stays a name here; pipeline/models resolves it at start-up (pipeline.models.hf.resolved).
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.config.errors import ConfigError
from pipeline.config.recipes import unset_parts
from pipeline.config.tree import Config

REMOVED_KEYS: dict[str, str] = {
    "generator.top_p": "the sampler always uses 1.0 for RL: with top_p < 1 the sampler's logprobs are of the "
                       "truncated, renormalised distribution, which the learner cannot score, so every "
                       "importance ratio is biased low",
    "weight_sync.backend": "the collective transport always uses trainer.backend, which it had to equal",
    "model.cache_dir": "the tiny model is the built-in checkpoint model.hf_dir=builtin:tiny, built once under "
                       ".cache/tiny-model",
    **{f"model.tiny.{k}": "the tiny model is the built-in checkpoint model.hf_dir=builtin:tiny, of one seed and "
                          "shape; another one is a folder `python -m pipeline.models.tiny --seed N --dim N "
                          "--n-layers N ...` builds and prints, named by model.hf_dir=<that folder>"
       for k in ("seed", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")},
}
"""Keys a config may no longer name -> why they went. A checkpoint's recorded config may still hold
them (pipeline/checkpoint.py ignores them when it diffs configs on resume)."""


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as one level of dotted keys (`{'run': {'steps': 5}}` -> `{'run.steps': 5}`)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _refuse_removed(given: Mapping[str, Any], where: str) -> None:
    """ConfigError for the first removed key among `given` (dotted key -> value as written)."""
    for key, value in given.items():
        if key in REMOVED_KEYS:
            raise ConfigError(f"config: {key}={value} ({where}) is no longer a key, it was removed: "
                              f"{REMOVED_KEYS[key]}. Drop it from the config")


def _colons_as_text(override: str) -> str:
    """key=12:00:00 stays the text 12:00:00: YAML would read it as a base-60 number (43200); `key=`
    is the empty text (as `key=""` in a shell is)."""
    key, value = override.split("=", 1)
    if value == "":
        return f'{key}=""'
    if ":" in value and not value.startswith(("[", "{", "'", '"')):
        return f"{key}={json.dumps(value)}"
    return override


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides; raises ConfigError on any bad input."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"config: override {ov!r} is not of the form key=value")
    _refuse_removed(dict(ov.split("=", 1) for ov in overrides), "a command-line override")
    overrides = [_colons_as_text(ov) for ov in overrides]
    try:
        cfg = OmegaConf.structured(Config)
        # The recipe parts start unset (the defaults' own __post_init__ resolved them), so that the
        # sections can tell a key the file or the command line named from one trainer.recipe fills.
        unset_parts(cfg)
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config: file {str(p)!r} does not exist")
            yaml = OmegaConf.load(p)
            _refuse_removed(flatten(OmegaConf.to_container(yaml)), f"in {str(p)!r}")
            cfg = OmegaConf.merge(cfg, yaml)
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config: bad key {key!r}: {msg}") from None
    assert isinstance(obj, Config)
    return obj
