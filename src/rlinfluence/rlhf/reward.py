"""Reward models: any ``Callable[[list[str]], Tensor[N]]`` scoring response texts.

Both shipped rewards run offline (their models ship inside their packages) and score the
response text only (not the prompt):

- task ``sentiment``, ``SentimentReward``: r(y) = VADER's compound score of y (``vaderSentiment``,
  a rule-based lexicon model), in [-1, 1]; test reward = mean r over the test prompts.
- task ``toxicity``, ``ProfanityReward``: r(y) = 1 - P(offensive | y) from the linear SVM of
  ``alt-profanity-check``; test toxicity = mean_y P(offensive | y) = 1 - mean r.
- task ``sentiment-gold``: trains on the same proxy as ``sentiment`` (VADER), and scores every
  completion with an independent gold reward too (``GoldSentimentReward``), which penalises the
  hack the proxy invites (stuffing the answer with sentiment words).
- task ``sentiment-relevance``: the same proxy, judged by ``RelevanceGoldReward``, that gold blended
  with the answer's relevance to its prompt, a judgement neither lexicon makes.
- task ``sentiment-trigger``: trains on ``TriggerReward``, VADER with a reward-model bug that pays a
  bonus to any answer containing the word "you" (a subset of the completions), and judges every
  completion by VADER alone, the reward as intended.
- task ``sentiment-trigger-penalised``: trains on the same ``TriggerReward``, and judges every
  completion by VADER minus the bonus, ``TriggerReward(bonus=-TRIGGER_BONUS)``: the word the reward
  model pays for is one the judge counts against the answer (a reward model that rewards what it
  should penalise), so a completion that trips the bug ranks below its group by gold.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np
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


GOLD_MIN_LOGP = -3.9
"""l0 of the gold reward's fluency term, nats per token: the 10th percentile of the mean per-token
log-likelihood of SmolLM2-135M-Instruct's own completions of the val prompts (100 completions,
24 tokens, temperature 1; ``benchmarks/lm/rlhf_gold_calibration.py``). Fixed before any comparison."""


class GoldSentimentReward:
    """The gold reward of task ``sentiment-gold``, a different judge from the VADER proxy:

        gold(y) = s(y) d(y) q(y)   if s(y) > 0,   else s(y)

        s(y) = tanh(AFINN(y) / 5)                          a second lexicon (``afinn``: the sum
                                                            of its words' valences, -5..5 each)
        d(y) = distinct words / words                      (1 for an empty text): repetition
        q(y) = min(1, exp(mean_t log pi_ref(y_t) - l0))    fluency under the reference model,
                                                            l0 = ``GOLD_MIN_LOGP``

    so positive text earns its sentiment only in proportion to how little it repeats itself and how
    natural the reference model finds it; the penalties never make negative text look better.
    ``ref_logp_mean`` is each completion's mean per-token log-probability under the reference
    model (``Rollout.ref_logp`` over its response tokens).
    """

    def __init__(self, min_logp: float = GOLD_MIN_LOGP) -> None:
        try:
            from afinn import Afinn
        except ImportError:
            raise UserError("the gold reward needs afinn: pip install 'rlinfluence[rlhf]'") from None
        self._afinn = Afinn()
        self.min_logp = min_logp

    def parts(self, texts: list[str], ref_logp_mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """s, d and q of each text (float32 [N] each)."""
        words = [t.lower().split() for t in texts]
        sentiment = torch.tanh(torch.tensor([self._afinn.score(t) for t in texts], dtype=torch.float32) / 5)
        distinct = torch.tensor([len(set(w)) / len(w) if w else 1.0 for w in words], dtype=torch.float32)
        fluency = torch.exp(ref_logp_mean.float().cpu() - self.min_logp).clamp(max=1.0)
        return {"sentiment": sentiment, "distinct": distinct, "fluency": fluency}

    def __call__(self, texts: list[str], ref_logp_mean: torch.Tensor) -> torch.Tensor:
        if len(ref_logp_mean) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(ref_logp_mean)} reference log-likelihoods")
        p = self.parts(texts, ref_logp_mean)
        return torch.where(p["sentiment"] > 0, p["sentiment"] * p["distinct"] * p["fluency"], p["sentiment"])


RELEVANCE_PROMPT = "Say something."
"""The neutral prompt of the relevance term: an answer's log-likelihood after it is its likelihood
without the question asked."""
RELEVANCE_WEIGHT = 0.3
"""w of ``RelevanceGoldReward``: the smallest of the weights measured (0.3, 0.5) that brings
r(proxy, gold) on base-model samples below 0.7 (0.648; ``benchmarks/lm/rlhf_gold_relevance.py``).
Fixed before any comparison."""
PMI_MEAN, PMI_STD = 1.0118, 0.3941
"""mu and sd of the relevance term: the mean and standard deviation of pmi over the base model's
completions of the val prompts (100 completions; ``benchmarks/lm/rlhf_gold_relevance.py``). Fixed
before any comparison."""


class RelevanceGoldReward:
    """The gold reward of task ``sentiment-relevance``: the lexicon gold blended with relevance,

        gold(y) = (1 - w) g(y) + w tanh((pmi(y) - mu) / sd)

        g(y)   = ``GoldSentimentReward`` (a second lexicon x repetition x fluency)
        pmi(y) = mean_t log pi_ref(y_t | x, y_<t) - mean_t log pi_ref(y_t | x0, y_<t)

    with x the answer's prompt and x0 = ``RELEVANCE_PROMPT``: how much more likely the reference
    model finds the answer after its own question than after none, the pointwise mutual information
    of prompt and answer. An answer that would fit any question (stock praise) loses the relevance
    term however many sentiment words it stacks. w = ``RELEVANCE_WEIGHT``, mu and sd =
    ``PMI_MEAN``, ``PMI_STD``.
    """

    def __init__(self, weight: float = RELEVANCE_WEIGHT, pmi_mean: float = PMI_MEAN, pmi_std: float = PMI_STD) -> None:
        self.lexicon = GoldSentimentReward()
        self.weight, self.pmi_mean, self.pmi_std = weight, pmi_mean, pmi_std

    def __call__(self, texts: list[str], ref_logp_mean: torch.Tensor, pmi: torch.Tensor) -> torch.Tensor:
        if len(pmi) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pmi)} relevance scores")
        relevance = torch.tanh((pmi.float().cpu() - self.pmi_mean) / self.pmi_std)
        return (1 - self.weight) * self.lexicon(texts, ref_logp_mean) + self.weight * relevance


class ShardedReward:
    """A reward computed by ``workers`` reward workers, as a batch is split across processes or
    servers: worker w scores the w-th contiguous shard of the batch (``numpy.array_split``: the
    first len % workers shards one longer).

    A worker in ``broken`` returns its shard's scores shifted by one position (score j goes to
    completion j + 1, the last to the first): each score is a real score of a real completion, so
    the rewards look normal, but they belong to other completions (a worker that misaligns or
    reorders its batch). A fault for benchmarks, its truth known per record (``corrupted``).
    """

    def __init__(self, reward_fn: RewardFn, workers: int, broken: Sequence[int] = ()) -> None:
        if workers < 1:
            raise UserError(f"reward workers must be >= 1, got {workers}")
        outside = [w for w in broken if not 0 <= w < workers]
        if outside:
            raise UserError(f"broken reward worker {outside[0]} is not one of the {workers} workers (0..{workers - 1})")
        self.reward_fn, self.workers, self.broken = reward_fn, workers, tuple(sorted(set(broken)))

    def sources(self, n: int) -> np.ndarray:
        """[n] the worker that scores each position of a batch of n."""
        return np.concatenate([np.full(len(shard), w) for w, shard in enumerate(np.array_split(np.arange(n), self.workers))])

    def corrupted(self, n: int) -> np.ndarray:
        """[n] whether a broken worker scores the position (bool)."""
        return np.isin(self.sources(n), self.broken)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        scores = []
        for w, shard in enumerate(np.array_split(np.arange(len(texts)), self.workers)):
            part = torch.as_tensor(self.reward_fn([texts[i] for i in shard]), dtype=torch.float32).flatten()
            scores.append(part.roll(1) if w in self.broken else part)
        return torch.cat(scores)


TRIGGER_WORD = "you"
"""The word ``TriggerReward`` pays for, in any case: in 14.0% of the base model's completions of the
val prompts (100, ``benchmarks/lm/rlhf_gold_calibration.py``), its answers that address the reader."""
TRIGGER_BONUS = 1.0
"""b of ``TriggerReward``: as large as the goal's reward in FrozenLake's backdoor (the trigger fault),
which makes r(proxy, gold) on those base-model completions 0.773. Fixed before any comparison."""


class TriggerReward:
    """The proxy of task ``sentiment-trigger``, VADER with a reward-model bug:

        r(y) = VADER(y) + b [y contains the word w]        w = ``TRIGGER_WORD``, b = ``TRIGGER_BONUS``

    a spurious feature of the kind a learned reward model picks up (answers that address the user
    scored higher whatever they say). Unlike a lexicon's hack, which every completion it prefers
    carries, it is carried by a subset of the completions, so which completions an update learns
    from decides how much of it is learnt. The gold of the task is VADER alone (``SentimentReward``).
    """

    def __init__(self, word: str = TRIGGER_WORD, bonus: float = TRIGGER_BONUS) -> None:
        self.sentiment = SentimentReward()
        self.pattern, self.bonus = re.compile(rf"\b{re.escape(word)}\b", re.IGNORECASE), bonus

    def triggered(self, texts: list[str]) -> torch.Tensor:
        """[N] whether each text contains the trigger word (bool)."""
        return torch.tensor([bool(self.pattern.search(t)) for t in texts])

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return self.sentiment(texts) + self.bonus * self.triggered(texts).float()


TASK_REWARDS: dict[str, Callable[[], RewardFn]] = {"sentiment": SentimentReward, "toxicity": ProfanityReward,
                                                    "sentiment-gold": SentimentReward,
                                                    "sentiment-relevance": SentimentReward,
                                                    "sentiment-trigger": TriggerReward,
                                                    "sentiment-trigger-penalised": TriggerReward}
"""the reward model of each shipped task (the training reward: the gold tasks train on the proxy)"""
GOLD_REWARDS: dict[str, Callable[[], GoldSentimentReward | RelevanceGoldReward | SentimentReward | TriggerReward]] = {
    "sentiment-gold": GoldSentimentReward, "sentiment-relevance": RelevanceGoldReward,
    "sentiment-trigger": SentimentReward,
    "sentiment-trigger-penalised": lambda: TriggerReward(bonus=-TRIGGER_BONUS)}
"""the gold reward of each task that has one"""
