"""Per-record gradient inner products without per-record gradients: the engine of both scorers.

Given a *row-separable* per-record function u(theta) = (u_1, ..., u_n), where u_i depends only
on record i (``record_fn(policy, *record_tensors) -> Tensor[n]``), and a direction v (one tensor
per attributed parameter, e.g. grad f of a target), ``per_record_dots`` returns

    d_i = < grad_theta u_i(theta), v >        for every record i,

computed in two parts that are added:

- ``nn.Linear`` / ``nn.Conv2d`` parameters -- ghost dot products (docs/method.md, sections 4.3, 4.4). Forward hooks
  capture each call's input X and output Y; ONE backward of sum_i u_i gives G = d(sum u)/dY,
  whose row i is record i's own output-gradient because the terms are independent. With P, q
  the layer's weight and bias parts of v:

      Linear:  d_i += ((G @ P) * X).sum(-1) + G @ q       (summed over any middle dims of X)
      Conv2d:  d_i += sum(G_i * (P U_i)) + (G_i 1) . q     (U_i = unfold(X_i): C_in*k*k x L)

  Nothing of size [n, out, in] is ever formed. A layer called several times adds up its calls
  (the gradient is linear in them).
- every other attributed parameter (``log_std``, LayerNorm, embeddings, layers of unknown kind)
  -- the forward-mode derivative of the whole vector u along v, ``torch.func.jvp`` of the policy
  with those parameters swapped for dual tensors: one forward pass gives exactly d_i = <grad u_i, v> for all i, without
  materialising per-record gradients. (Forward mode, not ``vmap(grad)``: it needs no per-record
  gradient memory and runs functions that ``vmap`` rejects, such as ``ppo_loss``, whose
  diagnostics call ``.item()``.)

The first pass of a call signature verifies its ghost terms: the same backward also returns autograd's gradient G of
sum_i u_i for each ghosted parameter, which must equal the gradient rebuilt from the captured
pairs, R = sum_i g_i x_i^T (bias: sum_i g_i) -- compared on a random rank-1 projection,
a^T R b = sum_i (a . g_i)(b . x_i), which costs two matrix-vector products -- and every call of
a hooked layer must have one row per record. A parameter failing either check -- used outside its layer too (tied weights), its
layer's output modified in place, a time or token axis in front of the records, a user hook
changing the output -- is demoted to the forward-mode path in that pass and every later one, so
unknown structure costs speed, never correctness. (Not caught: a row permutation inside the
policy that keeps the batch size; missed per-record parts that cancel exactly in the sum.)

The verdict of that comparison depends on the policy's structure, not on its parameter values, so
it is kept per policy (weakly referenced) under the pass's *call signature*: the record function,
the attributed parameters' identities, and per captured call its layer, input/output shapes (less
the record axis) and dtypes, and the layer's hook counts. A later pass with the same signature --
the next round of IIF -- reuses the verdict and skips the parameter gradients the comparison needs
(a third of the backward). A changed signature (a weight tied or a hook added since, another
input shape) is verified afresh.

Assumption, as for any per-record gradient: the policy processes the rows of a batch
independently and in order (no cross-record attention). Scoring runs in eval mode (``unchanged``):
BatchNorm uses its running statistics, so rows are independent, and dropout is off.

Scoring never changes the policy (``rlinfluence.influence.state.unchanged``). The forward-mode
path therefore swaps the dual parameters into every slot that holds them itself and puts the
originals back (``_substituted``): ``torch.func.functional_call`` does not restore a parameter
whose submodule is registered under two names (Stable-Baselines3's ``features_extractor`` /
``pi_features_extractor``), leaving a plain tensor that no optimiser holds.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jvp

from rlinfluence.influence.state import unchanged
from rlinfluence.influence.targets import check_positive_int

RecordFn = Callable[..., torch.Tensor]
"""``record_fn(policy, *record_tensors) -> Tensor[n]``; row i must depend on record i only."""

@contextmanager
def _substituted(policy: nn.Module, params: Sequence[nn.Parameter], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Every parameter slot of every module of ``policy`` that holds ``params[k]`` holds
    ``values[k]`` inside the block (aliased modules and tied weights included); the original
    Parameter objects are put back into exactly those slots afterwards."""
    value_of = {id(p): v for p, v in zip(params, values, strict=True)}
    slots = [(m, name, p) for m in policy.modules() for name, p in m._parameters.items()
             if p is not None and id(p) in value_of]
    try:
        for m, name, p in slots:
            m._parameters[name] = value_of[id(p)]
        yield
    finally:
        for m, name, p in slots:
            m._parameters[name] = p


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
        with torch.enable_grad(), unchanged(policy):
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


# -- per layer kind: ghost contractions with a direction (P, q), and batch gradients -------------
def _linear_weight(module: nn.Linear, x: torch.Tensor, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return ((g @ p) * x).sum(-1).reshape(len(x), -1).sum(1)


def _linear_bias(module: nn.Linear, x: torch.Tensor, g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (g @ q).reshape(len(x), -1).sum(1)


def _linear_rank1(module: nn.Linear, x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((g @ a) * (x @ b)).reshape(len(x), -1).sum(1)


def _linear_grads(module: nn.Linear, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    return g.T @ x, g.sum(0)


def _conv2d_patches(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)


def _conv2d_weight(module: nn.Conv2d, u: torch.Tensor, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return (g.flatten(2) * (p.flatten(1) @ u)).sum((1, 2))


def _conv2d_bias(module: nn.Conv2d, u: torch.Tensor, g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return g.flatten(2).sum(2) @ q


def _conv2d_rank1(module: nn.Conv2d, u: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (torch.einsum("nol,o->nl", g.flatten(2), a) * torch.einsum("nkl,k->nl", u, b)).sum(1)


def _conv2d_grads(module: nn.Conv2d, u: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = g.flatten(2)
    weight = torch.einsum("nol,nkl->ok", g, u)
    return weight.view_as(module.weight), g.sum((0, 2))


@dataclass(frozen=True)
class _Kind:
    inputs: Callable  # (module, X) -> U, what the contractions read: X itself, or a Conv2d's unfold(X)
    weight_dot: Callable  # (module, U, G, P) -> [n]: <grad_W u_i, P>
    bias_dot: Callable  # (module, U, G, q) -> [n]: <grad_b u_i, q>
    weight_rank1: Callable  # (module, U, G, a, b) -> [n]: <grad_W u_i, a b^T> (W as [out, rest])
    grads: Callable  # (module, U, G) -> (grad_W, grad_b) of sum_i u_i


_KINDS = {
    nn.Linear: _Kind(lambda module, x: x, _linear_weight, _linear_bias, _linear_rank1, _linear_grads),
    nn.Conv2d: _Kind(_conv2d_patches, _conv2d_weight, _conv2d_bias, _conv2d_rank1, _conv2d_grads),
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


@dataclass(frozen=True, eq=False)
class _Layer:
    name: str
    module: nn.Module
    weight: int | None  # slot of module.weight in GhostPlan.params, None: not ghosted
    bias: int | None

    def slots(self) -> list[int]:
        return [s for s in (self.weight, self.bias) if s is not None]


@dataclass(frozen=True, eq=False)
class _Call:
    layer: _Layer
    x: torch.Tensor | None
    out: torch.Tensor

    @cached_property
    def inputs(self) -> torch.Tensor:
        """U, what the layer's contractions read (``_Kind.inputs``): built once per call, however
        many directions, batch gradients and checks contract it (a Conv2d's unfold is its dearest part)."""
        return _KINDS[type(self.layer.module)].inputs(self.layer.module, self.x.detach())


@dataclass
class GhostPlan:
    """Which attributed parameters ``per_record_dots`` ghosts and which take forward mode.

    Built by ``plan_ghost``; ``per_record_dots`` demotes ghosted parameters that fail its checks.
    """

    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]  # each parameter's name in the policy
    layers: list[_Layer]  # hooked layers, with the slots they ghost
    jvp_slots: list[int] = field(default_factory=list)  # parameters handled by forward mode

    def demote(self, slots: set[int]) -> None:
        """Move ``slots`` from the ghost path to forward mode."""
        if not slots:
            return
        kept = [_Layer(c.name, c.module, *(None if s in slots else s for s in (c.weight, c.bias))) for c in self.layers]
        self.layers = [c for c in kept if c.slots()]
        self.jvp_slots = sorted({*self.jvp_slots, *slots})

    @property
    def ghost_parameter_names(self) -> tuple[str, ...]:
        return tuple(self.names[s] for layer in self.layers for s in layer.slots())

    @property
    def jvp_parameter_names(self) -> tuple[str, ...]:
        return tuple(self.names[s] for s in self.jvp_slots)


def plan_ghost(policy: nn.Module, params: Sequence[nn.Parameter]) -> GhostPlan:
    """Ghost the weights/biases in ``params`` of exact ``nn.Linear`` and supported ``nn.Conv2d``
    layers; everything else takes forward mode."""
    names = parameter_names(policy, params)
    slot_of = {id(p): s for s, p in enumerate(params)}
    layers = []
    for name, module in policy.named_modules():
        if _ghostable(module):
            bias = slot_of.get(id(module.bias)) if module.bias is not None else None
            layer = _Layer(name, module, slot_of.get(id(module.weight)), bias)
            if layer.slots():
                layers.append(layer)
    ghosted = {s for layer in layers for s in layer.slots()}
    return GhostPlan(tuple(params), names, layers, [s for s in range(len(params)) if s not in ghosted])


def _check_output(u: object, n: int) -> None:
    if not isinstance(u, torch.Tensor) or tuple(u.shape) != (n,):
        shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"the per-record function (log_prob) returned {shape} for {n} records; expected shape ({n},)")


def _run_captured(
    policy: nn.Module, layers: Sequence[_Layer], record_fn: RecordFn, records: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[_Call]]:
    """u = record_fn(policy, *records) with every call of the hooked layers captured."""
    calls: list[_Call] = []

    def capture(layer: _Layer, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        calls.append(_Call(layer, args[0] if args else None, out))

    handles = [layer.module.register_forward_hook(partial(capture, layer)) for layer in layers]
    try:
        with torch.enable_grad():
            u = record_fn(policy, *records)
    finally:
        for handle in handles:
            handle.remove()
    _check_output(u, len(records[0]))
    return u, calls


def _broken_layers(calls: Sequence[_Call], n: int) -> tuple[set[_Layer], set[int]]:
    """The hooked layers with a call that is not one row per record, and their parameter slots."""
    broken = {c.layer for c in calls if not _rows_are_records(c.layer.module, c.x, c.out, n)}
    return broken, {s for layer in broken for s in layer.slots()}


def _backward(
    plan: GhostPlan, u: torch.Tensor, calls: Sequence[_Call], retain_graph: bool, param_grads: bool
) -> tuple[list[tuple[_Call, torch.Tensor]], set[int], list[int], dict[int, torch.Tensor | None]]:
    """One backward of sum_i u_i: (call, output-gradient) pairs, the slots whose layer had a call
    without one row per record, the other ghosted slots, and -- if ``param_grads`` -- autograd's
    gradient of sum_i u_i for each of those (for ``_unverified``)."""
    n = len(u)
    broken, failed = _broken_layers(calls, n)
    slots = [s for layer in plan.layers for s in layer.slots() if s not in failed]
    live = [c for c in calls if c.layer not in broken and c.out.requires_grad]
    if not (slots and u.requires_grad):
        return [], failed, [], {}
    inputs = [c.out for c in live] + ([plan.params[s] for s in slots] if param_grads else [])
    grads = torch.autograd.grad(u.sum(), inputs, retain_graph=retain_graph, allow_unused=True)
    pairs = [(c, g) for c, g in zip(live, grads[: len(live)], strict=True) if g is not None]
    exact = dict(zip(slots, grads[len(live) :], strict=True)) if param_grads else {}
    return pairs, failed, slots, exact


# Verified call signature -> slots that failed verification, per policy (see the module docstring).
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, frozenset[int]]] = weakref.WeakKeyDictionary()


def _signature(plan: GhostPlan, record_fn: RecordFn, calls: Sequence[_Call]) -> tuple:
    """What the ghost-vs-autograd verdict of a pass depends on (everything but parameter values)."""

    def hooks(m: nn.Module) -> tuple[int, ...]:
        return len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks)

    def shape(t: object) -> tuple:
        return (tuple(t.shape[1:]), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else (type(t),)

    return (
        record_fn, tuple(map(id, plan.params)),
        tuple((c.layer.name, tuple(c.layer.slots()), id(c.layer.module), shape(c.x), shape(c.out), hooks(c.layer.module))
              for c in calls),
    )


def _ghost_backward(
    policy: nn.Module, plan: GhostPlan, record_fn: RecordFn, u: torch.Tensor, calls: Sequence[_Call], retain_graph: bool
) -> tuple[list[tuple[_Call, torch.Tensor]], set[int], list[int]]:
    """``_backward`` plus verification: (pairs, failed slots, verified slots). Verifies only a
    call signature not seen before for this policy."""
    signature = _signature(plan, record_fn, calls)
    known = _VERDICTS.setdefault(policy, {})
    verdict = known.get(signature)
    pairs, failed, slots, exact = _backward(plan, u, calls, retain_graph, param_grads=verdict is None)
    if verdict is None:
        verdict = frozenset(_unverified(pairs, exact, plan.params, len(u)))
        known[signature] = verdict
    failed |= verdict
    return pairs, failed, [s for s in slots if s not in failed]


def captured_pairs(
    policy: nn.Module, plan: GhostPlan, record_fn: RecordFn, calls: Sequence[_Call], n: int, scale: float
) -> tuple[list[tuple[_Call, torch.Tensor]], set[int]]:
    """The ghost pairs of a backward that has already run: for a loss L = sum_i u_i / ``scale``
    whose backward left ``out.grad`` on every captured call's output (``retain_grad``) and the
    gradient of L in each ghosted parameter's ``.grad``, the (call, d(sum_i u_i)/dY) pairs and
    the slots that fail verification (``_unverified`` of sum_i u_i's gradient, scale * .grad;
    once per call signature, as ``per_record_dots``). This lets a training step's own backward
    serve as the ghost pass (``tracin_influence``)."""
    broken, failed = _broken_layers(calls, n)
    pairs = [(c, c.out.grad * scale) for c in calls if c.layer not in broken and c.out.grad is not None]
    signature = _signature(plan, record_fn, calls)
    known = _VERDICTS.setdefault(policy, {})
    if signature not in known:
        slots = [s for layer in plan.layers for s in layer.slots() if s not in failed]
        exact = {s: None if plan.params[s].grad is None else plan.params[s].grad * scale for s in slots}
        known[signature] = frozenset(_unverified(pairs, exact, plan.params, n))
    return pairs, failed | known[signature]


def _unverified(
    pairs: Sequence[tuple[_Call, torch.Tensor]],
    exact: dict[int, torch.Tensor | None],
    params: Sequence[nn.Parameter],
    n: int,
) -> set[int]:
    """Slots whose batch gradient rebuilt from the pairs, R = sum_i g_i x_i^T (bias: sum_i g_i),
    differs from autograd's G, compared on a random rank-1 projection a^T R b vs a^T G b (bias:
    c . R vs c . G) to relative sqrt(eps) of sum_i |term_i|."""
    if not exact:
        return set()
    shapes = {s: [params[s].shape[0], params[s][0].numel()] if params[s].dim() > 1 else [params[s].numel()] for s in exact}
    draws = torch.randn(sum(map(sum, shapes.values())), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = iter(draws.split([k for shape in shapes.values() for k in shape]))
    probes = {s: tuple(next(draws).to(params[s].device, params[s].dtype) for _ in shape) for s, shape in shapes.items()}
    totals = []
    with torch.no_grad():
        for s, grad in exact.items():
            grad = torch.zeros_like(params[s]) if grad is None else grad
            probe = probes[s]  # weight: a^T G b with G as [out, rest]; bias: G . c
            totals.append(probe[0] @ grad.reshape(len(probe[0]), -1) @ probe[1] if len(probe) == 2 else grad @ probe[0])
        terms = {s: torch.zeros(n, dtype=params[s].dtype, device=params[s].device) for s in exact}  # per record, summed over calls
        for call, g in pairs:
            layer, kind = call.layer, _KINDS[type(call.layer.module)]
            for s, project in ((layer.weight, kind.weight_rank1), (layer.bias, kind.bias_dot)):
                if s in terms:
                    terms[s] += project(layer.module, call.inputs.to(g.dtype), g, *probes[s])
        stacked = torch.stack([t.double() for t in terms.values()])
        total = torch.stack(totals).double()
        tol = max(torch.finfo(params[s].dtype).eps for s in exact) ** 0.5
        bad = (stacked.sum(1) - total).abs() > tol * (stacked.abs().sum(1) + total.abs())
    return {s for s, b in zip(exact, bad.tolist(), strict=True) if b}


def _ghost_dots(
    pairs: Sequence[tuple[_Call, torch.Tensor]],
    failed: set[int],
    direction: Sequence[torch.Tensor],
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ghost terms <grad u_i, v> summed over the captured calls and the slots not failed, [n]."""
    dots = torch.zeros(n, dtype=dtype, device=direction[0].device)
    with torch.no_grad():
        for call, g in pairs:
            layer, kind = call.layer, _KINDS[type(call.layer.module)]
            u, g = call.inputs.to(dtype), g.to(dtype)
            for s, contract in ((layer.weight, kind.weight_dot), (layer.bias, kind.bias_dot)):
                if s is not None and s not in failed:
                    dots += contract(layer.module, u, g, direction[s].to(dtype))
    return dots


def _batch_gradients(
    pairs: Sequence[tuple[_Call, torch.Tensor]], slots: Sequence[int], params: Sequence[nn.Parameter], row_weights: torch.Tensor
) -> dict[int, torch.Tensor]:
    """grad of sum_i c_i u_i for each slot, rebuilt from the captured pairs (c = ``row_weights``)."""
    grads = {s: torch.zeros_like(params[s]) for s in slots}
    with torch.no_grad():
        for call, g in pairs:
            layer = call.layer
            g = g * row_weights.to(g.dtype).view(-1, *[1] * (g.dim() - 1))
            for s, grad in zip((layer.weight, layer.bias), _KINDS[type(layer.module)].grads(layer.module, call.inputs, g), strict=True):
                if s in grads:
                    grads[s] += grad
    return grads


def _jvp_dots(
    plan: GhostPlan,
    slots: Sequence[int],
    policy: nn.Module,
    record_fn: RecordFn,
    records: Sequence[torch.Tensor],
    direction: Sequence[torch.Tensor],
) -> torch.Tensor:
    """d_i = <grad_{slots} u_i, v_{slots}> for all i: one forward-mode pass, u = record_fn(policy,
    *records) with the slots' parameters replaced by dual tensors (primal theta, tangent v)."""
    params = [plan.params[s] for s in slots]
    primals = tuple(p.detach() for p in params)
    tangents = tuple(direction[s].to(plan.params[s].dtype) for s in slots)

    def forward(*values: torch.Tensor) -> torch.Tensor:
        with _substituted(policy, params, values):
            return record_fn(policy, *records)

    with torch.no_grad(), warnings.catch_warnings():
        # torch's own forward-AD decompositions still call the deprecated torch.jit.script on first use
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        u, dots = jvp(forward, primals, tangents)
    _check_output(u, len(records[0]))
    return dots


def per_record_dots(
    policy: nn.Module,
    plan: GhostPlan,
    record_fn: RecordFn,
    records: Sequence[torch.Tensor],
    direction: Sequence[torch.Tensor],
    records_per_pass: int = 4096,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """d_i = <grad_theta u_i, v> for every record, u = record_fn(policy, *records), v = ``direction``.

    ``direction`` is aligned with ``plan.params``. Records are processed ``records_per_pass`` at
    a time: one forward + one backward each, plus one forward-mode pass when the plan has
    forward-mode parameters. Ghosted parameters failing verification are demoted in ``plan`` (see
    the module docstring; verification runs once per call signature). Contractions and the result use ``accumulate_dtype`` (default: the
    direction's dtype).
    """
    check_positive_int("records_per_pass", records_per_pass)
    n = len(records[0])
    dtype = accumulate_dtype or direction[0].dtype
    dots = torch.zeros(n, dtype=dtype, device=direction[0].device)  # on the parameters' device (GPU too)
    with unchanged(policy):
        for start in range(0, n, records_per_pass):
            chunk = tuple(r[start : start + records_per_pass] for r in records)
            part = dots[start : start + len(chunk[0])]
            if plan.layers:
                u, calls = _run_captured(policy, plan.layers, record_fn, chunk)
                pairs, failed, _ = _ghost_backward(policy, plan, record_fn, u, calls, retain_graph=False)
                part += _ghost_dots(pairs, failed, direction, len(part), dtype)
                plan.demote(failed)
            if plan.jvp_slots:
                part += _jvp_dots(plan, plan.jvp_slots, policy, record_fn, chunk, direction).to(dtype)
    return dots


def self_target_dots(
    policy: nn.Module,
    plan: GhostPlan,
    record_fn: RecordFn,
    records: Sequence[torch.Tensor],
    weights: torch.Tensor,
    accumulate_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(d, v) with v = grad F, F = sum_j weights_j u_j over the same records, d_i = <grad u_i, v>.

    The case of a target built from the scored records themselves (``ReturnTarget()``): one
    forward and one backward serve both sides. The ghosted parts of v are rebuilt from the
    captured pairs, P = sum_j weights_j g_j x_j^T, q = sum_j weights_j g_j (then verified like
    ``per_record_dots``); the rest of v comes from autograd on the same graph. All records go in
    one pass.
    """
    (dots,), (direction,) = shared_self_target_dots(policy, plan, record_fn, records, [weights], accumulate_dtype)
    return dots, direction


def shared_self_target_dots(
    policy: nn.Module,
    plan: GhostPlan,
    record_fn: RecordFn,
    records: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    accumulate_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """``self_target_dots`` for several targets over the same records at once, F_t = sum_j
    weights[t]_j u_j: ([d_t], [v_t]). The forward, the backward and its verification are shared;
    each target adds only its own contractions (and its forward-mode pass where the plan has one)."""
    with unchanged(policy):
        u, calls = _run_captured(policy, plan.layers, record_fn, records)
        pairs, failed, verified = _ghost_backward(policy, plan, record_fn, u, calls, retain_graph=True)
        directions: list[list[torch.Tensor]] = []
        for w in weights:
            direction = [torch.zeros_like(p) for p in plan.params]
            for s, grad in _batch_gradients(pairs, verified, plan.params, w).items():
                direction[s] = grad
            directions.append(direction)
        dtype = accumulate_dtype or directions[0][0].dtype
        all_dots = [_ghost_dots(pairs, failed, direction, len(u), dtype) for direction in directions]
        plan.demote(failed)
        if plan.jvp_slots and u.requires_grad:
            for t, (w, direction, dots) in enumerate(zip(weights, directions, all_dots, strict=True)):
                target = (w.to(u.dtype) * u).sum()
                grads = torch.autograd.grad(target, [plan.params[s] for s in plan.jvp_slots], allow_unused=True,
                                            retain_graph=t < len(weights) - 1)
                for s, grad in zip(plan.jvp_slots, grads, strict=True):
                    direction[s] = torch.zeros_like(plan.params[s]) if grad is None else grad
                dots += _jvp_dots(plan, plan.jvp_slots, policy, record_fn, records, direction).to(dtype)
    return all_dots, directions
