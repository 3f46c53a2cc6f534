"""Sequence-level influence for RLHF (docs/method.md, sections 3.3, 4.5): one record = one (prompt, response).

    score_i = < grad u_i(theta), grad f(theta) >      at theta = theta(k), over the LoRA A and B
                                                      matrices only (value head excluded)

Training side, u_i = -l_i, record i's own PPO loss at ratio 1 (as a minibatch of one sequence,
the paper's mini_batch_size 1), T_i = its number of response tokens:

    PPO:   u_i = (1/T_i) sum_t A_it log pi(y_it)  -  [value_loss] c_vf (1/T_i) sum_t 1/2 (V_it - R_it)^2
    GRPO:  u_i = (1/T_i) sum_t [ A_i log pi(y_it) - beta k3_it ]

(A whitened as in training; the value term reaches the LoRA weights through the shared backbone;
the authors' code included it, ``value_loss`` makes that a choice.)

Targets f:

- ``"seq"`` (f_seq, docs/method.md, section 3.3): (1/m) sum_j A_last_j sum_t log pi(y_jt | x_j) over m validation
  sequences sampled from pi_theta(k), A_last_j the whitened advantage at its last response token
  (GRPO: the sequence's group advantage). ``heldout_sequence_influence`` takes them from the
  round's own rollout (no extra generation): the prompt groups are split into two halves and
  each half is scored against f_seq of the other half, so no sequence is in its own target;
  ``sequence_influence(validation=...)`` takes a separate validation rollout (fixed prompts,
  freshly sampled: one extra rollout per round);
- ``"return"`` (the token-level f_return, the code's ``rough-orig``): (1/sum_i T_i)
  sum_{i,t} A_it log pi(y_it) over the training rollout itself;
- ``"mean"`` (DTV, "Not All Rollouts Are Worth Learning"): (1/n) sum_i (1/T_i) sum_t A_it
  log pi(y_it) over the training rollout itself, so score_i = g_i . mean_j g_j with g_j the
  gradient of sequence j's own policy-gradient objective: no target beyond the batch.

Positive = training on the sequence moves theta towards a higher f (helpful), negative = harmful.

Every term is a sum over the sequence's non-padded tokens, so the ghost engine
(``rlinfluence.influence.per_record_dots``) applies unchanged: forward hooks on each
``lora_A`` / ``lora_B`` (``nn.Linear``) capture x_t and one backward gives g_t; per record

    <grad_W u_i, P_W> = sum_t g_t^T P_W x_t

with P_W the layer's part of grad f, so no per-record gradient tensor is ever formed. Padded
positions have zero output-gradient (the loss ignores them and nothing attends to them); prompt
positions do not (later tokens attend to them) and are included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from rlinfluence.influence import ZeroTargetGradient, per_record_dots, plan_ghost, unchanged
from rlinfluence.rlhf.core import masked_mean
from rlinfluence.rlhf.rollout import Rollout

Target = Literal["seq", "return", "mean"]


def record_objective(
    policy: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    algo: str,
    value_loss: bool,
    vf_coef: float,
    beta: float,
) -> torch.Tensor:
    """u_i(theta) of every record, shape [N] (see the module docstring)."""
    logp, values = policy(input_ids, attention_mask, mask.shape[1], values=algo == "ppo" and value_loss)
    if algo == "grpo":
        diff = ref_logp - logp
        k3 = torch.exp(diff) - diff - 1
        return masked_mean(advantages * logp - beta * k3, mask, dim=1)
    u = masked_mean(advantages * logp, mask, dim=1)
    if values is not None:
        u = u - vf_coef * masked_mean(0.5 * (values - returns) ** 2, mask, dim=1)
    return u


def target_direction(
    policy: nn.Module, params: Sequence[nn.Parameter], rollout: Rollout, target: Target, records_per_pass: int
) -> list[torch.Tensor]:
    """grad f w.r.t. ``params``; ``rollout`` is the validation rollout (seq) or the training one (return, mean)."""
    n = len(rollout)
    weights = rollout.sequence_advantages / n if target == "seq" else None  # f_seq: sum_j (A_last_j / m) sum_t logp_jt
    total_tokens = rollout.mask.sum()
    direction = [torch.zeros_like(p) for p in params]
    for start in range(0, n, records_per_pass):
        rows = slice(start, start + records_per_pass)
        with torch.enable_grad():
            logp, _ = policy(rollout.input_ids[rows], rollout.attention_mask[rows], rollout.mask.shape[1], values=False)
            mask = rollout.mask[rows]
            if weights is not None:
                f = (weights[rows, None] * logp * mask).sum()
            elif target == "mean":
                f = ((rollout.token_advantages[rows] * logp * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n
            else:
                f = (rollout.token_advantages[rows] * logp * mask).sum() / total_tokens
            grads = torch.autograd.grad(f, list(params), allow_unused=True)
        for acc, g in zip(direction, grads, strict=True):
            if g is not None:
                acc += g
    return direction


def heldout_halves(n_sequences: int, group_size: int) -> torch.Tensor:
    """Half (0 or 1) of every sequence: prompt groups (``group_size`` consecutive sequences)
    alternate, group g -> g mod 2, so each half holds whole groups. ``ValueError`` below 2 groups."""
    if group_size < 1 or n_sequences % group_size or n_sequences // group_size < 2:
        raise ValueError(f"a held-out target needs >= 2 prompt groups; got {n_sequences} sequences in groups of {group_size}")
    return (torch.arange(n_sequences) // group_size) % 2


def heldout_sequence_influence(policy: nn.Module, rollout: Rollout, *, group_size: int, **kwargs) -> torch.Tensor:
    """f_seq influence of every sequence of ``rollout`` with the round's own groups as the
    validation set, cross-fitted (``heldout_halves``):

        score_i = < grad u_i, grad f_seq(H_{1 - h(i)}) >,   H_h = the sequences of half h

    so every sequence is scored, none against a target that contains itself (that would add its
    own term, ~ A_i^2 |grad sum_t log pi(y_it)|^2 / (m T_i) >= 0, biasing scores towards
    helpful), and nothing is sampled beyond the round's rollout. Each half's grad f_seq
    is computed once (one forward + backward over that half), then the other half is scored
    (one forward + backward over it): two passes over the rollout in all. ``kwargs`` as
    ``sequence_influence`` (``algo``, ``value_loss``, ``vf_coef``, ``beta``, ...). Raises
    ``ZeroTargetGradient`` when a half's target gradient is zero.
    """
    half = heldout_halves(len(rollout), group_size)
    parts = {}
    for h in (0, 1):
        scored, held = (half == h).nonzero().squeeze(1), (half != h).nonzero().squeeze(1)
        parts[h] = (scored, sequence_influence(policy, rollout.select(scored), target="seq",
                                               validation=rollout.select(held), **kwargs))
    scores = torch.empty(len(rollout), dtype=parts[0][1].dtype, device=parts[0][1].device)
    for scored, part in parts.values():
        scores[scored.to(part.device)] = part
    return scores


def sequence_influence(
    policy: nn.Module,
    rollout: Rollout,
    *,
    target: Target = "seq",
    validation: Rollout | None = None,
    algo: str = "ppo",
    value_loss: bool = False,
    vf_coef: float = 0.1,
    beta: float = 0.0,
    records_per_pass: int = 16,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Influence score of every sequence of ``rollout`` on ``target``, shape [N] (module docstring).

    ``validation`` is required for ``target="seq"``. ``policy`` must be at theta(k), the
    parameters that sampled ``rollout``; ``beta`` is GRPO's KL coefficient of the round. Scoring
    runs in eval mode and leaves the policy unchanged (``rlinfluence.influence.unchanged``).
    Raises ``ZeroTargetGradient`` when grad f is exactly zero (e.g. every advantage of the
    target's rollout is 0: all rewards of every group equal); the trainer then keeps every
    sequence and logs ``skipped = 1``. Cost:
    one forward + backward over the validation set (or the rollout, for ``return``) for grad f,
    one forward + backward over the rollout for the scores, ``records_per_pass`` sequences at a
    time.
    """
    if target not in ("seq", "return", "mean"):
        raise ValueError(f"target must be 'seq', 'return' or 'mean', got {target!r}")
    if target == "seq" and validation is None:
        raise ValueError("target 'seq' needs a validation rollout")
    params = policy.lora_parameters()
    if not params:
        raise ValueError("the policy has no trainable LoRA parameters")
    with unchanged(policy):
        direction = target_direction(policy, params, validation if target == "seq" else rollout, target, records_per_pass)
        if not any(g.any() for g in direction):
            raise ZeroTargetGradient(
                f"target {target!r} has zero gradient w.r.t. the {len(params)} LoRA parameters, so every score "
                "would be 0 (e.g. every advantage is exactly 0: equal rewards within every group); nothing to "
                "attribute in this round: keep every sequence (IIF does so and logs skipped=1)"
            )
        plan = plan_ghost(policy, params)

        def objective(model: nn.Module, *records: torch.Tensor) -> torch.Tensor:
            return record_objective(model, *records, algo=algo, value_loss=value_loss, vf_coef=vf_coef, beta=beta)

        records = (rollout.input_ids, rollout.attention_mask, rollout.mask, rollout.token_advantages,
                   rollout.returns, rollout.ref_logp)
        scores = per_record_dots(policy, plan, objective, records, direction, records_per_pass, accumulate_dtype)
    if plan.jvp_parameter_names:  # a LoRA layer the ghost path could not verify took forward mode
        import warnings

        warnings.warn(f"LoRA parameters scored by forward mode instead of ghost dots: {plan.jvp_parameter_names[:3]}...",
                      stacklevel=2)
    return scores
