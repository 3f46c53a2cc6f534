"""Hyperparameter tuning on tuning seeds: a grid per method, one choice per method.

Each candidate (a point of the grid's product) is trained on K tuning seeds, which are disjoint
from the evaluation seeds; its tuning score is the mean over those seeds of

    auc       normalised area under the eval curve: mean_t (R_t - lo) / (hi - lo)
    final     normalised plateau: the mean of the last 5 rounds, (P - lo) / (hi - lo)
    rounds80  minus the rounds to first reach lo + 0.8 (hi - lo) (never: rounds + 1)

where lo = the mean first-round return and hi = the best plateau over every tuning run of the
env (all methods, all candidates), so the scale is shared and no evaluation run enters it.
The candidate with the highest score is chosen (ties: the first in grid order).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlinfluence.experiments.metrics import Curve, first_reach
from rlinfluence.experiments.specs import TuneMetric


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The product of the grid's values, in order (the last key varies fastest)."""
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]


def tuning_scores(curves: Mapping[tuple[str, int], Sequence[Curve]], metric: TuneMetric
                  ) -> dict[tuple[str, int], float]:
    """{(method, candidate index): [curve per tuning seed]} -> mean tuning score per key."""
    every = [c for runs in curves.values() for c in runs]
    lo = float(np.mean([c.returns[0] for c in every]))
    hi = max(c.plateau for c in every)
    span = hi - lo if hi != lo else 1.0

    def score(c: Curve) -> float:
        if metric == "auc":
            return float(((c.returns - lo) / span).mean())
        if metric == "final":
            return (c.plateau - lo) / span
        reached = first_reach(c.returns, lo + 0.8 * (hi - lo))
        return -float(reached if reached is not None else len(c.returns) + 1)

    return {key: float(np.mean([score(c) for c in runs])) for key, runs in curves.items()}


def choose(scores: Mapping[tuple[str, int], float], method: str) -> int:
    """Index of ``method``'s best candidate (the first of equal ones)."""
    own = sorted((i, s) for (m, i), s in scores.items() if m == method)
    return max(own, key=lambda item: (item[1], -item[0]))[0]


def at_edge(index: int, grid: Mapping[str, Sequence[Any]]) -> list[str]:
    """Keys of a chosen grid point that sit at the first or last value of their axis: a sign
    that the grid should be widened. An axis of two values has only edges, so its choice is
    always flagged (the optimum may lie outside); an axis of one value is not tuned."""
    keys = list(grid)
    position = np.unravel_index(index, [len(v) for v in grid.values()])
    return [k for k, p in zip(keys, position, strict=True) if len(grid[k]) >= 2 and p in (0, len(grid[k]) - 1)]


def widen_past_edge(grid: Sequence[float], choice: float, max_points: int) -> list[float] | None:
    """``grid`` sorted, with one more point past the edge ``choice`` sits on (/2 below the lowest, x2
    above the highest), so that tuning again can end on a choice interior to its grid; None when
    the choice is interior or the grid already has ``max_points`` points."""
    grid = sorted(grid)
    if len(grid) >= max_points or choice not in (grid[0], grid[-1]):
        return None
    edge = grid[0] / 2 if choice == grid[0] else grid[-1] * 2
    return sorted([*grid, float(f"{edge:.6g}")])
