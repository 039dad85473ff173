"""Liveness from progress (pipeline/generator/engine.py: hang_bound, Liveness): the pure bound logic,
on a fake clock. A stopped engine is found within its bound; a slow one that keeps progressing, a
long prefill and a paused engine are left alone. The real engine's side is in tests/test_generator.py
(test_a_stopped_engine_core_is_found_hung_within_its_bound).

    .venv/bin/python -m pytest -q tests/test_liveness.py
"""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.generator.liveness import SLOW_GAP_FACTOR, Liveness, hang_bound


def out(rid: str, finished: bool = False):
    return SimpleNamespace(request_id=rid, finished=finished)


def test_bound_grows_with_pending_prefill_and_slow_steps():
    assert hang_bound(6.0, 0.005, 0) == 6.0
    assert hang_bound(6.0, 0.005, 4000) == 26.0  # a prompt near max_model_len=4096 on CPU
    assert hang_bound(6.0, 0.005, 0, slowest_gap_s=3.0) == SLOW_GAP_FACTOR * 3.0  # a loaded machine
    assert hang_bound(6.0, 0.005, -5) == 6.0


def test_no_work_is_never_hung_and_work_starts_the_clock():
    live = Liveness(6.0, 0.005, now=0.0)
    assert live.hung(1000.0) is None  # idle for long: nothing expected of it
    live.added("a", 10, now=1000.0)  # the clock starts at the submission, not at the last output
    assert live.hung(1006.0) is None
    why = live.hung(1006.2)
    assert why is not None and "no progress for 6.2s" in why and "1 requests in the engine" in why


def test_a_stopped_engine_is_found_within_its_bound():
    live = Liveness(6.0, 0.005, now=0.0)
    for i in range(32):
        live.added(f"r{i}", 15, now=0.0)
    t = 0.0
    for _ in range(100):  # decoding: outputs every 20 ms
        t += 0.02
        live.outputs([out(f"r{i}") for i in range(32)], now=t)
    assert live.hung(t + 5.9) is None
    live.added("late", 20, now=t)  # admitted just before the stop: its prefill is pending
    assert abs(live.bound() - (6.0 + 20 * 0.005)) < 1e-9
    why = live.hung(t + 6.2)
    assert why is not None and "33 requests" in why and "20 prompt tokens awaiting prefill" in why


def test_a_slow_but_progressing_engine_is_left_alone():
    live = Liveness(6.0, 0.005, now=0.0)
    live.added("long", 4000, now=0.0)  # a prompt near max_model_len: one 18 s prefill step on CPU
    assert live.hung(18.0) is None  # bound 6 + 4000 x 0.005 = 26 s
    live.outputs([out("long")], now=18.0)  # its first token: the prefill is done
    t = 18.0
    for _ in range(20):  # a loaded machine: a decode step every 5 s, slower than the base bound
        assert live.hung(t + 5.0) is None
        t += 5.0
        live.outputs([out("long")], now=t)
    assert live.bound() >= SLOW_GAP_FACTOR * 5.0
    assert live.hung(t + 19.0) is None
    assert live.hung(t + 4 * 18.0 + 1) is not None  # the slowest gap (the 18 s prefill) x 4, then hung


def test_paused_requests_wait_but_a_control_call_must_be_answered():
    live = Liveness(6.0, 0.005, now=0.0)
    live.added("a", 10, now=0.0)
    live.call_began(1, "pause", now=1.0)
    live.call_ended(1, now=1.1, answered=True)
    live.paused(now=1.1)
    assert live.hung(100.0) is None  # paused for a long weight load: the load has its own bound
    live.resumed(now=100.0)
    assert live.hung(105.0) is None
    assert live.hung(106.5) is not None  # resumed, then no step came: hung
    assert live.hung(100.5) is None
    live.outputs([out("a", finished=True)], now=101.0)
    assert not live.busy and live.hung(500.0) is None
    live.call_began(2, "pause", now=500.0)  # a call to a stopped core: found within the bound
    assert live.hung(506.5) is not None and "pause" in live.hung(506.5)


def test_aborted_requests_leave_and_zero_turns_it_off():
    live = Liveness(6.0, 0.005, now=0.0)
    live.added("a", 10, now=0.0)
    live.removed(["a"], now=1.0)
    assert live.hung(60.0) is None
    off = Liveness(0.0, 0.005, now=0.0)
    off.added("a", 10, now=0.0)
    assert off.hung(1e6) is None


def test_cpu_use_tells_a_starved_engine_from_a_stopped_one():
    """Past the bound, an engine whose processes still use CPU is working (a loaded machine's first
    step, with no gap seen yet to raise the bound) until WORKING_CAP_FACTOR x the bound; one whose
    processes use none is hung at the bound. The waiting peer's spin (about a second after its
    partner stops) keeps the window busy until it leaves it."""
    from pipeline.generator.liveness import CPU_BUSY_FRAC, WORKING_CAP_FACTOR

    def engine(cpu_per_s):
        live = Liveness(6.0, 0.0, now=0.0)
        live.added("a", 10, now=0.0)
        t, c = 0.0, 0.0
        while t < 200.0:
            live.cpu(c, now=t)
            if live.hung(t) is not None:
                return t, live.hung(t)
            t += 0.5
            c += cpu_per_s(t) * 0.5
        return None, None

    starved, _ = engine(lambda t: 0.1)  # 10% of a core: a busy machine's share
    assert starved is not None and starved > WORKING_CAP_FACTOR * 6.0 - 0.5
    at, why = engine(lambda t: 1.0 if t <= 1.0 else 0.02)  # stopped at 0: the peer spins 1 s, then sleeps
    assert at is not None and 6.0 < at <= 8.0 and "CPU s in the last" in why, (at, why)
    assert 0.02 < CPU_BUSY_FRAC < 0.1
    # no CPU samples (processes not readable): the bound alone decides, as before
    live = Liveness(6.0, 0.0, now=0.0)
    live.added("a", 10, now=0.0)
    assert live.hung(6.5) is not None


def test_an_engine_waiting_on_the_machine_is_not_hung_but_a_stopped_or_sleeping_one_is():
    """No CPU and no progress past the bound: processes seen in state D (in the kernel: pages read back
    when memory runs short, the default job's two false alarms beside the suite) wait on the machine
    and are given up to WORKING_CAP_FACTOR x the bound; stopped (T, the SIGSTOP probe) or sleeping (S,
    a deadlock) ones are hung at the bound, and the evidence names the states seen."""
    from pipeline.generator.liveness import WORKING_CAP_FACTOR

    def engine(states_at):
        live = Liveness(6.0, 0.0, now=0.0)
        live.added("a", 10, now=0.0)
        t = 0.0
        while t < 200.0:
            live.cpu(0.0, now=t, states=states_at(t))
            if (why := live.hung(t)) is not None:
                return t, why
            t += 0.5
        return None, None

    at, why = engine(lambda t: "TT")  # core and worker stopped
    assert 6.0 < at <= 6.5 and "states seen: T" in why, (at, why)
    at, why = engine(lambda t: "SS")
    assert 6.0 < at <= 6.5 and "states seen: S" in why, (at, why)
    at, why = engine(lambda t: "SD" if 3.0 <= t <= 9.0 else "SS")  # a page-in of 6 s, then asleep for good
    assert 9.0 + 6.0 <= at <= 9.0 + 6.5, (at, why)  # hung once the wait left the window
    at, why = engine(lambda t: "DS")  # waiting on the machine throughout: only the cap ends it
    assert WORKING_CAP_FACTOR * 6.0 < at <= WORKING_CAP_FACTOR * 6.0 + 0.5 and "waiting on the machine" in why


def test_a_stall_of_the_checking_process_restarts_the_clock_not_the_engine():
    """The check runs in the generator's process, which reads the engine's outputs: when that process
    itself did not run for 30 s (a loaded machine), the outputs of that time were never seen, and the
    engine is not hung for it. A short lag is not a stall, and a stall without work changes nothing."""
    live = Liveness(6.0, 0.0, now=0.0)
    live.added("a", 10, now=0.0)
    assert not live.stalled(1.0, now=1.5)  # under half the bound: an ordinary lag
    assert live.stalled(29.0, now=30.0)
    assert live.hung(30.5) is None and live.hung(35.9) is None
    assert live.hung(36.5) is not None  # the engine still owes progress within the bound afterwards
    idle = Liveness(6.0, 0.0, now=0.0)
    assert not idle.stalled(29.0, now=30.0)


def test_cpu_samples_that_began_after_the_work_are_judged_over_their_span():
    """The engine's check may start sampling CPU only after its requests came (an engine given work at
    once, or a fixture's event loop idle until the test adds requests): no sample reaches back over the
    whole bound. A starved engine that still gets CPU is working, not hung; one that uses none is hung,
    with the CPU figure of the span in its evidence; below half the bound of samples, no verdict yet."""
    busy = Liveness(6.0, 0.0, now=0.0)
    idle = Liveness(6.0, 0.0, now=0.0)
    for live in (busy, idle):
        live.added("a", 10, now=0.0)
    t = 2.0  # the first sample 2 s after the work began
    while t <= 6.5:
        busy.cpu(0.3 * (t - 2.0), now=t)  # 30% of a core: a loaded machine's share
        idle.cpu(1.0, now=t)  # stopped: no CPU since the first sample
        t += 0.5
    assert busy.hung(6.5) is None
    why = idle.hung(6.5)
    assert why is not None and "used 0.00 CPU s in the last 4.5s" in why, why
    late = Liveness(6.0, 0.0, now=0.0)
    late.added("a", 10, now=0.0)
    late.cpu(1.0, now=4.0)
    late.cpu(1.0, now=6.5)
    assert late.hung(6.5) is None  # 2.5 s of samples, under half the bound: asked again later
    late.cpu(1.0, now=7.0)
    assert late.hung(7.0) is not None  # 3 s of them, and no CPU used
