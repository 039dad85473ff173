"""Built-in task: problems from local dataset files (parquet, JSONL, arrow) read with Hugging Face
`datasets`, scored by a grader named in config (pipeline/tasks/graders.py).

    python -m pipeline.run --config configs/tiny.yaml task.name=pipeline.tasks.dataset \\
        task.path=examples/gsm8k_style.jsonl task.eval_path=examples/gsm8k_style_eval.jsonl \\
        task.solution_column=answer

Files: `task.path` is the train split, `task.eval_path` (optional) the eval split, each read with
`datasets.load_dataset(<format>, data_files=<file>)`, the format from the file's suffix (.parquet;
.jsonl or .json; .arrow, an Arrow stream file as `datasets` writes). Only local files: the config
refuses a path that is not an existing file (a hub name like `openai/gsm8k` too), and nothing is
downloaded. Columns (config keys): `task.prompt_column` (default `question`) holds the prompt, a
non-empty string; `task.answer_column` (default `answer`) the reference, a string or a number;
`task.solution_column` (default empty) a worked solution, the demonstration (so the warm start
works; the task has no `demonstration` without it). GSM8K's files have `question` and `answer` (a
solution ending in `#### 72`), so the defaults read them and `task.solution_column=answer` gives
the warm start its solutions. A missing column fails at load naming the file and the columns it
has; a bad value (a missing or non-string prompt, a missing answer) names the file and row (rows
count from 0, as `dataset[i]`). A prompt is a string or a list of chat messages (checked like the JSONL
task's); with `task.apply_chat_template` a string becomes one user message, so an instruct checkpoint gets
a plain question column (GSM8K's) through its chat template. `task.instruction` (default empty) is
written after every prompt (after a space; a chat prompt: at the end of its last user message) to
state the answer format the grader reads, for data whose questions state none (GSM8K's: "Put the
final answer in \\boxed{}." for the math grader).

Reward: the grader (`task.grader`, default pipeline.tasks.graders.math) of the completion against
the prompt's reference, looked up by prompt, so a prompt has one reference across both files (a
repeat with the same one is kept, another fails at load naming both rows): pipeline/tasks/answers.py.
With a math grader (math, math_last_number), a demonstration that ends in GSM8K's `#### N` line has
that line written as `\\boxed{N}` (graders.boxed_solution), the answer the grader reads, so the warm
start teaches the format the reward scores.
The files are read once per process (`datasets` caches the Arrow conversion under HF_DATASETS_CACHE).
"""

from __future__ import annotations

from pathlib import Path

import datasets

from pipeline.config import TaskConfig
from pipeline.tasks import TaskError
from pipeline.tasks import graders
from pipeline.tasks.graders import Grader, load_grader
from pipeline.tokens import PromptError, check_messages
from pipeline.tasks.answers import AnswerSplits
from pipeline.types import Prompt, PromptItem

__all__ = ["DatasetTask", "Row", "from_config", "read_rows", "FORMATS"]

NAME = "pipeline.tasks.dataset"
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}

Row = tuple[PromptItem, str | None, str]  # (item, solution, where)


def from_config(cfg: TaskConfig) -> "DatasetTask":
    if not cfg.path:
        raise TaskError(f"task {NAME!r}: task.path is empty; set it to a local .parquet, .jsonl or .arrow file "
                        "(e.g. examples/gsm8k_style.jsonl)")
    columns = {"task.prompt_column": cfg.prompt_column, "task.answer_column": cfg.answer_column}
    if cfg.solution_column:
        columns["task.solution_column"] = cfg.solution_column
    return DatasetTask(cfg.path, cfg.eval_path, columns, load_grader(cfg.grader), cfg.apply_chat_template,
                       cfg.instruction)


def load(path: Path) -> datasets.Dataset:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise TaskError(f"task {NAME!r}: {path}: unknown format {path.suffix!r}; a file ending in "
                        f"{', '.join(FORMATS)}")
    bars_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # every process loads the files: one bar each is noise
    try:
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # the reader's own error (bad JSON, not parquet, ...), whatever its type
        raise TaskError(f"task {NAME!r}: cannot read {path} as {fmt}: {type(e).__name__}: {e}") from None
    finally:
        if bars_on:
            datasets.enable_progress_bars()


def instructed(prompt: Prompt, instruction: str) -> Prompt:
    """`prompt` with `instruction` written after it (module docstring); a copy, never in place."""
    if not instruction:
        return prompt
    if isinstance(prompt, str):
        return f"{prompt} {instruction}"
    last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
    if last is None:  # no user turn: the instruction is one
        return [*prompt, {"role": "user", "content": instruction}]
    return [{**m, "content": f"{m['content']} {instruction}"} if i == last else m for i, m in enumerate(prompt)]


def read_rows(path: str | Path, columns: dict[str, str], first_uid: int = 0, chat: bool = False,
              instruction: str = "") -> list[Row]:
    """(item, solution or None, where) per row of `path`; `columns` maps config key -> column name
    (prompt, answer and optionally solution, in that order); `chat`: a string prompt becomes one user
    message; `instruction` is written after each prompt (`instructed`). TaskError names the file and row."""
    path = Path(path)
    ds = load(path)
    missing = [f"{c!r} ({key})" for key, c in columns.items() if c not in ds.column_names]
    if missing:
        raise TaskError(f"{path}: no column {', '.join(missing)}; its columns: {', '.join(ds.column_names)}")
    data = ds.select_columns(list(dict.fromkeys(columns.values()))).to_dict()
    names = list(columns.values())
    # every other scalar column travels with the item (teacher.context may name it)
    others = [c for c in ds.column_names if c != names[0]]
    extra = ds.select_columns(others).to_dict() if others else {}
    prompts, answers = data[names[0]], data[names[1]]
    solutions = data[names[2]] if len(names) > 2 else [None] * len(prompts)
    rows: list[Row] = []
    for i, (prompt, answer, solution) in enumerate(zip(prompts, answers, solutions)):
        at = f"{path} row {i}"
        if isinstance(prompt, list):  # chat messages, rendered by the checkpoint's template
            try:
                check_messages(prompt)
            except PromptError as e:
                raise TaskError(f"{at}: column {names[0]!r}: {e}") from None
        elif not isinstance(prompt, str) or not prompt:
            raise TaskError(f"{at}: column {names[0]!r} must hold a non-empty string prompt or a list of chat "
                            f"messages, got {type(prompt).__name__} {str(prompt)[:80]!r}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise TaskError(f"{at}: column {names[1]!r} must hold the reference answer (a string or a number), "
                            f"got {type(answer).__name__} {answer!r}")
        if len(names) > 2 and not isinstance(solution, str):
            raise TaskError(f"{at}: column {names[2]!r} must hold a solution string, got "
                            f"{type(solution).__name__} {solution!r}")
        prompt = instructed(prompt, instruction)
        if chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        cols = tuple((c, str(extra[c][i])) for c in others
                     if isinstance(extra[c][i], (str, int, float)) and not isinstance(extra[c][i], bool))
        rows.append((PromptItem(uid=first_uid + i, prompt=prompt, answer=str(answer), columns=cols), solution, at))
    return rows


class DatasetTask:
    def __init__(self, path: str | Path, eval_path: str | Path, columns: dict[str, str], grader: Grader,
                 chat: bool = False, instruction: str = ""):
        train = read_rows(path, columns, chat=chat, instruction=instruction)
        evals = read_rows(eval_path, columns, first_uid=len(train), chat=chat, instruction=instruction) \
            if eval_path else []
        self.grade = grader
        self.splits = AnswerSplits(NAME, [(i, at) for i, _, at in train], [(i, at) for i, _, at in evals])
        self.prompts = self.splits.prompts
        if "task.solution_column" in columns:  # only then: the warm start asks for demonstration()
            boxed = grader in (graders.math, graders.math_last_number)  # the answer as the grader reads it
            self._solutions = [graders.boxed_solution(s) if boxed else s for _, s, _ in train + evals]  # by uid
            self.demonstration = self._demonstration

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.grade(completion, self.splits.answer(prompt))

    def _demonstration(self, item: PromptItem) -> str:
        return self._solutions[item.uid]
