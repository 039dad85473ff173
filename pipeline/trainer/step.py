"""TrainCore: the torch-level trainer of one rank (no Monarch): the RL and SFT steps over a model that
parallel.py builds, with AdamW and the LR schedule; state.py holds its export and checkpoints,
snapshots.py what a step remembers besides the weights, batches.py its minibatch plans and log-probs.

PPO minibatches and epochs: one batch is one policy version. log π_old is taken once, with the
weights from before the batch's first optimizer step; then each of `trainer.epochs` passes splits
the rows into `trainer.minibatches` near-equal minibatches by a fresh permutation (`minibatch_rows`:
drawn from run.seed, the policy version and the epoch, so every rank and a rerun draw the same), and
each minibatch gets a forward/backward (accumulated over micro-batches of
`trainer.micro_batch_size`), a gradient clip and an optimizer step. The PPO ratio
π_θ / π_old leaves 1 after the first of them, which is what makes the clip bite; the IS weight keeps
correcting μ → π_old with the sampler's logprobs (decoupled objective, see pipeline/losses.py). The
LR scheduler steps once per optimizer step, so trainer.warmup_steps counts optimizer steps. With
minibatches = epochs = 1 this is one plain step on the whole batch.

Data parallelism: each minibatch is split across the fsdp axis (parallel.py), data-parallel rank r
training on `tensor_split(minibatch_rows, dp_world)[r]`, so the union over ranks is the single-rank
minibatch. Loss denominators are the minibatch's *global* token / sequence counts (every rank sees
the full batch, so no collective is needed for them), and each rank's loss is scaled by `dp_world`
because FSDP2 averages gradients across ranks; the sum of shard gradients then equals the
single-rank gradient. Every rank runs the same number of micro-batches per minibatch, computed from
the global minibatch size (an empty one runs a zero-weighted row), so FSDP collectives always pair up.

Precision: model.dtype is the compute dtype and the generators'; the optimizer steps float32
master weights (parallel.py), and pushes and exports are cast to model.dtype (state.py).

Contract: every public method is a collective: every rank calls it with the same arguments (the full
Batch; each rank takes its shard), in the same order, and gets the same metrics. A refused or skipped
step (pipeline/trainer/errors.py) raises on every rank alike and leaves the version where it was and
no gradient behind (a batch's earlier minibatch steps stay applied, see `train_step`).

Example:
    core = TrainCore.from_config(cfg, rank, world)       # torch.distributed already initialised when world > 1
    metrics = core.train_step(batch)         # one version; raises a skip or a fatal error
    core.sft_step(input_ids, loss_mask, lr)  # the warm start: no version, no schedule step
    core.state.export_hf(out_dir)            # vLLM-loadable HF directory (collective; rank 0 writes)
    core.save(path, data_state); data_state = core.load(path)
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from pipeline import losses
from pipeline.config import Config, ModelConfig, TrainerConfig
from pipeline.loss_parts import loss_spec, step_metrics
from pipeline.models import read_arch
from pipeline.models.hf import model_dir
from pipeline.trainer import chunked
from pipeline.trainer.batches import logprobs, minibatch_plan, minibatch_rows, spans
from pipeline.trainer.checks import check_batch, check_sft
from pipeline.trainer.errors import (BadBatchError, EmptyBatchError, NonFiniteLossError, NonFiniteWeightsError,
                                     TooManySkippedSteps)
from pipeline.trainer.parallel import Parallel, local
from pipeline.trainer.snapshots import GradChunks, Proximal, Score, Snapshots
from pipeline.trainer.state import TrainerState
from pipeline.types import Batch


class TrainCore:
    """One trainer rank: the steps, and the counters a checkpoint carries (module docstring)."""

    def __init__(self, tcfg: TrainerConfig, model: ModelConfig, *, seed: int, temperature: float,
                 max_staleness: int, max_new_tokens: int, rank: int = 0, world: int = 1) -> None:
        """The trainer's own section, the model, and the four values it reads from others: `seed`
        (run.seed: the initial weights' randomness and the minibatch permutation), `temperature`
        (generator.temperature: the learner scores the distribution the sampler drew from),
        `max_staleness` (buffer.max_staleness: how many versions mis_balance keeps snapshots of) and
        `max_new_tokens` (generator.max_new_tokens: Dr. GRPO's normaliser when a batch names none)."""
        self.tcfg, self.seed, self.max_new_tokens = tcfg, seed, max_new_tokens
        self.loss = loss_spec(self.tcfg)  # the recipe's parts, resolved once
        self.par = Parallel(self.tcfg, rank, world)
        self.device = self.par.device
        torch.manual_seed(seed)
        hf_dir = model_dir(model)
        self.vocab_size = read_arch(hf_dir).vocab_size
        # model.dtype is the compute dtype and the generators'; the trained weights stay float32 (parallel.py)
        dtype = getattr(torch, model.dtype)
        self.model, self.adapter = self.par.build(hf_dir, dtype, self.tcfg.lora)
        self.ref_model = None
        if self.tcfg.kl_coef > 0:  # frozen reference for the KL penalty: initial policy until set_reference
            self.ref_model, _ = self.par.build(hf_dir, dtype, self.tcfg.lora, frozen=True)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.tcfg.lr,
                                           weight_decay=self.tcfg.weight_decay)
        warm = self.tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warm + 1)) if warm else 1.0)
        self.state = TrainerState(self.tcfg, self.par, hf_dir, self.model, self.adapter, self.ref_model,
                                  self.optimizer, self.scheduler, dtype)
        # The sampler's logprobs are of the temperature-scaled distribution it sampled from
        # (generator.logprobs_mode=processed, enforced by Config), so the learner scores the same.
        self.temperature = temperature
        # trainer.logprob_chunk_tokens: the loss in token chunks (chunked.py), unless tensor parallelism shards
        # the output head over the vocabulary, which keeps the full logits
        self.chunk = self.tcfg.logprob_chunk_tokens if chunked.chunkable(self.model) else 0
        self.snapshots = Snapshots(self.model, max_staleness, self._scorer(self.model), dtype)
        # the counters trainer_state.json carries (save / load)
        self.version = self.samples_seen = self.skipped_steps = 0
        self.entropy_coef = self.tcfg.entropy_coef  # adapted after each step when trainer.entropy_target > 0
        self.consecutive_skips = 0  # not checkpointed: a resumed run starts a new streak

    @classmethod
    def from_config(cls, cfg: Config, rank: int = 0, world: int = 1) -> "TrainCore":
        """The core of a whole Config: its trainer and model sections and the four values named above."""
        return cls(cfg.trainer, cfg.model, seed=cfg.run.seed, temperature=cfg.generator.temperature,
                   max_staleness=cfg.buffer.max_staleness, max_new_tokens=cfg.generator.max_new_tokens,
                   rank=rank, world=world)

    def _scorer(self, model: torch.nn.Module) -> Score:
        """Token ids (any device) -> `model`'s log-probs at the sampling temperature."""
        return lambda ids: logprobs(model, ids.to(self.device), self.temperature, self._chunk(model))[0]

    @staticmethod
    def _timed(score: Score, acc: list[float]) -> Score:
        def timed(ids):
            t0 = time.perf_counter()
            try:
                return score(ids)
            finally:
                acc[0] += time.perf_counter() - t0
        return timed

    def _chunk(self, model: torch.nn.Module) -> int:
        return self.chunk if model is self.model or chunked.chunkable(model) else 0

    def _logprobs(self, batch: Batch, rows: torch.Tensor, entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's log-probs (and entropy) of `rows` of the batch, [n, T-1] like its loss_mask: the
        forward runs on the rows cut to the longest of their `spans` (what follows changes no loss
        term), the output head on their loss tokens only (`positions`); 0 off the loss mask."""
        width = batch.input_ids.shape[1]
        keep = max(int(spans(batch.loss_mask[rows]).max()), 2)  # at least one predicted token
        ids = batch.input_ids[rows, :keep].to(self.device)
        positions = batch.loss_mask[rows, 1:keep].to(self.device) > 0
        lp, ent = logprobs(self.model, ids, self.temperature, self.chunk, entropy, positions)
        if keep < width:
            lp = torch.nn.functional.pad(lp, (0, width - keep))
            ent = None if ent is None else torch.nn.functional.pad(ent, (0, width - keep))
        return lp, ent

    # ------------------------------------------------------------------ steps

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One batch = one policy version (`_train_batch`), or a skipped step: a batch with no loss
        tokens (EmptyBatchError) or a non-finite loss or gradient norm (NonFiniteLossError) raises,
        the version stays, and the caller gives the batch back (ReplayBufferCore.skip_batch). With
        minibatches > 1, optimizer steps of the batch before a non-finite one stay applied: the
        weights moved under an unchanged version. That is accepted, not undone (no snapshot): the next
        batch's π_old is recomputed from the current weights, so its loss stays exact, and the
        change reaches the generators with the next version. trainer.max_skipped_steps skips in a row
        raise TooManySkippedSteps. Metrics include `skipped_steps`, the run's total so far."""
        try:
            metrics = self._train_batch(batch)
        except (NonFiniteLossError, EmptyBatchError) as e:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.tcfg.max_skipped_steps:
                raise TooManySkippedSteps(
                    f"trainer: {self.consecutive_skips} steps in a row skipped at version {self.version} "
                    f"(trainer.max_skipped_steps={self.tcfg.max_skipped_steps}); last: {e}") from e
            raise
        self.consecutive_skips = 0
        return {**metrics, "skipped_steps": float(self.skipped_steps)}

    def _train_batch(self, batch: Batch) -> dict[str, float]:
        """trainer.minibatches × trainer.epochs optimizer steps against a fixed π_old (module
        docstring). Raises before touching the weights on bad input; a non-finite loss or gradient
        norm raises NonFiniteLossError before that step's update. Returns globally reduced metrics
        (same on every rank); per-step ones are averaged over the batch's optimizer steps."""
        t = self.tcfg
        truncated = batch.truncated if batch.truncated is not None else torch.zeros(batch.num_samples, dtype=torch.bool)
        if t.overlong_filter and bool(truncated.any()):  # DAPO's overlong filtering: no loss tokens
            batch = dataclasses.replace(batch, loss_mask=batch.loss_mask * (~truncated).float()[:, None])
        check_batch(batch, self.vocab_size)
        if batch.num_samples < t.minibatches:
            raise BadBatchError(f"trainer: batch has {batch.num_samples} samples, fewer than "
                                f"trainer.minibatches={t.minibatches}")
        mask_all = batch.loss_mask[:, 1:].float()
        # rows of like length share a micro-batch, unless trainer.grad_variance compares the micro-batches'
        # gradients, which asks for rows in batch order (length-sorted micro-batches are not random draws)
        # one plan per epoch: the rows shuffled into minibatches anew each epoch, the same on every rank
        lengths = None if t.grad_variance else spans(batch.loss_mask)
        plans = [minibatch_plan(batch.num_samples, t.minibatches, self.par.dp_world, self.par.dp_rank,
                                t.micro_batch_size, lengths, split)
                 for split in minibatch_rows(batch.num_samples, t.minibatches, t.epochs, self.seed, self.version)]
        plan = plans[0]
        self.model.train()
        t_start = time.perf_counter()
        ref_s = [0.0]  # the reference model's forwards, wherever they run (π_old's pass or the first step)
        score_ref = None if self.ref_model is None else self._timed(self._scorer(self.ref_model), ref_s)
        prox = Proximal(mask_all.shape, self.device, t, score_ref, self.version)
        mis = self.snapshots.balance_mixture(self.version, batch, plan, prox) if t.correction == "mis_balance" else {}
        # π_old of minibatches 1.. with the pre-step weights, before any update. Minibatch 0's is
        # its own first forward (the weights are still pre-step then), which saves that forward and
        # keeps minibatches = epochs = 1 exactly the single-step computation.
        with torch.no_grad():
            for _, micro in plan[1:]:
                for rows, keep in micro:
                    ids = batch.input_ids[rows].to(self.device)
                    prox.record(batch, rows, keep, ids, *self._logprobs(batch, rows, "value"))
        t_old, ref_in_old = time.perf_counter(), ref_s[0]
        steps = []
        for epoch, epoch_plan in enumerate(plans):
            for m, (mb_rows, micro) in enumerate(epoch_plan):
                den = losses.local_denominators(mask_all[mb_rows])  # the full minibatch: global counts
                if den[0] == 0:  # no loss tokens: every rank sees that and skips the same step
                    continue
                try:
                    steps.append(self._ppo_step(batch, micro, den, prox, first=epoch == 0 and m == 0))
                except NonFiniteLossError as e:
                    if not steps:
                        raise
                    raise NonFiniteLossError(f"{e}; {len(steps)} earlier optimizer step(s) of this batch "
                                             "stay applied") from e
        once = self.par.all_reduce(prox.sums, prox.maxes)
        t_end = time.perf_counter()
        # where this rank's step went: π_old of minibatches 1.. (minibatch 0's is its first forward),
        # the reference's forwards, and the forward/backward/optimizer steps (the reference's excluded)
        timing = {"time/pi_old_s": t_old - t_start - ref_in_old, "time/ref_s": ref_s[0],
                  "time/policy_s": t_end - t_old - (ref_s[0] - ref_in_old)}
        self.version += 1
        self.samples_seen += batch.num_samples
        tok = float(mask_all.sum())

        def mean(f) -> float:
            return sum(f(s) for s in steps) / len(steps)

        def frac(key: str) -> float:
            return mean(lambda s: s[key] / max(s["tokens"], 1.0))

        mm = losses.finalize_mismatch({k[3:]: v for k, v in once.items() if k.startswith("mm_")})
        recipe = {"clip_low_frac": frac("clip_low_tokens"), "clip_high_frac": frac("clip_high_tokens"),
                  "truncated_frac": float(truncated.float().mean()),
                  "overlong_filtered_frac": float(truncated.float().mean()) if t.overlong_filter else 0.0}
        recipe.update(step_metrics(self.loss, steps))  # the parts' own: cispo_clip_frac, seq_ratio_*
        entropy, coef = once["entropy_sum"] / max(tok, 1.0), self.entropy_coef
        self.entropy_coef = losses.adapt_entropy_coef(coef, entropy, self.tcfg)  # same on every rank
        return {"loss": mean(lambda s: s["loss"]), "grad_norm": mean(lambda s: s["grad_norm"]),
                "lr": steps[0]["lr"], "version": float(self.version), "tokens": tok,
                "samples": float(batch.num_samples), "optimizer_steps": float(len(steps)),
                "clip_frac": frac("clip_tokens"), "dual_clip_frac": frac("dual_clip_tokens"),
                "is_clip_frac": frac("is_clip_tokens"), "kl_ref": frac("kl_sum"),
                "entropy": entropy, "entropy_coef": coef,
                "staleness_mean": float(batch.staleness().float().mean()), **recipe, **mm, **mis, **timing,
                **{f"grad/{k[5:]}": v for k, v in steps[0].items() if k.startswith("grad_var")},
                **losses.finalize_distill(steps[0])}

    def _ppo_step(self, batch: Batch, micro: list[tuple[torch.Tensor, float]], den: tuple[float, float],
                  prox: Proximal, first: bool) -> dict[str, float]:
        """Forward/backward over one minibatch's micro-batches, then clip and step; returns the
        step's globally reduced sums plus grad_norm and lr. `first`: the batch's first step, whose
        forward is still π_old and is recorded as such."""
        sums: dict[str, torch.Tensor] = {}
        chunks = GradChunks(self.par) if first and self.tcfg.grad_variance else None
        for rows, keep in micro:
            ids = batch.input_ids[rows].to(self.device)
            mask = batch.loss_mask[rows, 1:].float().to(self.device) * keep
            mu = batch.behaviour_logprobs[rows, 1:].to(self.device).float()
            bonus = self.entropy_coef > 0
            logp, ent = self._logprobs(batch, rows, "grad" if bonus else "value" if first else "")
            if first:
                prox.record(batch, rows, keep, ids, logp, ent)
            ref = prox.ref[rows] if prox.ref is not None else None
            ent = ent if bonus else None
            adv = batch.advantages[rows].to(self.device)
            if batch.teacher_logprobs is not None and (self.tcfg.distill_coef > 0 or self.tcfg.reward_coef != 1):
                teacher = batch.teacher_logprobs[rows, 1:].to(self.device).float()
                adv = losses.token_advantages(adv, prox.logp[rows], teacher, mask, self.tcfg.reward_coef,
                                              self.tcfg.distill_coef)
                if first:
                    for k, v in losses.distill_sums(prox.logp[rows], teacher, mask).items():
                        sums[f"distill_{k}"] = sums.get(f"distill_{k}", 0) + v.cpu()
            elif self.tcfg.reward_coef != 1:
                adv = adv * self.tcfg.reward_coef
            loss, stats = losses.policy_loss(logp, prox.logp[rows], mu, mask, adv,
                                             self.loss, ref=ref, denominators=den, entropy=ent,
                                             entropy_coef=self.entropy_coef,
                                             log_mix=None if prox.log_mix is None else prox.log_mix[rows],
                                             max_len=batch.max_len or self.max_new_tokens)
            (loss * self.par.dp_world).backward()
            if chunks is not None:
                chunks.add(self.model)
            for k, v in {"loss": loss.detach().double(), **stats}.items():
                sums[k] = sums.get(k, 0) + v.detach().cpu().double()
        red = self.par.all_reduce(sums)
        if chunks is not None:
            red.update(chunks.variance())
        if not math.isfinite(red["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: loss is {red['loss']} at version {self.version}; "
                                     "step skipped, weights not updated by it")
        red["lr"] = self.scheduler.get_last_lr()[0]
        red["grad_norm"] = self._clip_and_step()
        self.scheduler.step()
        return red

    def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, lr: float | None = None) -> dict[str, float]:
        """Supervised cross-entropy on demonstration tokens (loss_mask in the Batch token layout);
        one optimizer step at `lr` (None: the schedule's) that does not advance the RL version or
        the LR schedule."""
        check_sft(input_ids, loss_mask, self.vocab_size)
        mask_all = loss_mask[:, 1:].float()
        n_tok = float(mask_all.sum())
        self.model.train()
        total = torch.zeros((), dtype=torch.float64)
        micro = minibatch_plan(input_ids.shape[0], 1, self.par.dp_world, self.par.dp_rank, self.tcfg.micro_batch_size)
        for rows, keep in micro[0][1]:
            logp, _ = logprobs(self.model, input_ids[rows].to(self.device), 1.0, self.chunk)
            loss = -(logp * mask_all[rows].to(self.device) * keep).sum() / n_tok
            (loss * self.par.dp_world).backward()
            total += loss.detach().double().cpu()
        loss_v = self.par.all_reduce({"loss": total})["loss"]
        if not math.isfinite(loss_v):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: sft loss is {loss_v}; step skipped, weights not updated")
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        try:
            norm = self._clip_and_step()
        finally:
            for g, v in zip(self.optimizer.param_groups, saved):
                g["lr"] = v
        return {"loss": loss_v, "grad_norm": norm, "tokens": n_tok}

    def _clip_and_step(self) -> float:
        norm = self.par.clip_grad_norm(self.model, self.tcfg.grad_clip)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: grad norm is {norm} at version {self.version}; "
                                     "step skipped, weights not updated")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_weights()
        return norm

    def _check_weights(self) -> None:
        """Raise NonFiniteWeightsError on every rank if any rank's parameters hold NaN/inf, so such
        weights are never pushed (one all-reduce: a rank raising alone would hang the others)."""
        params = [(n, local(p)) for n, p in self.model.named_parameters()]
        with torch.no_grad():
            bad = torch.stack([(~torch.isfinite(p)).sum() for _, p in params])
        total = self.par.all_reduce({"nonfinite": bad.sum()}, per_shard=True)["nonfinite"]
        if total:
            names = [n for (n, _), b in zip(params, bad.tolist()) if b][:3]
            raise NonFiniteWeightsError(f"trainer: {int(total)} non-finite parameter value(s) after the optimizer "
                                        f"step at version {self.version} (on this rank: {names or 'none'}); "
                                        "the weights are corrupt and are not pushed")

    # ------------------------------------------------------------------ checkpoints

    def save(self, path, data_state: dict | None = None) -> str:
        """state.TrainerState.save with this core's counters (collective)."""
        counters = {"version": self.version, "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps,
                    "entropy_coef": self.entropy_coef}
        return self.state.save(path, counters, data_state)

    def load(self, path) -> dict:
        """state.TrainerState.load, then this core's counters; returns the saved data_state."""
        saved = self.state.load(path)
        self.version, self.samples_seen = int(saved["version"]), int(saved["samples_seen"])
        self.skipped_steps = int(saved["skipped_steps"])  # the run's total goes on (trainer/skipped_steps)
        # an adapted coefficient goes on; a changed trainer.entropy_coef without a target takes the new value
        self.entropy_coef = float(saved.get("entropy_coef", self.tcfg.entropy_coef)) \
            if self.tcfg.entropy_target > 0 else self.tcfg.entropy_coef
        return saved["data_state"]
