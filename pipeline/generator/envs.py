"""Multi-turn environments: a rollout as a sequence of model turns and environment observations.

A task becomes multi-turn with an environment factory, its own `env` or any dotted path in
`task.env` (so a sandbox or a search tool lives outside this repository):

    def env(item: PromptItem) -> Env          # one environment per rollout, made before its first turn

    class Env:
        def step(self, turn: str) -> str | None
            # `turn`: the model's last turn as text (special tokens dropped). Return the observation
            # to show the model next (appended as tokens, then the model's next turn), or None: the
            # episode ends. A tool error should come back as an observation ("error: ..."), which
            # the model sees and can learn from; an exception fails the rollout instead.

Layout and token flow (pipeline/generator/episode.py drives it). The completion of a multi-turn rollout
is `turn_1 obs_1 turn_2 obs_2 ... turn_k`: model tokens carry their behaviour logprobs and per-token
versions, observation tokens version ENV_VERSION (-1) and logprob 0, so the buffer leaves them out of
the loss and of staleness. Token in, token out: each turn is generated from the exact token sequence
so far (prompt, every model token the engine returned, EOS included, every observation token), never
from re-tokenised text; an observation is tokenised once, on its own, with no special tokens.

With a chat prompt (a list of messages, pipeline/tokens.py) each observation is a user turn of the
chat template, so the model sees the layout it was tuned on. The template's frame around it is
tokenised once per tokenizer (`observation_frame`, from the template's own rendering) and the
observation's tokens go between; frame tokens are environment tokens like the observation's
(version -1, masked out). Qwen3, enable_thinking unset:

    prompt  <|im_start|>user\nmul 37*4=<|im_end|>\n<|im_start|>assistant\n
    turn 1  ?<|im_end|>                                    (model; <|im_end|> is its stop token)
    obs     \n<|im_start|>user\n:148;<|im_end|>\n<|im_start|>assistant\n   (environment)
    turn 2  148<|im_end|>                                  (model)

The frame opens with the end of turn (`<|im_end|>`), left out when the model's turn already ends
with it and kept when the turn was cut by its length budget. An observation is cut to
`max_obs_tokens` inside its frame; a frame that no longer fits in `max_total_tokens` ends the
episode. A str prompt's observations have no frame (the layout above without the chat tokens). The
warm start lays demonstrations out the same way (pipeline/driver/warm_start.py).

Limits per rollout (task section): `max_turns` model turns, `max_total_tokens` completion tokens
(model and environment), each turn at most generator.max_new_tokens, each observation at most
`max_obs_tokens` (cut, counted as obs_truncated). The reward is the task's `reward(prompt,
transcript)` of the whole transcript (model turns and observations as text, special tokens and chat
frames left out: `?:148;148` in both layouts above) once the episode ends:
group advantages use this final reward; there are no per-turn advantages.

Optional, for an environment that scores its own episodes (pipeline/tasks/openenv.py's Episode):

    def reward(self) -> float      # the episode's reward, used instead of the task's reward()
    def close(self) -> None        # called once its episode is over (scored, rejected or failed; not
                                   # when carried over), on a worker thread
    turn_rewards: list[float]      # each step's reward, kept with the rollout (Rollout.turn_rewards)

Such an environment gets every model turn, the last one included: when a limit (task.max_turns,
task.max_total_tokens) ends the episode, `step` is still called with the last turn (its reward
counts) and the observation it returns is dropped.

Faults stay with the rollout: `env(item)` or `step` that raises, or runs past `task.env_timeout_s`
(both run on worker threads off the actor's event loop), rejects the sample as env_raised or
env_timeout and gives its group back, counted with the rejected rewards (task.max_reject_frac).

Weight updates between or within turns behave as for single-turn rollouts: keep, abort and drain
apply to the turn in flight, `carry_over=save` keeps the whole trajectory (environment included) and
resumes its current turn first; a rollout whose turns ran on two versions carries both, and its
staleness is the oldest model token's.

Example:
    class Echo:                                # ends the episode after one observation
        def __init__(self, item): self.left = 1
        def step(self, turn: str) -> str | None:
            self.left -= 1
            return f"you said {turn!r};" if self.left >= 0 else None

    def env(item: PromptItem) -> Env: return Echo(item)   # task.env = "mytask.env"
"""

from __future__ import annotations

from typing import Protocol

from pipeline.types import ENV_VERSION, PromptItem

__all__ = ["Env", "EnvFactory", "ENV_VERSION", "ENV_REASONS"]

ENV_REASONS = ("env_raised", "env_timeout", "env_bad_observation", "env_unreachable")


class Env(Protocol):
    def step(self, turn: str) -> str | None: ...


class EnvFactory(Protocol):
    def __call__(self, item: PromptItem) -> Env: ...


def env_scored(env: object) -> bool:
    """Whether an environment scores its own episodes (a `reward()` method: OpenEnv's observations
    carry the reward, pipeline/tasks/openenv.py); then the task's text reward is not called."""
    return env is not None and callable(getattr(env, "reward", None))


def turn_rewards(env: object) -> tuple[float, ...]:
    """The rewards an environment gave each step (its `turn_rewards`, None as NaN-free 0), else ()."""
    got = getattr(env, "turn_rewards", None) if env is not None else None
    return tuple(0.0 if r is None else float(r) for r in got) if got else ()
