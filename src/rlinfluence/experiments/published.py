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
    "env", "folder", "method", "chosen", "seeds", "first_seed", "reached80_n", "reference_reached80_n",
    *(f"{k}{s}" for k in ("rounds80", "log_ratio80", "poi_auc", "diff_auc", "iqm_auc_norm", "iqm_final_norm")
      for s in ("_mean" if k == "rounds80" else "", "_lo", "_hi")),
    "verdict80", "approx_kl_mean", "failed_seeds", "mean_auc_norm",
)


def collect(folders: Sequence[str | Path]) -> pd.DataFrame:
    """Every method row of each finished compare folder's summary.csv, with its env and first seed."""
    frames = []
    for folder in map(Path, folders):
        summary, config = folder / "summary.csv", folder / "compare.json"
        if not summary.is_file() or not config.is_file():
            raise UserError(f"{str(folder)!r} is not a finished compare folder (no summary.csv / compare.json)")
        settings = json.loads(config.read_text())
        rows = pd.read_csv(summary).assign(env=settings["env"], folder=folder.name, first_seed=settings["first_seed"])
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


def gap_table(data: pd.DataFrame, reference: str = "ppo", ceiling: str = "oracle") -> list[str]:
    """Per folder and method: the paired comparison with ``reference`` and, where the folder has a
    ``ceiling`` method, the fraction of its gain recovered, (auc_m - auc_ref) / (auc_ceiling - auc_ref)
    on the mean normalised auc (NaN where the ceiling does not beat the reference)."""
    body = []
    for folder, group in data.groupby("folder", sort=False):
        auc = group.set_index("method")["mean_auc_norm"]
        for record in group.to_dict("records"):
            row = _row(record)
            gap = "-"
            if ceiling in auc and row["method"] not in (reference, ceiling) and auc[ceiling] > auc[reference]:
                gap = f"{(auc[row['method']] - auc[reference]) / (auc[ceiling] - auc[reference]):.2f}"
            cells = robust_cells(row, reference)
            body.append([folder, cells[0], f"{row['mean_auc_norm']:.2f}", *cells[5:7], gap, cells[1], cells[4]])
    return markdown_table(["folder", "method", "mean auc", f"paired P(> {reference}), auc",
                           f"auc - {reference}'s, paired", f"gap to {ceiling} closed", "reached 80% (seeds)",
                           "reading (rounds to 80%)"], body)


def detection_table(rows: pd.DataFrame, reps: int = 2000, seed: int = 0) -> list[str]:
    """Per env and scorer: the mean detection AUROC at each level (record, episode, source), each
    a mean over seeds of the seed's mean over rounds, with a seeded 95% bootstrap interval over seeds."""
    from rlinfluence.experiments.statistics import bootstrap_mean

    levels = ("record", "episode", "source")
    body = []
    for (env, scorer), group in rows.groupby(["env", "scorer"], sort=False):
        cells = []
        for level in levels:
            per_seed = group[group["level"] == level].groupby("seed")["auroc"].mean().dropna().to_numpy()
            if not len(per_seed):
                cells.append("undefined")
                continue
            mean, lo, hi = bootstrap_mean(per_seed, reps, seed)
            cells.append(f"{mean:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if not math.isnan(lo) else ""))
        n_rounds, n_seeds = group["round"].nunique(), group["seed"].nunique()
        body.append([env, scorer, *cells, f"{n_rounds} x {n_seeds}"])
    return markdown_table(["env", "scorer", "record AUROC", "episode AUROC", "env AUROC", "rounds x seeds"], body)


def detection_by_round_table(rows: pd.DataFrame, level: str = "source") -> list[str]:
    """Per env and scorer: the mean over seeds of the ``level`` AUROC in each round."""
    table = rows[rows["level"] == level].groupby(["env", "scorer", "round"], sort=False)["auroc"].mean().unstack()
    return markdown_table(["env", "scorer", *(f"round {int(k)}" for k in table.columns)],
                          [[env, scorer, *(f"{v:.2f}" for v in values)] for (env, scorer), values in table.iterrows()])


def fill(text: str, name: str, lines: Sequence[str]) -> str:
    """``text`` with the lines between ``<!-- table:name -->`` and ``<!-- /table:name -->``
    replaced by ``lines`` (``UserError`` if the markers are missing)."""
    pattern = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- /table:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise UserError(f"no <!-- table:{name} --> ... <!-- /table:{name} --> markers")
    return pattern.sub(lambda m: m.group(1) + "".join(f"{line}\n" for line in lines) + m.group(2), text)
