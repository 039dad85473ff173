"""RewardModelClient: a generator's side of the reward model (actors/reward_model.py).

Contract: `feed` never blocks the decoding loop (chunks are fire-and-forget); `finish` is the only
call that waits, bounded by reward_model.timeout_s; every stream ends in exactly one `finish` or
`release` (the episode releases whatever it does not finish).

Example:
    rm = RewardModelClient(handle, chunk_tokens=16, timeout_s=30.0, prefix="g0r0/")
    rm.feed(key, context, new_ids)       # while decoding: sends a chunk once chunk_tokens new tokens wait
    score = await rm.finish(key, tokens) # after EOS: the rest, then the score (RewardRejected on failure)
    rm.release(key)                      # a rollout that will not be scored (rejected, carried over)
    rm.set_handle(new_handle)            # the controller restarted the reward model

A stream is the rollout's whole token sequence (prompt, model turns, observations); it only ever
grows, so chunks sent before an `abort` update or an observation stay valid. Chunks are sent
without waiting for them (the actor queues them in order); the first failed chunk marks the
stream, and its finish sends the whole sequence under a new stream id instead.

Faults, each failing the one sample (RewardRejected, counted by reason by the generator):
- reward_model_timeout: no score within reward_model.timeout_s of EOS.
- reward_model_failed: the scorer cannot score the sequence (the actor's {"error": ...}).
- reward_model_unavailable: the actor cannot be reached and no new one was attached in time.
A call that fails because the actor is gone is retried every RETRY_S (within the same timeout), on
the successor once the controller attaches it (`set_handle`), with the whole sequence, since the
new actor holds no streams: a reward-model restart costs latency, not samples.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from pipeline.tasks import RewardRejected

__all__ = ["RewardModelClient"]

RETRY_S = 0.5  # between calls to an unreachable reward model, until reward_model.timeout_s

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    seq: str
    sent: int = 0
    broken: bool = False


class RewardModelClient:
    def __init__(self, handle: Any, chunk_tokens: int, timeout_s: float, prefix: str, kind: str = "reward_model"):
        """`kind`: reward_model (finish returns the score) | teacher (the stream's per-token log-probs,
        actors/teacher.py); it names the rejection reasons (teacher_timeout, ...) and the config keys."""
        self.handle, self.chunk, self.timeout_s, self.prefix = handle, chunk_tokens, timeout_s, prefix
        self.kind, self.result = kind, "teacher" if kind == "teacher" else "score"
        self.what = "the teacher" if kind == "teacher" else "the reward model"
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._inflight: set[asyncio.Future] = set()
        self.counts = {"chunks": 0, "chunk_tokens": 0, "finish_tokens": 0, "resent_whole": 0, "scored": 0}
        self.scores: deque[float] = deque(maxlen=1000)

    def set_handle(self, handle: Any) -> None:
        """A new actor (a restart): it holds no stream, so every stream starts over with a new id."""
        self.handle = handle
        for key in list(self._streams):
            self._streams[key] = self._new()

    def _new(self) -> _Stream:
        return _Stream(f"{self.prefix}{next(self._ids)}")

    def feed(self, key: str, context: Sequence[int], new: Sequence[int] = (), prompt_len: int = 0) -> None:
        """Stream the sequence context + new: send what was not sent yet once at least
        chunk_tokens of it wait (and the actor is reachable). Never blocks. `prompt_len` > 0: the
        first `prompt_len` tokens go at once as a chunk of their own (a prefix the actor shares
        between the streams that start with it: the teacher's prompt, the same for a group)."""
        if self.chunk <= 0 or self.handle is None:  # no reward model attached yet
            return
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = self._new()
        if st.sent == 0 and 0 < prompt_len <= len(context) and not st.broken:
            self._send(st, list(context[:prompt_len]))
        total = len(context) + len(new)
        if st.broken or total - st.sent < self.chunk:
            return
        self._send(st, [*context[st.sent:], *new[max(0, st.sent - len(context)):]])

    def _send(self, st: _Stream, tokens: list[int]) -> None:
        """Send `tokens` as the stream's next chunk (at offset st.sent), fire and forget."""
        try:
            call = asyncio.ensure_future(self.handle.prefill.call_one(st.seq, st.sent, tokens))
        except Exception:  # noqa: BLE001 - the actor cannot take it now: finish sends the sequence whole
            st.broken = True
            return
        self._inflight.add(call)
        call.add_done_callback(lambda f, st=st: self._chunk_done(f, st))
        st.sent += len(tokens)
        self.counts["chunks"] += 1
        self.counts["chunk_tokens"] += len(tokens)

    def _chunk_done(self, f: asyncio.Future, st: _Stream) -> None:
        self._inflight.discard(f)
        if f.cancelled() or f.exception() is not None:
            st.broken = True  # finish sends the whole sequence

    async def finish(self, key: str, tokens: Sequence[int]) -> Any:
        """The reward model's score of the whole sequence `tokens` (what was streamed plus the rest);
        the teacher's {"logprobs", "top1"} of its tokens 1..L-1 (pipeline/teacher.py)."""
        deadline = time.monotonic() + self.timeout_s
        st = self._streams.pop(key, None) or self._new()
        while True:
            if st.broken or st.sent > len(tokens):
                self._release_seq(st)  # whatever the actor holds of the old stream id
                st = self._new()
                self.counts["resent_whole"] += 1
            handle = self.handle
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                r = await asyncio.wait_for(handle.finish.call_one(st.seq, st.sent, list(tokens[st.sent:])), left)
            except asyncio.TimeoutError:
                raise RewardRejected(f"{self.kind}_timeout", f"no answer from {self.what} within "
                                     f"{self.timeout_s:.0f}s ({self.kind}.timeout_s)") from None
            except Exception as e:  # noqa: BLE001 - the actor is gone (or unreachable): retry, on its
                # successor once the controller attaches one (set_handle), else on the same handle
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardRejected(f"{self.kind}_unavailable", f"{self.what} cannot be reached "
                                         f"({type(e).__name__}: {str(e)[:200]}) and none came back within "
                                         f"{self.timeout_s:.0f}s ({self.kind}.timeout_s)") from None
                await asyncio.sleep(min(RETRY_S, left))
                st = self._new()  # the actor may hold nothing of it now: send it whole
                continue
            if "error" in r:
                raise RewardRejected(f"{self.kind}_failed", r["error"])
            if r.get("lost"):  # its state was evicted or a chunk lost: send it whole
                st.broken = True
                continue
            self.counts["finish_tokens"] += len(tokens) - st.sent
            self.counts["scored"] += 1
            if self.result == "teacher":
                return r["teacher"]  # {"logprobs": [...], "top1": [...]}
            self.scores.append(r["score"])
            return float(r["score"])

    def release(self, key: str) -> None:
        """Free the reward model's state of a stream that will not be finished here."""
        st = self._streams.pop(key, None)
        if st is not None:
            self._release_seq(st)

    def _release_seq(self, st: _Stream) -> None:
        self._send_release([st.seq] if st.sent else [])

    def _send_release(self, seqs: list[str]) -> None:
        """Fire and forget; a release that cannot be sent is left to the actor's LRU bound."""
        if not seqs or self.handle is None:
            return
        try:
            call = asyncio.ensure_future(self.handle.release.call_one(seqs))
        except Exception:  # noqa: BLE001
            return
        self._inflight.add(call)
        call.add_done_callback(lambda f: (self._inflight.discard(f), f.cancelled() or f.exception()))

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until the actor has taken every chunk and release sent so far."""
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Release every stream and wait (bounded) for calls still on their way."""
        seqs = [st.seq for st in self._streams.values() if st.sent]
        self._streams.clear()
        self._send_release(seqs)
        await self.flush(timeout_s)

    def snapshot(self) -> dict:
        return {**self.counts, "streams": len(self._streams),
                "score_mean": sum(self.scores) / len(self.scores) if self.scores else float("nan")}
