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
so the endpoints keep answering while it computes. The worker takes everything queued at once and
hands it to StreamingScorer.run: a stream's consecutive chunks are joined, and the next chunk of
every stream, and every whole sequence, go through the model together in padded batches of
reward_model.max_batch (ops_per_forward in stats). A generator's messages to
this actor arrive in the order it sent them, so a stream's chunks come before its finish; if one
is lost anyway the offsets disagree and finish answers {"lost": True}.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

from monarch.actor import concurrent_endpoint, endpoint

from actors.base import PipelineActor
from actors.endpoints import reply_droppable
from pipeline.config import Config
from pipeline.placement import apply, reward_model_placement
from pipeline.procs import me

__all__ = ["RewardModelActor"]

log = logging.getLogger(__name__)


class RewardModelActor(PipelineActor):
    RESULT = "score"  # the key of a finished stream's result (TeacherActor: "logprobs")

    def __init__(self, cfg: Config, incarnation: int = 0):
        super().__init__(cfg.run.log_level)
        self.cfg, self.incarnation = cfg, incarnation
        self.scorer = None
        self._queue: deque[tuple] = deque()  # (op, seq, offset, tokens, future or None)
        self._more: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._busy_s = 0.0
        self._t0 = time.monotonic()
        self._batches: deque[float] = deque(maxlen=256)  # scoring ops per forward, recent worker rounds
        self._errors = 0
        self._forwards = 0

    def _placement(self):
        return reward_model_placement(self.cfg)

    @endpoint
    async def setup(self) -> dict:
        """Pin this proc (reward_model.cpus), load the scorer; its placement, pid and load seconds."""
        import transformers

        placed = apply(self._placement())
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        t0 = time.monotonic()
        self.scorer = await asyncio.to_thread(self._load)
        self._more = asyncio.Event()
        self._worker = asyncio.create_task(self._serve())
        return {"placement": placed, "pid": os.getpid(), "procs": [me()], "load_s": time.monotonic() - t0,
                "vocab_size": self.scorer.vocab_size}

    def _load(self):
        import torch

        from pipeline.reward_model import StreamingScorer

        rc = self.cfg.reward_model
        device = "cuda" if rc.device == "cuda" else "cpu"
        return StreamingScorer(rc.path, device, torch.float32, rc.max_sequences, rc.max_batch)

    def _put(self, op: str, seq: str, offset: int = 0, tokens=(), want: bool = False):
        if self.scorer is None:
            raise RuntimeError("reward model: setup was not called")
        fut = asyncio.get_running_loop().create_future() if want else None
        self._queue.append((op, seq, offset, list(tokens), fut))
        self._more.set()
        return fut

    @reply_droppable(concurrent=True)
    async def prefill(self, seq: str, offset: int, tokens: list[int]) -> None:
        """Queue a chunk of stream `seq` starting at `offset`; answers at once."""
        self._put("prefill", seq, offset, tokens)

    @reply_droppable(concurrent=True)
    async def finish(self, seq: str, offset: int, tokens: list[int]) -> dict:
        """The score of stream `seq` after its last chunk (offset 0: the whole sequence)."""
        return await self._put("finish", seq, offset, tokens, want=True)

    @reply_droppable(concurrent=True)
    async def release(self, seqs: list[str]) -> None:
        for s in seqs:
            self._put("release", s)

    @reply_droppable(concurrent=True)
    async def release_prefix(self, prefix: str) -> None:
        self._put("release_prefix", prefix)

    @concurrent_endpoint
    async def stats(self) -> dict:
        """Counters; raises if the worker ended (the supervisor then restarts this reward model)."""
        if self._worker is not None and self._worker.done():
            raise RuntimeError(f"reward model worker ended: {self._worker.exception() if not self._worker.cancelled() else 'cancelled'}")
        s = self.scorer
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        return {"incarnation": self.incarnation, "queued": len(self._queue), "held": s.held if s else 0,
                "elapsed_s": elapsed, "busy_s": self._busy_s,
                "busy_frac": self._busy_s / elapsed, "errors": self._errors,
                "ops_per_forward": sum(self._batches) / len(self._batches) if self._batches else 0.0,
                **(s.counts if s else {})}

    async def _serve(self) -> None:
        while True:
            if not self._queue:
                self._more.clear()
                await self._more.wait()
            ops = list(self._queue)
            self._queue.clear()
            t0 = time.monotonic()
            try:
                results = await asyncio.to_thread(self._run, ops)
            except Exception as e:  # noqa: BLE001 - never a silent dead worker: these ops fail, the next are served
                self._errors += 1
                log.error("reward model: a round of %d operations failed: %s: %s", len(ops), type(e).__name__, e)
                results = [{"error": f"{type(e).__name__}: {e}"}] * len(ops)
            self._busy_s += time.monotonic() - t0
            for (_, _, _, _, fut), r in zip(ops, results):
                if fut is not None and not fut.done():
                    fut.set_result(r)

    def _run(self, ops: list[tuple]) -> list:
        """Every queued op, the scoring ones in as few batched forwards as possible (StreamingScorer.run)."""
        s = self.scorer
        results: list = [None] * len(ops)
        scoring = [i for i, o in enumerate(ops) if o[0] in ("prefill", "finish")]
        try:
            out = s.run([ops[i][:4] for i in scoring])
        except Exception as e:  # noqa: BLE001 - a failed forward fails these ops alone; the actor serves on
            self._errors += 1
            out = [RuntimeError(f"{type(e).__name__}: {e}")] * len(scoring)
            for i in scoring:
                s.release(ops[i][1])
        for i, r in zip(scoring, out):
            if ops[i][0] == "prefill":
                results[i] = r is True
            elif isinstance(r, Exception):
                self._errors += 1
                results[i] = {"error": str(r)}
            else:
                results[i] = {"lost": True} if r is None else {self.RESULT: r}
        for i, (op, seq, *_rest) in enumerate(ops):
            if op == "release":
                results[i] = s.release(seq)
            elif op == "release_prefix":
                results[i] = s.release_prefix(seq)
        if s.counts["forwards"] > self._forwards:
            self._batches.append(len(scoring) / (s.counts["forwards"] - self._forwards))
            self._forwards = s.counts["forwards"]
        return results

    @endpoint
    async def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
