"""The project's prompt sets of the two tasks, or a user's in the same format.

One JSON object per line, ``{"id": int, "split": "train" | "val" | "test", "prompt": str}``;
train is sampled for the rollouts, val is the fixed validation set of the f_seq target with
``--target-source fresh``, test is held out for the evaluation. Both sets were written for this
project and split by a fixed shuffle:

- ``data/sentiment_prompts.jsonl`` (task ``sentiment``): 334 neutral everyday questions and
  requests (errands, weather, food, travel, work, hobbies: "How do you pack a suitcase?") that an
  instruct model answers in a sentence, leading neither to a positive nor a negative answer;
  234 train, 50 val, 50 test. Task ``sentiment-gold`` reads the same file with a larger test
  split, 184 train, 50 val, 100 test: the last ``GOLD_EXTRA_TEST`` train prompts (in file order)
  join the test prompts, so that the gold and proxy test rewards are means over 100 prompts.
- ``data/toxicity_prompts.jsonl`` (task ``toxicity``): 294 short prompts that invite a rude or
  insulting continuation ("That referee is a complete"); 194 train, 50 val, 50 test.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlinfluence.errors import UserError

SPLITS = ("train", "val", "test")
PROMPT_FILES = {task: Path(__file__).with_name("data") / f"{task}_prompts.jsonl" for task in ("sentiment", "toxicity")}
GOLD_TASKS = ("sentiment-gold", "sentiment-relevance", "sentiment-trigger", "sentiment-trigger-penalised")
"""The tasks that train on a sentiment proxy and judge every completion by a gold reward too."""
PROMPT_FILES.update({task: PROMPT_FILES["sentiment"] for task in GOLD_TASKS})  # the same prompts
GOLD_EXTRA_TEST = 50
"""Train prompts of the sentiment set that the gold tasks move to their test split (the last ones)."""


def load_prompts(split: str, path: str | Path | None = None, task: str = "sentiment") -> list[str]:
    """The prompts of ``split`` in file order, from ``path`` (JSONL as above) or the shipped set
    of ``task`` (``sentiment`` or ``toxicity``).

    ``UserError`` for an unknown split or task, an unreadable file, a malformed line or an empty split.
    """
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    if path is None and task not in PROMPT_FILES:
        raise UserError(f"unknown task {task!r} (choose from {', '.join(PROMPT_FILES)})")
    shipped_gold = path is None and task in GOLD_TASKS
    path = Path(path) if path is not None else PROMPT_FILES[task]
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read prompt file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise UserError(f"prompt file {str(path)!r} is not UTF-8 text (line {line}, byte {exc.start}: "
                        f"{exc.object[exc.start:exc.start + 1]!r}); save it as UTF-8") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if item["split"] == split:
                prompts.append(item["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{str(path)!r} line {number}: expected a JSON object with 'split' and 'prompt'") from None
        if prompts and not (isinstance(prompts[-1], str) and prompts[-1].strip()):  # a number or null is no prompt
            raise UserError(f"{str(path)!r} line {number}: 'prompt' must be a non-empty string, got {prompts[-1]!r}")
    if not prompts:
        raise UserError(f"no {split!r} prompts in {str(path)!r}")
    if shipped_gold and split != "val":
        moved = load_prompts("train", path)[-GOLD_EXTRA_TEST:]
        prompts = prompts[:-GOLD_EXTRA_TEST] if split == "train" else prompts + moved
    return prompts
