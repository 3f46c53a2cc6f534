"""The summary of a comparison folder: per method against the reference, the paper's SE/RT
reductions, rounds to 80% of the reference's range with every seed counted, rliable's IQM, mean and
paired probability of improvement with their intervals; ``summary.md`` (the answer first),
``summary.csv``, ``scores.csv``, ``curves.png``, and the terminal's table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.execution import failure
from rlinfluence.experiments.metrics import Curve, level_of, pair_metrics, paired_speed
from rlinfluence.experiments.specs import DEFAULT_REPS, Clock, dirname_of, split_specs
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import atomic_write
from rlinfluence.statistics import (
    ci95,
    interval_estimates,
    mean_se,
    normalise,
    probability_of_improvement,
)

_COLUMNS = [
    ("se_ave", "SE_ave %"), ("se_peak", "SE_peak %"), ("rt_peak", "RT_peak %"),
    ("se_50pct", "rounds to 50% (reduction %)"), ("se_80pct", "rounds to 80% (%)"),
    ("se_90pct", "rounds to 90% (%)"), ("rt_80pct", "seconds to 80% (%)"),
    ("rounds_to_ppo_peak", "rounds to ref peak"), ("seconds_to_ppo_peak", "seconds to ref peak"),
    ("auc", "mean return over rounds"),
]
_BOOTSTRAPPED = ("se_50pct", "se_80pct", "se_90pct", "rt_50pct", "rt_80pct", "rt_90pct")


def load_curves(out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1,
                clock: Clock = "wall", reference: str | None = None) -> dict[tuple[str, int], Curve]:
    """Every evaluation pair's curve. A pair that failed (its values diverged) is kept, not
    dropped, which would flatter its method: after its last completed round its curve stays at
    the lower of its own worst return and the reference's mean first-round return (normalised
    score 0; ``reference`` defaults to the first method), a value no third method in the folder
    changes; its seconds stop and its approx_kl is NaN."""
    curves, failed = {}, []
    for m in methods:
        for s in seeds:
            run_dir = out / f"{dirname_of(m)}__seed{s}"
            if failure(run_dir) is not None:
                failed.append((m, s))
                if not (run_dir / "metrics.csv").is_file() or len(pd.read_csv(run_dir / "metrics.csv")) == 0:
                    curves[m, s] = Curve(np.zeros(0), np.zeros(0), np.zeros(0))
                    continue
            curves[m, s] = Curve.from_run(run_dir, window, clock)
    if failed:
        n = max(len(c.returns) for c in curves.values())
        firsts = [curves[reference or methods[0], s].returns[:1] for s in seeds]
        start = float(np.mean(np.concatenate(firsts))) if any(len(f) for f in firsts) else math.inf
        for key in failed:
            c, pad = curves[key], n - len(curves[key].returns)
            floor = min(start, float(c.returns.min())) if len(c.returns) else start
            if not math.isfinite(floor):
                reason = failure(out / f"{dirname_of(key[0])}__seed{key[1]}")["error"]
                raise UserError(f"{key[0]} seed {key[1]} failed before its first round ({reason}) and so did its "
                                "reference: no score can be given to it")
            last_second = float(c.seconds[-1]) if len(c.seconds) else 0.0
            kl = c.approx_kl if c.approx_kl is not None else np.full(len(c.returns), np.nan)
            curves[key] = Curve(np.concatenate([c.returns, np.full(pad, floor)]),
                                np.concatenate([c.seconds, np.full(pad, last_second)]),
                                np.concatenate([kl, np.full(pad, np.nan)]))
    return curves


def normalised_scores(curves: dict[tuple[str, int], Curve], methods: Sequence[str], seeds: Sequence[int],
                      reference: str) -> pd.DataFrame:
    """One row per (method, seed): ``auc`` and ``final`` normalised to the reference
    (0 = its mean first-round return, 1 = its mean plateau)."""
    start = float(np.mean([curves[reference, s].returns[0] for s in seeds]))
    plateau = float(np.mean([curves[reference, s].plateau for s in seeds]))
    rows = []
    for m in methods:
        for s in seeds:
            c = curves[m, s]
            rows.append({"method": m, "seed": s, "auc": float(normalise(c.returns, start, plateau).mean()),
                         "final": float(normalise(np.array([c.plateau]), start, plateau)[0])})
    return pd.DataFrame(rows)


SPEED_FRACTION = 0.8  # the level of the headline speed figures: 80% of the way to the reference's plateau


def speed_verdict(row: dict[str, Any]) -> str:
    """The headline reading of a method's rounds to 80% against the reference: a method that
    reaches the level on fewer seeds is never called faster, whatever its speed where it got there."""
    if row["reached80_n"] < row["reference_reached80_n"]:
        return "reaches it on fewer seeds"
    low, high = row["log_ratio80_lo"], row["log_ratio80_hi"]
    if math.isnan(low):
        return "one seed: no interval"
    return "faster" if low > 0 else "slower" if high < 0 else "no clear difference"


def summarize(out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall",
              reference: str = "ppo", reps: int = DEFAULT_REPS,
              curves: dict[tuple[str, int], Curve] | None = None, seed: int = 0,
              progress: bool = False, failed: set[tuple[str, int]] | None = None) -> list[dict[str, Any]]:
    """Per method against ``reference``, every seed pair counted (``curves`` = ``load_curves``'s
    result saves reading the runs again, ``failed`` the (method, seed) runs that failed, read from
    ``out`` where not given; ``seed`` seeds every bootstrap; ``progress`` shows a line per method
    summarised, the bootstraps taking a while):

    - the paper's metrics (docs/method.md, section 7.2): mean, s.e. and number of seed pairs where defined;
    - censoring-aware rounds to 80% of the reference's range: seeds reached, the restricted mean of
      min(rounds, n + 1), and the paired log ratio ln(m_ref / m) with a bootstrap interval;
    - IQM / mean of the normalised scores, the paired difference of normalised auc, and the
      paired P(method > reference), each with a reproducible 95% bootstrap interval."""
    if reference not in methods:
        raise UserError(f"reference {reference!r} is not among the methods {list(methods)}")
    curves = curves if curves is not None else load_curves(out, methods, seeds, window, clock, reference)
    if failed is None:
        failed = {(m, s) for m in methods for s in seeds if failure(out / f"{dirname_of(m)}__seed{s}") is not None}
    scores = normalised_scores(curves, methods, seeds, reference)
    matrices = {kind: {m: scores[scores.method == m][kind].to_numpy()[:, None] for m in methods}
                for kind in ("auc", "final")}
    finite = all(np.isfinite(v).all() for v in matrices["auc"].values())
    estimates = {kind: interval_estimates(matrices[kind], reps, seed) for kind in matrices} if finite else {}
    # P(improvement) compares raw returns: a positive normalisation changes no ordering, and the
    # raw comparison stays defined when the reference did not improve (no scale to normalise by)
    raw = {"auc": {m: np.array([[curves[m, s].returns.mean()] for s in seeds]) for m in methods},
           "final": {m: np.array([[curves[m, s].plateau] for s in seeds]) for m in methods}}
    rows = []
    with progress_bar(progress, f"summary ({reps} bootstrap draws)", len(methods)) as advance:
        for method in methods:
            rows.append(_summary_row(method, curves, reference, seeds, reps, seed, matrices, estimates, finite,
                                     failed, raw))
            advance(method)
    return rows


def _summary_row(method: str, curves: dict[tuple[str, int], Curve], reference: str, seeds: Sequence[int], reps: int,
                 seed: int, matrices: dict[str, dict[str, np.ndarray]], estimates: dict[str, Any], finite: bool,
                 failed: set[tuple[str, int]], raw: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """One method's row of ``summarize``."""
    per_seed = [pair_metrics(curves[reference, s], curves[method, s]) for s in seeds]
    row: dict[str, Any] = {"method": method, "seeds": len(seeds)}
    for key in per_seed[0]:
        values = [p[key] for p in per_seed if p[key] is not None]
        row[f"{key}_n"] = len(values)
        row[f"{key}_mean"], row[f"{key}_se"] = mean_se(values) if values else (None, None)
        if key in _BOOTSTRAPPED:
            row[f"{key}_lo"], row[f"{key}_hi"] = ci95(values)[1:] if values else (None, None)
    speed = [paired_speed(curves[reference, s].returns, curves[method, s].returns,
                          level_of(curves[reference, s], SPEED_FRACTION)) for s in seeds]
    row["reached80_n"] = int(sum(p["reached"] for p in speed))
    row["reference_reached80_n"] = int(sum(p["reference_reached"] for p in speed))
    row["rounds80_mean"], row["rounds80_lo"], row["rounds80_hi"] = ci95([p["rounds"] for p in speed])
    row["log_ratio80"], row["log_ratio80_lo"], row["log_ratio80_hi"] = ci95(
        [p["log_ratio"] for p in speed])
    row["verdict80"] = speed_verdict(row) if finite else "undefined: the reference did not improve"
    finals = [float(curves[method, s].returns[-1]) for s in seeds]
    gains = [f - float(curves[reference, s].returns[-1]) for f, s in zip(finals, seeds, strict=True)]
    row["final_mean"], row["final_lo"], row["final_hi"] = ci95(finals)
    row["gain_mean"], row["gain_lo"], row["gain_hi"] = ci95(gains)
    for kind in ("auc", "final"):
        for stat in ("iqm", "mean"):
            point, lo, hi = estimates[kind][method][stat] if estimates else (math.nan,) * 3
            row[f"{stat}_{kind}_norm"], row[f"{stat}_{kind}_norm_lo"], row[f"{stat}_{kind}_norm_hi"] = point, lo, hi
        p = probability_of_improvement(raw[kind][method], raw[kind][reference], reps, seed, paired=True)
        if finite:
            x, y = matrices[kind][method], matrices[kind][reference]
            diff = ci95((x - y)[:, 0])
        else:
            diff = (math.nan,) * 3
        row[f"poi_{kind}"], row[f"poi_{kind}_lo"], row[f"poi_{kind}_hi"] = p
        row[f"diff_{kind}"], row[f"diff_{kind}_lo"], row[f"diff_{kind}_hi"] = diff
    kls = [float(np.nanmean(curves[method, s].approx_kl)) for s in seeds
           if curves[method, s].approx_kl is not None and np.isfinite(curves[method, s].approx_kl).any()]
    row["approx_kl_mean"] = float(np.mean(kls)) if kls else math.nan
    row["failed_seeds"] = " ".join(str(s) for s in seeds if (method, s) in failed)
    return row


def _cell(row: dict[str, Any], key: str) -> str:
    n, mean = row[f"{key}_n"], row[f"{key}_mean"]
    if mean is None:
        return f"undefined (0/{row['seeds']} seeds reached)"
    fmt = ".1f" if key.startswith(("se_", "rt_")) else ".4g"
    text = f"{mean:{fmt}} +/- {row[f'{key}_se']:{fmt}}"
    return text if n == row["seeds"] else f"{text} ({n}/{row['seeds']} seeds)"


def _interval(row: dict[str, Any], key: str, fmt: str = ".2f", bounds_key: str | None = None) -> str:
    bounds_key = bounds_key or key
    point, lo, hi = row[key], row[f"{bounds_key}_lo"], row[f"{bounds_key}_hi"]
    if point is None or (isinstance(point, float) and math.isnan(point)):
        return "undefined"
    bounds = f" [{lo:{fmt}}, {hi:{fmt}}]" if lo is not None and not math.isnan(lo) else ""
    return f"{point:{fmt}}{bounds}"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def write_summary(
    out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall",
    reference: str = "ppo", chosen: dict[str, dict[str, Any]] | None = None,
    tuning: pd.DataFrame | None = None, reps: int = DEFAULT_REPS, seed: int = 0, progress: bool = False,
) -> None:
    """summary.md, summary.csv, scores.csv (normalised scores per run) and curves.png; the tuning
    choice and table default to the folder's own (compare.json, tuning.csv)."""
    curves = load_curves(out, methods, seeds, window, clock, reference)
    rows = summarize(out, methods, seeds, window, clock, reference, reps, curves, seed, progress)
    if chosen is None and (out / "compare.json").is_file():
        chosen = json.loads((out / "compare.json").read_text()).get("chosen")
    if tuning is None and (out / "tuning.csv").is_file():
        try:
            tuning = pd.read_csv(out / "tuning.csv")
        except (OSError, ValueError, pd.errors.EmptyDataError) as exc:
            raise UserError(f"cannot read {str(out / 'tuning.csv')!r} ({exc}); re-run the tuning into another --out") \
                from None
        missing = sorted({"method", "chosen", "approx_kl", "at_edge", "failed"} - set(tuning.columns))
        if missing:
            raise UserError(f"{str(out / 'tuning.csv')!r} has no column {missing[0]!r}: it is not compare's tuning "
                            "table; re-run the tuning into another --out")
        tuning[["at_edge", "failed"]] = tuning[["at_edge", "failed"]].fillna("")
    chosen = chosen or {}
    tuned = set(tuning["method"]) if tuning is not None else set()
    for row in rows:
        row["chosen"] = json.dumps(chosen.get(row["method"], {}))
    atomic_write(out / "summary.csv", lambda p: pd.DataFrame(rows).to_csv(p, index=False))
    scores = normalised_scores(curves, methods, seeds, reference)
    atomic_write(out / "scores.csv", lambda p: scores.assign(reference=reference).to_csv(p, index=False))
    lines = [f"# {out.name}: {', '.join(methods)} against {reference}, seeds {list(seeds)}", ""]
    tuning_lines: list[str] = []
    if tuning is not None:
        metric = next(c for c in tuning.columns if c in ("auc", "final", "rounds80"))
        keys = [c for c in tuning.columns if c not in ("method", metric, "approx_kl", "chosen", "at_edge", "failed")]
        tuning_lines = [f"## Tuning ({metric} on the tuning seeds; chosen value in bold)", ""]
        table_rows = []
        for r in tuning.itertuples(index=False):
            r = r._asdict()
            value = f"{r[metric]:.4g}"
            note = (f"at the grid's edge: {r['at_edge']}" if r["at_edge"] else "") + (r["failed"] or "")
            table_rows.append([r["method"], *(r[k] for k in keys), f"**{value}**" if r["chosen"] else value,
                               f"{r['approx_kl']:.3g}", note])
        tuning_lines += markdown_table(["method", *keys, metric, "approx_kl", "note"], table_rows) + [""]
        untuned = [m for m in methods if m not in tuned]
        if untuned:
            tuning_lines += [f"Not tuned (run at {reference}'s chosen values): {', '.join(untuned)}.", ""]
    lines += [
        "## Against the reference, every seed counted", "",
        *robust_note(reference, reps, len(seeds)), "",
        *([few_seeds_note(len(seeds)), ""] if few_seeds_note(len(seeds)) else []),
    ]
    lines += markdown_table(robust_columns(reference), [robust_cells(r, reference) for r in rows])
    lines += ["", "**Reading** (rounds to 80% against the reference, every seed counted):", "",
              *(f"- {line}" for line in reading_lines(rows, reference)),
              *(f"- {line}" for line in collapse_lines(curves, methods, seeds)), "", *tuning_lines]
    lines += [
        "## Paper metrics (docs/method.md, section 7.2)", "",
        f"Reductions are percent, per seed pair against {reference}, mean +/- s.e. over seeds; smoothing window "
        f"{window} round(s). Levels: SE_ave = successive new maxima of the {reference} curve; 50/80/90% = that "
        f"fraction of the way from {reference}'s first-round return to its plateau (mean of its last 5 rounds). "
        f"Undefined = the method never reached the level in that pair. Seconds: {clock} clock (training only, "
        "evaluation excluded).", "",
    ]
    lines += markdown_table(
        ["method", "chosen", *(title for _, title in _COLUMNS), "final return (95% CI)", f"final gain vs {reference} (95% CI)"],
        [[r["method"], _chosen_text(chosen.get(r["method"]), tuning is None or r["method"] in tuned, reference),
          *(_cell(r, k) for k, _ in _COLUMNS),
          f"{r['final_mean']:.4g} [{r['final_lo']:.4g}, {r['final_hi']:.4g}]",
          f"{r['gain_mean']:.4g} [{r['gain_lo']:.4g}, {r['gain_hi']:.4g}]"] for r in rows])
    failed = [f"{r['method']} (seeds {r['failed_seeds']})" for r in rows if r["failed_seeds"]]
    if failed:
        lines += ["", f"**Failed pairs** (training diverged): {', '.join(failed)}. Each is kept in every "
                  "statistic, its curve after the last completed round set to the worst return any pair "
                  "of the comparison reached (failed.json in its folder says where and why)."]
    atomic_write(out / "summary.md", lambda p: p.write_text("\n".join(lines) + "\n"))
    plot_curves(out, curves, methods, seeds, clock, chosen, tuned if tuning is not None else None, reference)


def robust_columns(reference: str) -> list[str]:
    """The robust table's header."""
    return ["method", "reached 80% (seeds)", "rounds to 80%", "log ratio of rounds [95% CI]", "reading",
            f"paired P(> {reference}), auc", f"auc - {reference}'s, paired", "IQM auc", "IQM final", "approx_kl"]


def robust_note(reference: str, reps: int, n_seeds: int) -> list[str]:
    """What the robust table's columns are (under it in summary.md and in the docs)."""
    return [
        f"{n_seeds} seed pairs; method and {reference} share each seed's initial policy and evaluation episodes. "
        f"80% = 80% of the way from {reference}'s first-round return to its plateau (mean of its last 5 rounds), per "
        "seed. A run that never reaches it counts as rounds + 1 (right-censored: rounds to 80% then reads '>='). "
        f"log ratio = mean over seeds of ln(rounds of {reference} / rounds of the method): +0.69 = twice as fast, "
        "-0.69 = twice as slow. Reading: 'faster' or 'slower' only where the interval excludes 0, and never "
        f"'faster' for a method that reaches 80% on fewer seeds than {reference}.",
        f"Normalised scores: 0 = {reference}'s mean first-round return, 1 = its mean plateau; auc = mean of the "
        "normalised curve (speed), final = normalised plateau. A failed run scores at most 0 after it stops. "
        "P(> reference) is paired: the fraction of seeds on which the method's auc beats its pair's. Intervals (95%): "
        "a t interval over seeds for every mean and paired difference, the exact Clopper-Pearson interval for "
        f"P(> {reference}) (a fraction of seeds), a percentile bootstrap over seeds for the IQMs ({reps} "
        "replications, seeded: the same seed gives the same interval).",
    ]


def censoring_bound(reached: int, reference_reached: int, seeds: int) -> str:
    """How a ratio of rounds reads when some runs never got there (counted as rounds + 1, fewer
    than they would need): the method's censored runs make its ratio a lower bound ("at least "),
    the reference's an upper one ("at most "), both a figure that bounds nothing ("roughly ")."""
    method_censored, reference_censored = reached < seeds, reference_reached < seeds
    if method_censored and reference_censored:
        return "roughly "
    return "at least " if method_censored else "at most " if reference_censored else ""


def reading_lines(rows: Sequence[dict[str, Any]], reference: str) -> list[str]:
    """One sentence per method against ``reference``, from its row's figures and verdict."""
    ref = next(r for r in rows if r["method"] == reference)
    out = []
    for r in rows:
        if r["method"] == reference:
            continue
        phrase = {"faster": f"faster than {reference} to 80%", "slower": f"slower than {reference} to 80%",
                  "no clear difference": f"no clear difference from {reference} in rounds to 80%",
                  "reaches it on fewer seeds": f"reaches 80% on fewer seeds than {reference}"}
        if r["verdict80"].startswith("undefined"):
            out.append(f"{r['method']}: rounds to 80% {r['verdict80']}; paired P(auc > {reference}) {r['poi_auc']:.2f}.")
            continue
        rounds = [math.exp(-r[k]) for k in ("log_ratio80", "log_ratio80_hi", "log_ratio80_lo")]
        interval = f", 95% interval [{rounds[1]:.2f}x, {rounds[2]:.2f}x]" if not math.isnan(rounds[1]) else ""
        out.append(f"{r['method']}: {phrase.get(r['verdict80'], r['verdict80'])}: needs "
                   f"{censoring_bound(r['reached80_n'], ref['reached80_n'], r['seeds'])}{rounds[0]:.2f}x "
                   f"{reference}'s rounds (geometric mean over seeds{interval}; reached on {r['reached80_n']}/"
                   f"{r['seeds']} seeds, {reference} {ref['reached80_n']}/{r['seeds']}); paired P(auc > {reference}) "
                   f"{r['poi_auc']:.2f}.")
    return out


def collapse_lines(curves: dict[tuple[str, int], Curve], methods: Sequence[str], seeds: Sequence[int]) -> list[str]:
    """One sentence per run that collapsed: its evaluation return ends below half of the way from
    its first round to its best (R_end < R_0 + (max_k R_k - R_0) / 2, the best above the start).
    Such a seed counts in every statistic as it is; the sentence says so, and where to look."""
    out = []
    for method in methods:
        for seed in seeds:
            returns = curves[method, seed].returns
            start, best, end = float(returns[0]), float(np.max(returns)), float(returns[-1])
            if best > start and end < start + (best - start) / 2:
                out.append(f"{method} collapsed on seed {seed}: its evaluation return fell from {best:.4g} "
                           f"(round {int(np.argmax(returns))}) to {end:.4g} in the last round; the statistics above "
                           f"count it as it is (`rlinfluence explain` on a run trained with --save-buffers says "
                           "whether the data, a source or the step did it).")
    return out


def summary_table(out: Path) -> Any:
    """The robust table of a finished comparison folder as a ``rich.table.Table`` (for a terminal),
    titled with the folder and followed by nothing else: summary.md has every table."""
    from rich.table import Table

    config = json.loads((out / "compare.json").read_text())
    reference = config["reference"]
    rows = pd.read_csv(out / "summary.csv").fillna({"failed_seeds": ""}).to_dict("records")
    table = Table(title=f"{out.name}: {config['env']}, against {reference}, every seed counted")
    for column in robust_columns(reference):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*robust_cells(row, reference))
    table.caption = few_seeds_note(int(rows[0]["seeds"])) if rows else ""
    return table


def robust_cells(row: dict[str, Any], reference: str) -> list[str]:
    """One method's row of the robust table. Where the reference did not improve, 80% of its range
    is undefined: so are the seeds that reached it and the rounds to it (every seed "reaches" a
    level at its own start), and P(>) says that it compares raw returns."""
    n = row["seeds"]
    if str(row["verdict80"]).startswith("undefined"):
        reached, rounds, raw = "undefined", "undefined", " (raw returns)"
    else:
        censored = row["reached80_n"] < n
        reached, rounds, raw = f"{row['reached80_n']}/{n}", \
            f"{'>= ' if censored else ''}{_interval(row, 'rounds80_mean', '.1f', 'rounds80')}", ""
    if row["method"] == reference:
        return [row["method"], reached, rounds, "-", "reference", "-", "-",
                _interval(row, "iqm_auc_norm"), _interval(row, "iqm_final_norm"), f"{row['approx_kl_mean']:.3g}"]
    return [row["method"], reached, rounds, _interval(row, "log_ratio80"), row["verdict80"],
            _interval(row, "poi_auc") + raw, _interval(row, "diff_auc"), _interval(row, "iqm_auc_norm"),
            _interval(row, "iqm_final_norm"), f"{row['approx_kl_mean']:.3g}"]


def few_seeds_note(n_seeds: int) -> str:
    """A word on n where it is too small for an interval to say much ("" from 5 seeds)."""
    if n_seeds >= 5:
        return ""
    return (f"Only {n_seeds} seed pair{'s' if n_seeds != 1 else ''}: an interval over so few seeds says little (a t "
            "interval needs 2, and P(>) can only be 0, 0.5 or 1 with 2); run 5 or more before reading a difference.")


def _chosen_text(point: dict[str, Any] | None, tuned: bool = True, reference: str = "ppo") -> str:
    text = ", ".join(f"{k}={v}" for k, v in point.items()) if point else "-"
    return text if tuned or not point else f"{reference}'s: {text}"


def _definitions(out: Path) -> dict[str, str]:
    """label -> spec of the named methods (``NAME=SPEC``) of the folder's compare.json, so that a
    legend says what a name stands for; {} without one."""
    try:
        methods = json.loads((out / "compare.json").read_text())["methods"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    specs = [s.strip() for item in methods for s in split_specs(item)]
    return {name.strip(): spec.strip() for name, sep, spec in (s.partition("=") for s in specs)
            if sep and "@" not in name and name.strip() != spec.strip()}


def plot_curves(
    out: Path, curves: dict[tuple[str, int], Curve], methods: Sequence[str], seeds: Sequence[int],
    clock: Clock = "wall", chosen: dict[str, dict[str, Any]] | None = None, tuned: set[str] | None = None,
    reference: str = "ppo",
) -> Path:
    """curves.png, titled with the env: eval return vs rounds with approx_kl vs rounds stacked
    below it (shared round axis), and eval return vs training seconds; a mean +/- s.e. band over
    seeds per method (labelled with its tuned values, if any; ``tuned``: the methods tuned, the
    others labelled as run at the reference's values)."""
    from matplotlib.figure import Figure

    from rlinfluence.pages import ROUND_LABEL, round_axis

    fig = Figure(figsize=(14, 7), layout="constrained")
    grid = fig.add_gridspec(2, 2)
    ax_rounds = fig.add_subplot(grid[0, 0])
    ax_kl = fig.add_subplot(grid[1, 0], sharex=ax_rounds)
    ax_time = fig.add_subplot(grid[:, 1])
    definitions = _definitions(out)
    for method in methods:
        runs = [curves[method, s] for s in seeds]
        label = method if method not in definitions else f"{method} = {definitions[method]}"
        if chosen and chosen.get(method):
            own = tuned is None or method in tuned
            label += f" ({'tuned: ' if own else ''}{_chosen_text(chosen[method], own, reference)})"
        n = min(len(c.returns) for c in runs)
        y = np.stack([c.returns[:n] for c in runs])
        rounds = np.arange(n)
        _band(ax_rounds, rounds, y, label)
        t_max = min(c.seconds[n - 1] for c in runs)
        grid_seconds = np.linspace(0, t_max, 200)
        # each seed's curve as a step function of time: the return of the last finished round
        yt = np.stack([c.returns[np.clip(np.searchsorted(c.seconds[:n], grid_seconds, side="right") - 1, 0, n - 1)]
                       for c in runs])
        _band(ax_time, grid_seconds, yt, label)
        if all(c.approx_kl is not None for c in runs):
            _band(ax_kl, rounds, np.stack([c.approx_kl[:n] for c in runs]), label)
    env = json.loads((out / "compare.json").read_text()).get("env", out.name) if (out / "compare.json").is_file() else out.name
    fig.suptitle(env)
    ax_rounds.set(ylabel="eval return of theta(k+1)")
    ax_time.set(xlabel=f"training seconds, {clock} clock (evaluation excluded)", ylabel="eval return")
    ax_kl.set(ylabel="approx_kl of round k's update", yscale="log")
    round_axis(ax_rounds, None)
    ax_rounds.tick_params(labelbottom=False)  # the round axis is labelled once, under approx_kl
    round_axis(ax_kl, ROUND_LABEL)
    for ax in (ax_rounds, ax_time, ax_kl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title=f"mean +/- s.e. over {len(seeds)} seeds", title_fontsize=7)
    path = out / "curves.png"
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    return path


def _band(ax: Any, x: np.ndarray, y: np.ndarray, label: str) -> None:
    mean = y.mean(0)
    se = y.std(0, ddof=1) / math.sqrt(len(y)) if len(y) > 1 else np.zeros_like(mean)
    (line,) = ax.plot(x, mean, label=label)
    ax.fill_between(x, mean - se, mean + se, color=line.get_color(), alpha=0.2)
