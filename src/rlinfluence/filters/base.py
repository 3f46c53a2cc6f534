"""What every filter shares: the context it is called with, the protocol it follows, its own random
stream, and the keep-mask helpers (drop the lowest scores, keep at least one minibatch)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.errors import UserError


@dataclass
class FilterContext:
    """What a filter may look at besides the buffer, and where it reports."""

    policy: torch.nn.Module
    """The policy theta(k) that collected the buffer (not yet updated)."""
    round: int
    batch_size: int
    gamma: float = 0.99
    stats: dict[str, float] = field(default_factory=dict)
    sample_weights: torch.Tensor | None = None
    """Optional [N] non-negative minibatch sampling weights (set by prioritising filters)."""
    validation: RolloutBuffer | None = None
    """A separate rollout of pi_theta(k) (advantages computed) for filters with ``uses_validation``
    when the trainer is asked for one; None = score against the buffer itself."""
    optimizer: torch.optim.Optimizer | None = None
    """The trainer's optimiser, in its state before this round's update (for preconditioned scores)."""
    lookahead: Callable[[torch.Tensor, torch.Tensor], float] | None = None
    """``lookahead(train, held_out)``: the gain of one epoch of the round's update on the records
    ``train`` (flat indices), run on a copy of theta(k), measured on the records ``held_out`` as
    the PPO surrogate mean_j A_norm_j (pi'(a_j|s_j) / pi(a_j|s_j) - 1) (for ``drop_pct="auto"``)."""
    scores: torch.Tensor | None = None
    """The [N] influence scores a scoring filter computed this round (logged as a histogram)."""
    ent_coef: float = 0.0
    """The trainer's entropy coefficient: the training loss's entropy bonus enters the scores too."""
    trusted: torch.Tensor | None = None
    """[N] bool, flat order: the records of a trusted source (``PPOConfig.trusted_envs``). Scoring
    filters then judge every record against a return target computed on these records only, so
    that corrupted records are not part of the target they are judged by."""


class Filter(Protocol):
    name: str

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class KeepAll:
    """Standard PPO: keep every record."""

    name = "ppo"

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        return torch.ones(len(buffer), dtype=torch.bool)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def drop_lowest(scores: torch.Tensor, n_drop: int) -> torch.Tensor:
    """Keep mask dropping exactly the ``n_drop`` lowest scores (stable sort: ties by index)."""
    keep = torch.ones(len(scores), dtype=torch.bool)
    keep[torch.sort(scores, stable=True).indices[:n_drop]] = False
    return keep


def guard_minibatch(keep: torch.Tensor, scores: torch.Tensor, context: FilterContext) -> torch.Tensor:
    """Keep at least one full minibatch: if fewer survive, keep the ``batch_size`` best scores."""
    guarded = int(keep.sum()) < context.batch_size
    context.stats["minibatch_guard"] = float(guarded)
    if guarded:
        keep = torch.zeros_like(keep)
        keep[torch.sort(scores, descending=True, stable=True).indices[: context.batch_size]] = True
    return keep


class Seeded:
    """A filter's own random stream (saved with checkpoints so resumed runs stay reproducible)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])


DropMode = Literal["neg-bottom", "bottom", "neg"]


def iif_drop_count(scores: torch.Tensor, drop_pct: float, drop_mode: DropMode) -> int:
    """How many records IIF drops: floor(p * N_neg) (neg-bottom), floor(p * N) (bottom), N_neg (neg)."""
    n_negative = int((scores < 0).sum())
    if drop_mode == "neg-bottom":
        return math.floor(drop_pct / 100 * n_negative)
    if drop_mode == "bottom":
        return math.floor(drop_pct / 100 * len(scores))
    if drop_mode == "neg":
        return n_negative
    raise UserError(f"unknown drop_mode {drop_mode!r} (neg-bottom, bottom or neg)")
