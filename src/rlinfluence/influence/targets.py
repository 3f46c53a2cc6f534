"""Target functions f(theta): the quantity whose change a record's influence is measured on.

Targets are kept apart from the scorers (``snapshot_influence``, ``tracin_influence``): a scorer
only needs grad_theta f, which it gets from ``target_gradient``, so a new scorer never touches a
target and a new target never touches a scorer.

A target is any ``Target`` subclass whose ``pieces`` yields scalar tensors summing to f(theta).
The two built-in targets are weighted log-likelihoods,

    f(theta) = sum_j w_j log pi_theta(a_j | s_j),

- ``ActionTarget(obs, action)``: w_j = 1/m over m given (state, action) pairs, i.e. the mean
  log pi_theta(a*|s*) (docs/method.md, section 3.1);
- ``ReturnTarget()``: w_j = A_j / n with the raw (un-normalised) advantages of the scored buffer
  itself, or of a validation set passed explicitly (docs/method.md, section 3.2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlinfluence.errors import UserError
from rlinfluence.influence.state import unchanged


class ZeroTargetGradient(UserError):
    """The target's gradient is exactly zero (e.g. every advantage of the rollout is 0): every
    score would be 0, so the round carries no attribution signal. The IIF filters and callbacks
    catch it, keep every record that round and log ``skipped = 1``."""


def check_per_record(name: str, values: torch.Tensor, n: int) -> None:
    """Raise ValueError unless ``values`` is a finite tensor of shape ``[n]``."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if tuple(values.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},) (one value per record), got {tuple(values.shape)}")
    bad = (~torch.isfinite(values)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {values[i].item()} is not finite ({len(bad)} non-finite values)")


def check_positive_int(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _leading_dim(name: str, values: torch.Tensor) -> int:
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise ValueError(f"{name} must have a leading record dimension, got a 0-d tensor")
    return values.shape[0]


@dataclass(frozen=True, eq=False)
class Records:
    """The scored records, flat: ``obs [N, *obs_shape]``, ``actions [N, ...]``, raw ``advantages [N]``.

    Construction validates them: a non-empty buffer, matching leading dimensions, finite advantages.
    """

    obs: torch.Tensor
    actions: torch.Tensor
    advantages: torch.Tensor

    def __post_init__(self) -> None:
        n = _leading_dim("obs", self.obs)
        if n == 0:
            raise ValueError("empty buffer: obs has 0 records")
        n_actions = _leading_dim("actions", self.actions)
        if n_actions != n:
            raise ValueError(
                f"actions has {n_actions} rows but obs has {n} (shapes {tuple(self.actions.shape)} vs {tuple(self.obs.shape)})"
            )
        check_per_record("advantages", self.advantages, n)

    def __len__(self) -> int:
        return self.obs.shape[0]


class Target(ABC):
    """A scalar, differentiable target f(theta) of the policy."""

    @abstractmethod
    def pieces(self, policy: nn.Module, records: Records, records_per_pass: int) -> Iterator[torch.Tensor]:
        """Scalar tensors whose sum is f(theta), each from at most ``records_per_pass`` records.

        ``records`` are the scored records (a target may use them as its default data).
        """

    def value(self, policy: nn.Module, records: Records, records_per_pass: int = 4096) -> float:
        """f(theta) at the policy's current parameters."""
        with torch.no_grad():
            return sum(float(piece) for piece in self.pieces(policy, records, records_per_pass))


class LogProbTarget(Target):
    """f(theta) = sum_j w_j log pi_theta(a_j | s_j) over fixed pairs and weights."""

    @abstractmethod
    def weighted_pairs(self, records: Records) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(obs [m, ...], actions [m, ...], weights [m])`` defining f."""

    def pieces(self, policy: nn.Module, records: Records, records_per_pass: int) -> Iterator[torch.Tensor]:
        device = parameter_device(policy)
        obs, actions, weights = (x.to(device) for x in self.weighted_pairs(records))
        for start in range(0, len(weights), records_per_pass):
            rows = slice(start, start + records_per_pass)
            logp = policy.log_prob(obs[rows], actions[rows])
            yield (weights[rows].to(logp.dtype) * logp).sum()


def parameter_device(policy: nn.Module) -> torch.device:
    """The device of the policy's parameters (where its inputs must be; the CPU for none)."""
    return next(policy.parameters(), torch.empty(0)).device


def _as_batch(name: str, value: torch.Tensor, per_record_dims: int) -> torch.Tensor:
    """``value`` with a leading record dimension: one item (``per_record_dims`` dims) or a batch."""
    try:
        value = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a tensor or number, got {type(value).__name__}") from None
    if value.dim() == per_record_dims:
        return value.unsqueeze(0)
    if value.dim() == per_record_dims + 1:
        return value
    raise ValueError(
        f"{name} has shape {tuple(value.shape)}; expected one item with {per_record_dims} dims or a batch with {per_record_dims + 1}"
    )


@dataclass(frozen=True, repr=False, eq=False)
class ActionTarget(LogProbTarget):
    """f(theta) = (1/m) sum_j log pi_theta(action_j | obs_j): one (state, action) pair or m pairs.

    ``obs``/``action`` are a single observation and action (shaped like one record of the scored
    buffer) or batches of them.
    """

    obs: torch.Tensor
    action: torch.Tensor | int | float

    def weighted_pairs(self, records: Records) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs = _as_batch("ActionTarget obs", self.obs, records.obs.dim() - 1)
        actions = _as_batch("ActionTarget action", self.action, records.actions.dim() - 1)
        if obs.shape[1:] != records.obs.shape[1:]:
            raise ValueError(
                f"ActionTarget obs has per-record shape {tuple(obs.shape[1:])}, the buffer {tuple(records.obs.shape[1:])}"
            )
        if actions.shape[0] != obs.shape[0]:
            raise ValueError(f"ActionTarget has {obs.shape[0]} observations but {actions.shape[0]} actions")
        if not records.actions.is_floating_point():  # Discrete actions: indices, not rounded numbers
            if actions.is_floating_point() and not torch.equal(actions, actions.round()):
                raise ValueError(f"ActionTarget action {actions[actions != actions.round()][0].item()} is not an "
                                 "action index (the buffer's actions are Discrete)")
            if (actions < 0).any():
                raise ValueError(f"ActionTarget action {int(actions.min())} is negative: not an action index")
        m = obs.shape[0]
        return obs, actions.to(records.actions.dtype), torch.full((m,), 1.0 / m, dtype=torch.float64)

    def pieces(self, policy: nn.Module, records: Records, records_per_pass: int) -> Iterator[torch.Tensor]:
        n_actions = getattr(policy, "n_actions", None)
        head = getattr(policy, "action_head", None)
        if n_actions is None and not getattr(policy, "continuous", True) and isinstance(head, nn.Linear):
            n_actions = head.out_features  # an ActorCritic's Discrete head
        if isinstance(n_actions, int) and not records.actions.is_floating_point():
            actions = _as_batch("ActionTarget action", self.action, records.actions.dim() - 1)
            if (actions >= n_actions).any():
                raise ValueError(f"ActionTarget action {int(actions.max())} is out of range: the policy has "
                                 f"{n_actions} actions (0..{n_actions - 1})")
        yield from super().pieces(policy, records, records_per_pass)

    def __repr__(self) -> str:
        return f"ActionTarget(obs shape {tuple(torch.as_tensor(self.obs).shape)})"


@dataclass(frozen=True, repr=False, eq=False)
class ReturnTarget(LogProbTarget):
    """f(theta) = (1/n) sum_j A_j log pi_theta(a_j | s_j) with raw advantages A_j (docs/method.md, section 3.2).

    With no arguments the scored buffer is its own validation set; otherwise pass all three of
    ``obs``, ``actions``, ``advantages`` of a validation set.
    """

    obs: torch.Tensor | None = None
    actions: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    def weighted_pairs(self, records: Records) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        given = [x is not None for x in (self.obs, self.actions, self.advantages)]
        if not any(given):
            data = records
        elif all(given):
            data = Records(self.obs, self.actions, self.advantages)
        else:
            raise ValueError("ReturnTarget needs all of obs, actions, advantages, or none of them")
        return data.obs, data.actions, data.advantages / len(data)

    def __repr__(self) -> str:
        source = "scored buffer" if self.obs is None else f"{len(self.obs)} validation records"
        return f"ReturnTarget({source})"


def target_gradient(
    target: Target,
    policy: nn.Module,
    params: Sequence[nn.Parameter],
    records: Records,
    records_per_pass: int = 4096,
) -> list[torch.Tensor]:
    """grad_theta f at the current parameters, one tensor per entry of ``params``.

    Accumulated over ``target.pieces``, in eval mode, leaving the policy unchanged
    (``rlinfluence.influence.state.unchanged``). Raises ``ZeroTargetGradient`` when the gradient
    is exactly zero (e.g. a constant target, or all-zero advantages).
    """
    grads = [torch.zeros_like(p) for p in params]
    with torch.enable_grad(), unchanged(policy):
        for piece in target.pieces(policy, records, records_per_pass):
            if not piece.requires_grad:
                continue
            for acc, g in zip(grads, torch.autograd.grad(piece, params, allow_unused=True), strict=True):
                if g is not None:
                    acc += g
    return require_nonzero(target, grads)


def require_nonzero(target: Target, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` (a target's gradient); ``ZeroTargetGradient`` if exactly zero, since every score
    would be zero."""
    if not any(g.any() for g in grads):
        raise ZeroTargetGradient(
            f"target {target!r} has zero gradient w.r.t. the {len(grads)} attributed parameters, so every score "
            "would be 0 (e.g. every advantage is exactly 0: constant rewards and values); nothing to attribute "
            "in this round: keep every record (IIF does so and logs skipped=1) or use a target with signal"
        )
    return grads
