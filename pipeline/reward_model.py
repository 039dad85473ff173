"""Reward model: a scalar-head scoring model served with streaming prefill (as OPPO does).

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
None: the caller sends the whole sequence again from offset 0 (pipeline/generator/reward_client.py). At most
`max_sequences` states are held; the least recently used goes first. Operations waiting together
run in as few forwards as possible (`run`): a stream's consecutive chunks are joined, and the next
chunk of every stream and every whole sequence share one forward of up to `max_batch` sequences,
the streams' caches left-padded to the longest and their chunks right-padded.

The score is the head applied to the last token's final hidden state: what HF's
`*ForSequenceClassification` returns for an unpadded sequence. The scorer must share the policy's
tokenizer, since it reads the policy's token ids (`check_tokenizer`).

Pure torch + transformers, no Monarch: actors/reward_model.py serves it on its own mesh.
`init_scorer` makes a scorer from a causal-LM checkpoint (its body, a fresh head), the start of
tools/build/train_reward_model.py.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from pipeline.tokens import SpecialTokens, load_tokenizer

__all__ = ["StreamingScorer", "ScorerError", "init_scorer", "check_tokenizer"]


class ScorerError(ValueError):
    """A checkpoint that cannot serve as a scorer, or a sequence it cannot score."""


@dataclass
class _Stream:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, length, head_dim]
    length: int
    last: torch.Tensor  # final hidden state of the last token so far
    extra: Any = None  # what a subclass accumulates per stream (the teacher: log-probs so far)


class StreamingScorer:
    def __init__(self, hf_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_sequences: int = 4096, max_batch: int = 16):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        conf = AutoConfig.from_pretrained(hf_dir)
        if getattr(conf, "num_labels", None) != 1:
            raise ScorerError(f"{hf_dir}: a reward model needs a scalar head (num_labels=1 in config.json), "
                              f"this one has num_labels={getattr(conf, 'num_labels', None)}")
        model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
        self._serve(hf_dir, conf, model, getattr(model, "score", None), "`score` head (a decoder "
                    "*ForSequenceClassification model is needed)", device, max_sequences, max_batch)

    def _serve(self, hf_dir, conf, model, head, needs: str, device: str, max_sequences: int, max_batch: int) -> None:
        """Take `model` (its decoder body and `head`, a Linear on the final hidden states) and the
        empty stream table; ScorerError naming `hf_dir` and what it `needs` if either is missing."""
        self.body = getattr(model, model.base_model_prefix, None)
        self.head = head
        if self.body is None or not isinstance(self.head, torch.nn.Linear):
            raise ScorerError(f"{hf_dir}: {type(model).__name__} has no decoder body and {needs}")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.vocab_size = int(conf.vocab_size)
        self.max_len = int(getattr(conf, "max_position_embeddings", 1 << 30))
        self.max_sequences, self.max_batch = max_sequences, max_batch
        self._states: OrderedDict[str, _Stream] = OrderedDict()
        self._prefixes: OrderedDict[tuple, _Stream] = OrderedDict()  # share_prefixes: prompt states by tokens
        self._lock = threading.Lock()  # one forward at a time; every call may come from a worker thread
        self.counts = {"prefill_tokens": 0, "finish_tokens": 0, "whole_tokens": 0, "lost": 0, "evicted": 0,
                       "forwards": 0, "shared_tokens": 0}

    # ---------------------------------------------------------------- one call per operation

    def prefill(self, seq: str, offset: int, tokens: Sequence[int]) -> bool:
        """Extend stream `seq` (offset 0 starts it anew) by `tokens`; False if the stream's state is
        not `offset` tokens long (it is then dropped, and the sequence is scored whole at finish)."""
        return self.run([("prefill", seq, offset, tokens)])[0]

    def finish(self, seq: str, offset: int, tokens: Sequence[int]) -> float | None:
        """The score of stream `seq` extended by `tokens` (offset 0: `tokens` is the whole sequence);
        the stream is freed. None if its state is not `offset` tokens long (send it whole)."""
        r = self.run([("finish", seq, offset, tokens)])[0]
        if isinstance(r, Exception):
            raise r
        return r

    def score(self, seqs: Sequence[Sequence[int]]) -> list[float]:
        """Scores of whole sequences, `max_batch` per padded forward."""
        out = self.run([("finish", f"\0whole{i}", 0, s) for i, s in enumerate(seqs)])
        for r in out:
            if isinstance(r, Exception):
                raise r
        return out

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

    # ---------------------------------------------------------------- many operations at once

    def run(self, ops: Sequence[tuple[str, str, int, Sequence[int]]]) -> list:
        """Operations (kind 'prefill' | 'finish', seq, offset, tokens) in their order per stream, as
        few padded forwards as possible: a stream's consecutive chunks are joined into one, and the
        streams' next chunks (and whole sequences) go through the model together, `max_batch` at a
        time. Per op: prefill -> True/False (False: out of step, dropped); finish -> the score, None
        (out of step: send it whole) or a ScorerError for a sequence that cannot be scored."""
        with self._lock, torch.inference_mode():
            results: list = [None] * len(ops)
            queues: OrderedDict[str, list[int]] = OrderedDict()
            for i, (_, seq, _, _) in enumerate(ops):
                queues.setdefault(seq, []).append(i)
            while queues:
                work = []  # (seq, op indices joined, offset, tokens, finishes)
                for seq, q in list(queues.items()):
                    first = q.pop(0)
                    kind, _, offset, tokens = ops[first]
                    joined, tokens = [first], list(tokens)
                    # a shared prefix (a prompt sent alone at offset 0) is looked up on its own
                    while kind == "prefill" and q and ops[q[0]][2] == offset + len(tokens) and \
                            not (offset == 0 and self.share_prefixes):
                        kind, _, _, more = ops[q[0]]
                        joined.append(q.pop(0))
                        tokens += more
                    if not q:
                        del queues[seq]
                    work.append((seq, joined, offset, tokens, kind == "finish"))
                self._round(ops, work, results)
            return results

    def _round(self, ops, work, results) -> None:
        ready = []  # (seq, joined, state or None, tokens, finishes)
        for seq, joined, offset, tokens, fin in work:
            st = self._states.pop(seq, None)
            if offset > 0 and (st is None or st.length != offset):
                self.counts["lost"] += 1
                for i in joined:
                    results[i] = False if ops[i][0] == "prefill" else None
                continue
            st = st if offset > 0 else None
            try:
                self._check(tokens, offset)
            except ScorerError as e:
                for i in joined:
                    results[i] = e if ops[i][0] == "finish" else False
                continue
            if st is None and not fin and self.share_prefixes and tuple(tokens) in self._prefixes:
                # a prompt another stream already prefilled (a group's samples share it): no forward
                self._prefixes.move_to_end(tuple(tokens))
                for i in joined:
                    results[i] = True
                self._keep(seq, self._copy(self._prefixes[tuple(tokens)]))
                self.counts["shared_tokens"] += len(tokens)
                continue
            if not tokens:  # nothing to add (offset > 0, so st holds the stream): score or keep it as it is
                for i in joined:
                    results[i] = True
                if fin:
                    results[joined[-1]] = self._final(st)
                else:
                    self._keep(seq, st)
                continue
            ready.append((seq, joined, st, tokens, fin))
        twins: dict[tuple, list] = {}  # prompts several new streams of this round start with: one forward
        if self.share_prefixes:
            first: dict[tuple, int] = {}
            unique = []
            for item in ready:
                seq, joined, st, tokens, fin = item
                key = tuple(tokens)
                if st is None and not fin and key in first:
                    twins.setdefault(key, []).append((seq, joined))
                    continue
                if st is None and not fin:
                    first[key] = len(unique)
                unique.append(item)
            ready = unique
        for k in range(0, len(ready), self.max_batch):
            part = ready[k:k + self.max_batch]
            try:
                lasts = self._extend([(st, tokens) for _, _, st, tokens, _ in part])
            except Exception as e:  # noqa: BLE001 - a failed forward (out of memory, say) fails its part alone
                err = ScorerError(f"forward failed: {type(e).__name__}: {e}")
                for _, joined, _, _, _ in part:
                    for i in joined:
                        results[i] = err if ops[i][0] == "finish" else False
                continue
            for (seq, joined, st, tokens, fin), (new, hid) in zip(part, lasts):
                for i in joined[:-1]:
                    results[i] = True
                key = "whole_tokens" if st is None and fin else "finish_tokens" if fin else "prefill_tokens"
                self.counts[key] += len(tokens)
                new = self._grown(st, tokens, new, hid)
                if st is None and not fin and self.share_prefixes:
                    key = tuple(tokens)
                    self._prefixes[key] = new
                    while len(self._prefixes) > self.max_prefixes:
                        self._prefixes.popitem(last=False)
                    for tseq, tjoined in twins.pop(key, []):
                        for i in tjoined:
                            results[i] = True
                        self._keep(tseq, self._copy(new))
                        self.counts["shared_tokens"] += len(tokens)
                if fin:
                    results[joined[-1]] = self._final(new)
                else:
                    results[joined[-1]] = True
                    self._keep(seq, new)

    share_prefixes = False
    """Whether a stream's first op at offset 0 is a prefix other streams may share (the teacher: a
    prompt, sent alone by its client): its state is kept (LRU, max_prefixes) and a later stream that
    starts with the same tokens, or a twin in the same round, takes a copy instead of a forward."""
    max_prefixes = 256

    @staticmethod
    def _copy(st: _Stream) -> _Stream:
        """A stream state that shares `st`'s cache tensors (never written in place: `_extend` makes new
        ones) and copies what it accumulates."""
        extra = tuple(list(x) for x in st.extra) if isinstance(st.extra, tuple) else st.extra
        return _Stream(st.kv, st.length, st.last, extra)

    def _grown(self, st: _Stream | None, tokens: list[int], new: _Stream, hidden: torch.Tensor) -> _Stream:
        """The state after `tokens` were added to `st` (None: a new stream), given their final hidden
        states `hidden` [len(tokens), H]; a subclass adds what it accumulates (the teacher's log-probs)."""
        return new

    def _final(self, st: _Stream) -> Any:
        """A finished stream's result: the scalar head on its last token's final hidden state."""
        return float(self.head(st.last).float().item())

    def _extend(self, items: list[tuple[_Stream | None, list[int]]]) -> list[tuple[_Stream, torch.Tensor]]:
        """One forward of every item's new tokens on top of its cache: caches left-padded to the
        longest, chunks right-padded; positions continue each stream. Returns each item's extended
        state and the final hidden states of its new tokens [len(tokens), H]."""
        from transformers import DynamicCache

        n = len(items)
        lens = [st.length if st else 0 for st, _ in items]
        past, chunk = max(lens), max(len(t) for _, t in items)
        ids = torch.zeros(n, chunk, dtype=torch.long)
        mask = torch.zeros(n, past + chunk, dtype=torch.long)
        for b, (_, t) in enumerate(items):
            ids[b, :len(t)] = torch.tensor(t)
            mask[b, past - lens[b]:past] = 1
            mask[b, past:past + len(t)] = 1
        pos = torch.tensor(lens).unsqueeze(1) + torch.arange(chunk).unsqueeze(0)
        cache = DynamicCache()
        if past:
            for layer in range(self.model.config.num_hidden_layers):
                ref = next(st.kv[layer][0] for st, _ in items if st)
                k = ref.new_zeros(n, ref.shape[1], past, ref.shape[3])
                v = k.clone()
                for b, (st, _) in enumerate(items):
                    if st:
                        k[b, :, past - lens[b]:] = st.kv[layer][0][0]
                        v[b, :, past - lens[b]:] = st.kv[layer][1][0]
                cache.update(k, v, layer)
        kw = {} if n == 1 and not past else {"attention_mask": mask.to(self.device)}
        out = self.body(input_ids=ids.to(self.device), position_ids=pos.to(self.device), past_key_values=cache,
                        use_cache=True, **kw)
        self.counts["forwards"] += 1
        res = []
        for b, (st, t) in enumerate(items):
            kv = []
            for layer, cl in enumerate(out.past_key_values.layers):
                nk, nv = cl.keys[b:b + 1, :, past:past + len(t)], cl.values[b:b + 1, :, past:past + len(t)]
                if st:
                    nk, nv = torch.cat([st.kv[layer][0], nk], 2), torch.cat([st.kv[layer][1], nv], 2)
                kv.append((nk.clone(), nv.clone()))
            hid = out.last_hidden_state[b, :len(t)].clone()
            res.append((_Stream(kv, lens[b] + len(t), hid[-1]), hid))
        return res

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
    if getattr(conf, "pad_token_id", None) is None:  # HF's scalar head needs one: the checkpoint's own
        conf.pad_token_id = SpecialTokens.of(load_tokenizer(policy_dir)).pad
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
