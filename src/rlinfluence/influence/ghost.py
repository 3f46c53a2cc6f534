"""Per-record gradient inner products without per-record gradients: the engine of both scorers.

Given a *row-separable* per-record function u(theta) = (u_1, ..., u_n), where u_i depends only
on record i (``record_fn(policy, *record_tensors) -> Tensor[n]``), and a direction v (one tensor
per attributed parameter, e.g. grad f of a target), ``per_record_dots`` returns

    d_i = < grad_theta u_i(theta), v >        for every record i,

computed in two parts that are added:

- ``nn.Linear`` / ``nn.Conv2d`` parameters -- ghost dot products (spec 4.3, 4.4). Forward hooks
  capture each call's input X and output Y; ONE backward of sum_i u_i gives G = d(sum u)/dY,
  whose row i is record i's own output-gradient because the terms are independent. With P, q
  the layer's weight and bias parts of v:

      Linear:  d_i += ((G @ P) * X).sum(-1) + G @ q       (summed over any middle dims of X)
      Conv2d:  d_i += sum(G_i * (P U_i)) + (G_i 1) . q     (U_i = unfold(X_i): C_in*k*k x L)

  Nothing of size [n, out, in] is ever formed. A layer called several times adds up its calls
  (the gradient is linear in them).
- every other attributed parameter (``log_std``, LayerNorm, embeddings, layers of unknown kind)
  -- the forward-mode derivative of the whole vector u along v, ``torch.func.jvp`` over
  ``functional_call``: one forward pass gives exactly d_i = <grad u_i, v> for all i, without
  materialising per-record gradients. (Forward mode, not ``vmap(grad)``: it needs no per-record
  gradient memory and runs functions that ``vmap`` rejects, such as ``ppo_loss``, whose
  diagnostics call ``.item()``.)

Which parameters take which path is decided once per policy by ``plan_ghost``. A Linear/Conv2d
parameter is ghosted only if, on a few probe records and a random direction, the ghost terms
agree per record with autograd gradients of each u_i; otherwise -- the parameter is also used
outside its layer (tied weights), the layer's output is modified in place, rows are not records,
a subclass or a user hook changes the computation -- it goes to the forward-mode path, so
unknown structure costs speed, never correctness.

Assumption, as for any per-record gradient: the policy processes the rows of a batch
independently and in order (no BatchNorm in training mode, no cross-record attention).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp

from rlinfluence.influence.targets import check_positive_int

RecordFn = Callable[..., torch.Tensor]
"""``record_fn(policy, *record_tensors) -> Tensor[n]``; row i must depend on record i only."""
Direction = Sequence[torch.Tensor] | Callable[[torch.Tensor], Sequence[torch.Tensor]]
"""One tensor per attributed parameter, or a function of the pass's output u returning them."""


def check_policy(policy: object) -> None:
    """Raise ValueError unless ``policy`` is an nn.Module with a callable ``log_prob``."""
    if not isinstance(policy, nn.Module) or not callable(getattr(policy, "log_prob", None)):
        raise ValueError(
            f"policy must be a torch.nn.Module with a log_prob(obs, actions) method, got {type(policy).__name__}"
        )


def attributed_parameters(
    policy: nn.Module,
    params: Sequence[nn.Parameter] | None,
    obs: torch.Tensor,
    actions: torch.Tensor,
) -> list[nn.Parameter]:
    """The parameters scores are taken w.r.t. (duplicates removed, order kept).

    ``params`` if given; else ``policy.policy_parameters()`` if the policy has it; else every
    parameter with ``requires_grad`` that ``log_prob(obs, actions)`` reaches (its gradient is
    not None).
    """
    if params is not None:
        chosen = list(params)
    elif callable(getattr(policy, "policy_parameters", None)):
        chosen = list(policy.policy_parameters())
    else:
        candidates = [p for p in policy.parameters() if p.requires_grad]
        with torch.enable_grad():
            logp = policy.log_prob(obs, actions)
        reached = (
            torch.autograd.grad(logp.sum(), candidates, allow_unused=True)
            if candidates and logp.requires_grad
            else [None] * len(candidates)
        )
        chosen = [p for p, g in zip(candidates, reached, strict=True) if g is not None]
    unique = list({id(p): p for p in chosen}.values())
    if not unique:
        raise ValueError("no attributed parameters: log_prob reaches no parameter that requires grad")
    for i, p in enumerate(unique):
        if not isinstance(p, torch.Tensor) or not p.requires_grad:
            raise ValueError(f"attributed parameter {i} (shape {tuple(p.shape)}) does not require grad")
    return unique


def parameter_names(policy: nn.Module, params: Sequence[nn.Parameter]) -> tuple[str, ...]:
    """Each parameter's name in ``policy``; ValueError for one that is not the policy's."""
    names = {id(p): name for name, p in policy.named_parameters()}
    for i, p in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a parameter of the policy")
    return tuple(names[id(p)] for p in params)


# -- ghost contractions, per layer kind: (weight term, bias term) --------------------------------
def _linear_weight(module: nn.Linear, x: torch.Tensor, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return ((g @ p) * x).sum(-1).reshape(len(x), -1).sum(1)


def _linear_bias(module: nn.Linear, x: torch.Tensor, g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (g @ q).reshape(len(x), -1).sum(1)


def _conv2d_weight(module: nn.Conv2d, x: torch.Tensor, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    patches = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
    return (g.flatten(2) * (p.flatten(1) @ patches)).sum((1, 2))


def _conv2d_bias(module: nn.Conv2d, x: torch.Tensor, g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return g.flatten(2).sum(2) @ q


_CONTRACTIONS = {
    nn.Linear: (_linear_weight, _linear_bias),
    nn.Conv2d: (_conv2d_weight, _conv2d_bias),
}


def _ghostable(module: nn.Module) -> bool:
    """Exact Linear, or Conv2d that ``unfold`` reproduces (no groups, zero numeric padding)."""
    if type(module) is nn.Conv2d:
        return module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)
    return type(module) is nn.Linear


def _rows_are_records(module: nn.Module, x: torch.Tensor | None, out: torch.Tensor, n: int) -> bool:
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    dims_ok = x.dim() == 4 if isinstance(module, nn.Conv2d) else x.dim() >= 2
    return dims_ok and x.shape[0] == n and out.shape[0] == n


@dataclass(frozen=True)
class _Layer:
    name: str
    module: nn.Module
    weight: int | None  # slot of module.weight in GhostPlan.params, None: not ghosted
    bias: int | None


@dataclass(frozen=True)
class _Call:
    layer: int
    x: torch.Tensor | None
    out: torch.Tensor


@dataclass(frozen=True)
class GhostPlan:
    """How ``per_record_dots`` treats each attributed parameter of one policy instance."""

    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]  # each parameter's name in the policy
    layers: tuple[_Layer, ...]  # hooked layers, with the slots they ghost
    jvp_slots: tuple[int, ...]  # parameters handled by forward mode

    @property
    def ghost_parameter_names(self) -> tuple[str, ...]:
        return tuple(self.names[s] for layer in self.layers for s in (layer.weight, layer.bias) if s is not None)

    @property
    def jvp_parameter_names(self) -> tuple[str, ...]:
        return tuple(self.names[s] for s in self.jvp_slots)


def _check_output(u: object, n: int) -> None:
    if not isinstance(u, torch.Tensor) or tuple(u.shape) != (n,):
        shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"the per-record function (log_prob) returned {shape} for {n} records; expected shape ({n},)")


def _run_captured(
    policy: nn.Module, layers: Sequence[_Layer], record_fn: RecordFn, records: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[_Call]]:
    """u = record_fn(policy, *records) with every call of the hooked layers captured."""
    calls: list[_Call] = []

    def capture(k: int, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        calls.append(_Call(k, args[0] if args else None, out))

    handles = [layer.module.register_forward_hook(partial(capture, k)) for k, layer in enumerate(layers)]
    try:
        with torch.enable_grad():
            u = record_fn(policy, *records)
    finally:
        for handle in handles:
            handle.remove()
    _check_output(u, len(records[0]))
    return u, calls


def _ghost_terms(
    layers: Sequence[_Layer],
    calls: Sequence[_Call],
    u: torch.Tensor,
    direction: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> list[tuple[int, torch.Tensor]]:
    """(slot, [n] contribution) for every ghosted slot of every captured call, one backward."""
    live = [call for call in calls if call.out.requires_grad]
    if not live or not u.requires_grad:
        return []
    grads = torch.autograd.grad(u.sum(), [call.out for call in live], allow_unused=True)
    terms = []
    with torch.no_grad():
        for call, g in zip(live, grads, strict=True):
            if g is None:
                continue
            layer = layers[call.layer]
            x, g = call.x.to(dtype), g.to(dtype)
            for slot, contract in zip((layer.weight, layer.bias), _CONTRACTIONS[type(layer.module)], strict=True):
                if slot is not None:
                    terms.append((slot, contract(layer.module, x, g, direction[slot])))
    return terms


class _Bound(nn.Module):
    """``forward(*records) = record_fn(policy, *records)``, so ``functional_call`` can swap parameters."""

    def __init__(self, policy: nn.Module, record_fn: RecordFn):
        super().__init__()
        self.policy = policy
        self.record_fn = record_fn

    def forward(self, *records: torch.Tensor) -> torch.Tensor:
        return self.record_fn(self.policy, *records)


def _jvp_dots(
    plan_params: Sequence[nn.Parameter],
    names: Sequence[str],
    slots: Sequence[int],
    policy: nn.Module,
    record_fn: RecordFn,
    records: Sequence[torch.Tensor],
    direction: Sequence[torch.Tensor],
) -> torch.Tensor:
    """d_i = <grad_{slots} u_i, v_{slots}> for all i: one forward-mode pass."""
    bound = _Bound(policy, record_fn)
    keys = [f"policy.{names[s]}" for s in slots]
    primals = {k: plan_params[s].detach() for k, s in zip(keys, slots, strict=True)}
    tangents = {k: direction[s].to(plan_params[s].dtype) for k, s in zip(keys, slots, strict=True)}
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own forward-AD decompositions still call the deprecated torch.jit.script on first use
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        u, dots = jvp(lambda p: functional_call(bound, p, tuple(records)), (primals,), (tangents,))
    _check_output(u, len(records[0]))
    return dots


def _agree(ghost: torch.Tensor, exact: torch.Tensor) -> bool:
    """Per-record agreement up to sqrt(machine eps) of the larger magnitude."""
    scale = torch.maximum(ghost.abs().max(), exact.abs().max())
    return bool((ghost - exact).abs().max() <= torch.finfo(exact.dtype).eps ** 0.5 * scale)


def probe_indices(n: int, size: int = 3) -> torch.Tensor:
    """``size`` record indices spread over ``range(n)`` (all of them if n <= size).

    Three by default: an odd count, unlikely to equal a time or frame dimension that a policy
    might put in front of the records (the row check would then be fooled)."""
    return torch.linspace(0, n - 1, min(n, size)).round().long().unique()


def plan_ghost(
    policy: nn.Module,
    params: Sequence[nn.Parameter],
    record_fn: RecordFn,
    probe_records: Sequence[torch.Tensor],
) -> GhostPlan:
    """Decide, for ``record_fn`` on ``policy``, which parameters are ghosted and which use forward mode.

    Candidates are the weights/biases in ``params`` of exact ``nn.Linear`` and supported
    ``nn.Conv2d`` layers. A candidate is kept only if, on the probe records and a random
    direction, every call's rows are records and its ghost terms from one batched pass equal
    autograd on each probe record alone. Pass probe records whose u_i has a non-degenerate
    gradient (e.g. unit weights instead of advantages).
    """
    names = parameter_names(policy, params)
    slot_of = {id(p): s for s, p in enumerate(params)}
    candidates = []
    for name, module in policy.named_modules():
        if not _ghostable(module):
            continue
        weight = slot_of.get(id(module.weight))
        bias = slot_of.get(id(module.bias)) if module.bias is not None else None
        if weight is not None or bias is not None:
            candidates.append(_Layer(name, module, weight, bias))
    slots = [s for layer in candidates for s in (layer.weight, layer.bias) if s is not None]

    generator = torch.Generator().manual_seed(0)
    direction = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]
    n = len(probe_records[0])
    u, calls = _run_captured(policy, candidates, record_fn, probe_records)
    exact = {s: torch.zeros(n, dtype=u.dtype) for s in slots}
    for i in range(n) if slots and u.requires_grad else ():
        grads = torch.autograd.grad(u[i], [params[s] for s in slots], retain_graph=True, allow_unused=True)
        for s, g in zip(slots, grads, strict=True):
            if g is not None:
                exact[s][i] = (g * direction[s]).sum()
    broken = {c.layer for c in calls if not _rows_are_records(candidates[c.layer].module, c.x, c.out, n)}
    calls = [c for c in calls if c.layer not in broken]
    ghost = {s: torch.zeros(n, dtype=u.dtype) for s in slots}
    for slot, term in _ghost_terms(candidates, calls, u, [d.to(u.dtype) for d in direction], u.dtype):
        ghost[slot] += term
    rejected = {s for k in broken for s in (candidates[k].weight, candidates[k].bias) if s is not None}
    rejected |= {s for s in slots if not _agree(ghost[s], exact[s])}

    def keep(slot: int | None) -> int | None:
        return None if slot in rejected else slot

    layers = tuple(
        _Layer(c.name, c.module, keep(c.weight), keep(c.bias))
        for c in candidates
        if keep(c.weight) is not None or keep(c.bias) is not None
    )
    ghosted = {s for layer in layers for s in (layer.weight, layer.bias) if s is not None}
    jvp_slots = tuple(s for s in range(len(params)) if s not in ghosted)
    return GhostPlan(tuple(params), names, layers, jvp_slots)


def per_record_dots(
    policy: nn.Module,
    plan: GhostPlan,
    record_fn: RecordFn,
    records: Sequence[torch.Tensor],
    direction: Direction,
    records_per_pass: int = 4096,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """d_i = <grad_theta u_i, v> for every record, u = record_fn(policy, *records), v = ``direction``.

    ``direction`` is aligned with ``plan.params``: tensors, or a function of the pass's output u
    returning them, evaluated on the same forward graph (it must keep the graph, e.g.
    ``autograd.grad(..., retain_graph=True)``); the latter needs all records in one pass.
    Records are processed ``records_per_pass`` at a time (one forward + one backward each, plus
    one forward-mode pass if the plan has forward-mode parameters). Contractions and the result
    use ``accumulate_dtype`` (default: the direction's dtype).
    """
    check_positive_int("records_per_pass", records_per_pass)
    n = len(records[0])
    if callable(direction) and n > records_per_pass:
        raise ValueError(f"a direction computed from the pass needs one pass: {n} records > records_per_pass={records_per_pass}")
    dots = torch.zeros(0)
    for start in range(0, n, records_per_pass):
        chunk = tuple(r[start : start + records_per_pass] for r in records)
        m = len(chunk[0])
        if plan.layers or callable(direction):
            u, calls = _run_captured(policy, plan.layers, record_fn, chunk)
            for call in calls:
                layer = plan.layers[call.layer]
                if not _rows_are_records(layer.module, call.x, call.out, m):
                    shape = tuple(call.x.shape) if isinstance(call.x, torch.Tensor) else None
                    raise ValueError(f"layer {layer.name!r} got input {shape} in a pass of {m} records: rows are not records")
            if callable(direction):
                direction = list(direction(u))
        if start == 0:
            dtype = accumulate_dtype or direction[0].dtype
            direction_acc = [d.to(dtype) for d in direction]
            dots = torch.zeros(n, dtype=dtype)
        part = dots[start : start + m]
        if plan.layers:
            for _, term in _ghost_terms(plan.layers, calls, u, direction_acc, dtype):
                part += term
        if plan.jvp_slots:
            part += _jvp_dots(plan.params, plan.names, plan.jvp_slots, policy, record_fn, chunk, direction).to(dtype)
    return dots
