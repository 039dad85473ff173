"""Built-in task: prompts and answers from local JSONL files (`task.path`, optionally `task.eval_path`).

    python -m pipeline.run --config configs/tiny.yaml task.name=pipeline.tasks.jsonl \
        task.path=examples/tasks/capitals.jsonl task.eval_path=examples/tasks/capitals.jsonl run.epochs=30

One JSON object per line: {"prompt": "...", "answer": "..."} plus an optional "id" (a string or an
integer, unique within its file; error messages name it). A chat prompt is a "messages" key instead
of "prompt": {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
"answer": "..."}, rendered by the checkpoint's chat template (pipeline/tokens.py, task.enable_thinking);
the reward then gets the messages as its prompt. Other keys are ignored and blank lines skipped. A
bad line (invalid JSON, not an object, a missing key, both "prompt" and "messages", a prompt or
answer that is not a string, an empty prompt, a message without a str role or content, a repeated
id) fails at load naming file:line, before anything starts.

Splits: task.path is the train split; task.eval_path, if set, the eval split (a separate file, so
nothing is silently held out of training). Without it the eval split is empty, and a run with
evaluation on (run.eval_every and task.eval_prompts > 0) fails at start saying so.

Reward: 1.0 for the exact answer (the completion stripped of surrounding whitespace), else partial
credit: difflib's similarity ratio 2·M/T of the two strings (M matching characters, T both lengths),
below 1 whenever they differ. It looks the answer up by prompt, so a prompt has one answer across
both files: the same prompt twice with the same answer is allowed (it is trained twice per epoch),
with different answers it fails at load naming both lines. `demonstration` is the answer.

`prompts` returns a tuple, so PromptStream shuffles every epoch, the first included, and the files
are read once per process.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from pipeline.config import TaskConfig
from pipeline.tasks import TaskError
from pipeline.tokens import PromptError, check_messages
from pipeline.tasks.answers import AnswerSplits
from pipeline.types import Prompt, PromptItem

__all__ = ["JsonlTask", "from_config", "read_jsonl"]

NAME = "pipeline.tasks.jsonl"


def from_config(cfg: TaskConfig) -> "JsonlTask":
    if not cfg.path:
        raise TaskError(f"task {NAME!r}: task.path is empty; set it to a JSONL file of "
                        '{"prompt": ..., "answer": ...} lines (e.g. examples/tasks/capitals.jsonl)')
    return JsonlTask(cfg.path, cfg.eval_path)


def read_jsonl(path: str | Path, first_uid: int = 0) -> list[tuple[PromptItem, str]]:
    """(item, where) per line of `path`, where = "file:line" (and the id); TaskError names the bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"task {NAME!r}: cannot read {path}: {type(e).__name__}: {e}") from None
    rows: list[tuple[PromptItem, str]] = []
    ids: dict[object, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        at = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{at}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TaskError(f'{at}: expected a JSON object with "prompt" and "answer", got {type(obj).__name__}')
        if "prompt" in obj and "messages" in obj:
            raise TaskError(f"{at}: both 'prompt' and 'messages'; a line has one of them")
        key = "messages" if "messages" in obj else "prompt"
        missing = [k for k in (key, "answer") if k not in obj]
        if missing:
            raise TaskError(f"{at}: missing key(s) {', '.join(repr(k) for k in missing)}"
                            + (" (or 'messages', a chat prompt)" if key in missing else ""))
        for k in ("prompt", "answer") if key == "prompt" else ("answer",):
            if not isinstance(obj[k], str):
                raise TaskError(f"{at}: {k!r} must be a string, got {type(obj[k]).__name__} {obj[k]!r}")
        if key == "messages":
            try:
                check_messages(obj["messages"])
            except PromptError as e:
                raise TaskError(f"{at}: 'messages': {e}") from None
        elif not obj["prompt"]:
            raise TaskError(f"{at}: 'prompt' is empty")
        if "id" in obj:
            rid = obj["id"]
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                raise TaskError(f"{at}: 'id' must be a string or an integer, got {type(rid).__name__} {rid!r}")
            if rid in ids:
                raise TaskError(f"{at}: id {rid!r} repeats {ids[rid]}")
            ids[rid] = at
            at = f"{at} (id {rid!r})"
        rows.append((PromptItem(uid=first_uid + len(rows), prompt=obj[key], answer=obj["answer"]), at))
    return rows


class JsonlTask:
    def __init__(self, path: str | Path, eval_path: str | Path = ""):
        train = read_jsonl(path)
        self.splits = AnswerSplits(NAME, train, read_jsonl(eval_path, first_uid=len(train)) if eval_path else [])
        self.prompts = self.splits.prompts

    def reward(self, prompt: Prompt, completion: str) -> float:
        answer, got = self.splits.answer(prompt).strip(), completion.strip()
        if got == answer:
            return 1.0
        return difflib.SequenceMatcher(None, got, answer, autojunk=False).ratio()

    def demonstration(self, item: PromptItem) -> str:
        return self.splits.answer(item.prompt)
