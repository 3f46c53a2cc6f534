"""Multi-seed comparisons of methods against a reference, optionally each tuned first.

``compare(CompareConfig(...))``:

    1. plan      parse every method spec (``specs``), the reference, the tuning grid; build and
                 validate every run's ``PPOConfig``; nothing is written if anything is invalid
    2. tune      (with ``tune``) every method x grid point on the tuning seeds, disjoint from the
                 evaluation seeds; the best point by the tuning metric is each method's choice
    3. evaluate  every method (with its choice) on the evaluation seeds; each seed starts every
                 method from the same initial policy and evaluates on the same episode seeds
    4. summarise the paper's SE/RT metrics per seed pair against the reference, rliable's IQM,
                 mean and probability of improvement with bootstrap intervals, tables and plots

Pairs run in a process pool or as Ray tasks; a re-run with the same folder skips finished pairs,
trains unfinished ones again from their start, and refuses pairs started with other settings.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.execution import (
    Job,
    check_existing,
    failure,
    finished,
    folder_lock,
    run_jobs,
)
from rlinfluence.experiments.metrics import Clock, Curve, pair_metrics
from rlinfluence.experiments.specs import (
    MethodSpec,
    dirname_of,
    find_reference,
    parse_grid,
    parse_methods,
    parse_overrides,
)
from rlinfluence.experiments.statistics import (
    DEFAULT_REPS,
    bootstrap_mean,
    ci95,
    interval_estimates,
    mean_se,
    normalise,
    probability_of_improvement,
)
from rlinfluence.experiments.tuning import TuneMetric, at_edge, choose, grid_points, tuning_scores
from rlinfluence.ppo import PPOConfig
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import atomic_write


@dataclass
class CompareConfig:
    """Multi-seed comparison of methods against a reference (``rlinfluence compare``)."""

    env: str = "FrozenLake-v1"
    """gymnasium env id (a preset gives the paper's hyperparameters, p and round count)"""
    methods: tuple[str, ...] = ("ppo", "iif", "random")
    """method specs FILTER[@key=value,...] or NAME=FILTER@key=value,..., space-separated (or
    comma-separated); filters: ppo (standard), iif, random, advantage, td-error, reward-extremes"""
    reference: str = "ppo"
    """the method every metric is computed against (a label or spec among --methods)"""
    seeds: int = 5
    """number of evaluation seeds (first_seed, first_seed + 1, ...)"""
    first_seed: int = 1
    """the first evaluation seed"""
    rounds: int | None = None
    """rounds per run (default: the preset's standard-PPO round count)"""
    drop_pct: float | None = None
    """p for iif and the baselines (default: the preset's)"""
    eval_episodes: int | None = None
    """evaluation episodes per round (default: the preset's)"""
    set: tuple[str, ...] = ()
    """further PPOConfig overrides for every run, as key=value (e.g. optimizer=adam)"""
    tune: tuple[str, ...] = ()
    """tune every method over key=v1,v2,... (several keys, space-separated: their product) on
    the tuning seeds, then evaluate each with its best value"""
    tune_seeds: int = 2
    """number of tuning seeds (tune_first_seed, ...), disjoint from the evaluation seeds"""
    tune_first_seed: int = 1001
    """the first tuning seed"""
    tune_metric: TuneMetric = "auc"
    """tuning score: auc (normalised area under the eval curve), final (plateau), rounds80"""
    out: str | None = None
    """output folder (default runs/compare__<env>__<time>); re-run with it to resume"""
    workers: int = os.cpu_count() or 1
    """local worker processes"""
    ray_address: str | None = None
    """run the pairs as Ray tasks on this cluster (auto or HOST:PORT) instead"""
    smooth: int = 1
    """moving-average window (rounds) applied to every curve before the metrics"""
    clock: Clock = "wall"
    """RT figures from wall seconds, or from process CPU seconds (robust to other load on the machine)"""
    bootstrap_reps: int = DEFAULT_REPS
    """bootstrap replications of every interval"""
    progress: bool = True
    """show a progress bar of finished pairs"""

    def run_config(self, method: MethodSpec | str, seed: int, extra: dict[str, Any] | None = None) -> PPOConfig:
        """The validated ``PPOConfig`` of one run: the env's preset, then drop_pct,
        eval_episodes and --set, then the method's own overrides and ``extra`` (a tuning
        point); rounds are converted to env steps last, with the final n_steps and n_envs."""
        spec = parse_methods(method)[0] if isinstance(method, str) else method
        overrides: dict[str, Any] = {"seed": seed, "progress": False}
        if self.drop_pct is not None:
            overrides["drop_pct"] = self.drop_pct
        if self.eval_episodes is not None:
            overrides["eval_episodes"] = self.eval_episodes
        overrides.update(parse_overrides(self.set))
        overrides.update(spec.config_overrides())
        overrides.update(extra or {})
        try:
            config = PPOConfig.for_env(self.env, **overrides)
        except TypeError as exc:
            raise UserError(f"invalid settings for {spec.label!r}: {exc}") from None
        if self.rounds is not None:
            config.total_timesteps = self.rounds * config.rollout_size
        try:
            config.validate()
        except UserError as exc:
            raise UserError(f"method {spec.label!r}: {exc}") from None
        if config.eval_episodes < 1:  # every metric is computed on the evaluation curve
            raise UserError(f"a comparison needs eval_episodes >= 1, got {config.eval_episodes}")
        return config


@dataclass
class Plan:
    """Every run of a comparison, resolved and validated before anything trains."""

    specs: list[MethodSpec]
    reference: MethodSpec
    seeds: list[int]
    tune_seeds: list[int]
    grid: dict[str, list[Any]]
    points: list[dict[str, Any]] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.specs]


def plan_comparison(cfg: CompareConfig) -> Plan:
    """Parse and validate everything (``UserError`` naming the first bad value)."""
    for name in ("seeds", "rounds", "bootstrap_reps", "smooth", "workers"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    specs = parse_methods(cfg.methods)
    reference = find_reference(specs, cfg.reference)
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    grid = parse_grid(cfg.tune)
    tune_seeds = list(range(cfg.tune_first_seed, cfg.tune_first_seed + cfg.tune_seeds)) if grid else []
    if grid and cfg.tune_seeds < 1:
        raise UserError(f"--tune-seeds must be >= 1, got {cfg.tune_seeds}")
    overlap = sorted(set(seeds) & set(tune_seeds))
    if overlap:
        raise UserError(f"tuning seeds {tune_seeds} overlap the evaluation seeds at {overlap}: "
                        "choose --tune-first-seed past them")
    for spec in specs:
        fixed = sorted(set(spec.override_dict) & set(grid))
        if fixed:
            raise UserError(f"method {spec.label!r} fixes {', '.join(fixed)}, which --tune varies")
    plan = Plan(specs, reference, seeds, tune_seeds, grid, grid_points(grid) if grid else [{}])
    for spec in specs:  # every run that can happen is valid
        for point in plan.points:
            cfg.run_config(spec, seeds[0], point)
    return plan


def _tuning_jobs(cfg: CompareConfig, plan: Plan, out: Path) -> dict[tuple[str, int], list[Job]]:
    jobs: dict[tuple[str, int], list[Job]] = {}
    for spec in plan.specs:
        for i, point in enumerate(plan.points):
            candidate = spec.with_overrides(point)
            jobs[spec.label, i] = [(cfg.run_config(spec, s, point).to_dict(),
                                    str(out / "tune" / f"{candidate.dirname}__seed{s}")) for s in plan.tune_seeds]
    return jobs


def _run(cfg: CompareConfig, jobs: list[Job], label: str, may_fail: bool = False) -> None:
    done = sum(finished(run_dir) for _, run_dir in jobs)
    with progress_bar(cfg.progress, label, len(jobs), done) as advance:
        run_jobs(jobs, cfg.workers, cfg.ray_address, lambda run_dir: advance(Path(run_dir).name), may_fail)


def compare(cfg: CompareConfig) -> Path:
    """Plan, (tune,) run or resume every pair, then write the summary; returns the folder."""
    plan = plan_comparison(cfg)
    out = Path(cfg.out or f"runs/compare__{cfg.env}__{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {str(out)!r}: {exc.strerror}") from None
    with folder_lock(out):
        chosen: dict[str, dict[str, Any]] = {spec.label: {} for spec in plan.specs}
        tuning_table = None
        if plan.grid:
            tune_jobs = _tuning_jobs(cfg, plan, out)
            check_existing([job for jobs in tune_jobs.values() for job in jobs])
            _run(cfg, [job for jobs in tune_jobs.values() for job in jobs], "tuning pairs", may_fail=True)
            tuning_table, chosen = write_tuning(out, cfg, plan, tune_jobs)
        eval_jobs = [(cfg.run_config(spec, s, chosen[spec.label]).to_dict(), str(out / f"{spec.dirname}__seed{s}"))
                     for s in plan.seeds for spec in plan.specs]
        check_existing(eval_jobs)
        atomic_write(out / "compare.json", lambda p: p.write_text(json.dumps(
            {**asdict(cfg), "chosen": chosen}, indent=2)))
        _run(cfg, eval_jobs, "pairs", may_fail=True)
        write_summary(out, plan.labels, plan.seeds, cfg.smooth, cfg.clock, plan.reference.label,
                      chosen=chosen, tuning=tuning_table, reps=cfg.bootstrap_reps)
    return out


# -- tuning output ---------------------------------------------------------------------


def write_tuning(out: Path, cfg: CompareConfig, plan: Plan, jobs: dict[tuple[str, int], list[Job]]
                 ) -> tuple[pd.DataFrame, dict[str, dict[str, Any]]]:
    """tuning.csv (score per method per grid point) and each method's choice. A candidate with a
    failed tuning run (it diverged) scores -inf and is never chosen."""
    failed = {key: [f"seed {Path(d).name.rsplit('seed', 1)[1]} failed: {f['error']}"
                    for _, d in runs if (f := failure(d)) is not None] for key, runs in jobs.items()}
    curves = {key: [Curve.from_run(Path(run_dir), cfg.smooth, cfg.clock) for _, run_dir in runs]
              for key, runs in jobs.items() if not failed[key]}
    if not curves:
        raise UserError("every tuning candidate failed; narrow the --tune grid")
    scores = {key: -math.inf for key in jobs} | tuning_scores(curves, cfg.tune_metric)
    rows = []
    chosen: dict[str, dict[str, Any]] = {}
    for spec in plan.specs:
        best = choose(scores, spec.label)
        chosen[spec.label] = plan.points[best]
        if scores[spec.label, best] == -math.inf:
            raise UserError(f"every tuning candidate of {spec.label!r} failed; narrow the --tune grid")
        for i, point in enumerate(plan.points):
            kl = [float(np.nanmean(c.approx_kl)) for c in curves.get((spec.label, i), []) if c.approx_kl is not None]
            note = ",".join(at_edge(best, plan.grid)) if i == best else ""
            rows.append({"method": spec.label, **{k: _plain(v) for k, v in point.items()},
                         cfg.tune_metric: scores[spec.label, i], "approx_kl": float(np.mean(kl)) if kl else math.nan,
                         "chosen": i == best, "at_edge": note, "failed": "; ".join(failed[spec.label, i])})
    table = pd.DataFrame(rows)
    atomic_write(out / "tuning.csv", lambda p: table.to_csv(p, index=False))
    return table, chosen


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# -- summary ----------------------------------------------------------------------------

_COLUMNS = [
    ("se_ave", "SE_ave %"), ("se_peak", "SE_peak %"), ("rt_peak", "RT_peak %"),
    ("se_50pct", "rounds to 50% (reduction %)"), ("se_80pct", "rounds to 80% (%)"),
    ("se_90pct", "rounds to 90% (%)"), ("rt_80pct", "seconds to 80% (%)"),
    ("rounds_to_ppo_peak", "rounds to ref peak"), ("seconds_to_ppo_peak", "seconds to ref peak"),
    ("auc", "mean return over rounds"),
]
_BOOTSTRAPPED = ("se_50pct", "se_80pct", "se_90pct", "rt_50pct", "rt_80pct", "rt_90pct")


def load_curves(out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1,
                clock: Clock = "wall") -> dict[tuple[str, int], Curve]:
    """Every evaluation pair's curve. A pair that failed (its values diverged) is kept, not
    dropped, which would flatter its method: after its last completed round its curve stays at
    the worst return any pair of the comparison reached, its seconds stop and its approx_kl is NaN."""
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
        worst = min(float(c.returns.min()) for c in curves.values() if len(c.returns))
        for key in failed:
            c, pad = curves[key], n - len(curves[key].returns)
            last_second = float(c.seconds[-1]) if len(c.seconds) else 0.0
            kl = c.approx_kl if c.approx_kl is not None else np.full(len(c.returns), np.nan)
            curves[key] = Curve(np.concatenate([c.returns, np.full(pad, worst)]),
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


def summarize(out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall",
              reference: str = "ppo", reps: int = DEFAULT_REPS,
              curves: dict[tuple[str, int], Curve] | None = None) -> list[dict[str, Any]]:
    """Per method: each paper metric's mean, s.e. and number of seed pairs where it is defined
    (against ``reference``), bootstrap intervals of the fraction-of-range reductions, and
    rliable's IQM / mean of the normalised scores and P(method > reference). ``curves``
    (``load_curves``'s result) saves reading the runs again."""
    if reference not in methods:
        raise UserError(f"reference {reference!r} is not among the methods {list(methods)}")
    curves = curves if curves is not None else load_curves(out, methods, seeds, window, clock)
    scores = normalised_scores(curves, methods, seeds, reference)
    matrices = {kind: {m: scores[scores.method == m][kind].to_numpy()[:, None] for m in methods}
                for kind in ("auc", "final")}
    finite = all(np.isfinite(v).all() for v in matrices["auc"].values())
    estimates = {kind: interval_estimates(matrices[kind], reps) for kind in matrices} if finite else {}
    rows = []
    for method in methods:
        per_seed = [pair_metrics(curves[reference, s], curves[method, s]) for s in seeds]
        row: dict[str, Any] = {"method": method, "seeds": len(seeds)}
        for key in per_seed[0]:
            values = [p[key] for p in per_seed if p[key] is not None]
            row[f"{key}_n"] = len(values)
            row[f"{key}_mean"], row[f"{key}_se"] = mean_se(values) if values else (None, None)
            if key in _BOOTSTRAPPED:
                row[f"{key}_lo"], row[f"{key}_hi"] = bootstrap_mean(values, reps)[1:] if values else (None, None)
        finals = [float(curves[method, s].returns[-1]) for s in seeds]
        gains = [f - float(curves[reference, s].returns[-1]) for f, s in zip(finals, seeds, strict=True)]
        row["final_mean"], row["final_lo"], row["final_hi"] = ci95(finals)
        row["gain_mean"], row["gain_lo"], row["gain_hi"] = ci95(gains)
        for kind in ("auc", "final"):
            for stat in ("iqm", "mean"):
                point, lo, hi = estimates[kind][method][stat] if estimates else (math.nan,) * 3
                row[f"{stat}_{kind}_norm"], row[f"{stat}_{kind}_norm_lo"], row[f"{stat}_{kind}_norm_hi"] = point, lo, hi
            if finite:
                p = probability_of_improvement(matrices[kind][method], matrices[kind][reference], reps)
            else:
                p = (math.nan,) * 3
            row[f"poi_{kind}"], row[f"poi_{kind}_lo"], row[f"poi_{kind}_hi"] = p
        kls = [float(np.nanmean(curves[method, s].approx_kl)) for s in seeds
               if curves[method, s].approx_kl is not None and np.isfinite(curves[method, s].approx_kl).any()]
        row["approx_kl_mean"] = float(np.mean(kls)) if kls else math.nan
        row["failed_seeds"] = " ".join(str(s) for s in seeds
                                       if failure(out / f"{dirname_of(method)}__seed{s}") is not None)
        rows.append(row)
    return rows


def _cell(row: dict[str, Any], key: str) -> str:
    n, mean = row[f"{key}_n"], row[f"{key}_mean"]
    if mean is None:
        return f"undefined (0/{row['seeds']} seeds reached)"
    fmt = ".1f" if key.startswith(("se_", "rt_")) else ".4g"
    text = f"{mean:{fmt}} +/- {row[f'{key}_se']:{fmt}}"
    return text if n == row["seeds"] else f"{text} ({n}/{row['seeds']} seeds)"


def _interval(row: dict[str, Any], key: str, fmt: str = ".2f") -> str:
    point, lo, hi = row[key], row[f"{key}_lo"], row[f"{key}_hi"]
    if point is None or (isinstance(point, float) and math.isnan(point)):
        return "undefined"
    bounds = f" [{lo:{fmt}}, {hi:{fmt}}]" if lo is not None and not math.isnan(lo) else ""
    return f"{point:{fmt}}{bounds}"


def _reduction_interval(row: dict[str, Any], key: str) -> str:
    if row[f"{key}_mean"] is None:
        return f"undefined (0/{row['seeds']} seeds reached)"
    text = _interval({key: row[f"{key}_mean"], f"{key}_lo": row[f"{key}_lo"], f"{key}_hi": row[f"{key}_hi"]}, key, ".1f")
    return text if row[f"{key}_n"] == row["seeds"] else f"{text} ({row[f'{key}_n']}/{row['seeds']} seeds)"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def write_summary(
    out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall",
    reference: str = "ppo", chosen: dict[str, dict[str, Any]] | None = None,
    tuning: pd.DataFrame | None = None, reps: int = DEFAULT_REPS,
) -> None:
    """summary.md, summary.csv, scores.csv (normalised scores per run) and curves.png; the tuning
    choice and table default to the folder's own (compare.json, tuning.csv)."""
    curves = load_curves(out, methods, seeds, window, clock)
    rows = summarize(out, methods, seeds, window, clock, reference, reps, curves)
    if chosen is None and (out / "compare.json").is_file():
        chosen = json.loads((out / "compare.json").read_text()).get("chosen")
    if tuning is None and (out / "tuning.csv").is_file():
        tuning = pd.read_csv(out / "tuning.csv")
        tuning[["at_edge", "failed"]] = tuning[["at_edge", "failed"]].fillna("")
    chosen = chosen or {}
    for row in rows:
        row["chosen"] = json.dumps(chosen.get(row["method"], {}))
    atomic_write(out / "summary.csv", lambda p: pd.DataFrame(rows).to_csv(p, index=False))
    scores = normalised_scores(curves, methods, seeds, reference)
    atomic_write(out / "scores.csv", lambda p: scores.assign(reference=reference).to_csv(p, index=False))
    lines = [f"# {out.name}: {', '.join(methods)} against {reference}, seeds {list(seeds)}", ""]
    if tuning is not None:
        metric = next(c for c in tuning.columns if c in ("auc", "final", "rounds80"))
        keys = [c for c in tuning.columns if c not in ("method", metric, "approx_kl", "chosen", "at_edge", "failed")]
        lines += [f"## Tuning ({metric} on the tuning seeds; chosen value in bold)", ""]
        table_rows = []
        for r in tuning.itertuples(index=False):
            r = r._asdict()
            value = f"{r[metric]:.4g}"
            note = (f"at the grid's edge: {r['at_edge']}" if r["at_edge"] else "") + (r["failed"] or "")
            table_rows.append([r["method"], *(r[k] for k in keys), f"**{value}**" if r["chosen"] else value,
                               f"{r['approx_kl']:.3g}", note])
        lines += markdown_table(["method", *keys, metric, "approx_kl", "note"], table_rows) + [""]
    lines += [
        "## Paper metrics (method-spec 7.2)", "",
        f"Reductions are percent, per seed pair against {reference}, mean +/- s.e. over seeds; smoothing window "
        f"{window} round(s). Levels: SE_ave = successive new maxima of the {reference} curve; 50/80/90% = that "
        f"fraction of the way from {reference}'s first-round return to its plateau (mean of its last 5 rounds). "
        f"Undefined = the method never reached the level in that pair. Seconds: {clock} clock (training only, "
        "evaluation excluded).", "",
    ]
    lines += markdown_table(
        ["method", "chosen", *(title for _, title in _COLUMNS), "final return (95% CI)", f"final gain vs {reference} (95% CI)"],
        [[r["method"], _chosen_text(chosen.get(r["method"])), *(_cell(r, k) for k, _ in _COLUMNS),
          f"{r['final_mean']:.4g} [{r['final_lo']:.4g}, {r['final_hi']:.4g}]",
          f"{r['gain_mean']:.4g} [{r['gain_lo']:.4g}, {r['gain_hi']:.4g}]"] for r in rows])
    lines += [
        "", "## Robust statistics (rliable)", "",
        f"Normalised scores: 0 = {reference}'s mean first-round return, 1 = its mean plateau. auc = mean of the "
        "normalised curve over rounds (speed), final = normalised plateau. IQM / mean with 95% stratified-bootstrap "
        f"intervals ({reps} replications); P(improvement) = P(method's run > {reference}'s run). Reductions: mean "
        "over seed pairs with a 95% percentile-bootstrap interval. approx_kl: mean over rounds and seeds.", "",
    ]
    lines += markdown_table(
        ["method", "IQM auc", "mean auc", "IQM final", f"P(> {reference}) auc", f"P(> {reference}) final",
         "rounds to 80% (reduction %)", "seconds to 80% (%)", "approx_kl"],
        [[r["method"], _interval(r, "iqm_auc_norm"), _interval(r, "mean_auc_norm"), _interval(r, "iqm_final_norm"),
          _interval(r, "poi_auc"), _interval(r, "poi_final"), _reduction_interval(r, "se_80pct"),
          _reduction_interval(r, "rt_80pct"), f"{r['approx_kl_mean']:.3g}"] for r in rows])
    failed = [f"{r['method']} (seeds {r['failed_seeds']})" for r in rows if r["failed_seeds"]]
    if failed:
        lines += ["", f"**Failed pairs** (training diverged): {', '.join(failed)}. Each is kept in every "
                  "statistic, its curve after the last completed round set to the worst return any pair "
                  "of the comparison reached (failed.json in its folder says where and why)."]
    atomic_write(out / "summary.md", lambda p: p.write_text("\n".join(lines) + "\n"))
    plot_curves(out, curves, methods, seeds, clock, chosen)


def _chosen_text(point: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items()) if point else "-"


def plot_curves(
    out: Path, curves: dict[tuple[str, int], Curve], methods: Sequence[str], seeds: Sequence[int],
    clock: Clock = "wall", chosen: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """curves.png, titled with the env: eval return vs rounds with approx_kl vs rounds stacked
    below it (shared round axis), and eval return vs training seconds; a mean +/- s.e. band over
    seeds per method (labelled with its tuned values, if any)."""
    from matplotlib.figure import Figure

    from rlinfluence.analysis.report import ROUND_LABEL, round_axis

    fig = Figure(figsize=(14, 7), layout="constrained")
    grid = fig.add_gridspec(2, 2)
    ax_rounds = fig.add_subplot(grid[0, 0])
    ax_kl = fig.add_subplot(grid[1, 0], sharex=ax_rounds)
    ax_time = fig.add_subplot(grid[:, 1])
    for method in methods:
        runs = [curves[method, s] for s in seeds]
        label = f"{method} (tuned: {_chosen_text(chosen[method])})" if chosen and chosen.get(method) else method
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
