"""Full local TracIn (docs/method.md, section 4.1): each record's influence through every optimiser step of a round.

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

How it is computed (``TracInRecorder``, which the trainer can also run inside its own update,
``PPOConfig.tracin``): each step's own forward and backward (the trainer's minibatch loss) runs
with the ghost engine's capture on, so the layer inputs X and output gradients G it leaves behind
are the records' terms (``ghost.captured_pairs``: G of the mean loss times -b is d(sum_i u_i)/dY)
and no second pass over the minibatch is needed; before the step is taken, grad f(theta_j) (one
forward and backward of the target) and the ghost contractions give the step's d_{j,i}, plus the
forward-mode part for parameters outside Linear/Conv2d layers (``log_std``, LayerNorm).
(Batching the target's gradient over steps with ``vmap(grad)`` was measured slower on CPU,
docs/benchmarks.md.) Where capture cannot apply exactly -- BatchNorm or dropout in training mode
(steps take their gradients in training mode, scores in eval mode), a layer whose ghost terms
fail verification -- each step gets a separate ghost pass over its minibatch, with the same result.

Other optimisers (``optimizer=``, e.g. Adam with its moments at theta(k)): the iterates theta_j
are replayed with that optimiser, so they are the trainer's own, but each step's term keeps the
SGD form above (the paper's definition, lr-weighted as in TracIn). That is an approximation: an
Adam step is not eta_j times the minibatch gradient, so the identity above does not hold.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from rlinfluence.buffer import MinibatchStep
from rlinfluence.influence.ghost import (
    _Call,
    _ghost_dots,
    _jvp_dots,
    attributed_parameters,
    captured_pairs,
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
    ZeroTargetGradient,
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


@functools.cache
def _gain_of(loss_kwargs: tuple[tuple[str, Any], ...]) -> Any:
    """u = -ell with these PPO settings, one function object per settings: the ghost engine keeps
    its verification verdicts per record function, so every round of a run shares them."""
    return partial(_ppo_gain, loss_kwargs=dict(loss_kwargs))


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


def clip_coefficient(total_norm: float, max_grad_norm: float | None) -> float:
    """c = min(1, max_grad_norm / (total_norm + 1e-6)), the factor ``clip_grad_norm_`` scaled the
    gradients by (1 without clipping)."""
    return 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (float(total_norm) + 1e-6))


def _clip_factor(optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> float:
    """Clip the gradients in place like the trainer and return ``clip_coefficient``."""
    if max_grad_norm is None:
        return 1.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return clip_coefficient(torch.nn.utils.clip_grad_norm_(params, max_grad_norm), max_grad_norm)


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
    optimiser steps run in the policy's own training mode; gradients of f are taken in eval
    mode, ``rlinfluence.influence.state.unchanged``).
    Records are flat buffer fields (``RolloutBuffer.flat``); ``advantages`` raw; ``schedule`` the
    round's optimiser steps in order. The PPO settings must be the trainer's.

    ``optimizer``: ``None`` replays plain SGD (theta -= eta_j * grad of the full minibatch loss,
    including value/entropy terms, over every trainable parameter); otherwise an optimiser over
    ``policy``'s parameters whose state is the one at theta(k) (e.g. from
    ``copy.deepcopy((policy, optimizer))`` taken before the round), copied and stepped with each
    step's lr. ``max_grad_norm`` clips (over the optimiser's parameters) as the trainer does.
    ``target`` defaults to ``ReturnTarget()``; ``params``, ``records_per_pass`` and
    ``accumulate_dtype`` as in ``TracInRecorder``.

    Cost per step: the step itself (replayed: one forward and backward of the minibatch) and one
    forward and backward of the target; the trainer skips the replay by recording while it trains
    (``PPOConfig.tracin``).
    """
    check_policy(policy)
    records = Records(obs, actions, advantages)
    n = len(records)
    for name, values in (("old_logp", old_logp), ("returns", returns), ("old_values", old_values)):
        check_per_record(name, values, n)
    _check_schedule(schedule, n)
    if not callable(getattr(policy, "evaluate_actions", None)):
        raise ValueError("tracin_influence needs policy.evaluate_actions(obs, actions) -> (logp, entropy, value) for ppo_loss")
    loss_kwargs = {"clip_range": clip_range, "clip_range_vf": clip_range_vf, "vf_coef": vf_coef, "ent_coef": ent_coef}
    with unchanged(policy):
        names = parameter_names(policy, attributed_parameters(policy, params, obs[:3], actions[:3]))
    replica = copy.deepcopy(policy)
    replica_params = dict(replica.named_parameters())
    replay = _replay_optimizer(policy, replica, optimizer)
    recorder = TracInRecorder(replica, records, target=target, params=[replica_params[name] for name in names],
                              loss_kwargs=loss_kwargs, records_per_pass=records_per_pass,
                              accumulate_dtype=accumulate_dtype)
    fields = (obs, actions, old_logp, advantages, returns, old_values)
    for step in schedule:
        idx = step.indices.long()
        obs_b, actions_b, old_logp_b, adv_b, returns_b, old_values_b = (x[idx] for x in fields)
        if normalize_advantage:
            adv_b = normalize_advantages(adv_b)
        batch = (obs_b, actions_b, old_logp_b, adv_b, returns_b, old_values_b)
        replay.zero_grad()
        with recorder.capture(batch):
            ppo_loss(replica, *batch, normalize_advantage=False, **loss_kwargs).loss.backward()
        recorder.record(idx, step.lr * _clip_factor(replay, max_grad_norm))
        for group in replay.param_groups:
            group["lr"] = step.lr
        replay.step()
    if recorder.zero_target_steps == len(schedule):
        # as the snapshot scorer: a target without gradient carries no attribution signal
        target_gradient(recorder.target, replica, recorder.params, records, records_per_pass)
    return recorder.scores()


def _mode_dependent(policy: nn.Module) -> bool:
    """Whether a module in training mode computes differently in eval mode (BatchNorm, dropout)."""
    kinds = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    return any(isinstance(m, kinds) and m.training for m in policy.modules())


class TracInRecorder:
    """Full local TracIn of one round, recorded from the optimiser steps as they are taken.

    For each step of the round, in order::

        optimizer.zero_grad()
        with recorder.capture(batch):           # the minibatch's fields, advantages normalised
            ppo_loss(policy, *batch, normalize_advantage=False, **loss_kwargs).loss.backward()
        recorder.record(indices, lr * clip)     # after clipping, before optimizer.step()
        optimizer.step()

    then ``recorder.scores()`` is I of the module docstring, ``[N]``. ``policy`` is the module
    being trained (the trainer's own, or ``tracin_influence``'s replica); ``records`` the round's
    records with raw advantages; ``loss_kwargs`` the trainer's ``ppo_loss`` settings (clip_range,
    clip_range_vf, vf_coef, ent_coef). ``target`` defaults to ``ReturnTarget()``; ``params`` to
    the policy's attributed parameters (``ghost.attributed_parameters``); ``records_per_pass`` and
    ``accumulate_dtype`` as in ``snapshot_influence``. ``seconds`` is the wall time spent
    recording and scoring, what recording adds to a round. A step at which grad f is exactly 0
    (e.g. every advantage 0) adds nothing and is counted in ``zero_target_steps``.
    """

    def __init__(
        self,
        policy: nn.Module,
        records: Records,
        *,
        loss_kwargs: dict[str, Any],
        target: Target | None = None,
        params: Sequence[nn.Parameter] | None = None,
        records_per_pass: int = 4096,
        accumulate_dtype: torch.dtype | None = None,
    ) -> None:
        check_policy(policy)
        check_positive_int("records_per_pass", records_per_pass)
        self.policy, self.records, self.target = policy, records, target or ReturnTarget()
        self.records_per_pass = records_per_pass
        self.record_fn = _gain_of(tuple(sorted(loss_kwargs.items())))
        with unchanged(policy):
            self.params = attributed_parameters(policy, params, records.obs[:3], records.actions[:3])
        self.plan = plan_ghost(policy, self.params)
        self.capturing = not _mode_dependent(policy)
        self.influence = torch.zeros(len(records), dtype=accumulate_dtype or self.params[0].dtype,
                                     device=self.params[0].device)
        self.seconds = 0.0
        self.zero_target_steps = 0  # steps where grad f was exactly 0 (they add nothing)
        self._calls: list[_Call] = []
        self._batch: tuple[torch.Tensor, ...] | None = None
        self._pairs: list | None = None

    @contextmanager
    def capture(self, batch: Sequence[torch.Tensor]) -> Iterator[None]:
        """Around one step's forward and backward on ``batch``: keeps the ghosted layers' inputs and
        output gradients, then verifies them against the parameters' gradients."""
        start = time.perf_counter()
        self._batch, self._calls, self._pairs = tuple(batch), [], None
        layers = self.plan.layers if self.capturing else []
        handles = [layer.module.register_forward_hook(partial(self._keep, layer)) for layer in layers]
        self.seconds += time.perf_counter() - start
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        start = time.perf_counter()
        if any(c.out.grad is not None for c in self._calls):
            b = len(self._batch[0])
            pairs, failed = captured_pairs(self.policy, self.plan, self.record_fn, self._calls, b, -float(b))
            if failed:  # e.g. a tied weight: this and every later step get their own ghost pass
                self.capturing = False
            else:
                self._pairs = pairs
        self._calls = []
        self.seconds += time.perf_counter() - start

    def _keep(self, layer: Any, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self._calls.append(_Call(layer, args[0] if args else None, out))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.retain_grad()

    def record(self, indices: torch.Tensor, step_size: float) -> None:
        """The step just captured is taken with ``step_size`` = eta_j c_j on the records ``indices``
        of ``records``: adds its terms; call it before the optimiser's step (at theta_j)."""
        start = time.perf_counter()
        if self._batch is None:
            raise RuntimeError("TracInRecorder.record needs the step's forward and backward inside capture() first")
        try:
            direction = target_gradient(self.target, self.policy, self.params, self.records, self.records_per_pass)
        except ZeroTargetGradient:  # grad f = 0 at theta_j: every term of the step is exactly 0
            self.zero_target_steps += 1
            self._batch, self._pairs = None, None
            self.seconds += time.perf_counter() - start
            return
        dtype = self.influence.dtype
        if self._pairs is None:
            dots = per_record_dots(self.policy, self.plan, self.record_fn, self._batch, direction,
                                   self.records_per_pass, dtype)
        else:
            dots = _ghost_dots(self._pairs, set(), direction, len(indices), dtype)
            if self.plan.jvp_slots:
                with unchanged(self.policy):
                    dots += _jvp_dots(self.plan, self.plan.jvp_slots, self.policy, self.record_fn, self._batch,
                                      direction).to(dtype)
        self.influence.index_add_(0, indices.long(), dots.to(dtype) * (step_size / len(indices)))
        self._batch, self._pairs = None, None
        self.seconds += time.perf_counter() - start

    def scores(self) -> torch.Tensor:
        """I_i of every record, ``[N]``, over the steps recorded so far."""
        return self.influence
