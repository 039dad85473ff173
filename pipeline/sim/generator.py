"""SimGenerator: one generator (vLLM engine + StageScheduler + UpdateGate) on a simulated clock.

What it models, after pipeline/generator/:
  * N' slots (generator.concurrency) and up to N' admitted samples waiting (`pending`), as the
    StageScheduler keeps them; a freed slot starts the next sample at once, carried partials first.
  * Decoding as a fluid: between two events the running set is fixed and every running request
    gains one token per iteration of GeneratorCosts.iter_s(running, context). Starting a request
    costs its prefill (prompt tokens, or prompt + tokens so far when re-prefilled), a finished one
    request_overhead_s; these and a weight load are engine time (`debt`) spent before decoding
    goes on: the generator's engine, actor and reward share its cores.
  * Updates (generator.on_update): keep pauses for the load, in-flight requests go on under the new
    version; abort re-prefills every in-flight request after the load (gate closed meanwhile);
    drain stops starting requests, lets the running ones finish on the old weights, then loads.
  * Stage ends (generator.carry_over=save): running requests become partials, generation parks
    until the next update, and the partials resume first, re-prefilled.
  * A sample's versions: its first token's version (the engine's when that token is sampled, after
    the prefill: a request submitted just before an update and prefilled after it is fresh), then
    the version it finished under (what the buffer's staleness uses: the oldest). `busy_s` counts time with a slot held, as RolloutStats.
  * Contention: `slow` (set by the caller for the interval to come; 1 alone) stretches every engine
    second: the trainer busy on shared cores makes decoding, prefill and overheads slower.

Example:
    gen = SimGenerator(0, cfg.generator, costs.generator)
    gen.enqueue(samples)                # admitted: G samples of a group
    gen.refill(now)                     # start what fits in N'
    t = gen.next_event(now)             # when something changes next
    done = gen.advance(now, t)          # -> finished samples at t
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from pipeline.config import GeneratorConfig
from pipeline.sim.costs import GeneratorCosts

__all__ = ["SimGenerator", "SimSample"]

_EPS = 1e-9


@dataclass
class SimSample:
    group_id: int
    idx: int
    prompt_len: int
    length: int  # tokens it will have when done
    reward: float
    lessee: tuple[int, int]
    done: float = 0.0  # tokens so far (fluid), while not running; running: _Running.done(s)
    offset: float = 0.0
    v_first: int | None = None
    reprefill: int = 0


class _Running:
    """The requests in the engine. Every running request gains the same tokens per iteration, so
    each keeps its offset against one shared progress counter `P` (tokens so far = P + offset) and
    the next to finish is the top of a heap keyed by length - offset: O(log n) per event, not O(n)."""

    def __init__(self):
        self.P = 0.0
        self._heap: list[tuple[float, int, SimSample]] = []
        self._seq = 0
        self.sum_prompt = 0
        self.sum_offset = 0.0
        self._fresh: list[SimSample] = []  # no token sampled yet: their first token's version is still open

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (s for _, _, s in self._heap)

    def add(self, s: SimSample) -> None:
        s.offset = s.done - self.P
        heapq.heappush(self._heap, (s.length - s.offset, self._seq, s))
        self._seq += 1
        self.sum_prompt += s.prompt_len
        self.sum_offset += s.offset
        if s.v_first is None:
            self._fresh.append(s)

    def done(self, s: SimSample) -> float:
        return self.P + s.offset

    def min_remaining(self) -> float:
        return self._heap[0][0] - self.P

    def context(self) -> float:
        """Tokens held by the running requests: prompts plus what each generated."""
        return self.sum_prompt + len(self._heap) * self.P + self.sum_offset

    def progress(self, tokens: float, version: int) -> None:
        for s in self._fresh:  # a token's version is the engine's when it is sampled, not at submission
            s.v_first = version
        self._fresh = []
        self.P += tokens

    def pop_finished(self) -> list[SimSample]:
        out = []
        while self._heap and self._heap[0][0] - self.P <= 1e-6:
            _, _, s = heapq.heappop(self._heap)
            self._drop(s)
            s.done = s.length
            out.append(s)
        return out

    def take_all(self) -> list[SimSample]:
        """Every running request, out of the engine, with its tokens so far in `done`."""
        out = [s for _, _, s in sorted(self._heap, key=lambda x: x[1])]
        for s in out:
            s.done = self.P + s.offset
        self._heap, self._fresh, self.sum_prompt, self.sum_offset = [], [], 0, 0.0
        return out

    def _drop(self, s: SimSample) -> None:
        self.sum_prompt -= s.prompt_len
        self.sum_offset -= s.offset
        if not self._heap:  # exact zero again: no drift from adding and subtracting floats
            self.sum_prompt, self.sum_offset = 0, 0.0


class SimGenerator:
    """See the module docstring."""

    def __init__(self, gid: int, g: GeneratorConfig, costs: GeneratorCosts):
        self.gid, self.g, self.c = gid, g, costs
        self.version = 0
        self.active = _Running()
        self.pending: deque[SimSample] = deque()
        self.carried: deque[SimSample] = deque()
        self.debt = 0.0  # engine seconds (alone) owed before decoding goes on
        self.slow = 1.0  # engine time per second alone now (ContentionCosts: set by the simulator per interval)
        self.paused_until: float | None = None  # a weight load in progress
        self.gate_open = True  # abort / drain close it during an update
        self.parked = False  # carry_over=save: stage ended, waiting for the next update
        self.draining_to: int | None = None  # drain: the version to load once nothing runs
        self._on_update_done = None
        self.admitting = False  # one admit call in flight at a time (the admission loop awaits each)
        self.busy_s = 0.0
        self.generated_tokens = 0.0
        self.reprefill_tokens = 0

    # ---- admission --------------------------------------------------------------------------
    def wants_group(self) -> bool:
        """The admission loop fetches a group while fewer than N' samples wait (not parked, and its
        previous admit call has returned)."""
        return not self.parked and not self.admitting and len(self.pending) < self.g.concurrency

    def load(self) -> int:
        return len(self.active) + len(self.pending) + len(self.carried)

    def enqueue(self, samples: list[SimSample]) -> None:
        self.pending.extend(samples)

    def refill(self, now: float) -> None:
        """Start samples while a slot is free: carried partials first (re-prefilled), then pending."""
        if self.parked or not self.gate_open or self.paused_until is not None:
            return
        while len(self.active) < self.g.concurrency and (self.carried or self.pending):
            s = (self.carried or self.pending).popleft()
            ctx = s.prompt_len + int(s.done)
            if s.done > 0:
                s.reprefill += int(s.done)
                self.reprefill_tokens += int(s.done)
            self.debt += self.c.prefill_per_token_s * ctx
            self.active.add(s)

    # ---- clock ------------------------------------------------------------------------------
    def next_event(self, now: float) -> float | None:
        """The next time this generator's state changes by itself (None: it waits for others)."""
        if self.paused_until is not None:
            return self.paused_until
        if self.debt > _EPS:
            return now + self.debt * self.slow
        if self.active:
            r, n = self.active.min_remaining(), len(self.active)
            # iteration cost at the interval's mid context: the context grows as tokens are made
            return now + max(r, 0.0) * self.c.iter_s(n, self.active.context() + n * r / 2) * self.slow
        return None

    def busy(self) -> bool:
        """Engine work under way (decoding, prefill, request overhead): what contends with the trainer."""
        return self.paused_until is None and (bool(self.active) or self.debt > _EPS)

    def advance(self, now: float, t: float) -> list[SimSample]:
        """Run from `now` to `t`; the samples that finished (removed from their slots)."""
        dt = t - now
        if self.active:
            self.busy_s += dt
        if self.paused_until is not None:
            if t + _EPS < self.paused_until:
                return []
            dt = t - self.paused_until
            self._finish_load(self.paused_until)
        use = min(self.debt, dt / self.slow)
        self.debt -= use
        dt -= use * self.slow
        if dt > _EPS and self.active and self.debt <= _EPS:
            r, n = self.active.min_remaining(), len(self.active)
            it = self.c.iter_s(n, self.active.context() + n * r / 2) * self.slow
            tokens = min(dt / it, r) if it > 0 else r
            self.active.progress(tokens, self.version)
            self.generated_tokens += tokens * n
        done = self.active.pop_finished()
        self.debt += self.c.request_overhead_s * len(done)
        if self.draining_to is not None and not self.active:
            self._start_load(t, self.draining_to)
        return done

    # ---- updates and stage ends -------------------------------------------------------------
    def update(self, now: float, version: int, load_s: float, on_done) -> None:
        """Apply `version` under generator.on_update; `on_done(t)` once it serves it."""
        self._load_s, self._on_update_done = load_s, on_done
        mode = self.g.on_update
        if mode == "drain":
            self.gate_open = False
            if self.active:
                self.draining_to = version
                return
        elif mode == "abort":
            self.gate_open = False
            for s in self.active:  # resubmitted after the load with prompt + tokens so far
                d = int(self.active.done(s))
                s.reprefill += d
                self.reprefill_tokens += d
                self.debt += self.c.prefill_per_token_s * (s.prompt_len + d)
        self._start_load(now, version)

    def _start_load(self, now: float, version: int) -> None:
        self.draining_to = None
        self.paused_until = now + self._load_s
        self._loading = version

    def _finish_load(self, t: float) -> None:
        self.paused_until = None
        self.version = self._loading
        self.gate_open = True
        self.parked = False  # carry_over=save: the stage begins again on the new weights
        cb, self._on_update_done = self._on_update_done, None
        cb(t)
        self.refill(t)

    def end_stage_save(self) -> None:
        """carry_over=save: every running request becomes a partial, resumed first after the next update."""
        self.carried.extend(self.active.take_all())
        self.parked = True
