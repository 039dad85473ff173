"""RewardModelActor: a scalar-head scoring model (pipeline/reward_model.py) on its own mesh.

Protocol (the generators' RewardModelClient calls it; the controller supervises it):

    rm = procs.spawn("reward_modelr0", RewardModelActor, cfg, 0)
    info = await rm.setup.call_one()                       # placement, then the model (start_timeout_s)
    await rm.prefill.call_one(seq, offset, chunk)          # queued; answers at once
    r = await rm.finish.call_one(seq, offset, last_chunk)  # {"score": x} | {"lost": True} | {"error": why}
    await rm.release.call_one([seq, ...])                  # streams nobody will finish
    await rm.release_prefix.call_one("g1r0/")              # a dead generator's streams
    await rm.stats.call_one()                              # queue, held streams, batches, busy fraction

Every operation goes into one FIFO queue, served by one worker that runs the forwards on a thread,
so the endpoints keep answering while it computes. The worker takes everything queued at once:
whole sequences (score-at-end, or streams sent whole again) are scored together in padded
batches of reward_model.max_batch; stream chunks run in arrival order. A generator's messages to
this actor arrive in the order it sent them, so a stream's chunks come before its finish; if one
is lost anyway the offsets disagree and finish answers {"lost": True}.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

from monarch.actor import Actor, concurrent_endpoint, endpoint

from pipeline import logs
from pipeline.config import Config
from pipeline.placement import apply, reward_model_placement
from pipeline.procs import me

__all__ = ["RewardModelActor"]

log = logging.getLogger(__name__)


class RewardModelActor(Actor):
    def __init__(self, cfg: Config, incarnation: int = 0):
        logs.configure(cfg.run.log_level)
        self.cfg, self.incarnation = cfg, incarnation
        self.scorer = None
        self._queue: deque[tuple] = deque()  # (op, seq, offset, tokens, future or None)
        self._more: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._busy_s = 0.0
        self._t0 = time.monotonic()
        self._batches: deque[int] = deque(maxlen=256)  # whole sequences per forward, recent
        self._errors = 0

    @endpoint
    async def setup(self) -> dict:
        """Pin this proc (reward_model.cpus), load the scorer; its placement, pid and load seconds."""
        import torch
        import transformers

        from pipeline.reward_model import StreamingScorer

        placed = apply(reward_model_placement(self.cfg))
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        rc = self.cfg.reward_model
        t0 = time.monotonic()
        device = "cuda" if rc.device == "cuda" else "cpu"
        self.scorer = await asyncio.to_thread(StreamingScorer, rc.path, device, torch.float32, rc.max_sequences,
                                              rc.max_batch)
        self._more = asyncio.Event()
        self._worker = asyncio.create_task(self._serve())
        return {"placement": placed, "pid": os.getpid(), "procs": [me()], "load_s": time.monotonic() - t0,
                "vocab_size": self.scorer.vocab_size}

    def _handle_undeliverable_message(self, message) -> bool:
        """A reply to a generator that died meanwhile cannot be delivered; its streams are released
        by the controller (release_prefix). Carry on."""
        log.warning("reward model: a reply could not be delivered (its generator died?): %s", message)
        return True

    def _put(self, op: str, seq: str, offset: int = 0, tokens=(), want: bool = False):
        if self.scorer is None:
            raise RuntimeError("reward model: setup was not called")
        fut = asyncio.get_running_loop().create_future() if want else None
        self._queue.append((op, seq, offset, list(tokens), fut))
        self._more.set()
        return fut

    @concurrent_endpoint
    async def prefill(self, seq: str, offset: int, tokens: list[int]) -> None:
        """Queue a chunk of stream `seq` starting at `offset`; answers at once."""
        self._put("prefill", seq, offset, tokens)

    @concurrent_endpoint
    async def finish(self, seq: str, offset: int, tokens: list[int]) -> dict:
        """The score of stream `seq` after its last chunk (offset 0: the whole sequence)."""
        return await self._put("finish", seq, offset, tokens, want=True)

    @concurrent_endpoint
    async def release(self, seqs: list[str]) -> None:
        for s in seqs:
            self._put("release", s)

    @concurrent_endpoint
    async def release_prefix(self, prefix: str) -> None:
        self._put("release_prefix", prefix)

    @concurrent_endpoint
    async def stats(self) -> dict:
        s = self.scorer
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        return {"incarnation": self.incarnation, "queued": len(self._queue), "held": s.held if s else 0,
                "busy_frac": self._busy_s / elapsed, "errors": self._errors,
                "batch_mean": sum(self._batches) / len(self._batches) if self._batches else 0.0,
                **(s.counts if s else {})}

    async def _serve(self) -> None:
        while True:
            if not self._queue:
                self._more.clear()
                await self._more.wait()
            ops = list(self._queue)
            self._queue.clear()
            t0 = time.monotonic()
            results = await asyncio.to_thread(self._run, ops)
            self._busy_s += time.monotonic() - t0
            for (_, _, _, _, fut), r in zip(ops, results):
                if fut is not None and not fut.done():
                    fut.set_result(r)

    def _run(self, ops: list[tuple]) -> list:
        """Every queued op in order, except that whole sequences are scored together in batches."""
        s = self.scorer
        results: list = [None] * len(ops)
        whole = [i for i, (op, seq, off, _, _) in enumerate(ops) if op == "finish" and off == 0]
        for k in range(0, len(whole), s.max_batch):
            idx = whole[k:k + s.max_batch]
            try:
                scores = s.score([ops[i][3] for i in idx])
                for i, x in zip(idx, scores):
                    results[i] = {"score": x}
                    s.release(ops[i][1])  # a whole sequence replaces any stream of the same id
            except Exception:  # one bad sequence fails alone: score them one by one
                for i in idx:
                    results[i] = self._one(ops[i])
            self._batches.append(len(idx))
        for i, o in enumerate(ops):
            if results[i] is None and not (o[0] == "finish" and o[2] == 0):
                results[i] = self._one(o)
        return results

    def _one(self, o: tuple):
        op, seq, offset, tokens, _ = o
        s = self.scorer
        try:
            if op == "prefill":
                return s.prefill(seq, offset, tokens)
            if op == "finish":
                x = s.finish(seq, offset, tokens)
                return {"lost": True} if x is None else {"score": x}
            if op == "release":
                return s.release(seq)
            return s.release_prefix(seq)
        except Exception as e:  # a sequence the scorer cannot score: that sample alone
            self._errors += 1
            s.release(seq)
            return {"error": f"{type(e).__name__}: {e}"}

    @endpoint
    async def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
