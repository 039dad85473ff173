import json
import logging
import re
import subprocess
import sys

import pytest

from pipeline.checkpoint import MARKER, Checkpoints, prepare_resume, save_controller_state
from pipeline.config import Config, ConfigError, load_config

from .conftest import REPO


def test_tiny_yaml_is_the_embedded_default_and_loads():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert isinstance(cfg, Config)
    assert cfg.model.hf_dir == "builtin:tiny" and cfg.trainer.device == "cpu" and cfg.generator.engine == "vllm-cpu"


def test_the_config_package_is_a_leaf_importing_nothing_else_of_the_project():
    """pipeline.config imports no other project module (so every module may import it); a builtin:
    model.hf_dir stays a name until pipeline/models resolves it at start-up."""
    code = ("import sys, pipeline.config as c; "
            "cfg = c.load_config('configs/tiny.yaml', ['model.hf_dir=builtin:smollm2-135m-instruct']); "
            "print(cfg.model.hf_dir); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('pipeline'))))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    hf_dir, modules = p.stdout.splitlines()
    assert hf_dir == "builtin:smollm2-135m-instruct"
    others = [m for m in modules.split() if m != "pipeline" and not m.startswith("pipeline.config.")
              and m != "pipeline.config"]
    assert others == [], f"pipeline.config imported {others}"


def test_an_empty_model_hf_dir_names_builtin_tiny():
    with pytest.raises(ConfigError, match=r"model\.hf_dir='' is invalid; allowed: .*builtin:tiny"):
        load_config(REPO / "configs" / "tiny.yaml", ["model.hf_dir="])


def test_zero_signal_defaults_to_auto_and_takes_keep_or_drop():
    assert load_config(None).buffer.zero_signal == "auto"
    assert load_config(REPO / "configs" / "smollm2-135m-add.yaml", ["model.hf_dir=/not/built"]).buffer.zero_signal == "auto"
    for v in ("keep", "drop", "auto"):
        assert load_config(None, [f"buffer.zero_signal={v}"]).buffer.zero_signal == v
    with pytest.raises(ConfigError, match=r"buffer\.zero_signal='sometimes' is invalid; allowed: one of 'auto'"):
        load_config(None, ["buffer.zero_signal=sometimes"])


def test_cli_override_wins_over_yaml():
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["buffer.max_staleness=0", "trainer.lr=0.01"])
    assert cfg.buffer.max_staleness == 0 and cfg.trainer.lr == pytest.approx(0.01)


def test_mis_balance_is_accepted_with_consistent_rollouts():
    for ov in (["generator.on_update=drain"], ["run.mode=sync"]):
        cfg = load_config(REPO / "configs" / "tiny.yaml", ["trainer.correction=mis_balance", *ov])
        assert cfg.trainer.correction == "mis_balance"
    with pytest.raises(ConfigError, match="carry_over"):
        load_config(REPO / "configs" / "tiny.yaml", ["trainer.correction=mis_balance", "generator.on_update=drain",
                                                     "generator.carry_over=save"])


def test_mis_balance_is_refused_for_multi_turn_tasks_unless_sync():
    """An update can land between a multi-turn rollout's turns even with on_update=drain: refused,
    naming trainer.correction, for a task with its own environment or task.env; a single model turn
    (task.max_turns=1) or run.mode=sync is accepted."""
    base = ["trainer.correction=mis_balance", "generator.on_update=drain"]
    for ov in (["task.name=pipeline.tasks.calc"], ["task.name=pipeline.tasks.lookup"],
               ["task.env=pipeline.tasks.calc.env"]):
        with pytest.raises(ConfigError, match=r"^config: trainer.correction='mis_balance' is invalid.*task.max_turns=4"):
            load_config(REPO / "configs" / "tiny.yaml", [*base, *ov])
    for ov in (["task.name=pipeline.tasks.calc", "task.max_turns=1"], ["task.name=pipeline.tasks.calc", "run.mode=sync"]):
        assert load_config(REPO / "configs" / "tiny.yaml", [*base, *ov]).trainer.correction == "mis_balance"


@pytest.mark.parametrize(
    "override, must_name",
    [
        ("buffer.nope=1", "buffer.nope"),
        ("trainer.lr=fast", "trainer.lr"),
        ("buffer.batch_groups=-3", "buffer.batch_groups"),
        ("trainer.correction=magic", "trainer.correction"),
        ("weight_sync.transport=pigeon", "weight_sync.transport"),
        ("trainer.backend=nccl", "trainer.backend"),
        ("trainer.tensor_parallel=2", "trainer.tensor_parallel"),
        ("trainer.dual_clip=0.5", "trainer.dual_clip"),
        ("trainer.minibatches=0", "trainer.minibatches"),
        ("trainer.minibatches=65", "trainer.minibatches"),  # tiny.yaml: 8 groups of 8 samples
        ("trainer.epochs=0", "trainer.epochs"),
        ("buffer.window=2", "buffer.window"),
        ("buffer.slope_tstat=-1", "buffer.slope_tstat"),
        ("buffer.slope_threshold=0.1", "buffer.slope_threshold"),  # replaced by slope_tstat
        ("trainer.correction=mis_balance", "generator.on_update=drain"),  # tiny.yaml: keep, mixed versions
        ("trainer.grad_variance=true", "trainer.micro_batch_size"),  # whole-batch micro-batches: one chunk
        ("generator.cpu_executor=threads", "generator.cpu_executor"),
        ("run.preflight_prompts=-1", "run.preflight_prompts"),
        ("buffer.zero_signal=sometimes", "buffer.zero_signal"),
    ],
)
def test_bad_config_names_the_key(override, must_name):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "tiny.yaml", [override])
    assert must_name in str(e.value)


def test_the_worker_in_the_engine_core_is_refused_above_one_tensor_parallel_rank():
    from pipeline.generator.llm import worker_in_core

    tiny = REPO / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError, match="generator.cpu_executor.*tensor_parallel_size"):
        load_config(tiny, ["generator.cpu_executor=uni", "generator.tensor_parallel_size=2"])
    assert worker_in_core(load_config(tiny, []))  # auto: in the core at one rank
    assert not worker_in_core(load_config(tiny, ["generator.tensor_parallel_size=2"]))  # auto: a worker per rank
    assert not worker_in_core(load_config(tiny, ["generator.cpu_executor=mp"]))


def test_ppo_minibatches_and_dual_clip_accept_their_ranges():
    cfg = load_config(REPO / "configs" / "tiny.yaml",
                      ["trainer.minibatches=64", "trainer.epochs=3", "trainer.dual_clip=0"])
    assert (cfg.trainer.minibatches, cfg.trainer.epochs, cfg.trainer.dual_clip) == (64, 3, 0.0)
    assert load_config(None).trainer.dual_clip == 3.0  # on by default


def test_raw_logprobs_with_temperature_are_refused_naming_both_keys():
    """The learner scores softmax(logits / T); raw logprobs describe softmax(logits)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["generator.logprobs_mode=raw", "generator.temperature=0.7"])
    assert "generator.logprobs_mode" in str(e.value) and "generator.temperature" in str(e.value)
    assert load_config(None, ["generator.logprobs_mode=raw"]).generator.temperature == 1.0
    assert load_config(None, ["generator.temperature=0.7"]).generator.logprobs_mode == "processed"


def test_top_p_below_one_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"generator\.top_p=0\.9 .*1\.0 for RL.*truncated.*biased low"):
        load_config(None, ["generator.top_p=0.9"])


def test_choice_errors_list_allowed_values():
    with pytest.raises(ConfigError, match="'keep', 'abort', 'drain'"):
        load_config(None, ["generator.on_update=sometimes"])


def test_missing_yaml_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "override, must_name",
    [("buffer.nope=1", "buffer.nope"), ("trainer.lr=fast", "trainer.lr"), ("buffer.batch_groups=-1", "buffer.batch_groups")],
)
def test_run_entry_point_exits_nonzero_on_bad_config(override, must_name):
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", override],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert must_name in p.stderr


@pytest.mark.parametrize("override,key", [("task.env_timeout_s=400", "task.env_timeout_s"),
                                          ("task.max_turns=0", "task.max_turns"),
                                          ("task.max_total_tokens=0", "task.max_total_tokens"),
                                          ("task.max_obs_tokens=0", "task.max_obs_tokens"),
                                          ("task.env=nodots", "task.env")])
def test_bad_multi_turn_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config("configs/tiny.yaml", [override])


@pytest.mark.parametrize("key, value, why", [("generator.top_p", "1.0", "biased low"),
                                             ("weight_sync.backend", "gloo", "trainer.backend"),
                                             ("model.cache_dir", "/tmp/tiny", "model.hf_dir=builtin:tiny")])
def test_removed_keys_are_refused_by_name_with_the_reason(tmp_path, key, value, why):
    """A removed key fails as a ConfigError naming it, from the command line and from a YAML file,
    even at its only accepted value, instead of OmegaConf's unknown-key error."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}={value} \(a command-line override\) is no longer a "
                                          rf"key, it was removed: .*{why}"):
        load_config(None, [f"{key}={value}"])
    section, name = key.split(".")
    yaml = tmp_path / "old.yaml"
    yaml.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}={value} \(in .*old\.yaml'\) is no longer a key"):
        load_config(yaml)


def test_the_tiny_models_shape_keys_are_refused_naming_builtin_tiny_and_the_builder(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.tiny\.n_layers=3 \(a command-line override\) is no longer a key, "
                                          r"it was removed: .*builtin:tiny.*python -m pipeline\.models\.tiny"):
        load_config(None, ["model.tiny.n_layers=3"])
    yaml = tmp_path / "old.yaml"
    yaml.write_text("model:\n  hf_dir: ''\n  tiny:\n    dim: 256\n")
    with pytest.raises(ConfigError, match=r"model\.tiny\.dim=256 \(in .*old\.yaml'\) is no longer a key"):
        load_config(yaml)


def test_a_checkpoint_recording_removed_keys_still_resumes(tmp_path, caplog):
    """Checkpoints written before generator.top_p and weight_sync.backend went record them in their
    config; a resume ignores them (nothing can set them now) and diffs the rest as before."""
    ck = Checkpoints(load_config(REPO / "configs" / "tiny.yaml", [f"run.out_dir={tmp_path}"]))
    tmp = ck.begin(2)
    save_controller_state(tmp, {"step": 2, "version": 2})
    path = ck.commit(tmp, 2, 2)
    marker = json.loads((path / MARKER).read_text())
    marker["config"]["generator"]["top_p"] = 1.0
    marker["config"]["weight_sync"]["backend"] = "gloo"
    (path / MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.INFO, logger="pipeline.checkpoint"):
        cfg = prepare_resume(load_config(REPO / "configs" / "tiny.yaml",
                                         [f"run.out_dir={tmp_path}", "run.resume=latest", "trainer.lr=5e-4"]))
    assert cfg.run.resume == str(path)
    assert "trainer.lr=0.0005" in caplog.text and "top_p" not in caplog.text and "weight_sync.backend" not in caplog.text


@pytest.mark.parametrize("value, period, verified", [("off", 0, []), ("0", 0, []), ("every", 1, [1, 2, 3, 4, 5, 6, 7]),
                                                     ("on", 1, [1, 2, 3, 4, 5, 6, 7]), ("3", 3, [1, 4, 7])])
def test_weight_sync_verify_reads_off_every_or_a_period(value, period, verified):
    ws = load_config(str(REPO / "configs/tiny.yaml"), [f"weight_sync.verify={value}"]).weight_sync
    assert ws.verify_every == period and [n for n in range(1, 8) if ws.verified(n)] == verified


@pytest.mark.parametrize("overrides, why", [
    (["weight_sync.verify=sometimes"], "'off', 'every' or a positive integer k"),
    (["weight_sync.verify=-2"], "'off', 'every' or a positive integer k"),
    (["weight_sync.verify=every", "trainer.lora.rank=8", "generator.on_update=drain"], "trainer.lora.rank > 0"),
    (["weight_sync.verify=2", "generator.tensor_parallel_size=2"], "tensor_parallel_size=2"),
])
def test_weight_sync_verify_refuses_bad_values_naming_the_key(overrides, why):
    with pytest.raises(ConfigError, match=re.escape("weight_sync.verify=") + r".*" + re.escape(why)):
        load_config(str(REPO / "configs/tiny.yaml"), overrides)


def test_shadow_weights_is_a_bool_and_refused_with_lora():
    assert load_config(REPO / "configs" / "tiny.yaml", ["generator.shadow_weights=true"]).generator.shadow_weights
    with pytest.raises(ConfigError, match="generator.shadow_weights"):
        load_config(REPO / "configs" / "tiny.yaml", ["generator.shadow_weights=sometimes"])
    with pytest.raises(ConfigError, match="generator.shadow_weights.*lora"):
        load_config(REPO / "configs" / "tiny.yaml", ["generator.shadow_weights=true", "trainer.lora.rank=8",
                                                     "generator.on_update=abort"])


@pytest.mark.parametrize("overrides, why", [
    (["weight_sync.delta=true"], "weight_sync.delta=True is invalid; allowed: false with weight_sync.transport=shm"),
    (["weight_sync.delta=true", "weight_sync.transport=rdma", "weight_sync.full_every=-1"],
     "weight_sync.full_every=-1 is invalid; allowed: >= 0"),
])
def test_weight_sync_delta_refuses_shm_and_a_negative_period_naming_the_key(overrides, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        load_config(str(REPO / "configs/tiny.yaml"), overrides)
    ws = load_config(str(REPO / "configs/tiny.yaml"), ["weight_sync.transport=collective", "weight_sync.delta=true"])
    assert ws.weight_sync.delta and ws.weight_sync.full_every == 10
