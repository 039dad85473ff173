"""Roles: which host mesh each role of a run is placed on.

    roles = Roles.one_mesh(cfg, this_host())          # local, torchrun: one mesh, generator.placement decides
    roles = Roles.from_job(cfg, job.state())          # run.launcher=monarch: a host mesh per role
    roles.trainer                                     # the trainer's hosts ('hosts' dim: trainer ranks split evenly)
    roles.buffer                                      # the replay buffer's host (the trainer's first)
    roles.generators, roles.generator_host[i]         # generator i runs on generators.slice(hosts=generator_host[i])
    roles.side("teacher")                             # the reward model's or the teacher's host

Contract: `generator_host` has one entry per generator; `apart` says the generators' hosts are not
the trainer's (so no trainer rank shares their cores or GPUs); `local` says every host is a process
of this machine (pids in placement.json are this machine's, and a slot's leftovers can be killed
here). `add_generator` gives the host of a generator added while the run goes on (round-robin).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _host(mesh: Any, i: int) -> Any:
    return mesh.slice(hosts=i) if "hosts" in mesh.sizes else mesh


def _count(mesh: Any) -> int:
    return mesh.sizes.get("hosts", 1)


@dataclass
class Roles:
    trainer: Any
    generators: Any
    sides: Any
    generator_host: list[int] = field(default_factory=list)
    apart: bool = False
    local: bool = True

    @property
    def buffer(self) -> Any:
        return _host(self.trainer, 0)

    @property
    def trainer_hosts(self) -> int:
        return _count(self.trainer)

    def side(self, name: str) -> Any:
        """The reward model on the first side host, the teacher on the last."""
        return _host(self.sides, _count(self.sides) - 1 if name == "teacher" else 0)

    def remote_generators(self) -> list[str]:
        """Generators not on trainer rank 0's host, as 'generator<i> on host <h>'."""
        return [f"generator{i} on {'generator host' if self.apart else 'host'} {h}"
                for i, h in enumerate(self.generator_host) if self.apart or h != 0]

    def add_generator(self, active: list[int] | None = None) -> int:
        """The host index of one more generator: the generator host with the fewest generators (of
        `active`, the hosts of the generators in the pool now; default: every generator placed so far)."""
        n = _count(self.generators)
        hosts = self.generator_host if active is None else active
        counts = [hosts.count(h) for h in range(n)]
        h = counts.index(min(counts)) if self.apart or n > 1 else 0
        self.generator_host.append(h)
        return h

    @classmethod
    def one_mesh(cls, cfg: Any, host: Any) -> "Roles":
        """Every role on one host mesh (this host, or torchrun's nodes): the trainer spans it, the
        buffer and the side meshes are on its host 0, the generators on host 0 or spread."""
        n = _count(host)
        spread = cfg.generator.placement == "spread"
        return cls(trainer=host, generators=host, sides=_host(host, 0),
                   generator_host=[i % n if spread else 0 for i in range(cfg.generator.num_generators)],
                   apart=False, local=n == 1)

    @classmethod
    def from_job(cls, cfg: Any, state: Any, local: bool) -> "Roles":
        """The host meshes of a Monarch job's state (pipeline/cluster/jobs.py names them trainer,
        generators, sides); a role without hosts of its own shares the trainer's."""
        lc = cfg.launcher
        trainer = state.trainer
        if lc.generator_hosts:
            generators, apart = state.generators, True
            hosts = [i % lc.generator_hosts for i in range(cfg.generator.num_generators)]
        else:
            spread = cfg.generator.placement == "spread"
            generators, apart = trainer, False
            hosts = [i % lc.trainer_hosts if spread else 0 for i in range(cfg.generator.num_generators)]
        sides = state.sides if lc.side_hosts else _host(trainer, 0)
        return cls(trainer=trainer, generators=generators, sides=sides, generator_host=hosts, apart=apart,
                   local=local)
