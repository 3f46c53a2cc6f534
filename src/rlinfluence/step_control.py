"""Step control and lookahead probes of filtered PPO rounds (``PPOConfig.step_control``,
IIF's ``drop_pct="auto"``).

Dropping records changes the length of a round's update as well as its direction; these
functions measure that at theta(k) so a round can be scaled back to the unfiltered step:

- ``step_scale``: the round's learning-rate scale under ``step_control`` (``norm`` or ``kl``);
- ``probe``: approx_kl and surrogate gain on some records after one probe epoch on others, run
  on copies of the policy and optimiser (the trainer is untouched);
- ``lookahead``: the held-out gain of a candidate kept set (``FilterContext.lookahead``);
- ``adapt_learning_rate``: RSL-RL's adaptive schedule (``PPOConfig.adaptive_kl``).

They take the trainer as an ``Updating`` (``rlinfluence.ppo.PPO`` is one), so that this module sits
below the trainer and never imports it.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Protocol

import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.losses import MINIBATCH_FIELDS, normalize_advantages
from rlinfluence.seeding import derived_seed

if TYPE_CHECKING:
    from rlinfluence.config import PPOConfig
    from rlinfluence.influence import TracInRecorder
    from rlinfluence.losses import PPOTerms
    from rlinfluence.policies import ActorCritic


class Updating(Protocol):
    """What the probes use of a trainer: its config, policy and optimiser, and its update's minibatch step."""

    config: PPOConfig
    policy: ActorCritic
    optimizer: torch.optim.Optimizer

    @property
    def learning_rate(self) -> float: ...

    def _update_tensors(self, buffer: RolloutBuffer) -> dict[str, torch.Tensor]: ...

    def _minibatch_step(self, policy: ActorCritic, optimizer: torch.optim.Optimizer, fields: list[torch.Tensor],
                        idx: torch.Tensor, round_index: int, epoch: int, tracin: TracInRecorder | None = None
                        ) -> PPOTerms | None: ...


def step_scale(trainer: Updating, buffer: RolloutBuffer, keep: torch.Tensor) -> float:
    """The learning-rate scale of a filtered round under ``step_control`` (1 if every record
    is kept): ``norm_step_scale`` or ``kl_step_scale``."""
    keep = torch.as_tensor(keep, dtype=torch.bool)
    if bool(keep.all()) or trainer.config.step_control == "none":
        return 1.0
    if trainer.config.step_control == "kl":
        return kl_step_scale(trainer, buffer, keep)
    return norm_step_scale(trainer, buffer, keep)

def norm_step_scale(trainer: Updating, buffer: RolloutBuffer, keep: torch.Tensor) -> float:
    """|g(all records)| / |g(kept records)| at theta(k), with g(S) the gradient of the
    policy loss -(1/|S|) sum_{i in S} A_i log pi(a_i|s_i), advantages normalised over S (the
    first step of the round's update on S)."""
    obs, actions, advantages = (buffer.flat(name) for name in ("obs", "actions", "advantages"))
    params = [p for p in trainer.policy.parameters() if p.requires_grad]

    def grad_norm(idx: torch.Tensor) -> float:
        loss = -(normalize_advantages(advantages[idx]) * trainer.policy.log_prob(obs[idx], actions[idx])).mean()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return float(torch.sqrt(sum((g * g).sum() for g in grads if g is not None)))

    kept_norm = grad_norm(keep.nonzero().squeeze(1))
    return grad_norm(torch.arange(len(buffer))) / kept_norm if kept_norm > 0 else 1.0

def kl_step_scale(trainer: Updating, buffer: RolloutBuffer, keep: torch.Tensor) -> float:
    """sqrt(KL_all / KL_kept), KL_S the approx_kl over the whole buffer after one probe epoch
    of the update on the records S (``probe``). For small steps KL is quadratic in the step
    length, so the scaled round's KL is the unfiltered one's; clipped to [1/10, 10]."""
    everything = torch.arange(len(buffer))
    kl_all = probe(trainer, buffer, everything, everything)[0]
    kl_kept = probe(trainer, buffer, keep.nonzero().squeeze(1), everything)[0]
    if not (kl_kept > 0 and math.isfinite(kl_all)):
        return 1.0
    return float(min(max(math.sqrt(kl_all / kl_kept), 0.1), 10.0))

def lookahead(trainer: Updating, buffer: RolloutBuffer, train: torch.Tensor, held_out: torch.Tensor) -> float:
    """The surrogate gain on ``held_out`` of one epoch on ``train`` at this round's step
    control (``FilterContext.lookahead``; ``kl`` is approximated by ``norm`` there, as two
    probes per candidate would cost more than the choice is worth)."""
    keep = torch.zeros(len(buffer), dtype=torch.bool)
    keep[train] = True
    scale = norm_step_scale(trainer, buffer, keep) if trainer.config.step_control != "none" else 1.0
    return probe(trainer, buffer, train, held_out, scale)[1]

def probe(trainer: Updating, buffer: RolloutBuffer, train: torch.Tensor, measured: torch.Tensor,
          lr_scale: float = 1.0) -> tuple[float, float]:
    """(approx_kl, surrogate gain) on the records ``measured`` after one epoch of the round's
    update on the records ``train``, run on copies of the policy and the optimiser (the
    trainer is untouched; minibatches from a generator of their own, seeded by seed and
    round, so probing never shifts the training stream):

        approx_kl = mean_j (r_j - 1) - log r_j,   gain = mean_j A_norm_j (r_j - 1),
        r_j = pi'(a_j|s_j) / pi_theta(k)(a_j|s_j)
    """
    cfg = trainer.config
    policy = copy.deepcopy(trainer.policy)
    optimizer = type(trainer.optimizer)(policy.parameters(), **trainer.optimizer.defaults)
    optimizer.load_state_dict(trainer.optimizer.state_dict())
    for group in optimizer.param_groups:
        group["lr"] = trainer.learning_rate * lr_scale
    tensors = trainer._update_tensors(buffer)
    generator = torch.Generator().manual_seed(derived_seed(cfg.seed, buffer.round, 5))
    order = train[torch.randperm(len(train), generator=generator)]
    for m in range(len(order) // cfg.batch_size):
        idx = order[m * cfg.batch_size : (m + 1) * cfg.batch_size]
        fields = [tensors[k][idx] for k in MINIBATCH_FIELDS]
        if trainer._minibatch_step(policy, optimizer, fields, idx, buffer.round, epoch=0) is None:
            break
    with torch.no_grad():
        obs, actions, old_logp, advantages = (tensors[k][measured] for k in ("obs", "actions", "logp", "advantages"))
        log_ratio = policy.log_prob(obs, actions) - old_logp
        ratio = log_ratio.exp()
        kl = float(((ratio - 1) - log_ratio).mean())
        gain = float((normalize_advantages(advantages) * (ratio - 1)).mean())
    return kl, gain


def adapt_learning_rate(optimizer: torch.optim.Optimizer, approx_kl: float, adaptive_kl: float,
                        learning_rate: float) -> None:
    """RSL-RL's adaptive schedule, before a step: lr / 1.5 when approx_kl > 2 * adaptive_kl,
    lr * 1.5 when 0 < approx_kl < adaptive_kl / 2, within [learning_rate / 100, 10 * learning_rate]."""
    for group in optimizer.param_groups:
        if approx_kl > 2 * adaptive_kl:
            group["lr"] = max(group["lr"] / 1.5, learning_rate / 100)
        elif 0 < approx_kl < adaptive_kl / 2:
            group["lr"] = min(group["lr"] * 1.5, 10 * learning_rate)
