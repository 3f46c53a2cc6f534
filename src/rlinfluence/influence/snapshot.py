"""Snapshot influence (docs/method.md, section 4.2; what IIF uses): every record's influence on a target at theta(k).

    score_i = < grad l_i(theta), grad L_f(theta) >,   L_f = -f,   evaluated once at theta = theta(k)

with the record's training loss at ratio 1 (the clipped PPO objective has the same value and
gradient there), summed over records rather than averaged (docs/method.md, section 2.2):

    l_i = -(A_norm_i log pi(a_i|s_i) + c_ent H[pi(.|s_i)])
    =>  score_i = A_norm_i <grad log pi(a_i|s_i), grad f> + c_ent <grad H[pi(.|s_i)], grad f>

Positive = training on record i increases f (helpful), negative = harmful.

With a diagonal preconditioner P (``inverse_preconditioner`` = P^-1, e.g. Adam's, see
``adam_inverse_preconditioner``) the scores rank records by the change the preconditioned step
theta' = theta - lr P^-1 grad l_i would make:

    score_i = < grad l_i, P^-1 grad L_f >

Ghost dot products need no change: for a Linear weight, <delta_i a_i^T, P^-1 G> contracts the
record's factors with the elementwise-scaled target gradient P^-1 G.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from rlinfluence.config import DEFAULT_ADVANTAGE_NORM
from rlinfluence.influence.ghost import (
    attributed_parameters,
    check_policy,
    per_record_dots,
    plan_ghost,
    self_target_dots,
    shared_self_target_dots,
)
from rlinfluence.influence.state import unchanged
from rlinfluence.influence.targets import (
    LogProbTarget,
    Records,
    ReturnTarget,
    Target,
    ZeroTargetGradient,
    check_positive_int,
    parameter_device,
    require_nonzero,
    target_gradient,
)
from rlinfluence.losses import normalize_advantages

ADVANTAGE_NORMS = ("chunk", "batch", "none")
# DEFAULT_ADVANTAGE_NORM, the one every entry point scores with by default (IIF's
# PPOConfig.advantage_norm: within chunks of batch_size records of a random permutation of the
# buffer, ``chunk_permutation``, like the first epoch's minibatches), lives with the config


def chunk_permutation(n: int, seed: int = 0) -> torch.Tensor:
    """The record order whose consecutive chunks ``"chunk"`` normalises over, when scoring a
    buffer outside training (``score_buffer``): a random permutation of ``range(n)`` drawn from a
    generator seeded with ``seed``. IIF draws its own from its filter's generator each round; a
    fresh IIF filter with seed s draws this one first."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def normalize_for_attribution(advantages: torch.Tensor, mode: str, chunk_size: int) -> torch.Tensor:
    """The training side's A_norm (unbiased std + 1e-8, as ``rlinfluence.losses.normalize_advantages``).

    - ``"chunk"``: normalised within consecutive chunks of ``chunk_size`` records in the given
      order (the authors' grouping; the last chunk may be shorter, a 1-record chunk is unchanged);
    - ``"batch"``: normalised over all records;
    - ``"none"``: raw advantages.
    """
    if mode not in ADVANTAGE_NORMS:
        raise ValueError(f"advantage_norm must be one of {ADVANTAGE_NORMS}, got {mode!r}")
    check_positive_int("chunk_size", chunk_size)
    if mode == "chunk":
        k = len(advantages) // chunk_size * chunk_size
        full = [normalize_advantages(advantages[:k].view(-1, chunk_size), dim=1).flatten()] if k else []
        return torch.cat([*full, normalize_advantages(advantages[k:])])
    return normalize_advantages(advantages) if mode == "batch" else advantages


def _log_prob(policy: nn.Module, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return policy.log_prob(obs, actions)


def _entropy(policy: nn.Module, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return policy.evaluate_actions(obs, actions)[1]


def _weights_on_scored_pairs(target: Target, records: Records) -> torch.Tensor | None:
    """The target's weights w if f = sum_i w_i log pi(a_i|s_i) over the scored pairs themselves."""
    if not isinstance(target, LogProbTarget):
        return None
    obs, actions, weights = target.weighted_pairs(records)
    return weights if obs is records.obs and actions is records.actions else None


def snapshot_influence(
    policy: nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    advantages: torch.Tensor,
    *,
    target: Target | None = None,
    advantage_norm: str = DEFAULT_ADVANTAGE_NORM,
    chunk_size: int = 64,
    ent_coef: float = 0.0,
    params: Sequence[nn.Parameter] | None = None,
    records_per_pass: int = 4096,
    accumulate_dtype: torch.dtype | None = None,
    inverse_preconditioner: Mapping[nn.Parameter, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Snapshot influence of each record on ``target`` (default ``ReturnTarget()``), shape ``[N]``.

        score_i = A_norm_i <grad log pi(a_i|s_i), grad f> + ent_coef <grad H[pi(.|s_i)], grad f>

    at the policy's current parameters, gradients w.r.t. the attributed parameters ``params``
    (default: ``policy.policy_parameters()`` if defined, else every trainable parameter that
    ``log_prob`` reaches). ``advantages`` are raw; A_norm follows ``advantage_norm``
    (see ``normalize_for_attribution``): ``"chunk"`` normalises consecutive chunks of
    ``chunk_size`` records in the order given, so pass the records in a random order, as IIF does
    (``score_buffer`` does it for a buffer: ``chunk_permutation``). ``ent_coef != 0`` needs ``policy.evaluate_actions``
    returning (log-prob, entropy, value).

    Cost: for a log-prob target on the scored pairs themselves (``ReturnTarget()``) with
    ``ent_coef == 0`` and all records in one pass -- IIF's case -- one forward and one backward
    serve both sides (``self_target_dots``); otherwise one forward+backward for grad f, then per
    ``records_per_pass`` records one forward+backward with ghost contractions. Plus one
    forward-mode pass when parameters outside Linear/Conv2d are attributed. Ghost terms are
    verified against autograd once per policy structure (``rlinfluence.influence.ghost``).
    ``accumulate_dtype`` (e.g. ``torch.float64``) sets the dtype of contractions and scores.
    ``inverse_preconditioner`` maps attributed parameters to P^-1 (their shape); a parameter it
    does not name is not preconditioned (P = I).

    Scores are taken in eval mode and the policy is left exactly as it was
    (``rlinfluence.influence.state.unchanged``). Raises ``ZeroTargetGradient`` (a ``UserError``)
    when grad f is exactly zero, e.g. every advantage is 0: then every score would be 0 and there
    is nothing to attribute; keep every record of such a round (the IIF filters do).
    """
    check_policy(policy)
    check_positive_int("records_per_pass", records_per_pass)
    given_on, device = obs.device, parameter_device(policy)  # scores come back where the records came from
    obs, actions, advantages = obs.to(device), actions.to(device), advantages.to(device)
    records = Records(obs, actions, advantages)
    weights = normalize_for_attribution(advantages, advantage_norm, chunk_size)
    if ent_coef != 0 and not callable(getattr(policy, "evaluate_actions", None)):
        raise ValueError(f"ent_coef={ent_coef} needs policy.evaluate_actions(obs, actions) -> (logp, entropy, value)")
    target = target or ReturnTarget()
    with unchanged(policy):
        attributed = attributed_parameters(policy, params, obs[:3], actions[:3])
        plan = plan_ghost(policy, attributed)
        target_weights = _weights_on_scored_pairs(target, records)
        if (ent_coef == 0 and target_weights is not None and len(records) <= records_per_pass
                and not inverse_preconditioner):
            dots, direction = self_target_dots(policy, plan, _log_prob, (obs, actions), target_weights, accumulate_dtype)
            require_nonzero(target, direction)
            return (dots * weights.to(dots.dtype)).to(given_on)
        direction = target_gradient(target, policy, attributed, records, records_per_pass)
        if inverse_preconditioner:
            direction = [g * inverse_preconditioner[p] if p in inverse_preconditioner else g
                         for p, g in zip(attributed, direction, strict=True)]
        scores = per_record_dots(policy, plan, _log_prob, (obs, actions), direction, records_per_pass, accumulate_dtype)
        scores *= weights.to(scores.dtype)
        if ent_coef != 0:
            entropy = per_record_dots(policy, plan, _entropy, (obs, actions), direction, records_per_pass, accumulate_dtype)
            scores += ent_coef * entropy
    return scores.to(given_on)


def gradient_alignment(policy: nn.Module, obs: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor
                       ) -> torch.Tensor:
    """g_i . (1/N) sum_j g_j per record, g_i = A_i grad log pi(a_i|s_i) with A normalised over the
    records: each record's policy gradient against the batch's mean one, no target needed (the
    alignment rule of "Not All Rollouts Are Worth Learning", DTV). Ghost dot products, as
    ``snapshot_influence`` with a return target whose advantages are the normalised ones."""
    normalised = normalize_for_attribution(advantages, "batch", len(advantages))
    return snapshot_influence(policy, obs, actions, advantages, advantage_norm="batch",
                              target=ReturnTarget(obs, actions, normalised))


def _unless_zero_gradient(call: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    try:
        return call()
    except ZeroTargetGradient:
        return None


def return_and_alignment_scores(policy: nn.Module, obs: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor,
                                chunk_size: int = 64, records_per_pass: int = 4096) -> dict[str, torch.Tensor | None]:
    """Three scores of the records in the order given, from one forward and one backward (all three
    contract the same per-record gradients g_i = grad log pi(a_i|s_i)):

        "batch"      A_batch_i <g_i, (1/N) sum_j A_j g_j>       snapshot_influence(advantage_norm="batch")
        "chunk"      A_chunk_i <g_i, (1/N) sum_j A_j g_j>       snapshot_influence(advantage_norm="chunk")
        "alignment"  A_batch_i <g_i, (1/N) sum_j A_batch_j g_j>  gradient_alignment

    (return target on the scored records, raw A in it; A_chunk normalised in consecutive chunks of
    ``chunk_size``). Each equals its own call on the same records in the same order. None where that
    target's gradient is exactly zero (where the single call raises ``ZeroTargetGradient``). More
    records than ``records_per_pass`` take the three calls (their passes bound the memory)."""
    check_policy(policy)
    if len(obs) > records_per_pass:
        calls = {"batch": lambda: snapshot_influence(policy, obs, actions, advantages, advantage_norm="batch",
                                                     records_per_pass=records_per_pass),
                 "chunk": lambda: snapshot_influence(policy, obs, actions, advantages, advantage_norm="chunk",
                                                     chunk_size=chunk_size, records_per_pass=records_per_pass),
                 "alignment": lambda: gradient_alignment(policy, obs, actions, advantages)}
        return {name: _unless_zero_gradient(call) for name, call in calls.items()}
    given_on, device = obs.device, parameter_device(policy)
    obs, actions, advantages = obs.to(device), actions.to(device), advantages.to(device)
    batch = normalize_for_attribution(advantages, "batch", len(advantages))
    chunk = normalize_for_attribution(advantages, "chunk", chunk_size)
    with unchanged(policy):
        plan = plan_ghost(policy, attributed_parameters(policy, None, obs[:3], actions[:3]))
        (on_return, on_alignment), directions = shared_self_target_dots(
            policy, plan, _log_prob, (obs, actions), [advantages / len(advantages), batch / len(batch)])
    has_gradient = [any(g.any() for g in direction) for direction in directions]
    scores = {"batch": (on_return, batch, has_gradient[0]), "chunk": (on_return, chunk, has_gradient[0]),
              "alignment": (on_alignment, batch, has_gradient[1])}
    return {name: (dots * weights.to(dots.dtype)).to(given_on) if nonzero else None
            for name, (dots, weights, nonzero) in scores.items()}


def adam_inverse_preconditioner(optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, torch.Tensor]:
    """P^-1 of the step ``torch.optim.Adam`` takes next, per parameter, with its moments frozen:

        P^-1 = 1 / (sqrt(v / (1 - beta2^t)) + eps)

    (v the second-moment estimate after t steps, bias-corrected; eps Adam's). Parameters Adam has
    not stepped yet have no v and are left out (P = I): with v = 0 Adam's first step is the sign
    of the gradient, which no fixed diagonal P describes.
    """
    if not isinstance(optimizer, torch.optim.Adam):
        raise ValueError(f"the Adam preconditioner needs torch.optim.Adam, got {type(optimizer).__name__}")
    inverse: dict[nn.Parameter, torch.Tensor] = {}
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "exp_avg_sq" not in state or float(state["step"]) == 0:
                continue
            v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
            v_hat = v / (1 - beta2 ** float(state["step"]))
            inverse[param] = 1.0 / (v_hat.sqrt() + eps)
    return inverse
