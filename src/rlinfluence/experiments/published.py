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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.specs import parse_methods
from rlinfluence.experiments.summary import markdown_table, robust_cells, robust_columns

# the summary.csv columns a published table reads (a committed CSV keeps just these)
PUBLISHED_COLUMNS = (
    "env", "folder", "method", "chosen", "seeds", "first_seed", "reached80_n", "reference_reached80_n",
    *(f"{k}{s}" for k in ("rounds80", "log_ratio80", "poi_auc", "diff_auc", "iqm_auc_norm", "iqm_final_norm")
      for s in ("_mean" if k == "rounds80" else "", "_lo", "_hi")),
    "verdict80", "approx_kl_mean", "failed_seeds", "mean_auc_norm", "auc_mean",
)


def read_summary(path: str | Path) -> pd.DataFrame:
    """A summary CSV (compare's summary.csv or a published docs/data table) with ``failed_seeds``
    as text: a column of seed numbers would otherwise read as floats ("107.0")."""
    return pd.read_csv(path, dtype={"failed_seeds": str})


def collect(folders: Sequence[str | Path]) -> pd.DataFrame:
    """Every method row of each finished compare folder's summary.csv, with its env and first seed,
    ``tuning`` (how its values were chosen: tuned in the folder, the reference's choice, or given)
    and ``cpu_per_round`` (training CPU seconds per round, mean over its seeds)."""
    frames = []
    for folder in map(Path, folders):
        summary, config = folder / "summary.csv", folder / "compare.json"
        if not summary.is_file() or not config.is_file():
            raise UserError(f"{str(folder)!r} is not a finished compare folder (no summary.csv / compare.json)")
        settings = json.loads(config.read_text())
        rows = read_summary(summary).assign(env=settings["env"], folder=folder.name, first_seed=settings["first_seed"])
        missing = sorted(set(PUBLISHED_COLUMNS) - set(rows.columns))
        if missing:
            raise UserError(f"{summary} has no {', '.join(missing)}: re-run `rlinfluence compare --out {folder}`")
        rows = rows[list(PUBLISHED_COLUMNS)].copy()
        tuned = set(pd.read_csv(folder / "tuning.csv")["method"]) if (folder / "tuning.csv").is_file() else set()
        rows["tuning"] = ["tuned" if m in tuned else f"{settings['reference']}'s" if tuned else "given"
                          for m in rows["method"]]
        # a method whose values were given in its spec (``ppo@learning_rate=0.005``) shows them
        given = {spec.label: {k: v for k, v in spec.overrides if k == "learning_rate"}
                 for spec in parse_methods(settings["methods"])} if settings.get("methods") else {}
        rows["chosen"] = [c if isinstance(c, str) and json.loads(c) else json.dumps(given.get(m, {}))
                          for m, c in zip(rows["method"], rows["chosen"], strict=True)]
        rows["cpu_per_round"] = [_cpu_per_round(folder, m) for m in rows["method"]]
        frames.append(rows)
    return pd.concat(frames, ignore_index=True)


# per-seed data of a published table: each run's curve as its folder's summary read it
CURVE_COLUMNS = ("env", "reference", "method", "seed", "round", "eval_return", "cpu_seconds", "approx_kl", "failed")


def curves_frame(folders: Sequence[str | Path]) -> pd.DataFrame:
    """Every evaluation run of each finished compare folder, one row per round: the curve its
    summary read (``summary.load_curves``: smoothed with the folder's window, timed by its clock, a
    failed run padded after its last round and ``failed`` set), so that ``summary_from_curves``
    recomputes the folder's summary rows from these rows alone."""
    from rlinfluence.experiments.execution import failure
    from rlinfluence.experiments.specs import dirname_of
    from rlinfluence.experiments.summary import load_curves

    frames = []
    for folder in map(Path, folders):
        settings = json.loads((folder / "compare.json").read_text())
        methods = list(pd.read_csv(folder / "summary.csv")["method"])
        seeds = range(settings["first_seed"], settings["first_seed"] + settings["seeds"])
        reference = settings["reference"]
        curves = load_curves(folder, methods, seeds, settings["smooth"], settings["clock"], reference)
        for (method, seed), curve in curves.items():
            kl = curve.approx_kl if curve.approx_kl is not None else [math.nan] * len(curve.returns)
            frames.append(pd.DataFrame({
                "env": settings["env"], "reference": reference, "method": method, "seed": seed,
                "round": range(len(curve.returns)), "eval_return": curve.returns, "cpu_seconds": curve.seconds,
                "approx_kl": kl, "failed": failure(folder / f"{dirname_of(method)}__seed{seed}") is not None}))
    return pd.concat(frames, ignore_index=True)[list(CURVE_COLUMNS)]


def summary_from_curves(frame: pd.DataFrame, reps: int | None = None, seed: int = 0) -> pd.DataFrame:
    """The summary rows (``summary.summarize``, its default bootstrap) of each env's curves in
    ``frame`` (``curves_frame``'s columns), methods in their order of appearance."""
    from rlinfluence.experiments.metrics import Curve
    from rlinfluence.experiments.summary import summarize
    from rlinfluence.statistics import DEFAULT_REPS

    rows = []
    for env, runs in frame.groupby("env", sort=False):
        methods = list(dict.fromkeys(runs["method"]))
        seeds = sorted(runs["seed"].unique().tolist())
        curves = {(m, int(s)): Curve(g["eval_return"].to_numpy(float), g["cpu_seconds"].to_numpy(float),
                                      g["approx_kl"].to_numpy(float))
                  for (m, s), g in runs.sort_values("round").groupby(["method", "seed"], sort=False)}
        failed = {(m, int(s)) for m, s in runs.loc[runs["failed"], ["method", "seed"]].itertuples(index=False)}
        rows += [{"env": env, **row} for row in summarize(
            Path(str(env)), methods, seeds, reference=str(runs["reference"].iloc[0]),
            reps=DEFAULT_REPS if reps is None else reps, curves=curves, seed=seed, failed=failed)]
    return pd.DataFrame(rows)


def _cpu_per_round(folder: Path, method: str) -> float:
    per_seed = []
    for metrics in folder.glob(f"{method}__seed*/metrics.csv"):
        cpu = pd.read_csv(metrics, usecols=["train_cpu_seconds"])["train_cpu_seconds"]
        per_seed.append(float(cpu.iloc[-1]) / len(cpu))
    return sum(per_seed) / len(per_seed) if per_seed else math.nan


def _row(record: dict[str, Any]) -> dict[str, Any]:
    """A CSV record as summarize's row: empty cells (NaN) of text columns as empty text. A row
    summarised with percentile-bootstrap intervals (``interval`` = "percentile") gets its paired
    P(> reference) interval recomputed exactly (``statistics.clopper_pearson`` of the fraction of
    seeds won), which needs only that fraction and n: the bootstrap printed 5 of 5 as [1.00, 1.00]."""
    from rlinfluence.statistics import clopper_pearson

    row = {k: ("" if k in ("failed_seeds", "chosen") and not isinstance(v, str) and math.isnan(v) else v)
           for k, v in record.items()}
    if row.get("interval") == "percentile" and math.isfinite(row.get("poi_auc", math.nan)):
        row["poi_auc_lo"], row["poi_auc_hi"] = clopper_pearson(row["poi_auc"] * row["seeds"], int(row["seeds"]))
    return row


def _chosen(text: str) -> str:
    point = json.loads(text) if text else {}
    return ", ".join(f"{'lr' if k == 'learning_rate' else k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in point.items()) or "-"


def speed_p_values(data: pd.DataFrame, reference: str = "ppo") -> pd.Series:
    """Per row, the two-sided p of "the paired log ratio of rounds to 80% is 0" (from its interval,
    ``statistics.interval_p_value``; the row's ``interval`` column says which kind, a t interval where it
    has none) and, over every non-reference row of the table that has one,
    Holm's adjustment (``statistics.holm``): a table of m speed readings makes m chances of a
    "faster" by luck. NaN for the reference and where no interval exists."""
    from rlinfluence.statistics import holm, interval_p_value

    p = pd.Series([math.nan if r["method"] == reference else
                   interval_p_value(r["log_ratio80"], r["log_ratio80_lo"], r["log_ratio80_hi"], int(r["seeds"]),
                                    r["interval"] if isinstance(r.get("interval"), str) else "t")
                   for r in data.to_dict("records")], index=data.index, dtype=float)
    tested = p.notna()
    adjusted = pd.Series(math.nan, index=data.index)
    adjusted[tested] = holm(p[tested].to_numpy())
    return adjusted


def headline_table(data: pd.DataFrame, reference: str = "ppo",
                   grids: Mapping[str, Sequence[float]] | None = None) -> list[str]:
    """Per env and method: its tuned values and the robust columns against ``reference``
    (``summary.robust_cells``), with the speed reading's p after Holm over the table's rows
    (``speed_p_values``; a "faster" or "slower" whose adjusted p is 0.05 or more says "not after
    Holm"). ``grids``: per env, the learning rates its study tuned over; a choice at either end of its
    grid says "(grid edge)": the best rate may lie beyond it."""
    adjusted = speed_p_values(data, reference)
    body = []
    for (index, record) in zip(data.index, data.to_dict("records"), strict=True):
        row = _row(record)
        cells = robust_cells(row, reference)
        if row["failed_seeds"]:
            cells[0] += f" (failed: seeds {row['failed_seeds']})"
        p = adjusted[index]
        if cells[4] in ("faster", "slower") and not p < 0.05:
            cells[4] += " (not after Holm)"
        chosen = _chosen(row["chosen"])
        grid = (grids or {}).get(row["env"])
        if grid and json.loads(row["chosen"] or "{}").get("learning_rate") in (min(grid), max(grid)):
            chosen += " (grid edge)"
        body.append([row["env"], cells[0], chosen, *cells[1:5],
                     "-" if math.isnan(p) else f"{p:.3f}", *cells[5:]])
    columns = robust_columns(reference)
    return markdown_table(["env", columns[0], "tuned", *columns[1:5], f"p, Holm over {int(adjusted.notna().sum())}",
                          *columns[5:]], body)


def gap_closed(group: pd.DataFrame, reference: str = "ppo", ceiling: str = "oracle") -> pd.Series:
    """Per method of one folder: (auc_m - auc_ref) / (auc_ceiling - auc_ref) on the mean raw auc
    (the mean evaluation return over rounds and seeds: the same ratio as on normalised auc where
    that is defined, and defined where the reference did not improve), the fraction of the
    ceiling's gain recovered; NaN for the two themselves, and for every method where the folder
    has no ceiling or the ceiling does not beat the reference."""
    auc = group.set_index("method")["auc_mean"]
    if ceiling not in auc or not auc[ceiling] > auc[reference]:
        return pd.Series(math.nan, index=auc.index)
    gap = (auc - auc[reference]) / (auc[ceiling] - auc[reference])
    return gap.where(~gap.index.isin([reference, ceiling]))


def _cpu_cell(row: dict[str, Any], reference_cpu: float) -> str:
    cpu = row.get("cpu_per_round", math.nan)
    return "-" if math.isnan(cpu) else f"{cpu:.2f} ({cpu / reference_cpu:.2f}x)"


def gap_table(data: pd.DataFrame, reference: str = "ppo", ceiling: str = "oracle") -> list[str]:
    """Per folder and method: how its learning rate was chosen, the paired comparison with
    ``reference``, the fraction of the ``ceiling``'s gain recovered (``gap_closed``), and the
    training CPU seconds per round (and its ratio to the reference's)."""
    body = []
    for folder, group in data.groupby("folder", sort=False):
        gaps = gap_closed(group, reference, ceiling)
        reference_cpu = float(group.loc[group["method"] == reference, "cpu_per_round"].iloc[0]) \
            if "cpu_per_round" in group else math.nan
        for record in group.to_dict("records"):
            row = _row(record)
            gap = gaps[row["method"]]
            cells = robust_cells(row, reference)
            if row["failed_seeds"]:  # diverged pairs count in every statistic (padded at the worst return)
                cells[0] += f" (diverged: seeds {row['failed_seeds']})"
            lr = _chosen(row["chosen"]) + (f" ({row['tuning']})" if isinstance(row.get("tuning"), str) else "")
            mean_auc = "undefined" if math.isnan(row["mean_auc_norm"]) else f"{row['mean_auc_norm']:.2f}"
            body.append([folder, cells[0], lr, mean_auc, *cells[5:7],
                         "-" if math.isnan(gap) else f"{gap:.2f}", cells[1], cells[4], _cpu_cell(row, reference_cpu)])
    return markdown_table(["folder", "method", "learning rate", "mean auc", f"paired P(> {reference}), auc",
                           f"auc - {reference}'s, paired", f"gap to {ceiling} closed", "reached 80% (seeds)",
                           "reading (rounds to 80%)", "CPU s/round"], body)


ATTRIBUTION_FILTERS = ("iif", "iif-trusted", "iif-robust", "dtv")


def _target_cells(by_method: pd.DataFrame, gaps: pd.Series, method: str, reference: str) -> list[str]:
    """method, gap closed, paired P with its interval, CPU ratio to the reference, target met."""
    row = by_method.loc[method]
    ratio = float(row.get("cpu_per_round", math.nan)) / float(by_method.loc[reference].get("cpu_per_round", math.nan))
    met = gaps[method] >= 0.5 and row["poi_auc"] >= 0.75 and ratio <= 1.3  # an unmeasured CPU (NaN) is not met
    return [method, f"{gaps[method]:.2f}", f"{row['poi_auc']:.2f} [{row['poi_auc_lo']:.2f}, {row['poi_auc_hi']:.2f}]",
            "-" if math.isnan(ratio) else f"{ratio:.2f}x", "yes" if met else "no"]


def target_table(data: pd.DataFrame, reference: str = "ppo", ceiling: str = "oracle",
                 filters: Sequence[str] = ATTRIBUTION_FILTERS) -> list[str]:
    """Per corrupted folder: the attribution filter (of ``filters``) closing most of the gap to the
    ceiling, and the best other method, each with its gap closed, paired P(auc > reference) and
    CPU ratio; "met" = gap >= 0.5, P >= 0.75 and CPU <= 1.3x the reference's (the harmful-records
    issue's target)."""
    body = []
    for folder, group in data.groupby("folder", sort=False):
        gaps = gap_closed(group, reference, ceiling).dropna()
        if gaps.empty:
            continue
        by_method = pd.DataFrame([_row(r) for r in group.to_dict("records")]).set_index("method")
        attribution, others = gaps[gaps.index.isin(filters)], gaps[~gaps.index.isin(filters)]
        body.append([folder,
                     *(_target_cells(by_method, gaps, attribution.idxmax(), reference) if len(attribution) else ["-"] * 5),
                     *(_target_cells(by_method, gaps, others.idxmax(), reference)[:3] if len(others) else ["-"] * 3)])
    return markdown_table(["folder", "best attribution filter", "gap closed", f"paired P(> {reference})",
                           "CPU", "target met", "best other method", "gap closed", f"paired P(> {reference})"], body)


# (level, statistic) columns of the detection table
DETECTION_COLUMNS = (("record", "auroc", "record AUROC"), ("episode", "auroc", "episode AUROC"),
                     ("source", "auroc", "env AUROC"), ("episode", "precision", "episode precision"),
                     ("source", "precision", "env precision"))


def _conditions(rows: pd.DataFrame) -> pd.DataFrame:
    # rows measured before conditions existed are the flipped-env runs
    return rows.assign(condition=rows["condition"].fillna("flip1of8")) if "condition" in rows else \
        rows.assign(condition="flip1of8")


def detection_table(rows: pd.DataFrame, condition: str = "flip1of8") -> list[str]:
    """Per env and scorer, for one corruption ``condition``: the mean detection AUROC at each level
    (record, episode, source) and the precision at the corrupted fraction (episode, source), each
    a mean over seeds of the seed's mean over rounds, with a 95% t interval over seeds clipped to
    [0, 1] ("undefined" where a level has no corrupted item, e.g. an env for episode corruptions)."""
    from rlinfluence.statistics import ci95

    rows = _conditions(rows)
    body = []
    for (env, scorer), group in rows[rows["condition"] == condition].groupby(["env", "scorer"], sort=False):
        cells = []
        for level, stat, _ in DETECTION_COLUMNS:
            if stat not in group:  # rows measured before precision was
                cells.append("-")
                continue
            per_seed = group[group["level"] == level].groupby("seed")[stat].mean().dropna().to_numpy()
            if not len(per_seed):
                cells.append("undefined")
                continue
            mean, lo, hi = ci95(per_seed, bounds=(0.0, 1.0))
            cells.append(f"{mean:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if not math.isnan(lo) else ""))
        n_rounds, n_seeds = group["round"].nunique(), group["seed"].nunique()
        body.append([env, scorer, *cells, f"{n_rounds} x {n_seeds}"])
    return markdown_table(["env", "scorer", *(title for *_, title in DETECTION_COLUMNS), "rounds x seeds"], body)


def detection_by_round_table(rows: pd.DataFrame, level: str = "source", condition: str = "flip1of8") -> list[str]:
    """Per env and scorer: the mean over seeds of the ``level`` AUROC in each round of ``condition``."""
    rows = _conditions(rows)
    rows = rows[(rows["level"] == level) & (rows["condition"] == condition)]
    table = rows.groupby(["env", "scorer", "round"], sort=False)["auroc"].mean().unstack()
    return markdown_table(["env", "scorer", *(f"round {int(k)}" for k in table.columns)],
                          [[env, scorer, *(f"{v:.2f}" for v in values)] for (env, scorer), values in table.iterrows()])


def fill(text: str, name: str, lines: Sequence[str]) -> str:
    """``text`` with the lines between ``<!-- table:name -->`` and ``<!-- /table:name -->``
    replaced by ``lines`` (``UserError`` if the markers are missing)."""
    pattern = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- /table:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise UserError(f"no <!-- table:{name} --> ... <!-- /table:{name} --> markers")
    return pattern.sub(lambda m: m.group(1) + "".join(f"{line}\n" for line in lines) + m.group(2), text)


def flags_table(rows: pd.DataFrame) -> list[str]:
    """Per env and scorer (``benchmarks/faults/audit_flags.py``'s flags.csv): in how many flip runs the
    audit flagged the flipped env, in how many it flagged another env, and in how many clean runs
    it flagged any env; then the totals over envs."""
    body = []
    groups = [*rows.groupby(["env", "scorer"], sort=False), *((("all envs", s), g) for s, g in rows.groupby("scorer", sort=False))]
    for (env, scorer), group in groups:
        flips, cleans = group[group["condition"] == "flip1of8"], group[group["condition"] == "clean"]
        hits = int(flips["broken_flagged"].astype(str).str.lower().eq("true").sum())
        body.append([env, scorer, f"{hits}/{len(flips)}", f"{int((flips['false_flags'] > 0).sum())}/{len(flips)}",
                     f"{int((cleans['false_flags'] > 0).sum())}/{len(cleans)}"])
    return markdown_table(["env", "scorer", "flipped env flagged (runs)", "flip runs with a false flag",
                           "clean runs with a flag"], body)
