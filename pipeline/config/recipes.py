"""Loss recipes: which keys a recipe sets, what each recipe sets them to, and the one place they are resolved.

A recipe part is a key that starts unset (None). The loader (load.py) unsets every part before it merges
the file and the command line (`unset_parts`), so a part still None after that was named by neither, and
takes its recipe's value, else its NO_PRESET default:

    TrainerConfig.__post_init__  -> resolve_trainer(trainer)   the trainer.* parts
    BufferConfig.__post_init__   -> resolve_buffer(buffer)     its parts' plain defaults, which parts were named
    Config.__post_init__         -> resolve_config(cfg)        the parts that need two sections: the buffer's
                                                               parts from trainer.recipe, dapo's overlong_buffer
                                                               from generator.max_new_tokens

The loss then reads the parts as one frozen spec (pipeline/loss_parts.py `loss_spec`). Adding a recipe is
one entry in RECIPES; adding a part kind is its value list in LOSS_PARTS and its table in loss_parts.py.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from pipeline.config.errors import check, choice

if TYPE_CHECKING:
    from pipeline.config.buffer import BufferConfig
    from pipeline.config.trainer import TrainerConfig
    from pipeline.config.tree import Config

RECIPE_PARTS = ("clip_eps", "clip_eps_low", "clip_eps_high", "dual_clip", "ratio_level", "weight_form", "aggregation",
                "overlong_buffer", "overlong_penalty", "overlong_filter", "mis_low", "mis_high", "distill_coef",
                "reward_coef")
"""The trainer keys a recipe sets (each None until resolved: a key the config names wins over its recipe).
BUFFER_PARTS are parts too, and so is overlong_buffer under dapo (a fifth of generator.max_new_tokens, as
DAPO's 4,096 of 20,480): `resolve_config` fills those."""

BUFFER_PARTS = ("normalize_std", "zero_signal")
"""The buffer keys a recipe sets (None until resolved, like RECIPE_PARTS)."""

NO_PRESET = {"clip_eps": 0.2, "dual_clip": 3.0, "ratio_level": "token", "weight_form": "ppo",
             "aggregation": "token_mean", "overlong_buffer": 0, "overlong_penalty": 1.0, "overlong_filter": False,
             "mis_low": 0.5, "mis_high": 2.0, "distill_coef": 0.0, "reward_coef": 1.0}
"""recipe=none: each part at its own default (the loss this trainer had before recipes)."""

RECIPES: dict[str, dict] = {
    "none": {},
    # GRPO (Shao et al. 2024, DeepSeekMath): PPO-clip, symmetric 0.2, each response's token mean, std on
    "grpo": {"clip_eps": 0.2, "dual_clip": 0.0, "aggregation": "seq_mean", "normalize_std": True},
    # DAPO (Yu et al. 2025): clip-higher 0.2/0.28, token mean over the batch, overlong shaping + filtering,
    # dynamic sampling (groups without an accuracy spread dropped: buffer.zero_signal=drop)
    "dapo": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 0.0, "aggregation": "token_mean",
             "overlong_buffer": None, "overlong_penalty": 1.0, "overlong_filter": True, "normalize_std": True,
             "zero_signal": "drop"},
    # Dr. GRPO (Liu et al. 2025): no std, constant normaliser (the rollout's budget, Batch.max_len)
    "dr_grpo": {"clip_eps": 0.2, "dual_clip": 0.0, "aggregation": "constant", "normalize_std": False},
    # GSPO (Zheng et al. 2025): sequence-level, length-normalised ratio, clip 3e-4 / 4e-4, sequence mean
    "gspo": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "dual_clip": 0.0, "ratio_level": "sequence",
             "aggregation": "seq_mean", "normalize_std": True},
    # CISPO (MiniMax-M1, 2025): clipped, detached IS weight on a REINFORCE term; no lower bound, token mean
    "cispo": {"clip_eps_low": 1.0, "clip_eps_high": 0.28, "weight_form": "cispo", "aggregation": "token_mean",
              "normalize_std": True},
    # On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): a per-token advantage
    # -(log pi_student - log pi_teacher) on the sampled token (reverse KL), the task reward off
    "opd": {"clip_eps": 0.2, "dual_clip": 0.0, "aggregation": "token_mean", "distill_coef": 1.0, "reward_coef": 0.0,
            "normalize_std": True},
    # GRPO's loss with the teacher's per-token advantage added to the group advantage
    "opd+grpo": {"clip_eps": 0.2, "dual_clip": 0.0, "aggregation": "seq_mean", "distill_coef": 1.0, "reward_coef": 1.0,
                 "normalize_std": True},
}
"""trainer.recipe -> the parts it sets (docs/training.md "Loss recipes"); a part it leaves out takes NO_PRESET's."""

LOSS_PARTS = {"ratio_level": ("token", "sequence"), "weight_form": ("ppo", "cispo"),
              "correction": ("none", "tis", "seq_is", "geo_is", "mis", "icepop", "mis_balance", "ppo_is", "vanilla_is",
                             "geo_mask"),
              "aggregation": ("token_mean", "seq_mean", "constant")}
"""The values each loss-part key accepts: the keys of pipeline/loss_parts.py's tables, in their order (that
module checks the two agree when imported; this package imports nothing of the project)."""

SEQUENCE_CORRECTIONS = ("none", "geo_is", "ppo_is")
"""Off-policy corrections that compose with trainer.ratio_level=sequence: one length-normalised weight per
sequence (geo_is, as GSPO's s_i is normalised), s_i anchored at the sampler (ppo_is), or none."""


def unset_parts(cfg) -> None:
    """Every recipe part of a structured (OmegaConf) Config set to None before the file and overrides are
    merged, so that a part still None after them was named by neither."""
    for key in RECIPE_PARTS:
        cfg.trainer[key] = None
    for key in BUFFER_PARTS:
        cfg.buffer[key] = None


def resolve_trainer(t: TrainerConfig) -> None:
    """Fill each trainer part left unset (None): the recipe's value, else NO_PRESET's. The parts named
    explicitly are kept in `t.explicit_parts`."""
    choice("trainer.recipe", t.recipe, tuple(RECIPES))
    preset = RECIPES[t.recipe]
    given = {f.name for f in fields(t) if f.name in RECIPE_PARTS and getattr(t, f.name) is not None}
    t.explicit_parts = frozenset(given)  # a plain attribute, not a key
    icepop = t.correction == "icepop"
    defaults = {**NO_PRESET, "mis_high": 5.0 if icepop else 2.0}
    for key in ("clip_eps", "dual_clip", "ratio_level", "weight_form", "aggregation", "overlong_penalty",
                "overlong_filter", "mis_low", "mis_high", "distill_coef", "reward_coef"):
        if key not in given:
            setattr(t, key, preset.get(key, defaults[key]))
    if "overlong_buffer" not in given:  # dapo's None: a fifth of generator.max_new_tokens (resolve_config)
        t.overlong_buffer = preset.get("overlong_buffer", 0)
    for side in ("clip_eps_low", "clip_eps_high"):
        if side not in given:  # an explicit symmetric clip_eps beats the recipe's two sides
            setattr(t, side, t.clip_eps if "clip_eps" in given else preset.get(side, t.clip_eps))


def resolve_buffer(b: BufferConfig) -> None:
    """A BufferConfig's parts at their plain defaults (normalize_std true, zero_signal auto), remembering
    which were named (`b.explicit_parts`), so that resolve_config can give the unnamed ones the recipe's."""
    b.explicit_parts = frozenset(k for k in BUFFER_PARTS if getattr(b, k) is not None)  # a plain attribute
    if b.normalize_std is None:
        b.normalize_std = True
    if b.zero_signal is None:
        b.zero_signal = "auto"


def resolve_config(cfg: Config) -> None:
    """The parts that span sections: buffer.normalize_std and buffer.zero_signal (dapo's dynamic sampling,
    with group_size > 1) from trainer.recipe unless named, and dapo's overlong_buffer (a fifth of
    generator.max_new_tokens)."""
    t, b = cfg.trainer, cfg.buffer
    preset = RECIPES[t.recipe]
    named = getattr(b, "explicit_parts", frozenset(BUFFER_PARTS))
    if "normalize_std" not in named:
        b.normalize_std = preset.get("normalize_std", True)
    if "zero_signal" not in named and b.group_size > 1:
        b.zero_signal = preset.get("zero_signal", b.zero_signal)
    if t.overlong_buffer is None:
        t.overlong_buffer = max(1, cfg.generator.max_new_tokens // 5)
    check(t.overlong_buffer < cfg.generator.max_new_tokens or t.overlong_buffer == 0, "trainer.overlong_buffer",
          t.overlong_buffer, f"below generator.max_new_tokens={cfg.generator.max_new_tokens} (the penalty "
          "ramps over the budget's last overlong_buffer tokens), or 0 (off)")
