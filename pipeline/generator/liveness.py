"""Liveness from progress: when an engine with work counts as hung (generator.hang_timeout_s), kept
apart from the engine so the rule is tested on a fake clock (tests/test_liveness.py)."""

from __future__ import annotations

SLOW_GAP_FACTOR = 4.0  # the bound is never under this many times the slowest recent gap between outputs
CPU_BUSY_FRAC = 0.05
"""An engine whose processes (core and workers) used more than this share of one core over the bound's
last window is working, slowly, not hung: a starved process on a loaded machine still gets its share,
a stopped or blocked one gets none (its waiting peer spins about a second, then sleeps: ~2% of a core)."""
WORKING_CAP_FACTOR = 10.0
"""...but never more than this many times the bound without progress: a hang that spins (a GPU kernel
waited on by a busy-polling thread) uses CPU too."""
WAITING_STATES = frozenset("D")
"""Process states (/proc/<pid>/stat) of an engine that waits on the machine, not on itself: `D`, in the
kernel (a page read back from disk when memory runs short: the likely cause of two false alarms of
the default job beside the suite here, 0.01 CPU s over 7.4 s; their states were not recorded then,
the evidence names them now). Seen in the window, the engine is given up to
WORKING_CAP_FACTOR x the bound like a working one. A stopped process is `T` and a deadlocked one sleeps
(`S`): neither is waiting, and both are hung at the bound."""


def hang_bound(base_s: float, s_per_token: float, pending_prefill_tokens: int, slowest_gap_s: float = 0.0) -> float:
    """Seconds an engine with work may go without progress before it counts as hung: `base_s`, plus
    `s_per_token` for every prompt token still waiting for its prefill (one CPU step prefills a whole
    prompt and sends nothing before it ends), and never under SLOW_GAP_FACTOR x the slowest gap
    between outputs seen lately (a loaded machine's steps are slow, not hung)."""
    return max(base_s + s_per_token * max(pending_prefill_tokens, 0), SLOW_GAP_FACTOR * slowest_gap_s)


class Liveness:
    """What an engine core is doing, as its client sees it, and when it last showed progress.

    Fed by the engine's client (Engine._instrument): `added` (a request entered the core with its
    prompt tokens), `outputs` (a step's outputs: progress; a request's first output ends its
    prefill, a finished one leaves), `removed` (aborted), `paused` / `resumed`, and `call_began` /
    `call_ended` around a watched control call (its answer is progress); `cpu` (the CPU seconds its
    processes have used so far, and their states, sampled by the engine's check). `hung(now)` is the
    evidence when the engine has work and no progress within `bound()` while its processes used
    (almost) no CPU over that window and were never seen waiting on the machine (WAITING_STATES), or
    no progress within WORKING_CAP_FACTOR x `bound()` whatever they did; else None.
    Without CPU samples the bound alone decides; samples that began after the work did are judged over
    the span they cover, once it is half the bound. Pure logic: the clock is passed in.

    Example:
        live = Liveness(6.0, 0.005, now=0.0)
        live.added("r1", 400, now=0.0)            # bound 6 + 2 s while its prefill is pending
        live.hung(7.0)                            # None
        live.hung(9.0)                            # "no progress for 9.0s ..."
    """

    GAPS = 64  # the slowest of the last GAPS gaps between outputs raises the bound

    def __init__(self, base_s: float, s_per_token: float, now: float):
        self.base_s, self.s_per_token = base_s, s_per_token
        self.in_core: set[str] = set()
        self.prefill: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self.is_paused = False
        self.calls: dict[int, str] = {}  # watched control calls outstanding: id -> what
        self.last = now
        self.gaps: list[float] = []
        self.samples: list[tuple[float, float, str]] = []  # (time, CPU seconds used so far, states), oldest first

    @property
    def busy(self) -> bool:
        return bool(self.calls) or (bool(self.in_core) and not self.is_paused)

    def _work(self, now: float) -> None:
        if not self.busy:  # work begins: the clock starts now, not at the last output
            self.last = now

    def _progress(self, now: float) -> None:
        if self.busy:
            self.gaps = [*self.gaps[-(self.GAPS - 1):], now - self.last]
        self.last = now

    def added(self, rid: str, prompt_tokens: int, now: float) -> None:
        self._work(now)
        self.in_core.add(rid)
        self.prefill[rid] = prompt_tokens

    def outputs(self, outs, now: float) -> None:
        """A step's EngineCoreOutputs (each with request_id and finished)."""
        if outs:
            self._progress(now)
        for o in outs:
            self.prefill.pop(o.request_id, None)
            if o.finished:
                self.in_core.discard(o.request_id)

    def removed(self, rids, now: float) -> None:
        for rid in rids:
            self.in_core.discard(rid)
            self.prefill.pop(rid, None)

    def paused(self, now: float) -> None:
        self.is_paused = True

    def resumed(self, now: float) -> None:
        self._work(now)
        self.is_paused = False

    def call_began(self, key: int, what: str, now: float) -> None:
        self._work(now)
        self.calls[key] = what

    def call_ended(self, key: int, now: float, answered: bool) -> None:
        self.calls.pop(key, None)
        if answered:
            self.last = now

    def stalled(self, gap_s: float, now: float) -> bool:
        """The check that feeds this ran `gap_s` after its previous run. Past half the bound, its own
        process was not running meanwhile (a loaded machine, a long collection), so the outputs the
        engine made in that time were not read yet: the engine cannot be blamed for it, and the clock
        restarts. True when that happened."""
        if not self.busy or gap_s <= 0.5 * self.bound():
            return False
        self.last = now
        return True

    def cpu(self, cpu_s: float, now: float, states: str = "") -> None:
        """The engine's processes have used `cpu_s` CPU seconds in all (a running total); `states`:
        their /proc states now, one letter each (R, S, D, T, ...)."""
        self.samples.append((now, cpu_s, states))
        keep = now - WORKING_CAP_FACTOR * self.bound() - 1.0  # the windows asked about never reach further
        while len(self.samples) > 2 and self.samples[1][0] <= keep:
            self.samples.pop(0)

    def states_seen(self, now: float, window: float) -> str:
        """Every process state sampled over the last `window` seconds, sorted, once each."""
        return "".join(sorted({s for t, _, states in self.samples if t >= now - window for s in states}))

    def cpu_used(self, now: float, window: float) -> float | None:
        """CPU seconds used over the last `window` seconds, or None without a sample that old."""
        start = [c for t, c, _ in self.samples if t <= now - window]
        if not start:
            return None
        return self.samples[-1][1] - start[-1]

    def bound(self) -> float:
        return hang_bound(self.base_s, self.s_per_token, sum(self.prefill.values()), max(self.gaps, default=0.0))

    def hung(self, now: float) -> str | None:
        """The evidence that the engine is hung, or None (no work, progress within the bound, or off)."""
        if self.base_s <= 0 or not self.busy:
            return None
        age, bound = now - self.last, self.bound()
        if age <= bound:
            return None
        window = bound
        used = self.cpu_used(now, window)
        if used is None and self.samples:
            # The samples began after the work did: the check started with it (an engine given requests at
            # once), or its event loop was idle until they came (a test's fixture loop). No evidence was
            # judged as no CPU at all, which made a starved engine's first seconds on a loaded machine a
            # hang (three false alarms in one run of the suite). Judge on the span they cover, once it
            # is half the bound; until then, ask again (the samples come every half second at most).
            window = now - self.samples[0][0]
            if window < 0.5 * bound:
                return None
            used = self.samples[-1][1] - self.samples[0][1]
        seen = self.states_seen(now, window)
        working = used is not None and used > CPU_BUSY_FRAC * window
        waiting = bool(WAITING_STATES & set(seen))
        if (working or waiting) and age <= WORKING_CAP_FACTOR * bound:
            return None
        pending = sum(self.prefill.values())
        calls = ", ".join(sorted(set(self.calls.values()))) or "none"
        doing = "working" if working else "waiting on the machine (state D)"
        cpu = ("" if used is None else f"its processes used {used:.2f} CPU s in the last {window:.1f}s"
               + (f" (states seen: {seen})" if seen else "")
               + (f" ({doing}, but past {WORKING_CAP_FACTOR:g} x the bound)" if working or waiting else "") + "; ")
        return (f"the vLLM engine is hung: no progress for {age:.1f}s (bound {bound:.1f}s: "
                f"generator.hang_timeout_s={self.base_s:g} + {pending} prompt tokens awaiting prefill x "
                f"generator.hang_s_per_token={self.s_per_token:g}, slowest recent gap "
                f"{max(self.gaps, default=0.0):.2f}s); {cpu}{len(self.in_core)} requests in the engine"
                f"{' (paused)' if self.is_paused else ''}, control calls outstanding: {calls}")
