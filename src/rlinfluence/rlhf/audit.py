"""The harm table of a language-model round, for ``rlinfluence audit RUN``: one row per sequence,
its ``source`` the reward worker that scored it (``rlinfluence.rlhf.reward.ShardedReward``), and
one harm column per family (higher = more harmful):

    reward-extremes     |r_i - mean_j r_j|, the distance of the reward from the round's mean
    negative-advantage  -A_i, A_i the sequence's advantage (GRPO: group-relative; PPO: the whitened
                        advantage at its last token)
    abs-advantage       |A_i|
    influence           -<grad u_i, grad f_seq(H_other)>: the sequence's influence on f_seq over the
                        other half of the round's prompt groups (IIF's default scores,
                        ``heldout_sequence_influence``)
    reward-recheck      |r_i - r(y_i)|: the logged reward against the reward a reference scorer
                        gives the sequence's own completion (0 for a worker that scores what it
                        is given, whatever the completion)
    random              a uniform draw seeded by (seed, round): the chance line

The table has the columns of ``rlinfluence.analysis.audit``'s harm tables (``round``, ``source``,
``episode`` = round x N + the sequence's index in the round (unique across rounds), ``step`` 0, ``trusted`` False, ``corrupted``
where the truth is known), so the audit's verdict reads it as it reads an RL run's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rlinfluence.rundir import AUDIT_SCORES, atomic_write

HARM_FAMILIES = ("reward-extremes", "negative-advantage", "abs-advantage", "influence", "reward-recheck", "random")


def harm_table(round_index: int, rewards: torch.Tensor, advantages: torch.Tensor, influence: torch.Tensor | None,
               rechecked: torch.Tensor, sources: np.ndarray, corrupted: np.ndarray | None = None,
               seed: int = 0) -> pd.DataFrame:
    """One row per sequence of the round (all [N]: the logged ``rewards``, the sequence
    ``advantages``, the ``influence`` scores, the ``rechecked`` rewards of the same completions,
    the reward worker of each in ``sources``); the harm of every family in ``HARM_FAMILIES``
    (influence, a gradient family, only where its scores are given)."""
    r = rewards.detach().double().cpu().numpy()
    a = advantages.detach().double().cpu().numpy()
    n = len(r)
    table = pd.DataFrame({"round": np.full(n, round_index, dtype=np.int64), "source": np.asarray(sources, dtype=np.int64),
                          "episode": round_index * n + np.arange(n, dtype=np.int64), "step": np.zeros(n, dtype=np.int64), "trusted": False})
    if corrupted is not None:
        table["corrupted"] = np.asarray(corrupted, dtype=bool)
    table["reward-extremes"] = np.abs(r - r.mean())
    table["negative-advantage"] = -a
    table["abs-advantage"] = np.abs(a)
    if influence is not None:
        table["influence"] = -influence.detach().double().cpu().numpy()
    table["reward-recheck"] = np.abs(r - rechecked.detach().double().cpu().numpy())
    table["random"] = np.random.default_rng([seed, round_index]).random(n)
    return table


def write_harm_table(run_dir: str | Path, table: pd.DataFrame) -> Path:
    """``table`` (one round's) to ``RUN_DIR/audit/scores/round_K.parquet``, atomically."""
    path = Path(run_dir) / AUDIT_SCORES / f"round_{int(table['round'].iloc[0]):06d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: table.to_parquet(p, index=False))
    return path
