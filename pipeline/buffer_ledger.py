"""The replay buffer's ledger: leases and requeues, the accounting identity, stats and checkpoints.

BufferLedger is a base of ReplayBufferCore (pipeline/buffer.py), whose __init__ sets the state it reads;
HeldGroup is one group the buffer holds.

Accounting: each admitted group brings G sample slots and check_accounting() verifies

    admitted_samples == trained_samples + sum(dropped_samples by reason) + held_samples

where held groups are in flight or complete-but-untrained (G slots each). Each in-flight group is
leased to the generator generating it, named by a lessee (generator id, incarnation);
release_generator(lessee) (it died) requeues its groups whole, to be handed out again before any
new prompt: they stay held, so the identity holds across a kill. The lessee is revoked for good:
an admit it still had pending gets nothing (its reply could never arrive), and samples still
arriving under a revoked lease are ignored as late. A checkpoint keeps the held groups (state_dict):
after a resume the complete ones are trained and the in-flight ones requeued, so a restart drops
nothing and the identity holds across it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from pipeline.types import PromptGroup, Rollout

__all__ = ["BufferLedger", "HeldGroup", "Lessee"]

Lessee = tuple[int, int]  # (generator id, incarnation): a restarted generator is a new lessee


@dataclass
class HeldGroup:
    """A held group: in flight (its samples so far) or complete (all G, and their advantages)."""

    group: PromptGroup
    samples: dict[int, Rollout] = field(default_factory=dict)
    advantages: list[float] = field(default_factory=list)


class BufferLedger:
    """ReplayBufferCore's leases, counters and checkpoint (module docstring); `held_groups`, `_drop`,
    `admission_limit` and `delta_effective` are the core's."""

    # ---- leases ------------------------------------------------------------------------------
    def has_requeued(self) -> bool:
        return bool(self._requeued)

    def revoked(self, lessee: Lessee) -> bool:
        return lessee in self._revoked

    def take_requeued(self, lessee: Lessee) -> PromptGroup:
        """The oldest requeued group, leased anew to `lessee` (it is still held: no admission check)."""
        gid = self._requeued.popleft()
        self._lease[gid] = lessee
        return self._in_flight[gid].group

    def release_generator(self, lessee: Lessee) -> int:
        """A generator died: every group it holds in flight goes back to be generated again (whole:
        samples it already sent are discarded, as wasted tokens). The groups stay held, so the
        accounting identity is unchanged; returns how many were requeued."""
        n = 0
        for gid, g in self._in_flight.items():
            if self._lease.get(gid) == lessee:
                self.wasted_tokens += sum(r.num_model_tokens for r in g.samples.values())
                g.samples.clear()
                self._lease[gid] = None
                self._requeued.append(gid)
                n += 1
        self.requeued_groups += n
        self._revoked.add(lessee)
        return n

    def release(self, group_id: int, lessee: Lessee | None = None) -> bool:
        """A generator gave up on a group: drop it as "failed". False if it already left flight or is
        not (any more) leased to `lessee`."""
        if lessee is not None and self._foreign(group_id, lessee, lessee[0]):
            return False
        if group_id in self._in_flight:
            if group_id in self._requeued:
                self._requeued.remove(group_id)
            self._drop(self._in_flight[group_id], "failed")
            return True
        if not 0 <= group_id < self._next_id:
            raise ValueError(f"buffer: release of group {group_id}, which was never admitted")
        self._late.pop(group_id, None)  # nothing more will come for it
        return False

    def _foreign(self, group_id: int, lessee: Lessee | None, generator_id: int) -> bool:
        """The group is in flight but not leased to this sender (its lease was revoked: it was
        declared dead and the group requeued). `lessee` None: judged by generator id alone."""
        if group_id not in self._in_flight:
            return False
        lease = self._lease.get(group_id)
        return lease is None or (lease != lessee if lessee is not None else lease[0] != generator_id)

    # ---- metrics, accounting, checkpoint -----------------------------------------------------
    def accounting(self) -> dict[str, int]:
        G = self.cfg.group_size
        return {"admitted_samples": self.admitted_groups * G, "trained_samples": self.trained_groups * G,
                "dropped_samples": sum(self.dropped_groups.values()) * G, "held_samples": self.held_groups * G}

    def check_accounting(self) -> dict[str, int]:
        """Verify admitted = trained + dropped + held (in samples); raise RuntimeError if not."""
        a = self.accounting()
        if a["admitted_samples"] != a["trained_samples"] + a["dropped_samples"] + a["held_samples"]:
            raise RuntimeError(f"buffer: accounting broken: {a}")
        return a

    def stats(self) -> dict:
        G, cap = self.cfg.group_size, self.cfg.batch_groups + self.delta_ctl.delta
        return {
            **self.accounting(), "version": self.version, "batches": self.batches,
            "in_flight_groups": len(self._in_flight), "complete_groups": len(self._complete),
            "held_groups": self.held_groups, "admission_limit": self.admission_limit(),
            "occupancy": self.held_groups / cap, "delta": self.delta_ctl.delta,
            "delta_effective": self.delta_effective(), "delta_capped_steps": self.delta_capped_steps,
            "delta_history": list(self.delta_ctl.history), "reward_slope": self.delta_ctl.last_slope,
            "reward_slope_tstat": self.delta_ctl.last_tstat,
            "dropped_groups": dict(self.dropped_groups),
            "dropped_samples_by_reason": {k: v * G for k, v in self.dropped_groups.items()},
            "rejected": dict(self.rejected), "late_rollouts": self.late_rollouts, "wasted_tokens": self.wasted_tokens,
            "overlong_shaped_samples": self.overlong_shaped,
            "requeued_groups": self.requeued_groups, "requeued_waiting": len(self._requeued),
            "retried_prompts": self.retried_prompts, "retry_waiting": len(self._retry),
            "zero_signal_groups": self.zero_signal_groups, "deferred_groups": self.deferred_groups,
            "zero_signal_mode": self.zero_signal_mode,
            "staleness_hist": dict(sorted(self.staleness_hist.items())),
            "trainer_wait_s_total": self.wait_s_total, "trainer_wait_s_last": self.wait_s_last,
            **self.difficulty.stats(),
        }

    def state_dict(self) -> dict:
        """Counters, version, Δ and every held group. Complete groups keep their rollouts and
        advantages: after a resume they are trained, in the same order. In-flight groups keep their
        PromptGroup only: their generators (and any partial rollouts those carried) do not survive a
        restart, so on load they are requeued whole, as by release_generator (not dropped)."""
        G = self.cfg.group_size
        return {"version": self.version, "next_id": self._next_id, "admitted_groups": self.admitted_groups,
                "trained_groups": self.trained_groups, "batches": self.batches,
                "dropped_groups": dict(self.dropped_groups), "rejected": dict(self.rejected),
                "late_rollouts": self.late_rollouts, "wasted_tokens": self.wasted_tokens,
                "requeued_groups": self.requeued_groups,
                "retry": list(self._retry), "retried_prompts": self.retried_prompts,
                "zero_signal_groups": self.zero_signal_groups, "deferred_groups": self.deferred_groups, "staleness_hist": dict(self.staleness_hist),
                "wait_s_total": self.wait_s_total,
                "complete": [(g.group, [g.samples[i] for i in range(G)], list(g.advantages))
                             for g in self._complete.values()],
                "in_flight": [(g.group, sum(r.num_model_tokens for r in g.samples.values()))
                              for g in self._in_flight.values()],
                "delta_capped_steps": self.delta_capped_steps, "delta": self.delta_ctl.state_dict(),
                "difficulty": self.difficulty.state_dict(), "zero_signal_mode": self.zero_signal_mode}

    def load_state_dict(self, s: dict) -> None:
        """Restore a state_dict into a fresh buffer: complete groups are ready to train, in-flight
        ones wait in the requeue (handed out before any new prompt); the accounting identity holds."""
        if self.held_groups or self.admitted_groups:
            raise RuntimeError("buffer: load_state_dict needs a fresh buffer (nothing admitted yet)")
        self.version, self._next_id = s["version"], s["next_id"]
        self.admitted_groups, self.trained_groups, self.batches = (
            s["admitted_groups"], s["trained_groups"], s["batches"])
        self.dropped_groups = Counter(s["dropped_groups"])
        self.rejected = Counter(s["rejected"])
        self.late_rollouts, self.zero_signal_groups = s["late_rollouts"], s["zero_signal_groups"]
        self.wasted_tokens, self.requeued_groups = s["wasted_tokens"], s["requeued_groups"]
        self.deferred_groups, self.wait_s_total = s["deferred_groups"], s["wait_s_total"]
        self.delta_capped_steps = s["delta_capped_steps"]
        self.staleness_hist = Counter(s["staleness_hist"])
        self._retry = deque(s.get("retry", ()))  # a checkpoint from before retry_stale has none
        self.retried_prompts = s.get("retried_prompts", 0)
        if self.cfg.zero_signal == "auto":  # an explicit keep|drop wins over the checkpoint's choice
            self.zero_signal_mode = s.get("zero_signal_mode", "keep")  # a checkpoint from before auto: keep
        for group, samples, advantages in s["complete"]:
            self._complete[group.group_id] = HeldGroup(group, dict(enumerate(samples)), list(advantages))
        for group, received_tokens in s["in_flight"]:
            self._in_flight[group.group_id] = HeldGroup(group)
            self._lease[group.group_id] = None
            self._requeued.append(group.group_id)
            self.wasted_tokens += received_tokens  # its samples so far are generated again
        self.requeued_groups += len(s["in_flight"])
        self.delta_ctl.load_state_dict(s["delta"])
        if "difficulty" in s:  # a checkpoint from before the filter: it starts empty
            self.difficulty.load_state_dict(s["difficulty"])
