"""Detection of corrupted records: how well each scorer ranks the records a corruption changed.

For a saved round with ground truth (``RolloutBuffer.corrupted``, a run trained with
``--corrupt``), every scorer gives each record a *harm* score (higher = more harmful):

    influence           -<grad l_i, grad f>, f the return target on the whole buffer (IIF's scores)
    influence-trusted   the same with f on the trusted envs' records only (``trusted_envs``)
    negative-advantage  -A_i
    abs-advantage       |A_i|
    random              a uniform draw (the chance line)

and detection is measured as AUROC (the probability that a corrupted record is ranked more
harmful than a clean one; 0.5 = chance) at two levels: per record, and per source (a training
env), where a source's harm is the mean harm of its records. Trusted envs are left out of both
(their records are clean by construction and the trusted target is built from them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.filters import FilterContext, InfluenceScorer

Scorer = Callable[[RolloutBuffer, torch.nn.Module, torch.Tensor | None, int], np.ndarray]


def _influence(trusted_only: bool) -> Scorer:
    def harm(buffer: RolloutBuffer, policy: torch.nn.Module, trusted: torch.Tensor | None, batch_size: int
             ) -> np.ndarray:
        if trusted_only and trusted is None:
            raise ValueError("influence-trusted needs a run with trusted_envs > 0")
        context = FilterContext(policy, buffer.round, batch_size, trusted=trusted if trusted_only else None)
        scores = InfluenceScorer(advantage_norm="batch").scores(buffer, context)
        return -scores.double().numpy() if scores is not None else np.zeros(len(buffer))
    return harm


def _random(buffer: RolloutBuffer, *_: object) -> np.ndarray:
    return np.random.default_rng(buffer.round).random(len(buffer))


SCORERS: dict[str, Scorer] = {
    "influence": _influence(False),
    "influence-trusted": _influence(True),
    "negative-advantage": lambda buffer, *_: -buffer.flat("advantages").double().numpy(),
    "abs-advantage": lambda buffer, *_: buffer.flat("advantages").abs().double().numpy(),
    "random": _random,
}


def auroc(harm: np.ndarray, corrupted: np.ndarray) -> float:
    """P(a corrupted item's harm > a clean item's), ties counting 1/2; NaN if one class is empty."""
    corrupted = np.asarray(corrupted, bool)
    if corrupted.all() or not corrupted.any():
        return float("nan")
    return float(roc_auc_score(corrupted, harm))


def detection(buffer: RolloutBuffer, policy: torch.nn.Module, trusted_envs: int, batch_size: int,
              scorers: tuple[str, ...] = tuple(SCORERS)) -> list[dict[str, float | str | int]]:
    """One row per scorer and level (record, source) of one round: its AUROC."""
    n_envs = buffer.n_envs
    env = buffer.flatten(torch.arange(n_envs).expand(buffer.n_steps, -1)).numpy()
    trusted = torch.from_numpy(env >= n_envs - trusted_envs) if trusted_envs else None
    judged = env < n_envs - trusted_envs
    corrupted = buffer.flat("corrupted").numpy()
    rows: list[dict[str, float | str | int]] = []
    for name in scorers:
        if name == "influence-trusted" and trusted is None:
            continue
        harm = SCORERS[name](buffer, policy, trusted, batch_size)
        sources = np.unique(env[judged])
        source_harm = np.array([harm[env == s].mean() for s in sources])
        source_corrupted = np.array([corrupted[env == s].mean() > 0.5 for s in sources])
        rows.append({"round": buffer.round, "scorer": name, "level": "record",
                     "auroc": auroc(harm[judged], corrupted[judged])})
        rows.append({"round": buffer.round, "scorer": name, "level": "source",
                     "auroc": auroc(source_harm, source_corrupted)})
    return rows
