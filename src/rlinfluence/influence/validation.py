"""A counterfactual check of attribution scores: the linear datamodeling score (LDS) of a round.

Retrain the round from theta(k) on M random subsets S_1..S_M of its N records, each holding
``round(fraction * N)`` records, and compare what the scores predict with what happened:

    predicted_m = sum_{i in S_m} score_i
    real_m      = f(theta_{S_m}) - f(theta(k))
    LDS         = Spearman(predicted, real)

with a percentile-bootstrap confidence interval that resamples the M (predicted, real) pairs.
A drop test complements it: for each p in ``drop_pcts``, n_p = round(p N / 100) records are
removed and the real change f(theta_{-drop}) - f(theta(k)) is measured for

    the n_p lowest-scored records (the most negative first)  vs  n_p uniformly random records
    (``random_draws`` draws, shared by every scorer)  vs  no record (the full buffer).

Trainer-free: the update is a callable ``retrain([keep_mask [N] bool, ...]) -> [real change, ...]``
that the caller builds (``rlinfluence.analysis.validation`` does it for saved rounds of a run, with
all the re-runs batched); ``one_by_one`` makes one from a callable of a single mask.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from rlinfluence.errors import UserError
from rlinfluence.influence.targets import check_per_record

MIN_SUBSETS = 5
DROP_PCTS = (5.0, 10.0, 25.0)

Retrain = Callable[[Sequence[torch.Tensor]], Sequence[float]]
"""The real changes f(theta_keep) - f(theta(k)) of re-runs of the round on each keep mask."""


def one_by_one(retrain: Callable[[torch.Tensor], float]) -> Retrain:
    """A ``Retrain`` that runs ``retrain(keep) -> real change`` on each mask in turn."""
    return lambda masks: [float(retrain(keep)) for keep in masks]


@dataclass(frozen=True)
class LDS:
    """Spearman(predicted, real) over the subsets and its bootstrap interval [low, high];
    NaN with a ``message`` saying why when the correlation is undefined."""

    value: float
    low: float
    high: float
    confidence: float
    message: str | None = None


@dataclass(frozen=True)
class DropTest:
    """Real target changes after dropping ``dropped`` records: the lowest-scored ones
    (``negative_dropped`` of them had a negative score) and ``random_changes``, one per draw."""

    pct: float
    dropped: int
    negative_dropped: int
    lowest_change: float
    random_changes: tuple[float, ...]

    @property
    def random_mean(self) -> float:
        return float(np.mean(self.random_changes))

    @property
    def random_se(self) -> float:
        """Standard error of the random-drop mean over draws (NaN for one draw)."""
        n = len(self.random_changes)
        return float(np.std(self.random_changes, ddof=1) / math.sqrt(n)) if n > 1 else math.nan


@dataclass(frozen=True)
class ScorerValidation:
    """One score vector's results: ``predicted [M]`` (sum of scores over each subset)."""

    predicted: np.ndarray
    lds: LDS
    drops: tuple[DropTest, ...]


@dataclass(frozen=True)
class Validation:
    """``masks [M, N]`` (True = record kept), ``real [M]`` the real changes, ``full_change`` the
    real change of the update on every record, one ``ScorerValidation`` per score vector, and
    how many times ``retrain`` ran."""

    masks: torch.Tensor
    real: np.ndarray
    full_change: float
    scorers: dict[str, ScorerValidation]
    retrains: int


def _rng(seed: int | Sequence[int], stream: int) -> np.random.Generator:
    """An independent generator per stream (subsets, random drops, bootstrap) of one seed."""
    parts = [seed] if isinstance(seed, int) else list(seed)
    if any(part < 0 for part in parts):
        raise UserError(f"--seed must be >= 0, got {seed}")
    return np.random.default_rng([*parts, stream])


MAX_SUBSETS = 100_000


def check_settings(subsets: int, fraction: float) -> None:
    """UserError unless ``5 <= subsets <= MAX_SUBSETS`` and ``0 < fraction < 1``."""
    if isinstance(subsets, bool) or not isinstance(subsets, int) or subsets < MIN_SUBSETS:
        raise UserError(f"--subsets must be an integer >= {MIN_SUBSETS} (a rank correlation over "
                        f"fewer subsets says nothing), got {subsets!r}")
    if subsets > MAX_SUBSETS:  # each subset is a retrained round
        raise UserError(f"--subsets must be <= {MAX_SUBSETS} (each is a retrained round), got {subsets}")
    if not 0.0 < fraction < 1.0:
        raise UserError(f"--fraction must lie strictly between 0 and 1, got {fraction!r}")


def random_subsets(n: int, subsets: int, fraction: float,
                   seed: int | Sequence[int] = 0) -> torch.Tensor:
    """Keep masks ``[subsets, n]``: each row keeps ``round(fraction * n)`` records drawn uniformly
    without replacement; the same (n, subsets, fraction, seed) give the same masks."""
    check_settings(subsets, fraction)
    size = round(fraction * n)
    if not 0 < size < n:
        raise UserError(f"--fraction {fraction} of {n} records keeps {size}: every subset must "
                        "keep at least one record and drop at least one")
    rng = _rng(seed, 0)
    masks = torch.zeros(subsets, n, dtype=torch.bool)
    for row in masks:
        row[torch.from_numpy(rng.permutation(n)[:size])] = True
    return masks


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    return float(stats.spearmanr(x, y).statistic)


def _spearman_rows(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """Spearman's rho along ``axis`` (the Pearson correlation of the average ranks), NaN where a
    side is constant: the bootstrap's statistic, all resamples at once."""
    rx, ry = stats.rankdata(x, axis=axis), stats.rankdata(y, axis=axis)
    rx, ry = rx - rx.mean(axis=axis, keepdims=True), ry - ry.mean(axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (rx * ry).sum(axis=axis) / np.sqrt((rx * rx).sum(axis=axis) * (ry * ry).sum(axis=axis))


def linear_datamodeling_score(predicted: np.ndarray, real: np.ndarray, confidence: float = 0.95,
                              resamples: int = 2000, seed: int | Sequence[int] = 0) -> LDS:
    """LDS = Spearman(predicted, real) over subsets, with a percentile bootstrap interval:
    the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of Spearman over ``resamples``
    paired resamples of the subsets (scipy), ignoring resamples without a correlation (one subset
    drawn M times). NaN and a message when either side is the same on every subset (a
    correlation would mean nothing)."""
    predicted, real = np.asarray(predicted, dtype=np.float64), np.asarray(real, dtype=np.float64)
    if predicted.shape != real.shape or predicted.ndim != 1:
        raise ValueError(f"predicted {predicted.shape} and real {real.shape} must be equal "
                         "1-d shapes")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    message = None
    if np.ptp(real) == 0:
        message = (f"the real change of the target is {real[0]:.6g} on every subset: this round's "
                   "update cannot change the target, so there is nothing for the scores to predict")
    elif np.ptp(predicted) == 0:
        message = "the scores sum to the same value on every subset: they predict no difference"
    if message is not None:
        return LDS(math.nan, math.nan, math.nan, confidence, message)
    with warnings.catch_warnings():  # a resample repeating one subset has no correlation
        warnings.simplefilter("ignore", (stats.ConstantInputWarning, stats.DegenerateDataWarning))
        distribution = stats.bootstrap(
            (predicted, real), _spearman_rows, paired=True, vectorized=True, n_resamples=resamples,
            confidence_level=confidence, method="percentile", random_state=_rng(seed, 2),
        ).bootstrap_distribution
    tail = 50 * (1 - confidence)
    low, high = np.nanpercentile(distribution, [tail, 100 - tail])
    return LDS(_spearman(predicted, real), float(low), float(high), confidence)


def _drop_lowest(scores: torch.Tensor, n_drop: int) -> torch.Tensor:
    keep = torch.ones(len(scores), dtype=torch.bool)
    keep[torch.sort(scores, stable=True).indices[:n_drop]] = False
    return keep


def _score_table(scores: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    table = {"scores": scores} if isinstance(scores, torch.Tensor) else dict(scores)
    if not table:
        raise ValueError("no score vector given")
    n = len(next(iter(table.values())))
    for name, vector in table.items():
        check_per_record(f"scores {name!r}", vector, n)
    return {name: vector.detach().double().cpu() for name, vector in table.items()}


def validate(
    scores: torch.Tensor | Mapping[str, torch.Tensor],
    retrain: Retrain,
    *,
    subsets: int = 30,
    fraction: float = 0.5,
    drop_pcts: Sequence[float] = DROP_PCTS,
    random_draws: int = 5,
    seed: int | Sequence[int] = 0,
    confidence: float = 0.95,
    resamples: int = 2000,
) -> Validation:
    """Counterfactual check of one or several score vectors ``[N]`` of the same round (module
    docstring). ``retrain(masks)`` redoes the round's update on the kept records of each mask and
    returns the real changes f(theta_keep) - f(theta(k)); it is called once, with ``subsets + 1 +
    len(drop_pcts) * (random_draws + number of score vectors)`` masks, each subset and random draw
    shared by every score vector. Deterministic given ``seed`` (and a deterministic ``retrain``)."""
    table = _score_table(scores)
    n = len(next(iter(table.values())))
    masks = random_subsets(n, subsets, fraction, seed)
    if any(not 0 < p < 100 for p in drop_pcts):
        raise UserError("drop percentages must lie strictly between 0 and 100, got "
                        f"{list(drop_pcts)}")
    if random_draws < 1:
        raise UserError(f"random_draws must be >= 1, got {random_draws}")
    draws = _rng(seed, 1)
    n_drops = [round(p / 100 * n) for p in drop_pcts]
    random_masks = [[_drop_lowest(torch.from_numpy(draws.random(n)), k) for _ in range(random_draws)]
                    for k in n_drops]
    drop_masks = {name: [_drop_lowest(vector, k) for k in n_drops] for name, vector in table.items()}
    every = [*masks, torch.ones(n, dtype=torch.bool), *(m for row in random_masks for m in row),
             *(m for row in drop_masks.values() for m in row)]
    changes = iter(np.asarray(retrain(every), dtype=np.float64))
    retrains = len(every)
    real = np.array([next(changes) for _ in masks])
    full_change = float(next(changes))
    random_changes = [tuple(float(next(changes)) for _ in row) for row in random_masks]
    results = {}
    for name, vector in table.items():
        predicted = (masks.double() @ vector).numpy()
        drops = tuple(
            DropTest(float(p), k, int((torch.sort(vector, stable=True).values[:k] < 0).sum()),
                     float(next(changes)), row)
            for p, k, row in zip(drop_pcts, n_drops, random_changes, strict=True)
        )
        lds = linear_datamodeling_score(predicted, real, confidence, resamples, seed)
        results[name] = ScorerValidation(predicted, lds, drops)
    return Validation(masks, real, full_change, results, retrains)
