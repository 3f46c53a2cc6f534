"""Multi-seed comparisons of filtering methods against standard PPO (method-spec 7.2).

``compare(...)`` trains every (method, seed) pair — each seed starts every method from the same
initial policy and is evaluated on the same episode seeds — in a process pool or as Ray tasks,
then writes ``summary.md``, ``summary.csv`` and ``curves.png`` into its folder. A pair is a
pure function of its config, so results do not depend on the executor, and a re-run with the
same folder skips finished pairs and resumes unfinished ones from their last checkpoint.

Metrics per seed pair (standard curve s, other curve o; m(v) = first round, counted from 1,
at which a curve reaches at least v; T(v) = cumulative training seconds at that round):

    reduction(v) = 1 - m_o(v) / m_s(v)
    SE_ave  = mean of reduction(v) over the successive new maxima v of s (its running maximum
              at every round where it strictly increases)
    SE_peak = reduction(max s)          RT_peak = 1 - T_o(max s) / T_s(max s)

reported as mean +/- standard error over seeds; a level the other curve never reaches makes
that pair's value undefined, and the tables say how many pairs that was.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.progress import progress_bar

# -- metrics on curves ------------------------------------------------------------------


def first_reach(curve: Sequence[float], level: float) -> int | None:
    """Rounds trained (1-based) when ``curve`` first reaches ``level``; None if never."""
    hits = np.flatnonzero(np.asarray(curve) >= level)
    return int(hits[0]) + 1 if len(hits) else None


def running_max_levels(curve: Sequence[float]) -> list[float]:
    """The successive new maxima of ``curve`` (SE_ave's levels)."""
    levels: list[float] = []
    for value in curve:
        if not levels or value > levels[-1]:
            levels.append(float(value))
    return levels


def reduction(standard: Sequence[float], other: Sequence[float], level: float) -> float | None:
    """1 - m_other(level) / m_standard(level) in percent; None if either never reaches it."""
    m_std, m_other = first_reach(standard, level), first_reach(other, level)
    if m_std is None or m_other is None:
        return None
    return 100.0 * (1 - m_other / m_std)


def time_reduction(standard: Sequence[float], standard_seconds: Sequence[float],
                   other: Sequence[float], other_seconds: Sequence[float], level: float) -> float | None:
    """1 - T_other(level) / T_standard(level) in percent (training seconds to first reach)."""
    m_std, m_other = first_reach(standard, level), first_reach(other, level)
    if m_std is None or m_other is None:
        return None
    return 100.0 * (1 - other_seconds[m_other - 1] / standard_seconds[m_std - 1])


def se_ave(standard: Sequence[float], other: Sequence[float]) -> tuple[float | None, int]:
    """(SE_ave in percent, number of levels the other curve never reached); None if it reached none."""
    values = [reduction(standard, other, v) for v in running_max_levels(standard)]
    reached = [v for v in values if v is not None]
    return (float(np.mean(reached)) if reached else None), len(values) - len(reached)


def smooth(curve: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average over ``window`` rounds (window 1 = the raw curve)."""
    x = np.asarray(curve, dtype=float)
    if window <= 1:
        return x
    cumsum = np.cumsum(np.insert(x, 0, 0.0))
    out = np.empty_like(x)
    for i in range(len(x)):
        lo = max(0, i + 1 - window)
        out[i] = (cumsum[i + 1] - cumsum[lo]) / (i + 1 - lo)
    return out


_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (0 for a single value)."""
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of a 95% t-interval; half-width t_{n-1} * s.e. (paper: 2.776 for 5 seeds)."""
    mean, se = mean_se(values)
    t = _T975[len(values) - 2] if 2 <= len(values) <= 31 else 1.96
    return mean, mean - t * se, mean + t * se


Clock = Literal["wall", "cpu"]
CLOCK_COLUMNS = {"wall": "train_seconds", "cpu": "train_cpu_seconds"}


@dataclass
class Curve:
    """One run's evaluation curve: return and cumulative training seconds after each round."""

    returns: np.ndarray
    seconds: np.ndarray

    @classmethod
    def from_run(cls, run_dir: Path, window: int = 1, clock: Clock = "wall") -> Curve:
        """``clock="cpu"`` times rounds by the process's CPU seconds instead of wall seconds."""
        with (run_dir / "metrics.csv").open(newline="") as f:
            rows = list(csv.DictReader(f))
        column = CLOCK_COLUMNS[clock]
        if rows and not rows[0].get(column):
            raise UserError(f"{run_dir / 'metrics.csv'} has no {column} (a run from before it was logged): use clock wall")
        returns = smooth([float(r["eval_return_mean"]) for r in rows], window)
        return cls(returns, np.array([float(r[column]) for r in rows]))


def pair_metrics(standard: Curve, other: Curve, fractions: Sequence[float] = (0.5, 0.8, 0.9),
                 plateau_rounds: int = 5) -> dict[str, float | None]:
    """All comparison figures of one seed pair (percent reductions; None = undefined)."""
    peak = float(standard.returns.max())
    ave, unreached = se_ave(standard.returns, other.returns)
    out: dict[str, float | None] = {
        "se_ave": ave, "se_ave_unreached_levels": float(unreached),
        "se_peak": reduction(standard.returns, other.returns, peak),
        "rt_peak": time_reduction(standard.returns, standard.seconds, other.returns, other.seconds, peak),
        "rounds_to_ppo_peak": _opt_float(first_reach(other.returns, peak)),
        "seconds_to_ppo_peak": _seconds_at(other, first_reach(other.returns, peak)),
        "final_return": float(other.returns[-1]),
        "auc": float(other.returns.mean()),
    }
    start = float(standard.returns[0])
    plateau = float(standard.returns[-plateau_rounds:].mean())
    for f in fractions:
        level = start + f * (plateau - start)
        tag = f"{round(100 * f)}pct"
        out[f"se_{tag}"] = reduction(standard.returns, other.returns, level)
        out[f"rt_{tag}"] = time_reduction(standard.returns, standard.seconds, other.returns, other.seconds, level)
    return out


def _opt_float(x: int | None) -> float | None:
    return None if x is None else float(x)


def _seconds_at(curve: Curve, m: int | None) -> float | None:
    return None if m is None else float(curve.seconds[m - 1])


# -- running pairs ----------------------------------------------------------------------


def run_pair(config: dict[str, Any], run_dir: str) -> str:
    """Train one (method, seed) pair into ``run_dir``; resume it if a checkpoint exists.

    A top-level function of plain data, so that a process pool or Ray can run it.
    """
    path = Path(run_dir)
    if (path / "done.json").exists():
        return run_dir
    has_checkpoint = any((path / "checkpoints").glob("round_*.pt")) if path.exists() else False
    if has_checkpoint:
        saved = json.loads((path / "config.json").read_text())
        wanted = json.loads(json.dumps(config))  # tuples -> lists, as saved
        if saved != wanted:
            changed = sorted(k for k in wanted if saved.get(k) != wanted[k])
            raise UserError(f"{run_dir} was started with other settings ({', '.join(changed)}); use another --out")
    trainer = PPO.resume(path) if has_checkpoint else PPO(PPOConfig.from_dict(config), run_dir=path)
    trainer.learn()
    (path / "done.json").write_text(json.dumps({"round": trainer.round, "train_seconds": trainer.train_seconds}))
    return run_dir


def _run_local(jobs: list[tuple[dict, str]], workers: int, on_done: Callable[[str], None]) -> None:
    if workers <= 1:
        for config, run_dir in jobs:
            on_done(run_pair(config, run_dir))
        return
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_pair, config, run_dir) for config, run_dir in jobs]
        for future in as_completed(futures):
            on_done(future.result())


def _run_ray(jobs: list[tuple[dict, str]], address: str, on_done: Callable[[str], None]) -> None:
    try:
        import ray
    except ImportError:
        raise UserError("--ray-address needs ray: pip install 'rlinfluence[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(run_pair)
    pending = [remote.remote(config, run_dir) for config, run_dir in jobs]
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        on_done(ray.get(done[0]))


# -- the comparison ---------------------------------------------------------------------


@dataclass
class CompareConfig:
    """Multi-seed comparison of filtering methods with standard PPO (``rlinfluence compare``)."""

    env: str = "FrozenLake-v1"
    """gymnasium env id (a preset gives the paper's hyperparameters, p and round count)"""
    methods: str = "ppo,iif,random"
    """comma-separated: ppo (standard), iif, random, advantage, td-error, reward-extremes"""
    seeds: int = 5
    """number of seeds (first_seed, first_seed + 1, ...)"""
    first_seed: int = 1
    """the first seed"""
    rounds: int | None = None
    """rounds per run (default: the preset's standard-PPO round count)"""
    drop_pct: float | None = None
    """p for iif and the baselines (default: the preset's)"""
    eval_episodes: int | None = None
    """evaluation episodes per round (default: the preset's)"""
    set: tuple[str, ...] = ()
    """further PPOConfig overrides for every run, as key=value (e.g. optimizer=adam)"""
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
    progress: bool = True
    """show a progress bar of finished pairs"""

    def method_list(self) -> list[str]:
        methods = [m.strip() for m in self.methods.split(",") if m.strip()]
        if "ppo" not in methods:
            raise UserError(f"methods {self.methods!r} must include ppo (the reference curve)")
        return methods

    def run_config(self, method: str, seed: int) -> PPOConfig:
        overrides: dict[str, Any] = {"seed": seed, "progress": False,
                                     "filter": "none" if method == "ppo" else method, "method": method}
        base = PPOConfig.for_env(self.env)
        if self.rounds is not None:
            overrides["total_timesteps"] = self.rounds * base.rollout_size
        if self.drop_pct is not None:
            overrides["drop_pct"] = self.drop_pct
        if self.eval_episodes is not None:
            overrides["eval_episodes"] = self.eval_episodes
        overrides.update(parse_overrides(self.set))
        config = PPOConfig.for_env(self.env, **overrides)
        config.validate()
        return config


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings -> PPOConfig overrides, values parsed as JSON where possible."""
    fields = set(PPOConfig.__dataclass_fields__)
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise UserError(f"bad override {pair!r}: expected key=value with a PPOConfig field as key")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@contextmanager
def _folder_lock(out: Path) -> Iterator[None]:
    """Exclusive lock on ``out`` while a comparison runs: two comparisons writing the same
    pairs would interleave their files."""
    import fcntl

    with (out / ".lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another comparison is running in {str(out)!r}") from None
        yield


def compare(cfg: CompareConfig) -> Path:
    """Run (or resume) every pair, then write summary.md, summary.csv and curves.png."""
    methods = cfg.method_list()
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    out = Path(cfg.out or f"runs/compare__{cfg.env}__{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {str(out)!r}: {exc.strerror}") from None
    with _folder_lock(out):
        jobs = [(cfg.run_config(m, s).to_dict(), str(out / f"{m}__seed{s}")) for s in seeds for m in methods]
        (out / "compare.json").write_text(json.dumps({**cfg.__dict__, "set": list(cfg.set)}, indent=2))
        todo = [job for job in jobs if not (Path(job[1]) / "done.json").exists()]
        with progress_bar(cfg.progress, "pairs", len(jobs), len(jobs) - len(todo)) as advance:
            def on_done(run_dir: str) -> None:
                advance(Path(run_dir).name)

            if cfg.ray_address:
                _run_ray(todo, cfg.ray_address, on_done)
            else:
                _run_local(todo, cfg.workers, on_done)
        write_summary(out, methods, seeds, cfg.smooth, cfg.clock)
    return out


# -- summary ----------------------------------------------------------------------------

_COLUMNS = [
    ("se_ave", "SE_ave %"), ("se_peak", "SE_peak %"), ("rt_peak", "RT_peak %"),
    ("se_50pct", "rounds to 50% (reduction %)"), ("se_80pct", "rounds to 80% (%)"),
    ("se_90pct", "rounds to 90% (%)"), ("rt_80pct", "seconds to 80% (%)"),
    ("rounds_to_ppo_peak", "rounds to PPO peak"), ("seconds_to_ppo_peak", "seconds to PPO peak"),
    ("auc", "mean return over rounds"),
]


def summarize(
    out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall"
) -> list[dict[str, Any]]:
    """Per method: each metric's mean, s.e. and number of seed pairs where it is defined."""
    curves = {(m, s): Curve.from_run(out / f"{m}__seed{s}", window, clock) for m in methods for s in seeds}
    rows = []
    for method in methods:
        per_seed = [pair_metrics(curves["ppo", s], curves[method, s]) for s in seeds]
        row: dict[str, Any] = {"method": method, "seeds": len(seeds)}
        for key in per_seed[0]:
            values = [p[key] for p in per_seed if p[key] is not None]
            row[f"{key}_n"] = len(values)
            row[f"{key}_mean"], row[f"{key}_se"] = mean_se(values) if values else (None, None)
        finals = [float(curves[method, s].returns[-1]) for s in seeds]
        gains = [f - float(curves["ppo", s].returns[-1]) for f, s in zip(finals, seeds, strict=True)]
        row["final_mean"], row["final_lo"], row["final_hi"] = ci95(finals)
        row["gain_mean"], row["gain_lo"], row["gain_hi"] = ci95(gains)
        rows.append(row)
    return rows


def _cell(row: dict[str, Any], key: str) -> str:
    n, mean = row[f"{key}_n"], row[f"{key}_mean"]
    if mean is None:
        return f"undefined (0/{row['seeds']} seeds reached)"
    fmt = ".1f" if key.startswith(("se_", "rt_")) else ".4g"
    text = f"{mean:{fmt}} +/- {row[f'{key}_se']:{fmt}}"
    return text if n == row["seeds"] else f"{text} ({n}/{row['seeds']} seeds)"


def write_summary(
    out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall"
) -> None:
    rows = summarize(out, methods, seeds, window, clock)
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# {out.name}: {', '.join(methods)} vs ppo, seeds {list(seeds)}",
        "",
        f"Reductions are percent, per seed pair against ppo, mean +/- s.e. over seeds; smoothing window {window} "
        "round(s). Levels: SE_ave = successive new maxima of the ppo curve; 50/80/90% = that fraction of the way "
        "from ppo's first-round return to its plateau (mean of its last 5 rounds). Undefined = the method never "
        f"reached the level in that pair. Seconds: {clock} clock (training only, evaluation excluded).",
        "",
        "| method | " + " | ".join(title for _, title in _COLUMNS) + " | final return (95% CI) | final gain vs ppo (95% CI) |",
        "|---" * (len(_COLUMNS) + 3) + "|",
    ]
    for row in rows:
        cells = [_cell(row, key) for key, _ in _COLUMNS]
        final = f"{row['final_mean']:.4g} [{row['final_lo']:.4g}, {row['final_hi']:.4g}]"
        gain = f"{row['gain_mean']:.4g} [{row['gain_lo']:.4g}, {row['gain_hi']:.4g}]"
        lines.append(f"| {row['method']} | " + " | ".join(cells) + f" | {final} | {gain} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot_curves(out, methods, seeds, window, clock)


def plot_curves(
    out: Path, methods: Sequence[str], seeds: Sequence[int], window: int = 1, clock: Clock = "wall"
) -> Path:
    """curves.png: eval return vs rounds and vs training seconds, mean +/- s.e. band per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rounds, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for method in methods:
        curves = [Curve.from_run(out / f"{method}__seed{s}", window, clock) for s in seeds]
        n = min(len(c.returns) for c in curves)
        y = np.stack([c.returns[:n] for c in curves])
        rounds = np.arange(1, n + 1)
        _band(ax_rounds, rounds, y, method)
        t_max = min(c.seconds[n - 1] for c in curves)
        grid = np.linspace(0, t_max, 200)
        # each seed's curve as a step function of time: the return of the last finished round
        yt = np.stack([c.returns[np.clip(np.searchsorted(c.seconds[:n], grid, side="right") - 1, 0, n - 1)]
                       for c in curves])
        _band(ax_time, grid, yt, method)
    ax_rounds.set(xlabel="round", ylabel="eval return", title=out.name)
    ax_time.set(xlabel=f"training seconds, {clock} clock (evaluation excluded)", ylabel="eval return")
    for ax in (ax_rounds, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "curves.png"
    tmp = out / ".curves.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _band(ax: Any, x: np.ndarray, y: np.ndarray, label: str) -> None:
    mean = y.mean(0)
    se = y.std(0, ddof=1) / math.sqrt(len(y)) if len(y) > 1 else np.zeros_like(mean)
    (line,) = ax.plot(x, mean, label=f"{label} (n={len(y)})")
    ax.fill_between(x, mean - se, mean + se, color=line.get_color(), alpha=0.2)
