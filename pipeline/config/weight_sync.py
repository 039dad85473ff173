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

    def __post_init__(self) -> None:
        choice("weight_sync.transport", self.transport, ("rdma", "collective", "shm"))
        check(1 <= self.bucket_mb <= 4096, "weight_sync.bucket_mb", self.bucket_mb, "1..4096")
        check(self.timeout_s > 0, "weight_sync.timeout_s", self.timeout_s, "> 0")

