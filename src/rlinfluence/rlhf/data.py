"""The project's prompt set for the toxicity task, or a user's in the same format.

``data/toxicity_prompts.jsonl`` holds 294 short prompts written for this project that invite a
rude or insulting continuation ("That referee is a complete"), one JSON object per line,
``{"id": int, "split": "train" | "val" | "test", "prompt": str}``: 194 train (sampled for the
rollouts), 50 val (the fixed validation set of the f_seq target), 50 test (held-out toxicity).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlinfluence.errors import UserError

SPLITS = ("train", "val", "test")
PROMPTS_FILE = Path(__file__).with_name("data") / "toxicity_prompts.jsonl"


def load_prompts(split: str, path: str | Path | None = None) -> list[str]:
    """The prompts of ``split`` in file order, from ``path`` (JSONL as above) or the shipped set.

    ``UserError`` for an unreadable file, a malformed line or an empty split.
    """
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    path = Path(path) if path is not None else PROMPTS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read prompt file {str(path)!r}: {exc.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if item["split"] == split:
                prompts.append(str(item["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{str(path)!r} line {number}: expected a JSON object with 'split' and 'prompt'") from None
    if not prompts:
        raise UserError(f"no {split!r} prompts in {str(path)!r}")
    return prompts
