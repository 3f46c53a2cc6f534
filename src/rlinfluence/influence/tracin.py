"""Full local TracIn (spec 4.1): each record's influence through every optimiser step of a round.

    I_i = sum_{j : i in B_j}  eta_j c_j < grad f(theta_j), -grad ell_{j,i}(theta_j) / b_j >

- theta_j: the round's iterates, replayed from theta(k) on a deep copy of the policy with the
  recorded schedule (``rlinfluence.buffer.MinibatchStep``: minibatch indices B_j, lr eta_j);
- ell_{j,i}: record i's term of minibatch j's actual PPO loss, ``ppo_loss(..., reduction="none")``
  (clipped surrogate with the ratio against the stored old log-prob and the advantage normalised
  within the minibatch, + vf_coef value loss - ent_coef entropy); /b_j makes it the record's share
  of the minibatch mean;
- c_j = min(1, max_grad_norm / (||grad L_j|| + 1e-6)), the gradient-clipping factor (1 without
  clipping), treated as a constant.

With plain SGD, theta_{j+1} - theta_j = -eta_j c_j sum_{i in B_j} grad ell_{j,i} / b_j, hence the
first-order identity f(theta(k+1)) - f(theta(k)) = sum_i I_i + O(eta^2).

Other optimisers (``optimizer=``, e.g. Adam with its moments at theta(k)): the iterates theta_j
are replayed with that optimiser, so they are the trainer's own, but each step's term keeps the
SGD form above (the paper's definition, lr-weighted as in TracIn). That is an approximation: an
Adam step is not eta_j times the minibatch gradient, so the identity above does not hold.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from rlinfluence.buffer import MinibatchStep
from rlinfluence.influence.ghost import (
    attributed_parameters,
    check_policy,
    parameter_names,
    per_record_dots,
    plan_ghost,
)
from rlinfluence.influence.state import unchanged
from rlinfluence.influence.targets import (
    Records,
    ReturnTarget,
    Target,
    check_per_record,
    check_positive_int,
    target_gradient,
)
from rlinfluence.losses import normalize_advantages, ppo_loss


def _ppo_gain(
    policy: nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    *,
    loss_kwargs: dict[str, Any],
) -> torch.Tensor:
    """u_i = -ell_i: minus record i's term of the minibatch PPO loss (advantages already normalised)."""
    return -ppo_loss(
        policy, obs, actions, old_logp, advantages, returns, old_values,
        normalize_advantage=False, reduction="none", **loss_kwargs,
    ).loss


def _check_schedule(schedule: Sequence[MinibatchStep], n: int) -> None:
    if len(schedule) == 0:
        raise ValueError("schedule is empty: no optimiser steps to replay")
    for j, step in enumerate(schedule):
        idx = step.indices
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or len(idx) == 0 or idx.is_floating_point():
            raise ValueError(f"schedule[{j}].indices must be a non-empty 1-d integer tensor, got {idx!r}")
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise ValueError(f"schedule[{j}].indices contains {bad}, outside the buffer's [0, {n})")
        if not math.isfinite(step.lr) or step.lr < 0:
            raise ValueError(f"schedule[{j}].lr = {step.lr} must be finite and >= 0")


def _replay_optimizer(
    policy: nn.Module, replica: nn.Module, optimizer: torch.optim.Optimizer | None
) -> torch.optim.Optimizer:
    """The optimiser for the replica: plain SGD on every trainable parameter, or a copy of ``optimizer``."""
    if optimizer is None:
        return torch.optim.SGD([p for p in replica.parameters() if p.requires_grad], lr=0.0)
    names = {id(p): name for name, p in policy.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer holds parameters that are not the policy's: deep-copy them together, copy.deepcopy((policy, optimizer))")
    replica_params = dict(replica.named_parameters())
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [replica_params[names[id(p)]] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    replay = type(optimizer)(groups)
    replay.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return replay


def _clip_factor(optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> float:
    """Clip the gradients in place like the trainer and return c = min(1, max / (norm + 1e-6))."""
    if max_grad_norm is None:
        return 1.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    total = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    return min(1.0, max_grad_norm / (total + 1e-6))


def tracin_influence(
    policy: nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    schedule: Sequence[MinibatchStep],
    *,
    target: Target | None = None,
    clip_range: float = 0.2,
    clip_range_vf: float | None = None,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    normalize_advantage: bool = True,
    max_grad_norm: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    params: Sequence[nn.Parameter] | None = None,
    records_per_pass: int = 4096,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Full local TracIn I_i of every buffer record for one round, shape ``[N]`` (module docstring).

    ``policy`` is at theta(k) and is not modified (the round is replayed on a deep copy, whose
    optimiser steps run in the policy's own training mode; gradients of f and the per-record dots
    are taken in eval mode, ``rlinfluence.influence.state.unchanged``).
    Records are flat buffer fields (``RolloutBuffer.flat``); ``advantages`` raw; ``schedule`` the
    round's optimiser steps in order. The PPO settings must be the trainer's.

    ``optimizer``: ``None`` replays plain SGD (theta -= eta_j * grad of the full minibatch loss,
    including value/entropy terms, over every trainable parameter); otherwise an optimiser over
    ``policy``'s parameters whose state is the one at theta(k) (e.g. from
    ``copy.deepcopy((policy, optimizer))`` taken before the round), copied and stepped with each
    step's lr. ``max_grad_norm`` clips (over the optimiser's parameters) as the trainer does.
    ``target`` defaults to ``ReturnTarget()``; ``params``, ``records_per_pass`` and
    ``accumulate_dtype`` as in ``snapshot_influence``.

    Cost per step: one target gradient over the target's records, one forward+backward for the
    step, one ghost pass over the minibatch.
    """
    check_policy(policy)
    check_positive_int("records_per_pass", records_per_pass)
    records = Records(obs, actions, advantages)
    n = len(records)
    for name, values in (("old_logp", old_logp), ("returns", returns), ("old_values", old_values)):
        check_per_record(name, values, n)
    _check_schedule(schedule, n)
    if not callable(getattr(policy, "evaluate_actions", None)):
        raise ValueError("tracin_influence needs policy.evaluate_actions(obs, actions) -> (logp, entropy, value) for ppo_loss")
    loss_kwargs = {"clip_range": clip_range, "clip_range_vf": clip_range_vf, "vf_coef": vf_coef, "ent_coef": ent_coef}
    record_fn = partial(_ppo_gain, loss_kwargs=loss_kwargs)
    target = target or ReturnTarget()

    with unchanged(policy):
        names = parameter_names(policy, attributed_parameters(policy, params, obs[:3], actions[:3]))
    replica = copy.deepcopy(policy)
    replica_params = dict(replica.named_parameters())
    attributed = [replica_params[name] for name in names]
    replay = _replay_optimizer(policy, replica, optimizer)
    plan = plan_ghost(replica, attributed)

    influence = torch.zeros(n, dtype=accumulate_dtype or attributed[0].dtype, device=attributed[0].device)
    for step in schedule:
        idx = step.indices.long()
        adv = normalize_advantages(advantages[idx]) if normalize_advantage else advantages[idx]
        batch = (obs[idx], actions[idx], old_logp[idx], adv, returns[idx], old_values[idx])
        direction = target_gradient(target, replica, attributed, records, records_per_pass)
        replay.zero_grad()
        ppo_loss(replica, *batch, normalize_advantage=False, **loss_kwargs).loss.backward()
        clip = _clip_factor(replay, max_grad_norm)
        dots = per_record_dots(replica, plan, record_fn, batch, direction, records_per_pass, accumulate_dtype)
        influence.index_add_(0, idx, dots.to(influence.dtype) * (step.lr * clip / len(idx)))
        for group in replay.param_groups:
            group["lr"] = step.lr
        replay.step()
    return influence
