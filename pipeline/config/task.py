"""task.*: the prompts, the reward and the environment of a run (pipeline/tasks/, pipeline/generator/envs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config.errors import check


@dataclass
class OpenEnvConfig:
    """task.openenv.*: an OpenEnv environment as the task (pipeline/tasks/openenv.py, docs/openenv.md), with
    task.name=pipeline.tasks.openenv. One of `env` (in-process) or `url` (served) names it."""

    env: str = ""
    """Dotted path of an OpenEnv `Environment` subclass (or a factory of one), made once per episode in the
    generator's process and driven on its environment workers. With serve=local it is also what the run's
    own server serves."""
    url: str = ""
    """Base URL of a served environment (http://host:port); each episode is one WebSocket session on its /ws
    route. Set by the run itself with serve=local."""
    serve: str = "none"
    """none: `env` runs in-process, or `url` is an existing server. local: the run serves `env` itself
    (create_app + uvicorn on a free loopback port, its own process), restarts it when it dies (at most
    task.openenv.max_restarts times) and stops it with the run; episodes go over the WebSocket."""
    action: str = ""
    """How a completion becomes the environment's Action: empty: the default (the action's one required
    string field gets the completion's text; an MCP environment's CallToolAction is parsed from a
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in it); a field name: that field gets the
    text; a dotted path: `adapter(text: str, schema: dict) -> dict`, the action's fields."""
    observation: str = ""
    """How an observation becomes the text the model sees: empty: the default (its one string field, or
    a field named prompt/text/message/content/output, else its fields as JSON); a field name: that field;
    a dotted path: `render(observation: dict) -> str`."""
    reward: str = "last"
    """The episode's reward from the observations' rewards: last (the last one the episode returned) or
    sum (of all of them). Every step's reward is kept with the rollout (its turn_rewards)."""
    system: str = ""
    """A system message sent before the first observation (the action format, the tools); with
    task.openenv.chat=false it is written before it."""
    chat: bool = True
    """true: the first observation is a user message rendered by the checkpoint's chat template, later ones
    user turns; false: plain text prompts (a base or tiny model)."""
    episodes: int = 0
    """Distinct training episodes (seeds) before the stream repeats them in a new shuffled epoch; 0: an
    endless stream of fresh seeds. Held-out episodes (task.eval_prompts of them) use seeds no training
    episode uses."""
    demonstration: str = ""
    """Dotted path of `demo(first_observation: str, seed: int) -> list[str]`, an episode's ideal turns
    (model turn, observation, model turn, ...) for the warm start (run.warm_start_steps); empty: none."""
    connect_timeout_s: float = 20.0
    """Seconds an episode waits for a served environment to accept its session (a restarting local server
    included); past it the episode fails as env_unreachable and its group goes back."""
    max_restarts: int = 3
    """serve=local: restarts of a dead server before the run stops naming it (0..100)."""
    max_concurrent: int = 0
    """serve=local: the server's concurrent sessions (max_concurrent_envs); 0: enough for every episode a
    run can hold open, 4 x generator.concurrency x generators + 16 (training's, evaluation's, the prompt
    stream's)."""

    def __post_init__(self) -> None:
        check(self.serve in ("none", "local"), "task.openenv.serve", self.serve, "none or local")
        check(not self.env or "." in self.env, "task.openenv.env", self.env, "a dotted path like 'pkg.module.MyEnvironment'")
        check(not (self.serve == "local" and not self.env), "task.openenv.serve", self.serve,
              "local needs task.openenv.env (the environment the run serves)")
        check(self.serve == "local" or not (self.env and self.url), "task.openenv.url", self.url,
              "empty when task.openenv.env runs in-process (one of the two)")
        check(not self.url or self.url.startswith(("http://", "https://")), "task.openenv.url", self.url,
              "http://host:port")
        check(self.reward in ("last", "sum"), "task.openenv.reward", self.reward, "last or sum")
        check(not self.demonstration or "." in self.demonstration, "task.openenv.demonstration", self.demonstration,
              "a dotted path like 'pkg.module.demo', or empty")
        check(self.episodes >= 0, "task.openenv.episodes", self.episodes, ">= 0")
        check(self.connect_timeout_s > 0, "task.openenv.connect_timeout_s", self.connect_timeout_s, "> 0")
        check(0 <= self.max_restarts <= 100, "task.openenv.max_restarts", self.max_restarts, "0..100")
        check(0 <= self.max_concurrent <= 100000, "task.openenv.max_concurrent", self.max_concurrent, "0..100000")


@dataclass
class TaskConfig:
    """task.*: the task plug-in, its data files, reward and environment limits."""

    name: str = "pipeline.tasks.reverse"
    """Dotted path of a task module or object providing `prompts(...)` and `reward(prompt, completion)`."""
    seed: int = 0
    """Seed of the prompt stream: passed to prompts(seed, split); also seeds the per-epoch shuffle of a
    finite train split (pipeline/tasks/__init__.py)."""
    eval_prompts: int = 32
    """Held-out prompts scored for the learning curve (0..100000); a shorter eval split is used whole."""
    eval_samples: int = 4
    """n: completions sampled per eval prompt at generator.temperature (1..1024), besides the greedy one;
    eval/reward is their mean reward, eval/pass@k and eval/mean@k are estimated from them."""
    eval_k: int = 4
    """k of eval/pass@k (the unbiased estimator over the n = task.eval_samples samples of a prompt: the
    chance that at least one of k samples gets full reward) and eval/mean@k (1..task.eval_samples)."""
    path: str = ""
    """Data file of a file-based task (pipeline.tasks.jsonl: its train split, one JSON object per line);
    empty for tasks that need none. Must exist; read relative to the working directory, kept absolute."""
    eval_path: str = ""
    """Eval split file of a file-based task (pipeline.tasks.jsonl, pipeline.tasks.dataset); empty: no eval
    split. Must exist if set."""
    prompt_column: str = "question"
    """pipeline.tasks.dataset: the column holding each row's prompt (a string)."""
    answer_column: str = "answer"
    """pipeline.tasks.dataset: the column holding each row's reference answer (a string or a number; a
    GSM8K-style solution ending in `#### 72` too), which the grader scores completions against."""
    solution_column: str = ""
    """pipeline.tasks.dataset: the column holding a worked solution, the demonstration of the warm start
    (run.warm_start_steps); empty: the task has none. GSM8K's answer column is one: solution_column=answer."""
    apply_chat_template: bool = False
    """pipeline.tasks.dataset, pipeline.tasks.reasoning_gym: send each string prompt as one user message
    ([{"role": "user", "content": prompt}]), rendered by the checkpoint's chat template with the generation
    prompt, as a column of messages is; what an instruct checkpoint was trained on. false: a
    string prompt is tokenized as it is."""
    grader: str = "pipeline.tasks.graders.math"
    """pipeline.tasks.dataset: dotted path of `grade(completion, reference) -> float` (pipeline/tasks/graders.py:
    math, the last \\boxed{} checked with math-verify, so the prompts must ask for it (the data's own
    words or task.instruction); math_last_number, the same but a completion without a box is read for
    its last number; exact, the exact string)."""
    instruction: str = ""
    """pipeline.tasks.dataset: a sentence written after every prompt (after a space; for chat messages,
    at the end of the last user message) that states the answer format the grader reads, as
    "Put the final answer in \\boxed{}." for the math grader on GSM8K, whose questions state none;
    empty: the prompts as the files hold them."""
    reward_timeout_s: float = 30.0
    """Seconds one reward call may run (> 0); past it the sample is rejected as reward_timeout."""
    reward_workers: int = 4
    """Reward calls run at once per process, on threads off the event loop (1..256)."""
    max_reject_frac: float = 0.2
    """The run stops when more than this fraction of a generator's recent samples (its last 200,
    once 20 were seen) were rejected: a reward that raised, was NaN/inf or not a number, timed out,
    an environment that raised or timed out, or a prompt that was empty, too long or not
    tokenisable (0 < x <= 1; 1 never stops)."""
    env: str = ""
    """Multi-turn: dotted path of an environment factory `env(item) -> Env` (pipeline/generator/envs.py); empty:
    the task's own `env` if it has one, else single-turn."""
    max_turns: int = 4
    """Multi-turn: model turns per rollout (1..256); the episode ends after the last one."""
    max_total_tokens: int = 64
    """Multi-turn: completion tokens per rollout, model and environment together (1..131072); a turn
    gets at most generator.max_new_tokens of them."""
    max_obs_tokens: int = 32
    """Multi-turn: tokens one observation may add (1..131072); longer ones are cut and counted as
    obs_truncated."""
    env_timeout_s: float = 10.0
    """Seconds one environment call (env(item), step) may run (> 0); past it the sample is rejected
    as env_timeout. Calls run on threads off the event loop, like rewards."""
    enable_thinking: bool | None = None
    """Chat prompts (a task's prompt given as a list of messages): passed to the checkpoint's chat
    template as `enable_thinking` (a template with a think block renders it empty for false, so the
    model answers at once); null (the default): not passed, the template's own default. Unused for str prompts."""
    rg_dataset: str = ""
    """pipeline.tasks.reasoning_gym: the reasoning-gym dataset by its registered name (basic_arithmetic,
    chain_sum, leg_counting, ...); an unknown name fails when the task loads, listing the names."""
    rg_config: dict[str, Any] = field(default_factory=dict)
    """pipeline.tasks.reasoning_gym: fields of the dataset's own config dataclass (basic_arithmetic:
    {min_terms: 2, max_terms: 3}; on the command line task.rg_config.min_terms=2); unnamed fields keep
    the dataset's defaults. Not seed or size: task.seed and task.rg_size set them. A field the dataset's
    config lacks, or a value its validate() refuses, fails when the task loads, naming the field."""
    rg_size: int = 10000
    """pipeline.tasks.reasoning_gym: train items, generated from task.seed (1..1000000); every process
    that loads the task generates them all (the eval split: task.eval_prompts more, from a held-out seed)."""
    rg_system_prompt: str = ""
    """pipeline.tasks.reasoning_gym: a name in reasoning_gym.utils.SYSTEM_PROMPTS (default, simple, direct,
    DeepSeekZero, chain_of_draft) sent as a system message before each question (with
    task.apply_chat_template=false: written before it); empty: none, the user turn alone states the format."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """pipeline.tasks.openenv: the OpenEnv environment (task.openenv.*)."""
    rg_answer_format: str = "tags"
    """pipeline.tasks.reasoning_gym: how a completion states its answer, which the prompt asks for and the
    reward reads. tags: between <answer> and </answer> (reasoning-gym's own extract_answer); boxed: in
    \\boxed{} (the last complete one): for a checkpoint that already boxes its answers, which can then
    learn by RL alone, without a warm start to teach it the tags (measured: docs/configuration.md,
    "The reasoning-gym task")."""

    def __post_init__(self) -> None:
        check(bool(self.name) and "." in self.name, "task.name", self.name, "a dotted path like 'pkg.module'")
        check(0 <= self.eval_prompts <= 100000, "task.eval_prompts", self.eval_prompts, "0..100000")
        check(1 <= self.eval_samples <= 1024, "task.eval_samples", self.eval_samples, "1..1024")
        check(1 <= self.eval_k <= self.eval_samples, "task.eval_k", self.eval_k,
              f"1..task.eval_samples ({self.eval_samples}): pass@k needs at least k samples per prompt")
        for key in ("prompt_column", "answer_column"):
            check(bool(getattr(self, key)), f"task.{key}", getattr(self, key), "a column name")
        check("." in self.grader, "task.grader", self.grader, "a dotted path like 'pipeline.tasks.graders.math'")
        check(self.reward_timeout_s > 0, "task.reward_timeout_s", self.reward_timeout_s, "> 0")
        check(1 <= self.reward_workers <= 256, "task.reward_workers", self.reward_workers, "1..256")
        check(0 < self.max_reject_frac <= 1, "task.max_reject_frac", self.max_reject_frac, "0 < x <= 1")
        check(not self.env or "." in self.env, "task.env", self.env, "a dotted path like 'pkg.module.factory', or empty")
        check(1 <= self.max_turns <= 256, "task.max_turns", self.max_turns, "1..256")
        check(1 <= self.max_total_tokens <= 131072, "task.max_total_tokens", self.max_total_tokens, "1..131072")
        check(1 <= self.max_obs_tokens <= 131072, "task.max_obs_tokens", self.max_obs_tokens, "1..131072")
        check(self.env_timeout_s > 0, "task.env_timeout_s", self.env_timeout_s, "> 0")
        check(1 <= self.rg_size <= 1_000_000, "task.rg_size", self.rg_size, "1..1000000")
        check(not self.rg_dataset or self.rg_dataset.isidentifier(), "task.rg_dataset", self.rg_dataset,
              "a reasoning-gym dataset name like 'basic_arithmetic', or empty")
        check(self.rg_answer_format in ("tags", "boxed"), "task.rg_answer_format", self.rg_answer_format,
              "tags (<answer>...</answer>) or boxed (\\boxed{...})")
        for key in self.rg_config:
            check(isinstance(key, str) and key.isidentifier(), f"task.rg_config.{key}", self.rg_config[key],
                  "a field of the dataset's config (a Python identifier)")
            check(key not in ("seed", "size"), f"task.rg_config.{key}", self.rg_config[key],
                  "not set here: task.seed seeds the train items (the eval items a held-out seed) and "
                  "task.rg_size sizes the train split")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value:  # absolute: every process (generators, buffer) reads the same file whatever its cwd
                check(Path(value).is_file(), f"task.{key}", value,
                      "an existing local file (or empty); nothing is fetched from a dataset hub")
                setattr(self, key, str(Path(value).resolve()))

