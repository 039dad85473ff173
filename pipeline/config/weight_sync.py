"""weight_sync.*: how the trainer's weights reach the generators (pipeline/weightsync/)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.errors import check, choice


@dataclass
class WeightSyncConfig:
    """weight_sync.*: the transport of trainer -> generator weight pushes, its buckets and timeout."""

    transport: str = "shm"
    """rdma (Monarch RDMABuffer) | collective (torch.distributed broadcast, over trainer.backend) | shm
    (same-host shared memory)."""
    bucket_mb: int = 64
    """Bucket size in MiB (1..4096)."""
    timeout_s: float = 120.0
    """Seconds one push or pull may take before it fails loudly."""
    collective_host: str = ""
    """Address generators use to reach the trainer's rendezvous store (transport=collective); empty: this host's IP."""
    verify: str = "off"
    """Check that every generator serves the pushed version bit for bit (pipeline/weightsync/verify.py):
    'off' (or 0); 'every' push; or k (a positive integer): the first push and every k-th after it
    (pushes 1, 1+k, 1+2k, ...). When on, the first push of a run also starts by corrupting every
    generator's served weights (under the update's pause), so its check proves the push rewrote all
    of them. YAML and the command line read a bare off / on as a boolean: false means off, true every."""
    delta: bool = False
    """Delta push (pipeline/weightsync/delta.py): only the elements whose bits changed since the previous
    version cross the wire (indices and values), applied in place to the receiver's staged copy and
    checked against the trainer's per-tensor checksums. rdma and collective only (shm moves no bytes).
    A push is full when the delta would exceed half the full bytes, every full_every versions, and for
    a generator that does not hold the previous version."""
    full_every: int = 10
    """With delta: versions divisible by this are pushed full (0: only when needed)."""

    def __post_init__(self) -> None:
        choice("weight_sync.transport", self.transport, ("rdma", "collective", "shm"))
        check(1 <= self.bucket_mb <= 4096, "weight_sync.bucket_mb", self.bucket_mb, "1..4096")
        check(self.timeout_s > 0, "weight_sync.timeout_s", self.timeout_s, "> 0")
        check(_period(self.verify) is not None, "weight_sync.verify", self.verify,
              "'off', 'every' or a positive integer k (every k-th push)")
        check(self.full_every >= 0, "weight_sync.full_every", self.full_every, ">= 0")
        check(not (self.delta and self.transport == "shm"), "weight_sync.delta", self.delta,
              "false with weight_sync.transport=shm (shm moves no bytes: the engine maps the trainer's slot, "
              "so there is nothing for a delta to save); use rdma or collective")

    @property
    def verify_every(self) -> int:
        """weight_sync.verify as a period: 0 = off, 1 = every push, k = every k-th push."""
        return _period(self.verify) or 0

    def verified(self, push: int) -> bool:
        """Whether push number `push` (1 = the first of this run) is verified."""
        k = self.verify_every
        return k > 0 and (push - 1) % k == 0


def _period(value) -> int | None:
    """weight_sync.verify's period, None if the value is not one."""
    v = str(value).strip().lower()
    if v in ("off", "false"):
        return 0
    if v in ("every", "on", "true"):
        return 1
    return int(v) if v.isdigit() else None
