"""The whole config: one section per component, and the checks that span sections.

    cfg = Config(trainer=TrainerConfig(lr=1e-4))    # in code; load_config (load.py) from YAML and CLI

A section checks its own values in its `__post_init__`; `Config.__post_init__` then checks what
ties sections together (engine vs trainer device, LoRA vs on_update, mis_balance vs consistent
rollouts, overlapping core and GPU sets). Values only: whether this host has the cores and whether
run.resume names a usable checkpoint is checked at start-up (pipeline/placement.py check_host,
pipeline/checkpoint.py prepare_resume).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pipeline.config.buffer import BufferConfig
from pipeline.config.errors import check, id_set
from pipeline.config.generator import GeneratorConfig
from pipeline.config.ids import format_ids
from pipeline.config.launcher import LauncherConfig, check_launcher
from pipeline.config.model import ModelConfig
from pipeline.config.recipes import resolve_config
from pipeline.config.reward_model import RewardModelConfig
from pipeline.config.run import RunConfig
from pipeline.config.task import TaskConfig
from pipeline.config.teacher import TeacherConfig
from pipeline.config.trainer import TrainerConfig
from pipeline.config.weight_sync import WeightSyncConfig


@dataclass
class Config:
    """The run's whole configuration, one section per top-level key (model, generator, buffer, ...)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    run: RunConfig = field(default_factory=RunConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self) -> None:
        resolve_config(self)  # the recipe parts that span sections: pipeline/config/recipes.py
        check(self.trainer.device != "cuda" or self.generator.engine == "vllm", "generator.engine",
              self.generator.engine, "'vllm' when trainer.device='cuda'")
        g = self.generator
        # The learner scores softmax(logits / T); raw logprobs are of softmax(logits), so every IS
        # ratio would compare two different distributions.
        check(g.logprobs_mode == "processed" or g.temperature == 1.0, "generator.logprobs_mode", g.logprobs_mode,
              f"'processed' when generator.temperature={g.temperature} != 1 (the learner scores "
              "softmax(logits / temperature), the distribution processed logprobs describe)")
        # a stage end waits for rollouts parked in an environment call, within request_timeout_s
        check(self.task.env_timeout_s < g.request_timeout_s, "task.env_timeout_s", self.task.env_timeout_s,
              f"below generator.request_timeout_s={g.request_timeout_s} (a stage end waits for a rollout's "
              "environment call within it)")
        if self.trainer.lora.rank:  # vLLM switches adapters between requests only (pipeline/lora.py)
            check(g.on_update != "keep", "generator.on_update", g.on_update,
                  "'abort' or 'drain' with trainer.lora.rank > 0: an engine switches LoRA adapters between "
                  "requests, so requests kept running through an update would go on with the old adapter")
            check(not g.shadow_weights, "generator.shadow_weights", g.shadow_weights,
                  "false with trainer.lora.rank > 0 (a push is a new adapter, loaded between requests: "
                  "there is no weight load to hide)")
            check(self.trainer.tensor_parallel == 1, "trainer.tensor_parallel", self.trainer.tensor_parallel,
                  "1 with trainer.lora.rank > 0 (LoRA is not sharded over tensor parallel in this build)")
        if self.weight_sync.verify_every:  # served weights are compared per vLLM parameter of one worker
            check(not self.trainer.lora.rank, "weight_sync.verify", self.weight_sync.verify,
                  "'off' with trainer.lora.rank > 0 (a push carries adapters, not the served weights)")
            check(g.tensor_parallel_size == 1, "weight_sync.verify", self.weight_sync.verify,
                  f"'off' with generator.tensor_parallel_size={g.tensor_parallel_size} (verify reads one "
                  "worker's parameters: tensor_parallel_size 1 only)")
        if self.trainer.correction == "mis_balance":  # one behaviour policy per sample, or no mixture to weight
            check(self.run.mode == "sync" or (g.on_update == "drain" and g.carry_over == "keep"),
                  "trainer.correction", "mis_balance", "with consistent rollouts only: generator.on_update=drain "
                  f"and generator.carry_over=keep, or run.mode=sync (now on_update={g.on_update!r}, "
                  f"carry_over={g.carry_over!r}: a sample's tokens may come from several versions)")
            if self.run.mode != "sync":  # an update can land between a rollout's turns, drain or not
                from pipeline.tasks import has_turns  # the task module; pipeline.tasks imports this package
                check(not has_turns(self.task), "trainer.correction", "mis_balance",
                      f"with single-turn rollouts only, or run.mode=sync (task {self.task.name!r} has an "
                      f"environment and task.max_turns={self.task.max_turns}: an update between turns gives "
                      "a rollout model tokens of several versions)")
        check(self.trainer.distill_coef == 0 or bool(self.teacher.hf_dir), "teacher.hf_dir", self.teacher.hf_dir,
              f"a teacher checkpoint directory or 'self' with trainer.distill_coef={self.trainer.distill_coef} "
              f"(trainer.recipe={self.trainer.recipe!r}): distillation needs a teacher")
        if self.teacher.hf_dir:
            check(self.teacher.device == "cpu" or self.trainer.device == "cuda", "teacher.device", self.teacher.device,
                  "'cpu' when trainer.device='cpu'")
        n = self.buffer.batch_groups * self.buffer.group_size
        check(self.trainer.minibatches <= n, "trainer.minibatches", self.trainer.minibatches,
              f"at most the batch's {n} samples (buffer.batch_groups * buffer.group_size); "
              "an empty minibatch would be an optimizer step without data")
        self._check_placement()
        check_launcher(self)

    def _check_placement(self) -> None:
        """Core and GPU sets of different meshes do not overlap unless run.allow_shared_* allow it
        (pipeline/placement.py; set sizes against the ranks sharing them, and the host's cores, are
        checked at start)."""
        t, g, r = self.trainer, self.generator, self.run
        sets = [("trainer.cpus", t.cpus), ("generator.cpus", g.cpus), ("buffer.cpus", self.buffer.cpus),
                ("reward_model.cpus", self.reward_model.cpus), ("teacher.cpus", self.teacher.cpus)]
        for i, (k1, s1) in enumerate(sets):
            for k2, s2 in sets[i + 1:]:
                both = set(id_set(k1, s1)) & set(id_set(k2, s2))
                check(r.allow_shared_cpus or not both, k2, s2,
                      f"cores not in {k1}={s1!r} ({format_ids(both)} in both), or run.allow_shared_cpus=true")
        if t.device == "cuda" and g.engine == "vllm":
            td, gd = id_set("trainer.devices", t.devices, "GPU"), id_set("generator.devices", g.devices, "GPU")
            unset, other = ("generator.devices", f"trainer.devices={t.devices!r}") if td else \
                ("trainer.devices", f"generator.devices={g.devices!r}")
            check(bool(td) == bool(gd), unset, "", f"GPU ids as well, since {other} is set (the default "
                  "assignment beside explicit ids could put both meshes on one GPU)")
            both = set(td) & set(gd)
            check(r.allow_shared_devices or not both, "generator.devices", g.devices,
                  f"GPUs not in trainer.devices={t.devices!r} ({format_ids(both)} in both), "
                  "or run.allow_shared_devices=true")
        tc = self.teacher
        if tc.hf_dir and tc.device == "cuda":  # the teacher's GPU is named, and not one of the other meshes'
            tg = set(id_set("teacher.devices", tc.devices, "GPU"))
            check(len(tg) == 1, "teacher.devices", tc.devices, "one GPU id with teacher.device='cuda' (the "
                  "default assignment would put it on a GPU of the trainer's or the generators')")
            for key, spec in (("trainer.devices", t.devices), ("generator.devices", g.devices)):
                both = tg & set(id_set(key, spec, "GPU"))
                check(r.allow_shared_devices or not both, "teacher.devices", tc.devices,
                      f"a GPU not in {key}={spec!r}, or run.allow_shared_devices=true")


def sync_mode_config(cfg: Config) -> Config:
    """The config a `run.mode=sync` run uses: the synchronous baseline, same components, no
    over-commitment, strictly on-policy (Δ=0, max_staleness=0, on_update=drain; drain finishes every
    request before the update, so nothing is carried over: carry_over=keep). The driver's Job and the
    planner's simulator both apply this one function."""
    return dataclasses.replace(
        cfg, buffer=dataclasses.replace(cfg.buffer, overcommit="none", max_staleness=0),
        generator=dataclasses.replace(cfg.generator, on_update="drain", carry_over="keep"))
