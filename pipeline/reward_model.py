"""Reward model: a scalar-head scoring model served with streaming prefill (OPPO, seed 001).

    scorer = StreamingScorer(hf_dir)                      # AutoModelForSequenceClassification, 1 label
    scorer.prefill("g0r0/3:1/0", 0, prompt_and_first_chunk)   # state: a prefix cache of 11 tokens
    scorer.prefill("g0r0/3:1/0", 11, next_chunk)          # offset = tokens already prefilled
    s = scorer.finish("g0r0/3:1/0", 27, last_chunk)       # the score; the state is freed
    [s] == scorer.score([whole_sequence])                 # the same number, within fp tolerance

While the policy still decodes a response, its finished chunks are prefilled into the reward model
(`reward_model.chunk_tokens` new tokens at a time), each on top of the sequence's key/value cache,
so after EOS only the last chunk is left: the score arrives after one short forward instead of a
prefill of the whole sequence (score-at-end, `chunk_tokens=0`). Attention is causal, so the last
position's hidden state, and the score taken from it, do not depend on how the sequence was
chunked: streaming changes when the work is done, never the reward.

A stream is addressed by (seq, offset). A chunk whose offset is not the length of the stream's
state (a lost message, an evicted or restarted state) drops the state, and `finish` then answers
None: the caller sends the whole sequence again from offset 0 (pipeline/reward_client.py). At most
`max_sequences` states are held; the least recently used goes first. Whole sequences waiting
together are scored in one padded forward (`score`, up to `max_batch`).

The score is the head applied to the last token's final hidden state: what HF's
`*ForSequenceClassification` returns for an unpadded sequence. The scorer must share the policy's
tokenizer, since it reads the policy's token ids (`check_tokenizer`).

Pure torch + transformers, no Monarch: actors/reward_model.py serves it on its own mesh.
`init_scorer` makes a scorer from a causal-LM checkpoint (its body, a fresh head), the start of
tools/train_reward_model.py.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["StreamingScorer", "ScorerError", "init_scorer", "check_tokenizer"]


class ScorerError(ValueError):
    """A checkpoint that cannot serve as a scorer, or a sequence it cannot score."""


@dataclass
class _Stream:
    cache: Any  # transformers DynamicCache
    length: int
    last: torch.Tensor  # final hidden state of the last token so far


class StreamingScorer:
    def __init__(self, hf_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_sequences: int = 4096, max_batch: int = 16):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        conf = AutoConfig.from_pretrained(hf_dir)
        if getattr(conf, "num_labels", None) != 1:
            raise ScorerError(f"{hf_dir}: a reward model needs a scalar head (num_labels=1 in config.json), "
                              f"this one has num_labels={getattr(conf, 'num_labels', None)}")
        model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
        self.body = getattr(model, model.base_model_prefix, None)
        self.head = getattr(model, "score", None)
        if self.body is None or not isinstance(self.head, torch.nn.Linear):
            raise ScorerError(f"{hf_dir}: {type(model).__name__} has no decoder body and `score` head "
                              "(a decoder *ForSequenceClassification model is needed)")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.vocab_size = int(conf.vocab_size)
        self.max_len = int(getattr(conf, "max_position_embeddings", 1 << 30))
        self.max_sequences, self.max_batch = max_sequences, max_batch
        self._states: OrderedDict[str, _Stream] = OrderedDict()
        self._lock = threading.Lock()  # one forward at a time; every call may come from a worker thread
        self.counts = {"prefill_tokens": 0, "finish_tokens": 0, "whole_tokens": 0, "lost": 0, "evicted": 0}

    # ---------------------------------------------------------------- streams

    def prefill(self, seq: str, offset: int, tokens: Sequence[int]) -> bool:
        """Extend stream `seq` (offset 0 starts it anew) by `tokens`; False if the stream's state is
        not `offset` tokens long (it is then dropped, and the sequence is scored whole at finish)."""
        with self._lock, torch.inference_mode():
            st = self._take(seq, offset)
            if st is None and offset > 0:
                return False
            if not tokens:
                if st is not None:
                    self._keep(seq, st)
                return True
            st = self._extend(st, tokens)
            self.counts["prefill_tokens"] += len(tokens)
            self._keep(seq, st)
            return True

    def finish(self, seq: str, offset: int, tokens: Sequence[int]) -> float | None:
        """The score of stream `seq` extended by `tokens` (offset 0: `tokens` is the whole sequence);
        the stream is freed. None if its state is not `offset` tokens long (send it whole)."""
        with self._lock, torch.inference_mode():
            st = self._take(seq, offset)
            if st is None:
                if offset > 0:
                    return None
                return self._score_batch([list(tokens)])[0]
            if tokens:
                st = self._extend(st, tokens)
                self.counts["finish_tokens"] += len(tokens)
            return float(self.head(st.last).float().item())

    def release(self, seq: str) -> bool:
        with self._lock:
            return self._states.pop(seq, None) is not None

    def release_prefix(self, prefix: str) -> int:
        """Drop every stream whose id starts with `prefix` (a restarted generator's); how many."""
        with self._lock:
            gone = [k for k in self._states if k.startswith(prefix)]
            for k in gone:
                del self._states[k]
            return len(gone)

    @property
    def held(self) -> int:
        return len(self._states)

    # ---------------------------------------------------------------- whole sequences

    def score(self, seqs: Sequence[Sequence[int]]) -> list[float]:
        """Scores of whole sequences, `max_batch` per padded forward."""
        with self._lock, torch.inference_mode():
            out: list[float] = []
            for i in range(0, len(seqs), self.max_batch):
                out += self._score_batch([list(s) for s in seqs[i:i + self.max_batch]])
            return out

    def _score_batch(self, seqs: list[list[int]]) -> list[float]:
        for s in seqs:
            self._check(s, 0)
        n = max(map(len, seqs))
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: a real token never attends to a pad after it
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        kw = {"attention_mask": mask.to(self.device)} if len(seqs) > 1 else {}
        hidden = self.body(input_ids=ids.to(self.device), use_cache=False, **kw).last_hidden_state
        last = hidden[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
        self.counts["whole_tokens"] += sum(map(len, seqs))
        return [float(x) for x in self.head(last).float()[:, 0]]

    # ---------------------------------------------------------------- internals

    def _check(self, tokens: Sequence[int], offset: int) -> None:
        if offset == 0 and not tokens:
            raise ScorerError("an empty sequence has no score")
        if offset + len(tokens) > self.max_len:
            raise ScorerError(f"sequence of {offset + len(tokens)} tokens is longer than the reward model's "
                              f"{self.max_len} positions (max_position_embeddings)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ScorerError(f"token id {bad[0]} is outside the reward model's vocabulary of {self.vocab_size}")

    def _take(self, seq: str, offset: int) -> _Stream | None:
        st = self._states.pop(seq, None)
        if offset == 0:
            return None
        if st is None or st.length != offset:
            self.counts["lost"] += 1
            return None
        return st

    def _extend(self, st: _Stream | None, tokens: Sequence[int]) -> _Stream:
        from transformers import DynamicCache

        self._check(tokens, st.length if st else 0)
        if st is None:
            st = _Stream(DynamicCache(config=self.model.config), 0, torch.empty(0))
        ids = torch.tensor([list(tokens)], device=self.device)
        out = self.body(input_ids=ids, past_key_values=st.cache, use_cache=True)
        st.cache, st.length, st.last = out.past_key_values, st.length + len(tokens), out.last_hidden_state[0, -1]
        return st

    def _keep(self, seq: str, st: _Stream) -> None:
        self._states[seq] = st
        while len(self._states) > self.max_sequences:
            self._states.popitem(last=False)
            self.counts["evicted"] += 1


def init_scorer(policy_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A scorer checkpoint in `out_dir`: the causal LM in `policy_dir` as body (the usual start of a
    reward model), a fresh scalar head, the same tokenizer files."""
    import shutil

    from transformers import AutoConfig, AutoModelForSequenceClassification

    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    conf = AutoConfig.from_pretrained(policy_dir, num_labels=1)
    arch = conf.architectures[0].replace("ForCausalLM", "ForSequenceClassification")
    conf.architectures = [arch]
    conf.pad_token_id = getattr(conf, "pad_token_id", None) or 0
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, config=conf, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for f in policy_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def check_tokenizer(policy_dir: str | Path, scorer_dir: str | Path) -> str | None:
    """Why the scorer in `scorer_dir` cannot read the policy's token ids, or None if it can."""
    from transformers import AutoTokenizer

    try:
        a, b = AutoTokenizer.from_pretrained(policy_dir), AutoTokenizer.from_pretrained(scorer_dir)
    except Exception as e:  # noqa: BLE001 - the reason goes into the message
        return f"its tokenizer cannot be loaded ({type(e).__name__}: {e})"
    if a.get_vocab() != b.get_vocab():
        return (f"its tokenizer differs from the policy's ({len(b.get_vocab())} vs {len(a.get_vocab())} tokens); "
                "the reward model reads the policy's token ids as they stream, so both must share one tokenizer")
    vocab = json.loads((Path(scorer_dir) / "config.json").read_text()).get("vocab_size", 0)
    if vocab < len(a.get_vocab()):
        return f"its vocab_size {vocab} is smaller than the tokenizer's {len(a.get_vocab())} tokens"
    return None
