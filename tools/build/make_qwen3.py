"""Write a Qwen3 checkpoint folder with random weights: Qwen3-0.6B's or 1.7B's shapes, or a shrunk copy for tests.

    python -m tools.build.make_qwen3 --out /tmp/qwen3-0.6b                   # Qwen3-0.6B-shaped (~1.5 GB bf16)
    python -m tools.build.make_qwen3 --out /tmp/qwen3-1.7b --model Qwen3-1.7B    # Qwen3-1.7B-shaped (~4.1 GB bf16)
    python -m tools.build.make_qwen3 --out /tmp/q3 --layers 2 --hidden 64 --ffn 128 --heads 2 --kv-heads 1

The folder is what a downloaded Qwen3-0.6B holds (config.json, model.safetensors in bf16 under HF names,
tokenizer.json, tokenizer_config.json with Qwen3's chat template, vocab.json, merges.txt,
generation_config.json), so `model.hf_dir=DIR` runs the real path with no download. The tokenizer is
built offline from the `dashscope` package's BPE ranks, once, under --cache-dir (pipeline/models/qwen3_tokenizer.py).
Prints the folder, its size on disk and the build time.
"""

from __future__ import annotations

import argparse
import time

from pipeline.models.qwen3_tokenizer import CACHE_DIR
from pipeline.models.qwen3_checkpoint import MODELS, build_checkpoint, qwen3_config
from tools.lib.cli import REPO


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder to write (created; existing files are replaced)")
    ap.add_argument("--model", default="Qwen3-0.6B", choices=list(MODELS), help="the shape to start from")
    ap.add_argument("--layers", type=int, help="decoder layers (0.6B: 28)")
    ap.add_argument("--hidden", type=int, help="hidden size (0.6B: 1024)")
    ap.add_argument("--ffn", type=int, help="MLP intermediate size (0.6B: 3072)")
    ap.add_argument("--heads", type=int, help="query heads of 128 dims (0.6B: 16)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads (0.6B: 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(REPO / CACHE_DIR), help="where the tokenizer is built once")
    args = ap.parse_args()
    try:
        conf = qwen3_config(args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, model=args.model)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.monotonic()
    out = build_checkpoint(args.out, conf, args.seed, args.cache_dir)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{out}  {size / 1e6:.1f} MB on disk  {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
