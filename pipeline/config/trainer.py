"""trainer.*: the trainer ranks, their optimizer and loss (pipeline/trainer/), and trainer.lora.*."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.config.errors import check, choice, id_set
from pipeline.config.recipes import LOSS_PARTS, SEQUENCE_CORRECTIONS, resolve_trainer

LORA_TARGETS = {"wqkv": "attention.qkv_linear.wqkv", "wo": "attention.wo", "w1": "feed_forward.w1",
                "w2": "feed_forward.w2", "w3": "feed_forward.w3"}
"""trainer.lora.targets names -> the torchtitan module path inside a block (pipeline/lora.py adapts them)."""

@dataclass
class LoraConfig:
    """trainer.lora.*: low-rank adapters instead of full fine-tuning (rank 0: off)."""

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
        check(self.rank in (0, 8, 16, 32, 64, 128, 256), "trainer.lora.rank", self.rank,
              "0 (off) or one of 8, 16, 32, 64, 128, 256 (the ranks vLLM serves)")
        check(self.alpha > 0 and math.isfinite(self.alpha), "trainer.lora.alpha", self.alpha, "> 0")
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        check(bool(names) and set(names) <= set(LORA_TARGETS) and len(set(names)) == len(names), "trainer.lora.targets",
              self.targets, "comma-separated, each once: " + ", ".join(LORA_TARGETS))


@dataclass
class TrainerConfig:
    """trainer.*: ranks and parallelism, optimizer, loss and off-policy correction, placement, timeouts."""

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
    output head over the second (pipeline/trainer/parallel.py). On CPU with gloo and on GPU with nccl."""
    lr: float = 3e-4
    """AdamW learning rate (0 < lr <= 1)."""
    warmup_steps: int = 0
    """Linear LR warmup, in optimizer steps (>= 0); a batch takes minibatches * epochs of them."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    grad_clip: float = 1.0
    """Max global grad norm (> 0)."""
    recipe: str = "none"
    """Loss recipe preset: none | grpo | dapo | dr_grpo | gspo | cispo | opd | opd+grpo (pipeline/config/recipes.py RECIPES;
    docs/training.md "Loss recipes"). It sets the parts below marked "recipe part"; a part the config names itself wins."""
    clip_eps: float | None = None
    """Recipe part. PPO clip ε (0 < ε < 1), both sides unless clip_eps_low / clip_eps_high say otherwise (0.2)."""
    clip_eps_low: float | None = None
    """Recipe part. ε_low: the ratio (or CISPO's weight) is clipped below at 1 − ε_low (0 < ε_low <= 1;
    1: no lower bound). Default: clip_eps."""
    clip_eps_high: float | None = None
    """Recipe part. ε_high: clipped above at 1 + ε_high (> 0; DAPO's clip-higher 0.28). Default: clip_eps."""
    dual_clip: float | None = None
    """Recipe part. c of dual-clip PPO (3.0): for negative-advantage tokens the objective is bounded at c·A, so a
    token whose ratio has run far above 1 cannot push the loss without limit; 0 disables; otherwise > 1.
    Only with weight_form=ppo (CISPO's weight is bounded already)."""
    ratio_level: str | None = None
    """Recipe part. token | sequence (token): sequence is GSPO's length-normalised ratio
    s_i = exp(mean_t log r_t), clipped per sequence, with GSPO-token's gradient form."""
    weight_form: str | None = None
    """Recipe part. ppo | cispo (ppo): ppo is min(r·A, clip(r)·A); cispo is sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π_θ
    (MiniMax-M1), so no token's gradient is dropped by the clip."""
    distill_coef: float | None = None
    """Recipe part. Weight of the teacher's per-token advantage A_t = −(log π_old(y_t) − log π_teacher(y_t))
    (the reverse-KL estimator on the sampled token, no discounting), added to every loss token's
    advantage (>= 0; 0: off; opd, opd+grpo: 1). Needs teacher.hf_dir."""
    reward_coef: float | None = None
    """Recipe part. Weight of the task's group advantage in every token's advantage (>= 0; 1; opd: 0,
    distillation alone). The reward is still computed, logged and evaluated."""
    minibatches: int = 1
    """Optimizer steps per batch per epoch: the batch's rows split into this many near-equal minibatches
    (1..1024, at most the batch's sample count buffer.batch_groups * buffer.group_size). Above 1 the rows
    are shuffled anew each epoch, row by row, by a permutation drawn from run.seed and the policy version
    (the same on every trainer rank and in a rerun)."""
    epochs: int = 1
    """Passes over the batch (1..100); π_old stays the policy from before the batch's first step."""
    correction: str = "tis"
    """Off-policy correction: none | tis | seq_is | geo_is (seq_is's geometric mean: the length-normalised
    sequence weight, GSPO's) | mis (masked IS) | icepop (mis with the window [0.5, 5]) | mis_balance (multiple IS with the
    balance heuristic, for consistent rollouts: generator.on_update=drain or run.mode=sync, and
    generator.carry_over=keep, and single-turn tasks unless run.mode=sync; every q_j is the trainer's,
    from snapshots of the trainable parameters of the last max_staleness versions) | ppo_is | vanilla_is |
    geo_mask (a sequence kept at weight 1 while its geo_is ratio is in [mis_low, mis_high], else dropped).
    The formulas: pipeline/loss_parts.py CORRECTIONS."""
    is_cap: float = 2.0
    """C: truncation cap of TIS / sequence IS (>= 1)."""
    mis_low: float | None = None
    """Masked IS keeps tokens with ratio in [mis_low, mis_high] (geo_mask: sequences; 0 <= low < 1; 0.5)."""
    mis_high: float | None = None
    """Upper bound of the masked-IS ratio window (> 1; 2.0, and 5.0 with correction=icepop)."""
    aggregation: str | None = None
    """Recipe part. Loss aggregation: token_mean (Σ over the batch's tokens / their count) | seq_mean (mean over
    sequences of each one's token mean) | constant (Σ / (sequences × generator.max_new_tokens), Dr. GRPO; a
    multi-turn task's rollouts: × task.max_total_tokens, their budget)."""
    overlong_buffer: int | None = None
    """Recipe part. DAPO's soft overlong penalty over the last this-many tokens of the length budget L
    (generator.max_new_tokens, or a prompt's own max_new_tokens): a response of length n > L − buffer gets
    overlong_penalty · (L − buffer − n) / buffer added to its reward before the group advantages (0: off;
    dapo: L // 5). A multi-turn rollout: each model turn against L and its whole completion (observations
    included) against task.max_total_tokens, the most negative penalty counting."""
    overlong_penalty: float | None = None
    """Recipe part. Scale of the overlong penalty at the end of the budget (> 0; 1.0)."""
    overlong_filter: bool | None = None
    """Recipe part. Truncated samples (finish_reason 'length') get no loss tokens (DAPO's overlong filtering);
    they still count in their group's advantages."""
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
    """Samples per forward/backward (0: the whole batch at once). With more than one micro-batch a
    rank's rows are taken longest first (unless grad_variance), and every forward is cut to its
    longest row's last loss token: right padding costs nothing then. The step's sums do not depend on
    the split (the loss denominators are the minibatch's)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the loss's output head (pipeline/trainer/chunked.py): the log-probs of the
    sampled tokens, the entropy and their gradients are computed chunk by chunk over tokens, so the
    [tokens, vocab] float32 logits are never built, and the head runs on the loss tokens only (not
    on prompts and padding); 0 builds them whole (the unchunked path, also what tensor parallelism
    with an untied output head uses). >= 0."""
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
        resolve_trainer(self)
        check(1 <= self.num_ranks <= 4096, "trainer.num_ranks", self.num_ranks, "1..4096")
        choice("trainer.device", self.device, ("cpu", "cuda"))
        choice("trainer.backend", self.backend, ("gloo", "nccl"))
        check(not (self.device == "cpu" and self.backend == "nccl"), "trainer.backend", self.backend,
              "'gloo' when trainer.device='cpu'")
        check(1 <= self.tensor_parallel <= self.num_ranks and self.num_ranks % self.tensor_parallel == 0,
              "trainer.tensor_parallel", self.tensor_parallel,
              f"a divisor of trainer.num_ranks={self.num_ranks} (the ranks form a num_ranks/tp x tp mesh)")
        check(0 < self.lr <= 1, "trainer.lr", self.lr, "0 < lr <= 1")
        check(self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, ">= 0")
        check(self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, ">= 0")
        check(self.grad_clip > 0, "trainer.grad_clip", self.grad_clip, "> 0")
        check(0 < self.clip_eps < 1, "trainer.clip_eps", self.clip_eps, "0 < eps < 1")
        check(0 < self.clip_eps_low <= 1, "trainer.clip_eps_low", self.clip_eps_low, "0 < eps_low <= 1")
        check(0 < self.clip_eps_high and math.isfinite(self.clip_eps_high), "trainer.clip_eps_high",
              self.clip_eps_high, "> 0")
        check(self.dual_clip == 0 or self.dual_clip > 1, "trainer.dual_clip", self.dual_clip, "0 (off) or > 1")
        choice("trainer.ratio_level", self.ratio_level, LOSS_PARTS["ratio_level"])
        choice("trainer.weight_form", self.weight_form, LOSS_PARTS["weight_form"])
        check(self.overlong_buffer is None or self.overlong_buffer >= 0, "trainer.overlong_buffer",
              self.overlong_buffer, ">= 0 (0: off)")
        check(self.overlong_penalty > 0, "trainer.overlong_penalty", self.overlong_penalty, "> 0")
        check(self.distill_coef >= 0 and math.isfinite(self.distill_coef), "trainer.distill_coef", self.distill_coef,
              ">= 0 (0: no distillation)")
        check(self.reward_coef >= 0 and math.isfinite(self.reward_coef), "trainer.reward_coef", self.reward_coef,
              ">= 0")
        check(self.distill_coef > 0 or self.reward_coef > 0, "trainer.reward_coef", self.reward_coef,
              "> 0 when trainer.distill_coef is 0 (the loss would have no signal)")
        check(1 <= self.minibatches <= 1024, "trainer.minibatches", self.minibatches, "1..1024")
        check(1 <= self.epochs <= 100, "trainer.epochs", self.epochs, "1..100")
        choice("trainer.correction", self.correction, LOSS_PARTS["correction"])
        if self.ratio_level == "sequence":
            check(self.correction in SEQUENCE_CORRECTIONS, "trainer.correction", self.correction,
                  f"one of {', '.join(SEQUENCE_CORRECTIONS)} with trainer.ratio_level='sequence' (recipe "
                  f"{self.recipe!r}): a per-token weight on a sequence-level ratio reweights the tokens of one "
                  "sequence unevenly, and seq_is / mis_balance weigh a sequence by its whole likelihood ratio, "
                  "whose truncated weight falls with length, where GSPO's ratio is length-normalised; "
                  "geo_is is the length-normalised sequence weight")
            check(self.weight_form == "ppo", "trainer.weight_form", self.weight_form,
                  "'ppo' with trainer.ratio_level='sequence' (CISPO's weight is per token)")
        check(self.is_cap >= 1, "trainer.is_cap", self.is_cap, ">= 1")
        check(0 <= self.mis_low < 1, "trainer.mis_low", self.mis_low, "0 <= low < 1")
        check(self.mis_high > 1, "trainer.mis_high", self.mis_high, "> 1")
        choice("trainer.aggregation", self.aggregation, LOSS_PARTS["aggregation"])
        check(self.kl_coef >= 0, "trainer.kl_coef", self.kl_coef, ">= 0")
        check(self.entropy_coef >= 0, "trainer.entropy_coef", self.entropy_coef, ">= 0")
        check(self.entropy_target >= 0, "trainer.entropy_target", self.entropy_target, ">= 0 (0: off)")
        check(self.entropy_adapt_rate > 0, "trainer.entropy_adapt_rate", self.entropy_adapt_rate, "> 0")
        check(self.entropy_coef_max >= self.entropy_coef, "trainer.entropy_coef_max", self.entropy_coef_max,
              f">= trainer.entropy_coef ({self.entropy_coef})")
        choice("trainer.kl_estimator", self.kl_estimator, ("k1", "k3"))
        check(self.micro_batch_size >= 0, "trainer.micro_batch_size", self.micro_batch_size, ">= 0")
        check(self.logprob_chunk_tokens >= 0, "trainer.logprob_chunk_tokens", self.logprob_chunk_tokens,
              ">= 0 (0: the unchunked loss)")
        check(not self.grad_variance or self.micro_batch_size > 0, "trainer.micro_batch_size",
              self.micro_batch_size, "> 0 with trainer.grad_variance (its micro-batches are the chunks)")
        check(self.cpu_threads >= 0, "trainer.cpu_threads", self.cpu_threads, ">= 0")
        id_set("trainer.cpus", self.cpus)
        check(not id_set("trainer.devices", self.devices, "GPU") or self.device == "cuda", "trainer.devices",
              self.devices, "'' when trainer.device='cpu'")
        check(self.init_timeout_s > 0, "trainer.init_timeout_s", self.init_timeout_s, "> 0")
        check(self.step_timeout_s > 0, "trainer.step_timeout_s", self.step_timeout_s, "> 0")
        check(self.max_skipped_steps >= 1, "trainer.max_skipped_steps", self.max_skipped_steps, ">= 1")
