"""The GPU recipes in configs/ (Qwen3-0.6B and 1.7B on GSM8K-style math, one node of 8 GPUs): each loads
with the CLI's loader and validates, its GPU split holds on a simulated 8-GPU host through the same
placement functions every proc applies at start, and its keys fit the named model's shape (a
config.json of that shape from pipeline/models/qwen3_checkpoint.py, the real Qwen3 tokenizer and chat
template). No GPU and no weights are needed: the shapes are built on torch's meta device."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.model import read_arch, read_hf_config
from pipeline.models.decoder import titan_config
from pipeline.placement import PlacementError, check_host, generator_placements, resolve_gpus, trainer_placement
from pipeline.models.qwen3_tokenizer import IM_START_ID, IM_END_ID, copy_tokenizer
from pipeline.models.qwen3_checkpoint import MODELS, qwen3_config
from pipeline.tasks import open_task, take
from pipeline.tokens import SpecialTokens, encode_prompt, load_tokenizer

from .conftest import REPO

RECIPES = {"qwen3-0.6b-gsm8k.yaml": ("Qwen3-0.6B", 596_049_920), "qwen3-1.7b-gsm8k.yaml": ("Qwen3-1.7B", 1_720_574_976)}
"""Recipe file -> (the model it is for, its parameter count, tied embeddings counted once)."""
GPUS = 8
THINK_OFF = [151667, 271, 151668, 271]  # "<think>\n\n</think>\n\n": Qwen3's template with enable_thinking=false


@pytest.fixture(params=sorted(RECIPES))
def recipe(request, monkeypatch):
    monkeypatch.chdir(REPO)  # task.path is relative to the repository root, where a recipe is run from
    return REPO / "configs" / request.param


def gpus_of(cfg, visible: int) -> tuple[list, list]:
    """GPU ids of every trainer rank and every generator on one host with `visible` GPUs, as each
    proc's placement resolves them at its start (pipeline/placement.py apply)."""
    ranks = cfg.trainer.num_ranks  # one node: every rank on it
    cores = len(os.sched_getaffinity(0))
    trainer = [resolve_gpus(trainer_placement(cfg, r, ranks, cores), visible) for r in range(ranks)]
    gens = [resolve_gpus(p, visible) for p in generator_placements(cfg, [0] * cfg.generator.num_generators, ranks)]
    return trainer, gens


def test_every_recipe_in_configs_is_checked_here():
    cpu = {"tiny.yaml", "smollm2-135m-add.yaml"}  # CPU recipes: tests/test_smollm2_run.py runs the second
    assert {p.name for p in (REPO / "configs").glob("*.yaml")} - cpu == set(RECIPES)


def test_a_recipe_loads_validates_and_trains_on_gpus_in_bf16_from_a_dataset(recipe):
    cfg = load_config(recipe)  # unknown keys, types, ranges and cross-section checks, as the CLI does
    check_host(cfg)
    t, g = cfg.trainer, cfg.generator
    assert (t.device, t.backend, g.engine, cfg.model.dtype) == ("cuda", "nccl", "vllm", "bfloat16")
    assert cfg.weight_sync.transport == "collective" and 1e-7 <= t.lr <= 1e-5
    assert cfg.task.name == "pipeline.tasks.dataset" and cfg.task.apply_chat_template
    assert Path(cfg.task.path) == REPO / "examples" / "gsm8k_style.jsonl"
    assert Path(cfg.task.eval_path) == REPO / "examples" / "gsm8k_style_eval.jsonl"
    task = open_task(cfg.task, evaluate=True)
    item = take(task, cfg.task.seed, "train", 1)[0]
    assert item.prompt[0]["role"] == "user" and task.reward(item.prompt, f"\\boxed{{{item.answer.split('####')[-1]}}}") == 1.0
    # every key written in the recipe is one the config has: a typo'd key would have failed load_config
    with pytest.raises(ConfigError, match="trainer.learning_rate"):
        load_config(recipe, ["trainer.learning_rate=1e-6"])


def test_a_recipe_splits_the_8_gpus_between_trainer_ranks_and_generators(recipe):
    cfg = load_config(recipe)
    trainer, gens = gpus_of(cfg, GPUS)
    assert all(len(ids) == 1 for ids in trainer)
    assert all(len(ids) == cfg.generator.tensor_parallel_size for ids in gens)
    used = [i for ids in trainer + gens for i in ids]
    assert sorted(used) == list(range(GPUS))  # every GPU used, none shared between meshes
    assert cfg.trainer.num_ranks % cfg.trainer.tensor_parallel == 0
    # a host with fewer GPUs fails the generator's start naming the key, before CUDA starts
    with pytest.raises(PlacementError, match=r"generator.devices names GPU .* has 4 visible GPU"):
        gpus_of(cfg, 4)
    # moving the generators onto the trainer's GPUs is refused at load, naming the key
    with pytest.raises(ConfigError, match="generator.devices"):
        load_config(recipe, [f"generator.devices={cfg.trainer.devices}"])


def test_the_qwen3_1_7b_shape():
    conf = qwen3_config(model="Qwen3-1.7B")
    assert {k: conf[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")} == {
        "num_hidden_layers": 28, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151_936, "tie_word_embeddings": True}
    assert qwen3_config(layers=2, model="Qwen3-1.7B")["hidden_size"] == 2048
    with pytest.raises(ValueError, match="Qwen3-0.6B, Qwen3-1.7B"):
        qwen3_config(model="Qwen3-8B")


def test_a_recipes_keys_fit_its_models_shape_tokenizer_and_context(recipe, tmp_path):
    cfg = load_config(recipe)
    name, params = RECIPES[recipe.name]
    assert Path(cfg.model.hf_dir).name == name and name in MODELS
    conf = qwen3_config(model=name)
    hf = tmp_path / name  # what a download holds, less the weights
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(conf))
    copy_tokenizer(hf, REPO / ".cache" / "qwen3")
    conf = read_hf_config(hf)  # the trainer's own reader (model_type, rope scaling)
    assert cfg.model.dtype == conf["torch_dtype"]
    with torch.device("meta"):  # the torchtitan model the trainer builds from it, without memory
        model = titan_config(read_arch(hf)).build()
    assert sum(p.numel() for p in model.parameters()) == params
    tp, gtp = cfg.trainer.tensor_parallel, cfg.generator.tensor_parallel_size
    for key in ("num_key_value_heads", "intermediate_size", "vocab_size"):  # how the trainer shards by tp
        assert conf[key] % tp == 0, key
    for key in ("num_attention_heads", "num_key_value_heads"):  # vLLM shards heads over its tp ranks
        assert conf[key] % gtp == 0, key
    assert cfg.generator.max_model_len <= conf["max_position_embeddings"]
    # every prompt of both files, rendered by Qwen3's chat template, leaves room for a full completion
    tok = load_tokenizer(hf)
    assert SpecialTokens.of(tok).eos == IM_END_ID
    task = open_task(cfg.task, evaluate=True)
    items = take(task, 0, "train", 10_000) + take(task, 0, "eval", 10_000)
    lengths = []
    for item in items:
        ids = encode_prompt(tok, item.prompt, cfg.task.enable_thinking)
        assert ids[0] == IM_START_ID and ids[-4:] == THINK_OFF  # a user turn, then the empty think block
        lengths.append(len(ids))
    assert max(lengths) + cfg.generator.max_new_tokens <= cfg.generator.max_model_len, max(lengths)
