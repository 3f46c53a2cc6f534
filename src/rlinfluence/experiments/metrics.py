"""Metrics on learning curves (docs/method.md, section 7.2, and the fraction-of-range reductions).

For a reference curve s and another curve o (m(v) = first round, counted from 1, at which a
curve reaches at least v; T(v) = cumulative training seconds at that round):

    reduction(v) = 1 - m_o(v) / m_s(v)
    SE_ave  = mean of reduction(v) over the successive new maxima v of s (its running maximum
              at every round where it strictly increases)
    SE_peak = reduction(max s)          RT_peak = 1 - T_o(max s) / T_s(max s)
    se_{f}  = reduction(s_0 + f (plateau(s) - s_0)),  plateau = mean of s's last 5 rounds

A level the other curve never reaches makes that pair's value undefined (None): those are the
paper's definitions. The censoring-aware figures (``time_to_level``, ``paired_speed``) never drop
such a pair: a run of n rounds that never reaches v is right-censored, its rounds counted as
n + 1 (a lower bound on the truth), and the pair's speed-up is the symmetric log ratio

    log_ratio(v) = ln(m_s(v) / m_o(v))       (+0.69 = twice as fast, -0.69 = twice as slow)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.specs import Clock

CLOCK_COLUMNS = {"wall": "train_seconds", "cpu": "train_cpu_seconds"}
PLATEAU_ROUNDS = 5


def first_reach(curve: Sequence[float], level: float) -> int | None:
    """Rounds trained (1-based) when ``curve`` first reaches ``level``; None if never."""
    hits = np.flatnonzero(np.asarray(curve) >= level)
    return int(hits[0]) + 1 if len(hits) else None


def time_to_level(curve: Sequence[float], level: float) -> tuple[int, bool]:
    """(rounds, reached): ``first_reach``, or (len(curve) + 1, False) when the run never got there
    (right-censored: the true time is at least that)."""
    m = first_reach(curve, level)
    return (m, True) if m is not None else (len(curve) + 1, False)


def paired_speed(standard: Sequence[float], other: Sequence[float], level: float) -> dict[str, float]:
    """One seed pair at ``level``: both runs' (censored) rounds, whether each reached it, and
    ln(m_standard / m_other) (positive = other is faster)."""
    m_std, std_reached = time_to_level(standard, level)
    m_other, other_reached = time_to_level(other, level)
    return {"rounds": float(m_other), "reached": float(other_reached), "reference_rounds": float(m_std),
            "reference_reached": float(std_reached), "log_ratio": math.log(m_std / m_other)}


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
    return pd.Series(x).rolling(window, min_periods=1).mean().to_numpy()


@dataclass
class Curve:
    """One run's curves after each round: eval return, cumulative training seconds, approx_kl."""

    returns: np.ndarray
    seconds: np.ndarray
    approx_kl: np.ndarray | None = None

    @classmethod
    def from_run(cls, run_dir: Path, window: int = 1, clock: Clock = "wall") -> Curve:
        """``clock="cpu"`` times rounds by the process's CPU seconds instead of wall seconds."""
        path = run_dir / "metrics.csv"
        try:
            rows = pd.read_csv(path)
        except (OSError, ValueError, pd.errors.EmptyDataError) as exc:  # ParserError, binary (UnicodeDecodeError)
            raise UserError(f"cannot read {str(path)!r}: {str(exc).splitlines()[0] if str(exc) else 'empty'}") from None
        column = CLOCK_COLUMNS[clock]
        if column not in rows or rows[column].isna().any():
            raise UserError(f"{path} has no {column} (a run from before it was logged): use clock wall")
        if "eval_return_mean" not in rows or len(rows) == 0:
            raise UserError(f"{path} has no evaluation returns")
        try:
            returns, seconds = (rows[c].to_numpy(float) for c in ("eval_return_mean", column))
            kl = rows["approx_kl"].to_numpy(float) if "approx_kl" in rows else None
        except ValueError as exc:  # text where numbers belong
            raise UserError(f"{path} holds a value that is not a number ({exc}); remove {str(run_dir)!r} to rerun "
                            "that pair") from None
        return cls(smooth(returns, window), seconds, kl)

    @property
    def plateau(self) -> float:
        """Mean of the last ``PLATEAU_ROUNDS`` rounds."""
        return float(self.returns[-PLATEAU_ROUNDS:].mean())


def level_of(standard: Curve, fraction: float) -> float:
    """s_0 + fraction (plateau(s) - s_0): ``fraction`` of the way from the reference's first round
    to its plateau."""
    start = float(standard.returns[0])
    return start + fraction * (standard.plateau - start)


def pair_metrics(standard: Curve, other: Curve, fractions: Sequence[float] = (0.5, 0.8, 0.9)
                 ) -> dict[str, float | None]:
    """All comparison figures of one seed pair (percent reductions; None = undefined).

    A reference that never rises above its first round has no level to reach: its peak is its
    start (every peak figure is undefined) and a plateau at or below its start leaves the
    fraction levels undefined, as the normalised scores are."""
    start, peak = float(standard.returns[0]), float(standard.returns.max())
    rises, improves = peak > start, standard.plateau > start
    ave, unreached = se_ave(standard.returns, other.returns)
    out: dict[str, float | None] = {
        "se_ave": ave, "se_ave_unreached_levels": float(unreached),
        "se_peak": reduction(standard.returns, other.returns, peak) if rises else None,
        "rt_peak": time_reduction(standard.returns, standard.seconds, other.returns, other.seconds, peak)
        if rises else None,
        "rounds_to_ppo_peak": _opt_float(first_reach(other.returns, peak)) if rises else None,
        "seconds_to_ppo_peak": _seconds_at(other, first_reach(other.returns, peak)) if rises else None,
        "final_return": float(other.returns[-1]),
        "auc": float(other.returns.mean()),
    }
    for f in fractions:
        level = level_of(standard, f)
        tag = f"{round(100 * f)}pct"
        out[f"se_{tag}"] = reduction(standard.returns, other.returns, level) if improves else None
        out[f"rt_{tag}"] = time_reduction(standard.returns, standard.seconds, other.returns, other.seconds, level) \
            if improves else None
    return out


def _opt_float(x: int | None) -> float | None:
    return None if x is None else float(x)


def _seconds_at(curve: Curve, m: int | None) -> float | None:
    return None if m is None else float(curve.seconds[m - 1])
