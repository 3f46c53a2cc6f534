"""Reward models: any ``Callable[[list[str]], Tensor[N]]`` scoring response texts.

Both shipped rewards run offline (their models ship inside their packages) and score the
response text only (not the prompt):

- task ``sentiment``, ``SentimentReward``: r(y) = VADER's compound score of y (``vaderSentiment``,
  a rule-based lexicon model), in [-1, 1]; test reward = mean r over the test prompts.
- task ``toxicity``, ``ProfanityReward``: r(y) = 1 - P(offensive | y) from the linear SVM of
  ``alt-profanity-check``; test toxicity = mean_y P(offensive | y) = 1 - mean r.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlinfluence.errors import UserError

RewardFn = Callable[[list[str]], torch.Tensor]


class SentimentReward:
    """r(y) = VADER compound score of y, in [-1, 1]:

        compound = s / sqrt(s^2 + 15),   s = sum of the valences of y's words after VADER's rules
                                         (negation, intensifiers, "but", capitals, punctuation)

    > 0 positive, < 0 negative, 0 for text with no sentiment-bearing word (or empty text).
    """

    def __init__(self) -> None:
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError:
            raise UserError("the sentiment reward needs vaderSentiment: pip install 'rlinfluence[rlhf]'") from None
        self._analyzer = SentimentIntensityAnalyzer()

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([self._analyzer.polarity_scores(t)["compound"] for t in texts], dtype=torch.float32)


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


TASK_REWARDS: dict[str, Callable[[], RewardFn]] = {"sentiment": SentimentReward, "toxicity": ProfanityReward}
"""the reward model of each shipped task"""
