"""A round's records: sampled (prompt, response) sequences with everything PPO/GRPO and the
influence scores need, plus the code that produces them.

    generate  -> input_ids, attention_mask, mask            (pi_theta(k), plain sampling)
    forward   -> logp, ref_logp, values                     (policy, reference = adapters off)
    reward    -> scores                                     (reward model on the response text)
    advantage -> PPO: r_t = -beta kl_t (+ score at the last token), GAE, whitened over the batch
                 GRPO: A_i = group-normalised score on every token
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from rlinfluence.rlhf.core import gae, group_advantages, masked_whiten, token_rewards
from rlinfluence.rlhf.model import PolicyWithValueHead
from rlinfluence.rlhf.reward import RewardFn


@dataclass
class Rollout:
    """N sequences (one record each); per-token tensors are [N, R], zero after each response."""

    prompts: list[str]
    responses: list[str]
    input_ids: torch.Tensor  # [N, P + R]
    attention_mask: torch.Tensor  # [N, P + R]
    mask: torch.Tensor  # [N, R] float, response tokens
    logp: torch.Tensor  # log pi_theta(k)(y_t)
    ref_logp: torch.Tensor  # log pi_ref(y_t)
    values: torch.Tensor  # V_theta(k) before each token (zeros for GRPO)
    scores: torch.Tensor  # [N] reward-model scores
    token_advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N, R] (whitened)
    returns: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N, R] (PPO)
    sequence_advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N]: A_last / A_i
    kl: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N, R] log pi - log pi_ref
    seconds: dict[str, float] = field(default_factory=dict)  # generation, forward, reward

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: torch.Tensor) -> Rollout:
        """The records at ``index`` (tensors indexed, lists picked)."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.numel():
                picked[f.name] = value[index]
            elif isinstance(value, list):
                picked[f.name] = [value[i] for i in index.tolist()]
            else:
                picked[f.name] = value
        return Rollout(**picked)

    @property
    def mean_kl(self) -> float:
        """Mean over sequences of the summed per-token KL estimate."""
        return float(self.kl.sum(1).mean())


def concatenate(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """One rollout of the records of ``rollouts`` in order, each with its advantages as computed
    in its own rollout (so: for group-relative GRPO advantages). Prompts are left-padded and
    responses right-padded to the widest, as ``sample`` pads its chunks; stage seconds add up."""
    if len(rollouts) == 1:
        return rollouts[0]
    r_max = max(r.mask.shape[1] for r in rollouts)
    p_max = max(r.input_ids.shape[1] - r.mask.shape[1] for r in rollouts)

    def widened(r: Rollout, ids: torch.Tensor, value: int) -> torch.Tensor:
        width = r.mask.shape[1]
        prompt, response = ids[:, : ids.shape[1] - width], ids[:, ids.shape[1] - width :]
        return torch.cat([F.pad(prompt, (p_max - prompt.shape[1], 0), value=value),
                          F.pad(response, (0, r_max - width), value=value)], 1)

    merged: dict = {}
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in rollouts]
        if f.name == "input_ids":
            merged[f.name] = torch.cat([widened(r, r.input_ids, pad_token_id) for r in rollouts])
        elif f.name == "attention_mask":
            merged[f.name] = torch.cat([widened(r, r.attention_mask, 0) for r in rollouts])
        elif f.name == "seconds":
            merged[f.name] = {k: sum(v.get(k, 0.0) for v in values) for k in values[0]}
        elif isinstance(values[0], list):
            merged[f.name] = [x for v in values for x in v]
        elif values[0].dim() == 2:  # per token [N, R]: zero after each response
            merged[f.name] = torch.cat([F.pad(v, (0, r_max - v.shape[1])) for v in values])
        else:
            merged[f.name] = torch.cat(values)
    return Rollout(**merged)


@torch.no_grad()
def sample(
    policy: PolicyWithValueHead,
    prompts: list[str],
    reward_fn: RewardFn,
    response_length: int,
    *,
    values: bool = True,
    temperature: float = 1.0,
    records_per_pass: int = 16,
    chat: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> Rollout:
    """Generate responses to ``prompts`` with the policy (``chat``: in its chat template), then
    ``score_sequences`` (no advantages). Stage seconds in ``Rollout.seconds`` are read off
    ``clock`` (wall time by default; ``time.process_time`` for CPU time)."""
    start = clock()
    parts = [policy.generate(prompts[i : i + records_per_pass], response_length, temperature, chat)
             for i in range(0, len(prompts), records_per_pass)]
    width = max(p["input_ids"].shape[1] for p in parts)  # prompts are padded per chunk: left-pad to one width
    pad = policy.tokenizer.pad_token_id
    input_ids = torch.cat([F.pad(p["input_ids"], (width - p["input_ids"].shape[1], 0), value=pad) for p in parts])
    attention_mask = torch.cat([F.pad(p["attention_mask"], (width - p["attention_mask"].shape[1], 0)) for p in parts])
    mask = torch.cat([p["mask"] for p in parts])
    seconds = clock() - start
    rollout = score_sequences(policy, prompts, input_ids, attention_mask, mask, reward_fn,
                              values=values, records_per_pass=records_per_pass, clock=clock)
    rollout.seconds["generation"] = seconds
    return rollout


@torch.no_grad()
def score_sequences(
    policy: PolicyWithValueHead,
    prompts: list[str],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    reward_fn: RewardFn,
    *,
    values: bool = True,
    records_per_pass: int = 16,
    clock: Callable[[], float] = time.perf_counter,
) -> Rollout:
    """Log-probs under the policy and the reference, values (if ``values``) and reward-model scores
    of given sequences (layout as ``PolicyWithValueHead``); no advantages yet. The scores are
    moved to the sequences' device."""
    start = clock()
    r = mask.shape[1]
    logp, ref_logp, value = [], [], []
    for i in range(0, len(prompts), records_per_pass):
        rows = slice(i, i + records_per_pass)
        lp, v = policy(input_ids[rows], attention_mask[rows], r, values=values)
        logp.append(lp)
        ref_logp.append(policy(input_ids[rows], attention_mask[rows], r, values=False, reference=True)[0])
        value.append(v if v is not None else torch.zeros_like(lp))
    middle = clock()
    responses = policy.decode(input_ids, mask)
    scores = torch.as_tensor(reward_fn(responses), dtype=torch.float32).flatten().to(mask.device)
    if scores.shape != (len(prompts),) or not torch.isfinite(scores).all():
        raise ValueError(f"reward function returned {tuple(scores.shape)} values (non-finite?) for {len(prompts)} responses")
    end = clock()
    mask = mask.float()
    return Rollout(
        list(prompts), responses, input_ids, attention_mask, mask,
        torch.cat(logp) * mask, torch.cat(ref_logp) * mask, torch.cat(value) * mask, scores,
        seconds={"forward": middle - start, "reward": end - middle},
    )


def add_advantages(
    rollout: Rollout, algo: str, beta: float, gamma: float = 1.0, lam: float = 0.95, group_size: int = 1
) -> Rollout:
    """Fill the advantage fields in place (module docstring); returns ``rollout``.

    PPO: token rewards with KL coefficient ``beta``, GAE, advantages whitened over the whole
    rollout, ``sequence_advantages`` = the whitened advantage at each last response token.
    GRPO: ``sequence_advantages`` = group-relative scores (groups of ``group_size`` consecutive
    sequences), copied onto every response token; ``kl`` is still recorded.
    """
    mask = rollout.mask
    rewards, rollout.kl = token_rewards(rollout.scores, rollout.logp, rollout.ref_logp, mask, beta)
    if algo == "grpo":
        rollout.sequence_advantages = group_advantages(rollout.scores, group_size)
        rollout.token_advantages = rollout.sequence_advantages[:, None] * mask
        rollout.returns = torch.zeros_like(mask)
    else:
        advantages, rollout.returns = gae(rewards, rollout.values, mask, gamma, lam)
        rollout.token_advantages = masked_whiten(advantages, mask)
        last = mask.sum(1).long() - 1
        rollout.sequence_advantages = rollout.token_advantages[torch.arange(len(rollout), device=mask.device), last]
    return rollout
