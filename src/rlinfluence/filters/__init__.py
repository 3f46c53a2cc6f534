"""Record filters: what the trainer calls between "compute advantages" and "optimise".

A filter is any callable ``filter(buffer, context) -> keep`` returning a boolean mask of shape
``[len(buffer)]`` in the buffer's flat (env-major) order; the update then trains only on kept
records. A filter may instead (or also) set ``context.sample_weights``: the update then draws
its minibatches from the kept records with probability proportional to the weights. Filters own
their random state (``state_dict`` for resume) and report per-round statistics by writing
numbers into ``context.stats`` (logged to metrics.csv and TensorBoard under ``filter/``).

Filters here: ``none`` (standard PPO), ``iif`` (the paper's influence-based filtering, docs/method.md, section 5),
the baselines of section 8.3: ``random``, ``advantage`` (H1/H2), ``td-error``,
``reward-extremes``; and ``quarantine``, which drops whole sources the audit's test flags.
Modules: ``base`` (the context, the protocol, the keep-mask helpers), ``iif`` (the influence-scored
filters), ``rules`` (the rule-based ones), ``quarantine``; ``make_filter`` builds one by name.
"""

from __future__ import annotations

from typing import Literal

from rlinfluence.config import AUTO, FILTER_NAMES, check_drop_pct
from rlinfluence.errors import UserError
from rlinfluence.filters.base import (
    DropMode,
    Filter,
    FilterContext,
    KeepAll,
    Seeded,
    drop_lowest,
    guard_minibatch,
    iif_drop_count,
)
from rlinfluence.filters.iif import (
    AUTO_DROP_GRID,
    GATE_SPLITS,
    IIFFilter,
    InfluenceScorer,
    RandomFilter,
)
from rlinfluence.filters.quarantine import QuarantineFilter
from rlinfluence.filters.rules import (
    AdvantageFilter,
    AdvantageSignFilter,
    DropsLowestScores,
    DTVFilter,
    OracleFilter,
    RewardExtremesFilter,
    TDErrorFilter,
)
from rlinfluence.influence import DEFAULT_ADVANTAGE_NORM

__all__ = ["AUTO", "AUTO_DROP_GRID", "FILTER_NAMES", "GATE_SPLITS", "AdvantageFilter", "AdvantageSignFilter", "DTVFilter",
           "DropMode", "DropsLowestScores", "Filter", "FilterContext", "IIFFilter", "InfluenceScorer", "KeepAll",
           "OracleFilter", "QuarantineFilter", "RandomFilter", "RewardExtremesFilter", "Seeded", "TDErrorFilter",
           "check_drop_pct", "drop_lowest", "guard_minibatch", "iif_drop_count", "make_filter"]


def make_filter(
    name: str,
    *,
    drop_pct: float | str = 50.0,
    seed: int = 0,
    drop_mode: DropMode = "neg-bottom",
    advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM,
    random_match: Literal["iif", "pct"] = "iif",
    heuristic: Literal["H1", "H2"] = "H1",
    gate: Literal["none", "split-half"] = "none",
    gate_threshold: float = 0.3,
    precondition: Literal["none", "adam"] = "none",
    quarantine: tuple[int, float, bool, int] = (6, 0.01, False, 0),
) -> Filter:
    """Build a filter by name (``none`` = standard PPO), passing each the options it uses
    (``quarantine``: the quarantine filter's window, alpha, attribution and trusted_envs)."""
    if name != "iif":
        check_drop_pct(drop_pct)  # auto is IIF's alone; a filter without p ignores a number
    if name == "none":
        return KeepAll()
    if name == "iif":
        return IIFFilter(drop_pct, drop_mode, advantage_norm, seed, gate, gate_threshold, precondition)
    if name == "random":
        return RandomFilter(drop_pct, random_match, drop_mode, advantage_norm, seed, gate, gate_threshold,
                            precondition)
    if name == "advantage":
        return AdvantageFilter(drop_pct, heuristic, seed)
    if name == "td-error":
        return TDErrorFilter(seed=seed)
    if name == "reward-extremes":
        return RewardExtremesFilter(drop_pct, seed)
    if name == "dtv":
        return DTVFilter(drop_pct, drop_mode, seed)
    if name == "advantage-sign":
        return AdvantageSignFilter(drop_pct, drop_mode, seed)
    if name == "oracle":
        return OracleFilter(seed)
    if name == "quarantine":
        return QuarantineFilter(*quarantine)
    raise UserError(f"unknown filter {name!r} (choose from {', '.join(FILTER_NAMES)})")
