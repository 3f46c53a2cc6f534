"""Record filters: what the trainer calls between "compute advantages" and "optimise".

A filter is any callable ``filter(buffer, context) -> keep`` returning a boolean mask of shape
``[len(buffer)]`` in the buffer's flat (env-major) order; the update then trains only on kept
records. Filters own their random state; they may report per-round statistics by writing
numbers into ``context.stats`` (logged to metrics.csv and TensorBoard under ``filter/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlinfluence.buffer import RolloutBuffer


@dataclass
class FilterContext:
    """What a filter may look at besides the buffer."""

    policy: torch.nn.Module
    """The policy theta(k) that collected the buffer (not yet updated)."""
    round: int
    batch_size: int
    stats: dict[str, float] = field(default_factory=dict)


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
