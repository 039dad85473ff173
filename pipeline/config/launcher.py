"""launcher.*: the hosts of a run.launcher=monarch job, asked of a scheduler through Monarch's job
API (pipeline/cluster/): hosts per role, devices per host, and the scheduler's own fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.config.errors import check, choice

_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+-\d+$")
_K8S_QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_K8S_NAME = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass
class SlurmConfig:
    """launcher.slurm.*: the batch job that starts one Monarch worker per node (launcher.job=slurm)."""

    partition: str = ""
    """#SBATCH --partition ('' = the cluster's default)."""
    account: str = ""
    """#SBATCH --account ('' = the user's default)."""
    qos: str = ""
    """#SBATCH --qos ('' = the default)."""
    time: str = ""
    """#SBATCH --time, Slurm's syntax: MM, HH:MM:SS or D-HH:MM:SS ('' = the partition's limit)."""
    sbatch: list[str] = field(default_factory=list)
    """Further #SBATCH options, one per entry, each starting with '-' (e.g. '--constraint=h100')."""
    python: str = ""
    """The Python that runs the workers on the nodes ('' = this controller's sys.executable: the same
    environment, on a shared filesystem)."""
    port: int = 22222
    """Node i's worker listens on port + i (1024..65000)."""
    exclusive: bool = True
    """#SBATCH --exclusive: whole nodes."""
    cpus_per_task: int = 0
    """#SBATCH --cpus-per-task (0 = not set)."""
    mem: str = ""
    """#SBATCH --mem, e.g. '0' (all of it) or '500G' ('' = not set)."""

    def check(self) -> None:
        check(not self.time or bool(_SLURM_TIME.match(self.time)), "launcher.slurm.time", self.time,
              "Slurm's time syntax: MM, HH:MM:SS or D-HH:MM:SS, quoted in a YAML file ('12:00:00': unquoted, "
              "YAML reads 12:00:00 as the number 43200)")
        for line in self.sbatch:
            check(isinstance(line, str) and line.startswith("-") and "\n" not in line, "launcher.slurm.sbatch", line,
                  "a list of sbatch options, each one line starting with '-' (e.g. '--constraint=h100')")
        check(1024 <= self.port <= 65000, "launcher.slurm.port", self.port, "1024..65000")
        check(self.cpus_per_task >= 0, "launcher.slurm.cpus_per_task", self.cpus_per_task, ">= 0")
        for key in ("partition", "account", "qos", "mem"):
            v = getattr(self, key)
            check(not any(c.isspace() for c in v), f"launcher.slurm.{key}", v, "one word, no spaces")


@dataclass
class KubernetesConfig:
    """launcher.kubernetes.*: one MonarchMesh resource per role, provisioned by the Monarch operator
    (launcher.job=kubernetes)."""

    namespace: str = "default"
    """Namespace of the MonarchMesh resources and their pods."""
    image: str = ""
    """Container image of the workers: this project and its environment installed (required)."""
    cpu: str = ""
    """CPU request and limit of each worker pod, a Kubernetes quantity ('32', '500m'; '' = not set)."""
    memory: str = ""
    """Memory request and limit of each worker pod ('256Gi'; '' = not set)."""
    shm: str = ""
    """Size of a memory-backed /dev/shm in each pod ('16Gi', for NCCL and the shm transport; '' = none)."""
    port: int = 26600
    """The workers' Monarch port (1024..65000)."""
    kubeconfig: str = ""
    """A kubeconfig file for a controller outside the cluster ('' = the in-cluster config)."""

    def check(self) -> None:
        check(bool(_K8S_NAME.match(self.namespace)), "launcher.kubernetes.namespace", self.namespace,
              "an RFC 1123 label: lowercase letters, digits and '-', at most 63 characters")
        for key in ("cpu", "memory", "shm"):
            v = getattr(self, key)
            check(not v or bool(_K8S_QUANTITY.match(v)), f"launcher.kubernetes.{key}", v,
                  "a Kubernetes quantity such as '32', '500m', '256Gi', or '' for none")
        check(1024 <= self.port <= 65000, "launcher.kubernetes.port", self.port, "1024..65000")
        check(not any(c.isspace() for c in self.image), "launcher.kubernetes.image", self.image,
              "an image reference without spaces")


@dataclass
class LauncherConfig:
    """launcher.*: the hosts a run.launcher=monarch run asks for, and from which scheduler."""

    job: str = "process"
    """process: every host a process on this machine, reached over TCP (a multi-host job without a
    cluster) | slurm: one sbatch job, one Monarch worker per node | kubernetes: one MonarchMesh per
    role, provisioned by the Monarch operator."""
    name: str = "pipeline"
    """The job's name (Slurm job name; prefix of the Kubernetes resources): lowercase letters, digits, '-'."""
    trainer_hosts: int = 1
    """Hosts of the trainer (1..1024): trainer.num_ranks / trainer_hosts ranks on each. The replay
    buffer runs on the first."""
    generator_hosts: int = 1
    """Hosts of the generators (0..4096; 0: on the trainer's hosts, generator.placement decides).
    Generator i runs on generator host i mod generator_hosts."""
    side_hosts: int = 0
    """Hosts of the reward model and the teacher (0..2; 0: on the trainer's first host). With 2 the
    teacher has a host of its own."""
    devices_per_host: int = 0
    """GPUs per host (0..64; 0: CPU only). Asked of the scheduler (Slurm --gpus-per-node, the pods'
    nvidia.com/gpu) and checked against the ranks and engines placed on a host."""
    start_timeout_s: float = 1800.0
    """Seconds the scheduler may take to start every host (queueing included; > 0). Past it the job
    is cancelled and the run exits 1."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        choice("launcher.job", self.job, ("process", "slurm", "kubernetes"))
        check(bool(_K8S_NAME.match(self.name)) and len(self.name) <= 40, "launcher.name", self.name,
              "lowercase letters, digits and '-', starting with a letter, at most 40 characters")
        check(1 <= self.trainer_hosts <= 1024, "launcher.trainer_hosts", self.trainer_hosts, "1..1024")
        check(0 <= self.generator_hosts <= 4096, "launcher.generator_hosts", self.generator_hosts, "0..4096")
        check(0 <= self.side_hosts <= 2, "launcher.side_hosts", self.side_hosts, "0..2")
        check(0 <= self.devices_per_host <= 64, "launcher.devices_per_host", self.devices_per_host, "0..64")
        check(self.start_timeout_s > 0, "launcher.start_timeout_s", self.start_timeout_s, "> 0")
        self.slurm.check()
        self.kubernetes.check()

    def hosts(self) -> dict[str, int]:
        """Hosts per role, in the order the job asks for them (roles with no host left out)."""
        out = {"trainer": self.trainer_hosts}
        if self.generator_hosts:
            out["generators"] = self.generator_hosts
        if self.side_hosts:
            out["sides"] = self.side_hosts
        return out


def check_launcher(cfg) -> None:
    """run.launcher=monarch: the hosts asked for can hold what the config places on them (a ConfigError
    naming the key before anything is submitted). `cfg` is the whole Config."""
    if cfg.run.launcher != "monarch":
        return
    lc, t, g = cfg.launcher, cfg.trainer, cfg.generator
    check(t.num_ranks % lc.trainer_hosts == 0, "launcher.trainer_hosts", lc.trainer_hosts,
          f"a divisor of trainer.num_ranks={t.num_ranks} (each trainer host runs num_ranks / trainer_hosts ranks)")
    check(g.num_generators >= lc.generator_hosts, "launcher.generator_hosts", lc.generator_hosts,
          f"at most generator.num_generators={g.num_generators} (a generator host without a generator is idle)")
    sides = bool(cfg.reward_model.path) + bool(cfg.teacher.hf_dir)
    check(lc.side_hosts <= sides, "launcher.side_hosts", lc.side_hosts,
          f"at most {sides}, the side meshes configured (reward_model.path, teacher.hf_dir): a side host without "
          "one is idle")
    apart = lc.generator_hosts > 0 or lc.trainer_hosts > 1
    check(not apart or cfg.weight_sync.transport != "shm", "weight_sync.transport", cfg.weight_sync.transport,
          "'rdma' or 'collective' when launcher.generator_hosts > 0 or launcher.trainer_hosts > 1 ('shm' reaches "
          "only processes on trainer rank 0's host)")
    check(lc.job != "kubernetes" or bool(lc.kubernetes.image), "launcher.kubernetes.image", lc.kubernetes.image,
          "a container image with this project installed (launcher.job=kubernetes)")
    per_host = t.num_ranks // lc.trainer_hosts
    if t.device == "cuda":
        check(lc.devices_per_host >= per_host, "launcher.devices_per_host", lc.devices_per_host,
              f">= {per_host}, the trainer ranks on each trainer host (trainer.device=cuda, trainer.num_ranks="
              f"{t.num_ranks}, launcher.trainer_hosts={lc.trainer_hosts})")
    if g.engine == "vllm" and lc.generator_hosts:
        need = -(-g.num_generators // lc.generator_hosts) * g.tensor_parallel_size
        check(lc.devices_per_host >= need, "launcher.devices_per_host", lc.devices_per_host,
              f">= {need}, the GPUs of the generators on one generator host (generator.num_generators="
              f"{g.num_generators} over launcher.generator_hosts={lc.generator_hosts}, tensor_parallel_size="
              f"{g.tensor_parallel_size})")
