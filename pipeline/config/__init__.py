"""Typed configuration: a dataclass tree with checked fields; YAML and CLI only override it.

    from pipeline.config import Config, ConfigError, load_config
    cfg = load_config("configs/tiny.yaml", ["trainer.lr=1e-4", "buffer.max_staleness=0"])

A leaf package: it imports nothing else of the project, so every module may import it. It checks
values only (ranges, choices, how keys combine), before anything starts; what needs this host or
the disk is checked at start-up (pipeline/placement.py check_host: the cores named are this host's;
pipeline/checkpoint.py prepare_resume: run.resume resolved and matched).

    errors.py   ConfigError and the checks: every message names the dotted key and what is allowed
    ids.py      core and GPU id sets in cpuset syntax ('0,2,4-7')
    model.py generator.py buffer.py trainer.py weight_sync.py task.py reward_model.py teacher.py run.py
                one section each: its fields with their docstrings, its own checks
    tree.py     Config, the checks spanning sections
    load.py     load_config (defaults -> YAML -> key=value overrides), REMOVED_KEYS
"""

from pipeline.config.buffer import BufferConfig
from pipeline.config.errors import ConfigError
from pipeline.config.generator import GeneratorConfig
from pipeline.config.load import REMOVED_KEYS, flatten, load_config
from pipeline.config.model import ModelConfig
from pipeline.config.reward_model import RewardModelConfig
from pipeline.config.run import LOG_LEVELS, RunConfig
from pipeline.config.task import TaskConfig
from pipeline.config.teacher import TeacherConfig
from pipeline.config.trainer import LORA_TARGETS, LoraConfig, TrainerConfig
from pipeline.config.tree import Config, sync_mode_config
from pipeline.config.weight_sync import WeightSyncConfig

__all__ = ["BufferConfig", "Config", "ConfigError", "GeneratorConfig", "LOG_LEVELS", "LORA_TARGETS", "LoraConfig",
           "ModelConfig", "REMOVED_KEYS", "RewardModelConfig", "RunConfig", "TaskConfig", "TeacherConfig",
           "TrainerConfig", "WeightSyncConfig", "flatten", "load_config", "sync_mode_config"]
