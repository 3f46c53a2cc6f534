"""Conveniences on top of the scorers: score a ``RolloutBuffer``, pick top/bottom records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlinfluence.buffer import MinibatchStep, RolloutBuffer
from rlinfluence.influence.snapshot import (
    DEFAULT_ADVANTAGE_NORM,
    chunk_permutation,
    snapshot_influence,
)
from rlinfluence.influence.targets import check_positive_int
from rlinfluence.influence.tracin import tracin_influence

MODES = ("snapshot", "full")


def score_buffer(
    policy: nn.Module,
    buffer: RolloutBuffer,
    *,
    mode: str = "snapshot",
    schedule: Sequence[MinibatchStep] | None = None,
    advantage_norm: str = DEFAULT_ADVANTAGE_NORM,
    chunk_seed: int = 0,
    **kwargs: Any,
) -> torch.Tensor:
    """Scores of every record of ``buffer`` in flat (env-major) order, shape ``[len(buffer)]``.

    ``mode="snapshot"``: ``snapshot_influence(policy, obs, actions, advantages,
    advantage_norm=advantage_norm, **kwargs)``, the records taken in the order
    ``chunk_permutation(len(buffer), chunk_seed)`` for ``"chunk"`` (IIF's normalisation, the
    default; pass ``chunk_size=batch_size`` as IIF does); ``mode="full"``:
    ``tracin_influence(policy, obs, actions, logp, advantages, returns, values, schedule,
    **kwargs)`` with the round's recorded ``schedule`` (which normalises as the trainer did).
    ``policy`` must be at theta(k), the parameters that collected the buffer;
    ``buffer.compute_advantages`` must have run.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(buffer, RolloutBuffer):
        raise ValueError(f"buffer must be a RolloutBuffer (a collected round), got {type(buffer).__name__}")
    if buffer.advantages.numel() != len(buffer):
        raise ValueError(f"round {buffer.round} buffer has no advantages: call compute_advantages first")
    obs, actions, advantages = buffer.flat("obs"), buffer.flat("actions"), buffer.flat("advantages")
    if mode == "snapshot":
        if schedule is not None:
            raise ValueError("schedule is only used by mode='full'")
        if advantage_norm != "chunk":
            return snapshot_influence(policy, obs, actions, advantages, advantage_norm=advantage_norm, **kwargs)
        order = chunk_permutation(len(buffer), chunk_seed)
        permuted = snapshot_influence(policy, obs[order], actions[order], advantages[order],
                                      advantage_norm=advantage_norm, **kwargs)
        return torch.empty_like(permuted).index_copy_(0, order, permuted)
    if schedule is None:
        raise ValueError("mode='full' needs the round's schedule (record_minibatches=True in the trainer)")
    return tracin_influence(
        policy, obs, actions, buffer.flat("logp"), advantages, buffer.flat("returns"), buffer.flat("values"),
        schedule, **kwargs,
    )


@dataclass(frozen=True, eq=False)
class TopRecords:
    """The k most helpful (proponents, highest score first) and most harmful records
    (opponents, lowest score first), as record indices with their scores."""

    proponents: torch.Tensor
    proponent_scores: torch.Tensor
    opponents: torch.Tensor
    opponent_scores: torch.Tensor


def top_records(scores: torch.Tensor, k: int) -> TopRecords:
    """Top-k proponents and opponents of ``scores [N]`` (k capped at N; stable order on ties)."""
    check_positive_int("k", k)
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-d, got shape {tuple(scores.shape)}")
    k = min(k, len(scores))
    order = torch.sort(scores, descending=True, stable=True).indices
    lowest = torch.sort(scores, stable=True).indices[:k]
    return TopRecords(order[:k], scores[order[:k]], lowest, scores[lowest])
