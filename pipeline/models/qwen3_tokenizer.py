"""Qwen3's real tokenizer, built offline from the BPE ranks the `dashscope` package ships.

    tok_dir = ensure_tokenizer(".cache/qwen3")    # built once (~1 min), then reused
    tok = AutoTokenizer.from_pretrained(tok_dir)  # Qwen3's tokenizer: ids, specials, chat template
    tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)

Nothing is downloaded. Qwen's byte-level BPE (151,643 ranks, the same table Qwen2 and Qwen3 use) is
`dashscope/resources/qwen.tiktoken`; transformers' TikTokenConverter turns the ranks into a `tokenizers`
BPE (it recovers the merges from the ranks), and this module dresses it the way Qwen3's tokenizer.json
is dressed: NFC normalizer, Qwen's pre-tokenizer regex, byte-level decoding, and the 26 added tokens of
Qwen3 at their ids (151643 <|endoftext|> ... 151668 </think>). tokenizer_config.json carries Qwen3's chat
template (pipeline/models/qwen3_chat_template.py), eos `<|im_end|>`, pad `<|endoftext|>`, no bos;
generation_config.json stops on both [151645, 151643] and carries Qwen3's recommended sampling.

The files go to a folder keyed by a hash of everything they are made from (vocabulary bytes, specials,
template, format), so a changed input never reuses an old build; a build is written to a temporary
folder and renamed into place, so concurrent builders never see half a tokenizer.

Run `python -m pipeline.models.qwen3_tokenizer [--cache-dir DIR]` to build it by hand; tools/build/make_qwen3.py builds a whole
checkpoint around it (pipeline/models/qwen3_checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from pipeline.models.assets import build_once, package_file

from pipeline.models.qwen3_chat_template import CHAT_TEMPLATE

CACHE_DIR = ".cache/qwen3"
VOCAB_RESOURCE = ("dashscope", "resources/qwen.tiktoken")
BPE_RANKS = 151_643
"""Ranks in the BPE table: ids 0 .. 151642; the added tokens follow."""
PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen's pre-tokenizer split (single digits, unlike GPT-4's 1-3), as in Qwen3's tokenizer.json."""

# Qwen3's added tokens in id order from BPE_RANKS on: (content, special). `special` is Qwen3's flag
# (skipped by decode(skip_special_tokens=True)); the tool, fim, repo and think markers are not special.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
TOKEN_IDS = {content: BPE_RANKS + i for i, (content, _) in enumerate(ADDED_TOKENS)}
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = TOKEN_IDS["<|endoftext|>"], TOKEN_IDS["<|im_start|>"], TOKEN_IDS["<|im_end|>"]
EOS_TOKEN_IDS = [IM_END_ID, ENDOFTEXT_ID]
"""generation_config.json's stop ids: end of turn, then end of document."""
PAD_ID = ENDOFTEXT_ID
MODEL_MAX_LENGTH = 131_072
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json")
_FORMAT = 1  # bump when the files written here change


class Qwen3AssetError(RuntimeError):
    """Qwen3 assets cannot be built here (a missing package, or a build that does not match Qwen3)."""


def vocab_file() -> Path:
    """The path of dashscope's qwen.tiktoken, found without importing dashscope (its __init__ pulls in
    an HTTP client stack this project never uses)."""
    package, resource = VOCAB_RESOURCE
    return package_file(package, resource, Qwen3AssetError, f"pip install {package}")


def tokenizer_config() -> dict:
    """tokenizer_config.json in Qwen3's layout (its added_tokens_decoder, specials and template)."""
    decoder = {str(TOKEN_IDS[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": s} for c, s in ADDED_TOKENS}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, s in ADDED_TOKENS[1:] if s],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config() -> dict:
    """generation_config.json as Qwen3 ships it: both stop ids, and its recommended thinking-mode sampling
    (which vLLM and HF apply only where a request leaves a parameter unset)."""
    return {"bos_token_id": ENDOFTEXT_ID, "do_sample": True, "eos_token_id": EOS_TOKEN_IDS,
            "pad_token_id": PAD_ID, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _build(out: Path) -> None:
    """Write TOKENIZER_FILES into `out` and check the ids landed where Qwen3 has them."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(vocab_file()), pattern=PATTERN).converted()
    if tok.get_vocab_size(with_added_tokens=False) != BPE_RANKS:
        raise Qwen3AssetError(f"{vocab_file()}: {tok.get_vocab_size(with_added_tokens=False)} ranks, "
                              f"Qwen's table has {BPE_RANKS}")
    tok.normalizer = normalizers.NFC()
    tok.model.ignore_merges = False  # as Qwen3's tokenizer.json (and transformers' Qwen2Tokenizer) has it
    for content, special in ADDED_TOKENS:  # one at a time, so each takes the next id
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
    wrong = {c: tok.token_to_id(c) for c, i in TOKEN_IDS.items() if tok.token_to_id(c) != i}
    if wrong:
        raise Qwen3AssetError(f"added tokens landed at the wrong ids: {wrong}")
    tok.save(str(out / "tokenizer.json"))
    model = json.loads((out / "tokenizer.json").read_text())["model"]
    (out / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in model["merges"]))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False))
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2))


def tokenizer_dir(cache_dir: str | Path = CACHE_DIR) -> Path:
    """The cache folder for the current inputs: a hash of the vocabulary bytes, specials, template, format."""
    h = hashlib.sha256(vocab_file().read_bytes())
    h.update(json.dumps([_FORMAT, PATTERN, ADDED_TOKENS, CHAT_TEMPLATE, generation_config()]).encode())
    return Path(cache_dir) / f"tokenizer-{h.hexdigest()[:12]}"


def ensure_tokenizer(cache_dir: str | Path = CACHE_DIR) -> Path:
    """Qwen3's tokenizer files, built once under `cache_dir`; returns their folder."""
    return build_once(tokenizer_dir(cache_dir), _build, TOKENIZER_FILES)


def copy_tokenizer(out_dir: Path, cache_dir: str | Path = CACHE_DIR) -> None:
    """Put Qwen3's tokenizer files into a checkpoint folder."""
    src = ensure_tokenizer(cache_dir)
    for f in TOKENIZER_FILES:
        shutil.copy2(src / f, Path(out_dir) / f)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", default=CACHE_DIR)
    print(ensure_tokenizer(ap.parse_args().cache_dir))
