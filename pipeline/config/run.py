"""run.*: the run as a whole: mode, length, outputs, logging, checkpoints and resume."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Union

from pipeline.config.errors import check, choice

LOG_LEVELS = ("debug", "info", "warning", "error")
"""run.log_level's values (pipeline/logs.py maps them to logging levels)."""


@dataclass
class RunConfig:
    """run.*: mode, length, seed, outputs, logging, checkpoints and resume, placement sharing."""

    mode: str = "async"
    """async (overlapped loops) | sync (generate a full batch, train, sync, repeat)."""
    launcher: str = "auto"
    """Where the run's hosts come from: local (this host) | torchrun (every rank of a torchrun job joins
    one Monarch job; rank 0 drives) | monarch (this process is the controller and asks a scheduler for
    hosts per role through Monarch's job API: launcher.*, pipeline/cluster/) | auto (torchrun when
    started by torchrun, else local)."""
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
    warm_start_steps: Union[int, str] = "auto"
    """Supervised warm-start steps on task demonstrations before RL (reported as such): an integer
    runs that many (0 disables); 'auto' (pipeline/driver/warm_start.py) runs them in chunks of
    run.warm_start_chunk and stops once RL can take over, as the held-out probe after each chunk says
    (run.warm_start_signal, run.warm_start_pass_min/max), or once the demonstration loss stops falling
    (run.warm_start_min_loss_drop), at run.warm_start_max_steps at most; no steps for a task without
    `demonstration()`. A resumed run never warm-starts again."""
    warm_start_max_steps: int = 200
    """'auto': the most warm-start steps (1..10^6)."""
    warm_start_chunk: int = 10
    """'auto': supervised steps between two held-out probes (1..10^6)."""
    warm_start_signal: float = 0.8
    """'auto': stop once this share of held-out groups (task.eval_prompts prompts, buffer.group_size
    samples each at generator.temperature, as RL samples them) has a reward spread (0 < x <= 1)."""
    warm_start_pass_min: float = 0.1
    """'auto', a 0/1 reward (every probe reward 0 or 1): the held-out pass rate must also be at least
    this ... (0..1)"""
    warm_start_pass_max: float = 0.9
    """... and at most this; above it the warm start stops too (more demonstrations would only
    take the spread away) (warm_start_pass_min..1)."""
    warm_start_min_loss_drop: float = 0.03
    """'auto': stop once a chunk's mean demonstration loss is less than this fraction below the
    previous chunk's (the loss stopped falling; 0..1, 0: never for this reason)."""
    warm_start_lr: float = 0.0
    """Learning rate of the warm-start steps (0: trainer.lr). Supervised steps on demonstrations take
    a larger rate than RL steps on the policy's own samples."""
    eval_every: int = 5
    """Score held-out prompts every this many steps (0 disables)."""
    eval_overlap: bool = False
    """Held-out evals run beside training: the eval of step s (and a fresh run's step-0 eval and
    pre-flight probe) runs on a generator while the trainer trains step s+1, and the push of s+1
    waits for it, so it reads step s's weights alone. The step's metrics row is written once its eval
    ends; a checkpoint step and run.steps wait for theirs. false: the trainer waits out each eval."""
    preflight_prompts: int = 0
    """The pre-flight line (pipeline/driver/learning_signal.py) probes the first this many of the
    task.eval_prompts held-out prompts with buffer.group_size samples each, after a fresh run's step-0
    eval and reusing its sampled completions (0, or more than there are: all of them). Fewer
    prompts make a coarser line and a quicker start: the probe holds the end of step 0 (with
    run.eval_overlap, the first push)."""
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
    no_signal_share: float = 0.9
    """Zero-signal alarm (pipeline/driver/learning_signal.py): a step counts as without signal when at least
    this share of the groups that finished in it had no reward spread (0 < x <= 1) ..."""
    no_signal_patience: int = 20
    """... and after this many such steps in a row the run warns once, with the numbers and the knobs
    to turn (>= 1) ..."""
    stop_without_signal: int = 100
    """... and after this many in a row it stops early (a final eval, the summary, exit code 3; see
    docs/faults-and-checkpoints.md). 0: never stops for it (>= 0)."""
    resume: str = ""
    """Continue from a checkpoint (its step + 1 up to run.steps): 'latest' (the newest complete one
    under out_dir/checkpoints) or a step_N directory, resolved and checked at start-up
    (pipeline/checkpoint.py prepare_resume). It must match this config's model shape,
    tokenizer, task.name, buffer.batch_groups, buffer.group_size, generator.temperature,
    generator.logprobs_mode and model.dtype; other keys take the new value."""
    allow_shared_cpus: bool = False
    """Let trainer.cpus, generator.cpus, buffer.cpus and reward_model.cpus overlap (meshes then compete for those cores)."""
    allow_shared_devices: bool = False
    """Let trainer.devices and generator.devices overlap (a GPU shared by trainer and generators)."""

    def __post_init__(self) -> None:
        choice("run.mode", self.mode, ("async", "sync"))
        choice("run.launcher", self.launcher, ("auto", "local", "torchrun", "monarch"))
        check(0 <= self.steps <= 10_000_000, "run.steps", self.steps, "0..10000000")
        check(0 <= self.epochs <= 1_000_000, "run.epochs", self.epochs, "0..1000000 (0: unbounded)")
        check(self.warm_start_steps == "auto" or (isinstance(self.warm_start_steps, int) and self.warm_start_steps >= 0),
              "run.warm_start_steps", self.warm_start_steps, "an integer >= 0 (0: none) or 'auto'")
        check(1 <= self.warm_start_max_steps <= 1_000_000, "run.warm_start_max_steps", self.warm_start_max_steps,
              "1..1000000")
        check(1 <= self.warm_start_chunk <= 1_000_000, "run.warm_start_chunk", self.warm_start_chunk, "1..1000000")
        check(0 < self.warm_start_signal <= 1, "run.warm_start_signal", self.warm_start_signal, "0 < x <= 1")
        check(0 <= self.warm_start_pass_min <= 1, "run.warm_start_pass_min", self.warm_start_pass_min, "0..1")
        check(self.warm_start_pass_min <= self.warm_start_pass_max <= 1, "run.warm_start_pass_max",
              self.warm_start_pass_max, f"run.warm_start_pass_min ({self.warm_start_pass_min})..1")
        check(0 <= self.warm_start_min_loss_drop < 1, "run.warm_start_min_loss_drop", self.warm_start_min_loss_drop,
              "0 <= x < 1 (0: the loss never stops the warm start)")
        check(0 < self.no_signal_share <= 1, "run.no_signal_share", self.no_signal_share, "0 < x <= 1")
        check(self.no_signal_patience >= 1, "run.no_signal_patience", self.no_signal_patience, ">= 1")
        check(self.stop_without_signal >= 0, "run.stop_without_signal", self.stop_without_signal, ">= 0 (0: off)")
        check(0 <= self.warm_start_lr <= 1, "run.warm_start_lr", self.warm_start_lr, "0 (trainer.lr) .. 1")
        check(self.eval_every >= 0, "run.eval_every", self.eval_every, ">= 0")
        check(self.preflight_prompts >= 0, "run.preflight_prompts", self.preflight_prompts, ">= 0 (0: all held-out prompts)")
        check(self.checkpoint_every >= 0, "run.checkpoint_every", self.checkpoint_every, ">= 0")
        check(self.collapse_entropy >= 0, "run.collapse_entropy", self.collapse_entropy, ">= 0 (0: off)")
        check(self.collapse_length >= 0, "run.collapse_length", self.collapse_length, ">= 0 (0: off)")
        check(self.collapse_patience >= 1, "run.collapse_patience", self.collapse_patience, ">= 1")
        check(self.keep_checkpoints >= 0, "run.keep_checkpoints", self.keep_checkpoints, ">= 0 (0 keeps all)")
        choice("run.log_level", self.log_level, LOG_LEVELS)
        check(0 <= self.log_rollouts <= 1024, "run.log_rollouts", self.log_rollouts, "0..1024 (0: none)")
        if self.wandb == "False":  # YAML 1.1 reads a bare `off` as false, which the str field keeps as 'False'
            self.wandb = "off"
        choice("run.wandb", self.wandb, ("off", "offline", "online"))
        check(self.wandb == "off" or importlib.util.find_spec("wandb") is not None, "run.wandb", self.wandb,
              "'off' unless the wandb package is installed: pip install wandb (or pip install -e '.[wandb]')")
