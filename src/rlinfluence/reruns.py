"""Counterfactual updates as a batch: K re-runs of one saved round's PPO update (other keep masks,
learning-rate scales, epoch counts) for the price of a few.

Every check of attribution against reality re-runs an update: ``validate`` on ~30 random
subsets and its drop arms, ``intervene`` under other masks and step sizes, ``explain`` under
harmful, random, leave-one-source-out and shorter-step variants. Each re-run is the same small
network trained on the same buffer, step by step on 64-record minibatches: overhead-bound when
run serially. Here the K variants' parameters and optimiser states are stacked ([K, ...]) and
each step evaluates all K minibatches at once: for an MLP actor-critic on the stacked parameters
directly (each linear layer one ``baddbmm``, one backward of the summed losses), for any other
policy by ``torch.func.vmap`` of ``grad`` of the loss under ``functional_call``.

Variant v runs exactly what ``SavedRound.retrain(keep_v, lr_scale_v)`` runs: from theta(k) with
the saved optimiser state, the generator restored and advanced past the round's collection
draw, then per epoch a fresh permutation of its kept records (its own draws, as a serial re-run
would make them), full minibatches, gradient-norm clipping and the optimiser's step (Adam:
m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2, theta <- theta - lr_v / (1 - b1^t) m /
(sqrt(v / (1 - b2^t)) + eps); SGD: theta <- theta - lr_v g), target_kl's early stop per variant. The
variants run longest first, so a variant with fewer steps than the longest leaves the batch when
it is done (the ones still stepping are always a prefix). The result
equals K serial re-runs to float tolerance (tests/test_reruns.py), not bit for bit: the batched
kernels sum in another order.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from rlinfluence.checkpoint import SavedRound
from rlinfluence.errors import UserError
from rlinfluence.losses import normalize_advantages, ppo_terms
from rlinfluence.policies import LOG_SQRT_2PI, ActorCritic, FlattenEncoder


@dataclass(frozen=True)
class Variant:
    """One re-run of a round's update: on the records ``keep`` (default: all), at ``lr_scale``
    times the configured learning rate, for ``n_epochs`` epochs (default: the configured ones)."""

    keep: torch.Tensor | None = None
    lr_scale: float = 1.0
    n_epochs: int | None = None


@dataclass(frozen=True)
class Reruns:
    """The variants' parameters theta'(k+1) (one ``{name: tensor}`` per variant, in order), each
    variant's mean approx_kl over its steps and its number of optimiser steps."""

    params: list[dict[str, torch.Tensor]]
    approx_kl: list[float]
    n_updates: list[int]

    def load(self, policy: nn.Module, index: int) -> nn.Module:
        """``policy`` with variant ``index``'s parameters copied in (returned for chaining)."""
        with torch.no_grad():
            for name, param in policy.named_parameters():
                param.copy_(self.params[index][name])
        return policy


class _Evaluate(nn.Module):
    """The policy's ``evaluate_actions`` as a forward, for ``functional_call``."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.policy.evaluate_actions(obs, actions)


def _schedules(saved: SavedRound, variants: Sequence[Variant]) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [K, steps, batch], active [K, steps]): each variant's minibatches, drawn from the
    round's generator as its serial re-run draws them, padded to the longest."""
    trainer, cfg = saved.trainer, saved.trainer.config
    trainer.load_state_dict(copy.deepcopy(saved.start))
    trainer.policy.noise((cfg.n_steps, cfg.n_envs), trainer.generator)
    state = trainer.generator.get_state()
    rows = []
    for v in variants:
        keep = torch.ones(len(saved.buffer), dtype=torch.bool) if v.keep is None else torch.as_tensor(v.keep).bool()
        if keep.shape != (len(saved.buffer),):
            raise UserError(f"a re-run's keep mask has shape {tuple(keep.shape)}, expected ({len(saved.buffer)},)")
        kept = keep.nonzero().squeeze(1)
        if len(kept) < cfg.batch_size:
            raise UserError(f"round {saved.buffer.round}: a re-run keeps {len(kept)} records, fewer than one "
                            f"minibatch (batch_size {cfg.batch_size})")
        trainer.generator.set_state(state)
        n_minibatches = len(kept) // cfg.batch_size
        epochs = [kept[torch.randperm(len(kept), generator=trainer.generator)][: n_minibatches * cfg.batch_size]
                  for _ in range(cfg.n_epochs if v.n_epochs is None else v.n_epochs)]
        rows.append(torch.cat(epochs).view(-1, cfg.batch_size))
    steps = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), steps, cfg.batch_size, dtype=torch.int64)
    active = torch.zeros(len(rows), steps, dtype=torch.bool)
    for k, r in enumerate(rows):
        idx[k, : len(r)], active[k, : len(r)] = r, True
    return idx, active


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


def _stacked_mlp_gradients(policy: nn.Module, cfg) -> Callable | None:
    """For an MLP actor-critic (flatten encoder, ``Linear``/``Tanh`` actor and critic), the variants'
    gradients computed on the stacked parameters directly: each ``Linear`` of the m variants is one
    ``baddbmm`` ([m, B, in] x [m, in, out]), and one backward of the sum of the variants' losses gives
    each variant its own gradient (no variant's loss depends on another's parameters). The same
    arithmetic as ``vmap`` of ``grad`` over ``functional_call`` (to float tolerance) without vmap's
    per-operation cost. ``None`` for any other policy (a CNN): the caller vmaps."""
    if not (isinstance(policy, ActorCritic) and isinstance(policy.encoder, FlattenEncoder)
            and all(isinstance(layer, nn.Linear | nn.Tanh) for net in (policy.actor, policy.critic) for layer in net)):
        return None
    continuous = policy.continuous

    def linear(p: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(p[f"{name}.bias"].unsqueeze(1), x, p[f"{name}.weight"].transpose(1, 2))

    def mlp(p: dict[str, torch.Tensor], prefix: str, net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(net):
            x = torch.tanh(x) if isinstance(layer, nn.Tanh) else linear(p, f"{prefix}.{i}", x)
        return x

    def gradients(params: dict[str, torch.Tensor], obs, actions, old_logp, advantages, returns, old_values):
        p = {n: t.detach().requires_grad_() for n, t in params.items()}
        x = obs.reshape(*obs.shape[:2], -1)
        x = x if x.is_floating_point() else x.float()
        out = linear(p, "action_head", mlp(p, "actor", policy.actor, x))
        values = linear(p, "value_head", mlp(p, "critic", policy.critic, x)).squeeze(-1)
        if continuous:  # log N(a; mu, sigma) summed over dimensions; the entropy does not depend on mu
            log_std = p["log_std"].unsqueeze(1)
            z = (actions - out) * torch.exp(-log_std)
            logp = (-0.5 * z.pow(2) - log_std - LOG_SQRT_2PI).sum(-1)
            entropy = (0.5 + LOG_SQRT_2PI + log_std).sum(-1).expand_as(logp)
        else:
            log_probs = torch.log_softmax(out, dim=-1)
            logp = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        terms = ppo_terms(logp, entropy, values, old_logp, advantages, returns, old_values, clip_range=cfg.clip_range,
                          clip_range_vf=cfg.clip_range_vf, vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef,
                          normalize_advantage=False)
        value = terms.per_record.mean(dim=1)
        grads = torch.autograd.grad(value.sum(), list(p.values()))
        with torch.no_grad():
            kl = ((terms.ratio - 1) - terms.log_ratio).mean(dim=1)
        return dict(zip(p, grads, strict=True)), (value.detach(), kl)

    return gradients


def batched_retrain(saved: SavedRound, variants: Sequence[Variant]) -> Reruns:
    """Re-run round k's update once per variant, all together (module docstring). The trainer is
    left at theta(k). Falls back to serial ``SavedRound.retrain`` (said once, as a warning) where
    the update cannot be batched: prioritised minibatches, an optimiser other than plain Adam or
    SGD, a KL-adaptive rate (``adaptive_kl``: each variant's rate would follow its own KL); a run
    trained by the NumPy update (``update_engine numpy``) is re-run one by one in its own arithmetic,
    without a warning (its serial re-runs cost about what the batched torch ones do)."""
    trainer, cfg = saved.trainer, saved.trainer.config
    if not variants:
        return Reruns([], [], [])
    idx, active = _schedules(saved, variants)  # restores theta(k) and the optimiser state
    group = trainer.optimizer.param_groups[0]
    plain = not group.get("weight_decay") and not group.get("amsgrad") and not group.get("maximize") \
        and not group.get("momentum") and len(trainer.optimizer.param_groups) == 1
    if cfg.adaptive_kl is not None:
        warnings.warn("a KL-adaptive rate cannot be batched: re-running the variants one by one", stacklevel=2)
        return _serial(saved, variants)
    if not plain:
        warnings.warn("this optimiser's update cannot be batched: re-running the variants one by one", stacklevel=2)
        return _serial(saved, variants)
    if cfg.update_engine == "numpy":  # the default's runs: their own arithmetic, one by one as fast as torch's
        return _serial(saved, variants)  # batched (validate of a LunarLander round: 8.2 s against 7.4 s wall)
    # longest first, so that the variants still stepping are always a prefix: the batch shrinks as
    # the short ones finish instead of computing padded steps
    lengths = active.sum(dim=1)
    order = torch.argsort(-lengths, stable=True)
    idx, active, lengths = idx[order], active[order], lengths[order]
    names = [name for name, _ in trainer.policy.named_parameters()]
    n_variants = len(variants)
    params = {n: p.detach().unsqueeze(0).repeat(n_variants, *[1] * p.dim())
              for n, p in trainer.policy.named_parameters()}
    adam = cfg.optimizer == "adam"
    moments: dict[str, list[torch.Tensor]] = {}
    step = torch.zeros(n_variants, dtype=torch.float64)
    if adam:
        state = trainer.optimizer.state_dict()["state"]
        for i, n in enumerate(names):
            s = state.get(i, {})
            moments[n] = [s.get(key, torch.zeros_like(params[n][0])).unsqueeze(0).repeat(n_variants, *[1] * params[n][0].dim())
                          for key in ("exp_avg", "exp_avg_sq")]
        if state:
            step += float(state[0]["step"])
        beta1, beta2 = group["betas"]
    lr = torch.tensor([trainer.learning_rate * variants[k].lr_scale for k in order.tolist()], dtype=torch.float64)
    tensors = {name: saved.buffer.flat(name) for name in ("obs", "actions", "logp", "values", "advantages", "returns")}
    evaluate = _Evaluate(trainer.policy)

    def loss(p: dict[str, torch.Tensor], obs, actions, old_logp, advantages, returns, old_values):
        outputs = functional_call(evaluate, {f"policy.{n}": t for n, t in p.items()}, (obs, actions))
        terms = ppo_terms(*outputs, old_logp, advantages, returns, old_values, clip_range=cfg.clip_range,
                          clip_range_vf=cfg.clip_range_vf, vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef,
                          normalize_advantage=False)
        return terms.per_record.mean(), terms.approx_kl()

    gradients = _stacked_mlp_gradients(trainer.policy, cfg) or vmap(grad_and_value(loss, has_aux=True))
    running = torch.ones(n_variants, dtype=torch.bool)
    kl_sum, updates = torch.zeros(n_variants, dtype=torch.float64), torch.zeros(n_variants, dtype=torch.int64)
    for j in range(idx.shape[1]):
        m = int((lengths > j).sum())  # the variants with a step j: a prefix
        fields = [tensors[k][idx[:m, j]] for k in ("obs", "actions", "logp", "advantages", "returns", "values")]
        if cfg.normalize_advantage:
            fields[3] = normalize_advantages(fields[3], dim=1)
        grads, (value, kl) = gradients({n: params[n][:m] for n in names}, *fields)
        on = running[:m].clone()
        if cfg.target_kl is not None:  # the serial update stops before stepping, for good
            on &= ~(kl > 1.5 * cfg.target_kl)
            running[:m] = on
        if not torch.isfinite(value[on]).all():
            bad = int(order[on.nonzero()[~torch.isfinite(value[on])][0]])
            raise UserError(f"round {saved.buffer.round}: re-run {bad} reached a non-finite loss at step {j}")
        if not on.any():
            continue
        kl_sum[:m] += torch.where(on, kl.double(), 0.0)
        updates[:m] += on.long()
        if cfg.max_grad_norm is not None:
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
            clip = (cfg.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            grads = {n: g * _expand(clip, g) for n, g in grads.items()}
        step[:m] += on.double()
        t = step[:m].clamp(min=1)
        every = bool(on.all())  # no variant stopped by target_kl: the step needs no mask
        for n in names:
            g, p = grads[n], params[n][:m]
            if adam:
                mean, square = (x[:m] for x in moments[n])
                mean_new = mean.lerp(g, 1 - beta1)
                square_new = square * beta2 + (1 - beta2) * g * g
                size = (lr[:m] / (1 - beta1 ** t)).to(p.dtype)
                root = torch.sqrt(1 - beta2 ** t).to(p.dtype)
                p_new = p - _expand(size, p) * mean_new / (square_new.sqrt() / _expand(root, p) + group["eps"])
                moments[n][0][:m] = mean_new if every else torch.where(_expand(on, mean), mean_new, mean)
                moments[n][1][:m] = square_new if every else torch.where(_expand(on, square), square_new, square)
            else:
                p_new = p - _expand(lr[:m].to(p.dtype), p) * g
            params[n][:m] = p_new if every else torch.where(_expand(on, p), p_new, p)
    back = torch.argsort(order)
    return Reruns([{n: params[n][k].clone() for n in names} for k in back.tolist()],
                  (kl_sum / updates.clamp(min=1))[back].tolist(), updates[back].tolist())


def _serial(saved: SavedRound, variants: Sequence[Variant]) -> Reruns:
    trainer = saved.trainer
    out = Reruns([], [], [])
    for v in variants:
        stats = saved.retrain(v.keep, v.lr_scale, v.n_epochs)
        out.params.append({n: p.detach().clone() for n, p in trainer.policy.named_parameters()})
        out.approx_kl.append(stats["approx_kl"])
        out.n_updates.append(int(stats["n_updates"]))
    trainer.load_state_dict(copy.deepcopy(saved.start))
    return out
