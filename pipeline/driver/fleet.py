"""The fleet: every actor of the run that runs on a proc of its own and can be restarted (the
generators and the reward model), one `MeshSlot` each, and the one list of live generator handles
that the weight sync reads.

    fleet = Fleet(cfg)
    await fleet.start(roles, placements)   # reward model first, then the generators (pipeline/cluster/roles.py)
    fleet.handles                    # generator i's handle while it takes part in pushes, else None
    slot = fleet.generators[i]       # handle, procs, pids, segments, incarnation, stats, version
    await slot.stop()                # shutdown -> stop its procs -> kill survivors -> unlink its segments
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence

from actors.generator import GeneratorActor
from actors.reward_model import RewardModelActor
from actors.teacher import TeacherActor
from pipeline import cleanup
from pipeline.config import Config
from pipeline.driver.calls import call_within
from pipeline.placement import Placement, describe
from pipeline.procs import alive, descendants, kill

log = logging.getLogger(__name__)

STOP_CALL_S = 15.0  # the actor's own shutdown (an engine's close) before its procs are stopped
STOP_PROCS_S = 30.0


class MeshSlot:
    """One restartable actor on its own proc: generator i or the reward model.

    Contract: `spawn` starts incarnation `incarnation` as the mesh `<name>r<incarnation>` (a unique
    name, so a late fault of a replaced mesh is told from its successor's by `incarnation_of`) and
    records what a cleanup after a hard kill needs: the pids of its proc and its children, and (on a
    one-host job, where those pids mean something here) the /dev/shm segments they held. `stop` is
    best effort and bounded (STOP_CALL_S + STOP_PROCS_S + 5 s): the actor's shutdown (unless
    `closed`), its proc mesh, then (`kill`) SIGKILL to whatever of its processes survived and unlink
    of the segments nobody holds any more. It never raises; a second stop does nothing. `live` is whether the handle takes part in the
    run (generation, pushes); a slot is out while it is restarted. `stats` is the latest answer to the
    supervisor's probe (None until the first probe of this incarnation); `version` the weights it was
    spawned with.

    Example:
        slot = MeshSlot("generator0", "generator0", host=0, local=True)
        await slot.spawn(host_mesh, GeneratorActor, (cfg, 0, slot.incarnation),
                         lambda a: a.setup.call_one(0, placement), timeout_s=600)
        ...
        slot.incarnation += 1           # the supervisor's restart: reports of the old one are stale now
        await slot.stop()
    """

    def __init__(self, name: str, label: str, host: int, local: bool):
        self.name = name  # its role in placement.json and the prefix of its mesh names
        self.label = label  # how logs name it
        self.host = host  # index of its host in the job
        self.local = local  # a one-host job: its pids are this host's
        self.incarnation = 0  # restarts so far
        self.handle: Any = None
        self.live = False
        self.procs: Any = None
        self.pids: list = []  # (pid, start) of its proc and its children at setup
        self.segments: set[str] = set()  # /dev/shm segments they held at setup
        self.stats: dict | None = None
        self.probe_max_s = 0.0  # the slowest health probe's round trip since the train loop last read it
        self.version = 0
        self.membership = "member"  # joining | member | leaving | removed: the pool's (pipeline/driver/pool.py);
        # the supervisor restarts members only

    @property
    def mesh_name(self) -> str:
        return f"{self.name}r{self.incarnation}"

    def incarnation_of(self, mesh_name: str) -> int | None:
        """The incarnation of this slot that a Monarch mesh name (`<name>r<k>-<suffix>`) is, or None."""
        head, sep, _ = mesh_name.partition("-")
        prefix = f"{self.name}r"
        if sep and head.startswith(prefix) and head[len(prefix):].isdigit():
            return int(head[len(prefix):])
        return None

    def proc_dead(self) -> str | None:
        """On a one-host job, why its proc is known dead (Monarch may take ~30 s to say so), else None."""
        if self.local and self.pids and not alive(self.pids[0]):
            return f"its process {self.pids[0][0]} died"
        return None

    async def spawn(self, host_mesh: Any, actor: type, args: Sequence[Any],
                    setup: Callable[[Any], Awaitable[dict]], timeout_s: float) -> dict:
        """Start this incarnation on its host and run its setup (bounded); returns setup's answer.
        The handle is stored but not live: the caller makes it live once it is wired in."""
        if "hosts" in host_mesh.sizes:
            host_mesh = host_mesh.slice(hosts=self.host)
        self.procs = host_mesh.spawn_procs(per_host={"procs": 1})
        handle = self.procs.spawn(self.mesh_name, actor, *args)
        info = await call_within(f"{self.label} setup", setup(handle), timeout_s)
        self.handle, self.pids, self.stats = handle, info["procs"], None
        if self.local:  # its engine's segments, unlinked after it stops even if all its holders died first
            self.segments = cleanup.held_by(p for p, _ in self.pids)
        return info

    async def stop(self, closed: bool = False) -> None:
        """Take it out and stop it (see the class docstring); `closed`: its shutdown ran already."""
        handle, procs, pids = self.handle, self.procs, self.pids
        self.handle, self.procs, self.live, self.pids = None, None, False, []
        if handle is None and procs is None and not pids:  # never spawned, or stopped already
            return
        tree, held = list(pids), set()
        if self.local:  # the engine's message queues: unlinked by vLLM on a clean exit, not after a kill
            tree += [d for root, _ in pids for d in descendants(root) if d not in tree]
            held, self.segments = cleanup.held_by(p for p, _ in tree) | self.segments, set()
        clean = closed
        if handle is not None and not closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.shutdown.call_one(), STOP_CALL_S)
                clean = True
        if procs is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(procs.stop(), STOP_PROCS_S)
        if self.local:
            await self.kill(tree, held, clean)

    async def kill(self, tree: list, held: set[str], clean: bool) -> None:
        """After its proc mesh stopped (one host only): SIGKILL whatever of `tree` (its processes)
        survived, since an engine core outlives a parent killed with SIGKILL, wait (bounded) until
        they are reaped, then unlink the segments of `held` that nobody maps any more. `clean`: its
        shutdown ran, so survivors are vLLM's exiting helpers (logged at INFO, else WARNING)."""
        killed = kill(tree)
        deadline = time.monotonic() + 5.0  # a SIGKILLed process holds its mappings until it is reaped
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cleanup._sweep_lora_dirs()  # a generator killed hard leaves its LoRA adapter directory behind
        gone = cleanup.unlink_orphaned(held)
        if gone:
            log.info("%s: removed %d shared-memory segments it left: %s", self.label, len(gone), " ".join(gone))
        if killed:
            log.log(logging.INFO if clean else logging.WARNING, "%s: killed leftover processes %s", self.label, killed)


class LiveHandles(Sequence):
    """Generator i's handle while its slot is live, else None: the list `WeightSync` reads. Its
    writes (detach: None; rejoin: the replacement's handle) set the slot's `live`, so the fleet's
    slots stay the one record of who is serving."""

    def __init__(self, slots: list[MeshSlot]):
        self._slots = slots

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i):
        s = self._slots[i]
        return s.handle if s.live else None

    def __setitem__(self, i: int, handle: Any) -> None:
        s = self._slots[i]
        if handle is not None and handle is not s.handle:
            raise ValueError(f"{s.label}: a handle that is not its current incarnation's cannot go live")
        s.live = handle is not None


class Fleet:
    """The generators and the reward model: their slots, their placement.json, their spawning.

    Contract: `start` spawns the reward model (reward_model.path) before the generators, so each
    generator is handed its handle at setup; generators spawn concurrently. `handles` is the one
    live view of the generator handles (LiveHandles); the weight sync and everything that calls the
    generators read it, and only WeightSync.detach / rejoin and `start` change it. `placement` is
    every proc's placement by role, written to out_dir/placement.json at every spawn (restarts
    included). Restarts are the Supervisor's; the slots' cleanup is MeshSlot.stop.

    Example:
        fleet = Fleet(cfg)
        await fleet.start(Roles.one_mesh(cfg, this_host()), placements)
        sync = WeightSync(trainer, fleet.handles, cfg)
        for slot in fleet.live_generators(): ...
    """

    def __init__(self, cfg: Config, placement: dict | None = None):
        self.cfg = cfg
        n = cfg.generator.num_generators
        self.generators = [MeshSlot(f"generator{i}", f"generator{i}", 0, True) for i in range(n)]
        self.reward_model = MeshSlot("reward_model", "reward model", 0, True) if cfg.reward_model.path else None
        self.teacher = MeshSlot("teacher", "teacher", 0, True) if cfg.teacher.hf_dir else None
        self.handles = LiveHandles(self.generators)
        self.placement: dict = placement if placement is not None else {}
        self.host_mesh: Any = None  # the generators' host mesh (roles.generators)
        self.roles: Any = None  # every role's host mesh (pipeline/cluster/roles.py), set by start
        self.placements: list[Placement] = []

    def slots(self) -> Iterator[MeshSlot]:
        yield from self.generators
        yield from self.sides()

    def sides(self) -> list[MeshSlot]:
        """The scoring meshes beside the generators: the reward model and the teacher (those configured)."""
        return [s for s in (self.reward_model, self.teacher) if s is not None]

    def is_side(self, slot: MeshSlot) -> bool:
        return slot is not None and (slot is self.reward_model or slot is self.teacher)

    @staticmethod
    def attach_call(slot: MeshSlot) -> str:
        """The generator endpoint that hands it this side mesh's handle."""
        return "attach_teacher" if slot.name == "teacher" else "attach_reward_model"

    def side_handle(self, slot: MeshSlot | None) -> Any:
        return slot.handle if slot is not None and slot.live else None

    async def attach_sides(self, i: int, gen: Any) -> None:
        """Hand generator i every live side mesh (while one is restarted, its restart attaches it)."""
        for side in self.sides():
            h = self.side_handle(side)
            if h is not None:
                name = self.attach_call(side)
                await call_within(f"generator{i}.{name}", getattr(gen, name).call_one(h), 60)

    def live_generators(self) -> list[tuple[int, MeshSlot]]:
        return [(i, s) for i, s in enumerate(self.generators) if s.live]

    def active_generators(self) -> list[tuple[int, MeshSlot]]:
        """Every generator of the pool now, live or restarting, but not one that is joining, leaving or gone."""
        return [(i, s) for i, s in enumerate(self.generators) if s.membership == "member"]

    def new_generator(self, host: int, placement: Placement) -> int:
        """A slot for one more generator (the pool's): the next index, never one a removed slot had,
        so lessees, stream ids, placement.json and faults.jsonl name one generator each."""
        i = len(self.generators)
        slot = MeshSlot(f"generator{i}", f"generator{i}", host, self.generators[0].local)
        slot.membership = "joining"
        self.generators.append(slot)
        self.placements.append(placement)
        return i

    def forget(self, slot: MeshSlot) -> None:
        """A removed generator leaves placement.json (its index is not reused)."""
        slot.membership = "removed"
        if self.placement.pop(slot.name, None) is not None:
            self.write_placement()

    async def refresh_stats(self, timeout_s: float) -> None:
        """Ask every live generator for its stats now and cache the answers (`slot.stats`); one that
        does not answer keeps its cached ones (a failure is the supervisor's to notice)."""
        live = [s for _, s in self.live_generators()]
        res = await asyncio.gather(*[asyncio.wait_for(s.handle.stats.call_one(), timeout_s) for s in live],
                                   return_exceptions=True)
        for slot, r in zip(live, res):
            if not isinstance(r, BaseException):
                slot.stats = r

    async def start(self, roles: Any, placements: list[Placement], hf_dir: str | None = None) -> None:
        """Spawn the reward model, then every generator (on `roles.generator_host[i]` of
        `roles.generators`, placed by `placements[i]`), serving `hf_dir` (default: the model) as
        version 0; every generator is live afterwards. `roles`: pipeline/cluster/roles.py."""
        self.roles, self.host_mesh, self.placements = roles, roles.generators, placements
        for slot in self.slots():
            slot.local = roles.local
        for slot, h in zip(self.generators, roles.generator_host):
            slot.host = h
        for side in self.sides():
            await self.spawn_side(side)
        await asyncio.gather(*[self.spawn_generator(i, hf_dir, 0) for i in range(len(self.generators))])
        for s in self.generators:
            s.live = True

    async def spawn_generator(self, i: int, hf_dir: str | None, version: int) -> Any:
        """Generator i's current incarnation, its engine serving `hf_dir` (default: the model) as
        `version`, handed the reward model when one is live. Not live yet: see Fleet's contract."""
        cfg = self.cfg if hf_dir is None else dataclasses.replace(
            self.cfg, model=dataclasses.replace(self.cfg.model, hf_dir=hf_dir))
        slot = self.generators[i]
        info = await slot.spawn(self.host_mesh, GeneratorActor, (cfg, i, slot.incarnation),
                                lambda a: a.setup.call_one(version, self.placements[i]),
                                self.cfg.generator.start_timeout_s)
        slot.version = version
        self._placed(slot, info["placement"])
        log.info("placement: generator%d (pid %d): %s", i, info["placement"]["pid"], describe(info["placement"]))
        await self.attach_sides(i, slot.handle)
        return slot.handle

    async def spawn_side(self, slot: MeshSlot) -> Any:
        """A side mesh's current incarnation (the reward model, pipeline/reward_model.py, or the teacher,
        pipeline/teacher.py) on its own proc on its side host (roles.side); live."""
        teacher = slot is self.teacher
        sc = self.cfg.teacher if teacher else self.cfg.reward_model
        info = await slot.spawn(self.roles.side(slot.name), TeacherActor if teacher else RewardModelActor,
                                (self.cfg, slot.incarnation), lambda a: a.setup.call_one(), sc.start_timeout_s)
        self._placed(slot, info["placement"])
        log.info("%s %s loaded in %.1fs (pid %d): %s; streaming chunks of %d tokens", slot.label,
                 sc.hf_dir if teacher else sc.path, info["load_s"], info["pid"], describe(info["placement"]),
                 sc.chunk_tokens)
        slot.live = True
        return slot.handle

    def _placed(self, slot: MeshSlot, placement: dict) -> None:
        self.placement[slot.name] = placement
        self.write_placement()

    def write_placement(self) -> None:
        """out_dir/placement.json: every proc's role, pid, cores, threads and GPUs, kept current
        across restarts (where to look, or what to kill, when debugging a run)."""
        out = Path(self.cfg.run.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "placement.json.tmp"
        tmp.write_text(json.dumps(self.placement, indent=2, default=str))
        tmp.replace(out / "placement.json")
