"""Reward models: any ``Callable[[list[str]], Tensor[N]]`` scoring response texts.

The toxicity task's reward is ``ProfanityReward``: r(y) = 1 - P(offensive | y) from the linear
SVM of ``alt-profanity-check`` (its model ships inside the package, so it runs offline), applied
to the response text only (not the prompt). Test toxicity is mean_y P(offensive | y) = 1 - mean r.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlinfluence.errors import UserError

RewardFn = Callable[[list[str]], torch.Tensor]


class ProfanityReward:
    """r(y) = 1 - P(offensive | y) (``profanity_check.predict_prob``), in [0, 1]."""

    def __init__(self) -> None:
        try:
            from profanity_check import predict_prob
        except ImportError:
            raise UserError("the toxicity reward needs alt-profanity-check: pip install 'rlinfluence[rlhf]'") from None
        self._predict_prob = predict_prob

    def offensive_probability(self, texts: list[str]) -> torch.Tensor:
        """P(offensive | y) of each text, float32 [N]."""
        return torch.as_tensor(self._predict_prob(list(texts)), dtype=torch.float32)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return 1.0 - self.offensive_probability(texts)
