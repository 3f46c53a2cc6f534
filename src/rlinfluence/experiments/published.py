"""Tables in the docs written from result data, never by hand (``benchmarks/publish_results.py``).

A results table lives in a Markdown page between two markers,

    <!-- table:NAME -->
    ...generated lines...
    <!-- /table:NAME -->

and is rebuilt from a committed CSV (``collect`` gathers it from ``compare`` folders: every row
of their summary.csv, with the env). ``fill`` replaces what lies between the markers, so the
same CSV always gives the same page, and a check can tell a hand-edited table from a generated one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.comparison import markdown_table, robust_cells, robust_columns

# the summary.csv columns a published table reads (a committed CSV keeps just these)
PUBLISHED_COLUMNS = (
    "env", "method", "chosen", "seeds", "first_seed", "reached80_n", "reference_reached80_n",
    *(f"{k}{s}" for k in ("rounds80", "log_ratio80", "poi_auc", "diff_auc", "iqm_auc_norm", "iqm_final_norm")
      for s in ("_mean" if k == "rounds80" else "", "_lo", "_hi")),
    "verdict80", "approx_kl_mean", "failed_seeds",
)


def collect(folders: Sequence[str | Path]) -> pd.DataFrame:
    """Every method row of each finished compare folder's summary.csv, with its env and first seed."""
    frames = []
    for folder in map(Path, folders):
        summary, config = folder / "summary.csv", folder / "compare.json"
        if not summary.is_file() or not config.is_file():
            raise UserError(f"{str(folder)!r} is not a finished compare folder (no summary.csv / compare.json)")
        settings = json.loads(config.read_text())
        rows = pd.read_csv(summary).assign(env=settings["env"], first_seed=settings["first_seed"])
        missing = sorted(set(PUBLISHED_COLUMNS) - set(rows.columns))
        if missing:
            raise UserError(f"{summary} has no {', '.join(missing)}: re-run `rlinfluence compare --out {folder}`")
        frames.append(rows[list(PUBLISHED_COLUMNS)])
    return pd.concat(frames, ignore_index=True)


def _row(record: dict[str, Any]) -> dict[str, Any]:
    """A CSV record as summarize's row: empty cells (NaN) of text columns as empty text."""
    return {k: ("" if k in ("failed_seeds", "chosen") and not isinstance(v, str) and math.isnan(v) else v)
            for k, v in record.items()}


def _chosen(text: str) -> str:
    point = json.loads(text) if text else {}
    return ", ".join(f"{'lr' if k == 'learning_rate' else k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in point.items()) or "-"


def headline_table(data: pd.DataFrame, reference: str = "ppo") -> list[str]:
    """Per env and method: its tuned values and the robust columns against ``reference``
    (``comparison.robust_cells``), then a line saying which seeds and where the CSV is."""
    body = []
    for record in data.to_dict("records"):
        row = _row(record)
        cells = robust_cells(row, reference)
        if row["failed_seeds"]:
            cells[0] += f" (failed: seeds {row['failed_seeds']})"
        body.append([row["env"], cells[0], _chosen(row["chosen"]), *cells[1:]])
    columns = robust_columns(reference)
    return markdown_table(["env", columns[0], "tuned", *columns[1:]], body)


def fill(text: str, name: str, lines: Sequence[str]) -> str:
    """``text`` with the lines between ``<!-- table:name -->`` and ``<!-- /table:name -->``
    replaced by ``lines`` (``UserError`` if the markers are missing)."""
    pattern = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- /table:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise UserError(f"no <!-- table:{name} --> ... <!-- /table:{name} --> markers")
    return pattern.sub(lambda m: m.group(1) + "".join(f"{line}\n" for line in lines) + m.group(2), text)
