"""The GPU recipes in configs/ (Qwen3-0.6B and 1.7B on GSM8K-style math, and Qwen3-8B distilled into
Qwen3-0.6B, one node of 8 GPUs): each loads with the CLI's loader and validates, its GPU split holds on a
simulated 8-GPU host through the same placement functions every proc applies at start, and its keys fit
the named model's shape (a config.json of that shape from pipeline/models/qwen3_checkpoint.py, the real
Qwen3 tokenizer and chat template). A recipe with a teacher loads with teacher.hf_dir pointed at a
temporary directory of the teacher's shape (the config checks that the directory exists). No GPU and no
weights are needed: the shapes are built on torch's meta device."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.models import read_arch
from pipeline.models.hf import read_hf_config
from pipeline.models.decoder import titan_config
from pipeline.placement import (PlacementError, check_host, generator_placements, resolve_gpus, teacher_placement,
                                trainer_placement)
from pipeline.models.qwen3_tokenizer import IM_START_ID, IM_END_ID, copy_tokenizer
from pipeline.models.qwen3_checkpoint import MODELS, qwen3_config
from pipeline.tasks import open_task, take
from pipeline.teacher import check_tokenizers
from pipeline.tokens import SpecialTokens, encode_prompt, load_tokenizer

from .conftest import REPO

RECIPES = {"qwen3-0.6b-gsm8k.yaml": ("Qwen3-0.6B", 596_049_920), "qwen3-1.7b-gsm8k.yaml": ("Qwen3-1.7B", 1_720_574_976),
           "qwen3-8b-to-0.6b-opd.yaml": ("Qwen3-0.6B", 596_049_920)}
"""Recipe file -> (the model it is for, its parameter count, tied embeddings counted once)."""
TEACHERS = {"qwen3-8b-to-0.6b-opd.yaml": ("Qwen3-8B", 8_190_735_360)}
"""Recipe file -> (its teacher, the teacher's parameter count, its untied LM head counted apart)."""
GPU_BYTES = 80 * 2**30  # the 80 GB H100 / A100 the OPD recipe's header assumes
GPUS = 8
THINK_OFF = [151667, 271, 151668, 271]  # "<think>\n\n</think>\n\n": Qwen3's template with enable_thinking=false


@pytest.fixture(params=sorted(RECIPES))
def recipe(request, monkeypatch):
    monkeypatch.chdir(REPO)  # task.path is relative to the repository root, where a recipe is run from
    return REPO / "configs" / request.param


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    """shape_dir(name): a directory holding what a download of Qwen3 model `name` holds, less the weights
    (its config.json from MODELS and the Qwen3 tokenizer files), made once per module."""
    root, made = tmp_path_factory.mktemp("shapes"), {}

    def make(name: str) -> Path:
        if name not in made:
            hf = root / name
            hf.mkdir()
            (hf / "config.json").write_text(json.dumps(qwen3_config(model=name)))
            copy_tokenizer(hf, REPO / ".cache" / "qwen3")
            made[name] = hf
        return made[name]
    return make


@pytest.fixture
def load(shape_dir):
    """load_config as the CLI does, with a recipe's teacher.hf_dir pointed at a directory of the teacher's
    shape: the config checks that teacher.hf_dir exists, and /models/... is not on this machine."""
    def load_recipe(path: Path, overrides=()):
        extra = [f"teacher.hf_dir={shape_dir(TEACHERS[path.name][0])}"] if path.name in TEACHERS else []
        return load_config(path, [*extra, *overrides])
    return load_recipe


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
    assert set(TEACHERS) <= set(RECIPES)


def test_a_recipe_loads_validates_and_trains_on_gpus_in_bf16_from_a_dataset(recipe, load):
    cfg = load(recipe)  # unknown keys, types, ranges and cross-section checks, as the CLI does
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
        load(recipe, ["trainer.learning_rate=1e-6"])


def test_a_recipe_splits_the_8_gpus_between_trainer_ranks_and_generators(recipe, load):
    cfg = load(recipe)
    trainer, gens = gpus_of(cfg, GPUS)
    assert all(len(ids) == 1 for ids in trainer)
    assert all(len(ids) == cfg.generator.tensor_parallel_size for ids in gens)
    teacher = [resolve_gpus(teacher_placement(cfg), GPUS)] if cfg.teacher.hf_dir else []  # its proc's start
    used = [i for ids in trainer + gens + teacher for i in ids]
    assert sorted(used) == list(range(GPUS))  # every GPU used, none shared between meshes
    assert cfg.trainer.num_ranks % cfg.trainer.tensor_parallel == 0
    # a host with fewer GPUs fails the generator's start naming the key, before CUDA starts
    with pytest.raises(PlacementError, match=r"generator.devices names GPU .* has 4 visible GPU"):
        gpus_of(cfg, 4)
    # moving the generators onto the trainer's GPUs is refused at load, naming the key
    with pytest.raises(ConfigError, match="generator.devices"):
        load(recipe, [f"generator.devices={cfg.trainer.devices}"])


def test_the_qwen3_1_7b_shape():
    conf = qwen3_config(model="Qwen3-1.7B")
    assert {k: conf[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")} == {
        "num_hidden_layers": 28, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151_936, "tie_word_embeddings": True}
    assert qwen3_config(layers=2, model="Qwen3-1.7B")["hidden_size"] == 2048
    with pytest.raises(ValueError, match="Qwen3-0.6B, Qwen3-1.7B, Qwen3-4B, Qwen3-8B"):
        qwen3_config(model="Qwen3-14B")


def meta_params(conf: dict, tmp_path: Path) -> int:
    """Parameters of the torchtitan model the trainer builds from `conf`, built on the meta device."""
    hf = tmp_path / f"meta-{conf['num_hidden_layers']}-{conf['hidden_size']}"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(conf))
    with torch.device("meta"):
        return sum(p.numel() for p in titan_config(read_arch(hf)).build().parameters())


def test_the_qwen3_4b_and_8b_shapes(tmp_path):
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rope_theta")
    c8, c4 = qwen3_config(model="Qwen3-8B"), qwen3_config(model="Qwen3-4B")
    assert {k: c8[k] for k in keys} == {
        "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151_936, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "rope_theta": 1_000_000}
    assert {k: c4[k] for k in keys} == {
        "num_hidden_layers": 36, "hidden_size": 2560, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151_936, "tie_word_embeddings": True,
        "max_position_embeddings": 40960, "rope_theta": 1_000_000}
    assert c8["max_window_layers"] == c4["max_window_layers"] == 36
    # the 8B's untied head is a second 151,936 x 4,096 matrix: 8.19e9 in all, the 4B's tied one counted once
    assert meta_params(c8, tmp_path) == TEACHERS["qwen3-8b-to-0.6b-opd.yaml"][1] == 8_190_735_360
    assert meta_params(c4, tmp_path) == 4_022_468_096


def test_a_recipes_keys_fit_its_models_shape_tokenizer_and_context(recipe, tmp_path, load):
    cfg = load(recipe)
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


def teacher_peak_bytes(cfg, conf: dict, params: int) -> dict[str, int]:
    """The teacher GPU's worst case, term by term, as the OPD recipe's header writes it out: bf16 weights;
    teacher.max_sequences key/value caches of generator.max_model_len tokens (the longest stream when
    teacher.context is empty), twice over (a scoring round holds each stream's old cache beside its
    extended one until the round ends: pipeline/reward_model.py StreamingScorer._round); and one forward
    of teacher.max_batch whole sequences: their padded cache copy, activations, attention scores on the
    math kernel, and one sequence's float32 logits and their log-softmax."""
    tc, n, L = cfg.teacher, cfg.teacher.max_batch, cfg.generator.max_model_len
    width = 2  # bytes of a bf16 element
    hd, heads, kv = conf["head_dim"], conf["num_attention_heads"], conf["num_key_value_heads"]
    kv_token = conf["num_hidden_layers"] * kv * hd * 2 * width  # k and v of every layer
    act_token = (3 * conf["hidden_size"] + heads * hd + 2 * kv * hd + 4 * conf["intermediate_size"]) * width
    return {"weights": params * width, "caches": 2 * tc.max_sequences * L * kv_token, "copy": n * L * kv_token,
            "activations": n * L * act_token, "attention": n * heads * L * L * width * 2,
            "logits": 2 * L * conf["vocab_size"] * 4}


def test_the_opd_recipe_puts_qwen3_8b_on_its_own_gpu_and_fits_it_in_80_gb(monkeypatch, tmp_path, shape_dir, load):
    monkeypatch.chdir(REPO)
    recipe = REPO / "configs" / "qwen3-8b-to-0.6b-opd.yaml"
    student, (teacher, teacher_params) = RECIPES[recipe.name][0], TEACHERS[recipe.name]
    written = yaml.safe_load(recipe.read_text())
    assert Path(written["teacher"]["hf_dir"]).name == teacher and teacher in MODELS
    if not Path(written["teacher"]["hf_dir"]).is_dir():  # as on this machine: the override below is needed
        with pytest.raises(ConfigError, match="teacher.hf_dir"):
            load_config(recipe)
    cfg = load(recipe)
    t, tc, g = cfg.trainer, cfg.teacher, cfg.generator
    assert (t.recipe, t.distill_coef, t.reward_coef) == ("opd", 1.0, 0.0)
    assert (tc.device, tc.dtype, tc.context) == ("cuda", "bfloat16", "")
    assert Path(tc.hf_dir) == shape_dir(teacher).resolve()

    # the teacher's GPU, as its proc resolves it at start: its own, every GPU of the host used once
    trainer, gens = gpus_of(cfg, GPUS)
    mine = resolve_gpus(teacher_placement(cfg), GPUS)
    assert mine == (7,)
    others = [i for ids in trainer + gens for i in ids]
    assert not set(mine) & set(others) and sorted(others + list(mine)) == list(range(GPUS))
    with pytest.raises(PlacementError, match=r"teacher.devices names GPU 7, but this host has 4 visible GPU"):
        resolve_gpus(teacher_placement(cfg), 4)
    for busy in (t.devices.split("-")[0], g.devices.split("-")[0]):  # onto a trainer's or a generator's GPU
        with pytest.raises(ConfigError, match="teacher.devices"):
            load(recipe, [f"teacher.devices={busy}"])

    # the teacher reads the student's token ids: the same Qwen3 tokenizer files (the check the run makes
    # before any mesh starts, pipeline/driver/job.py check_teacher)
    sdir, tdir = shape_dir(student), shape_dir(teacher)
    assert check_tokenizers(sdir, tdir) is None
    sconf, tconf = read_hf_config(sdir), read_hf_config(tdir)
    # the teacher's vocabulary covers the student's (its ids and every id the student's embedding has)
    assert tconf["vocab_size"] >= sconf["vocab_size"] >= len(load_tokenizer(sdir))
    assert tconf["model_type"] == "qwen3" and not tconf["tie_word_embeddings"]
    assert g.max_model_len <= tconf["max_position_embeddings"]

    # every rollout in flight keeps its stream: no eviction (an evicted stream is scored whole at EOS)
    b = cfg.buffer
    assert (b.batch_groups + b.delta_max) * b.group_size <= g.num_generators * g.concurrency < tc.max_sequences

    # the teacher's worst case fits the GPU, with the header's figures
    assert meta_params(tconf, tmp_path) == teacher_params
    peak = teacher_peak_bytes(cfg, tconf, teacher_params)
    assert {k: round(v / 1e9, 1) for k, v in peak.items()} == {
        "weights": 16.4, "caches": 43.5, "copy": 3.6, "activations": 3.3, "attention": 4.8, "logits": 1.9}
    assert round(sum(peak.values()) / 1e9, 1) == 73.5
    assert sum(peak.values()) < 0.9 * GPU_BYTES
    # the brief form too: weights + every stream at full length once
    assert peak["weights"] + peak["caches"] // 2 < 0.9 * GPU_BYTES
