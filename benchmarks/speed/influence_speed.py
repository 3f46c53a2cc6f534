"""Speed of the attribution core on one LunarLander-v3 PPO round.

Collects an ``--n-steps`` buffer with the preset-shaped policy (``make_policy`` on LunarLander's
spaces: tanh 64-64 actor and critic) and times, single-threaded (``torch.set_num_threads(1)``),
over ``--repeats`` calls each; the summary ratios use the best time of each side (the ``timeit``
convention: on a shared machine the higher times measure the other processes), the medians are
printed as well:

(a) our whole ``snapshot_influence`` call (input checks, forward, backward, target gradient,
    contractions; the ghost-vs-autograd verification runs on the first call for a policy and is
    reused while its structure is unchanged, as across IIF's rounds -- the first call's time is
    printed too) vs
    the authors' contraction formula alone (``compute_sample_ip_layers_vec``: per layer
    Q = G[:, :, None] * X[:, None, :] of shape [N, G, F], then (Q * P).sum), fed the very
    activations and output-gradients our hooks see;
(b) the same call vs brute force: target gradient + per-record gradients by
    ``torch.func.vmap(grad)`` over ``functional_call`` + dot products;
(c) the share of one PPO round (the collection + ``--epochs`` x (N / ``--batch-size``)
    minibatch updates with ``rlinfluence.losses.ppo_loss``) that scoring adds;

and full TracIn over the round's recorded schedule, with the round's actual change of the return
target next to sum_i I_i (equal to first order in the learning rate). Prints the summary lines last.

    python benchmarks/speed/influence_speed.py [--n-steps 2048] [--optimizer sgd|adam]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys  # noqa: E402
import time
from collections.abc import Callable
from pathlib import Path  # noqa: E402

import gymnasium as gym
import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from rlinfluence.buffer import MinibatchStep, RolloutBuffer
from rlinfluence.influence import Records, ReturnTarget, snapshot_influence, tracin_influence
from rlinfluence.influence.snapshot import normalize_for_attribution
from rlinfluence.losses import ppo_loss
from rlinfluence.policies import ActorCritic, make_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

GAMMA, GAE_LAMBDA, CLIP_RANGE = 0.99, 0.95, 0.2


def seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, best) wall time of ``fn`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def collect(env: gym.Env, policy: ActorCritic, n_steps: int, seed: int) -> RolloutBuffer:
    """One round of ``n_steps`` steps of one env with ``policy.act``; GAE computed."""
    obs_space, act_space = env.observation_space, env.action_space
    buf = RolloutBuffer.empty(0, n_steps, 1, obs_space.shape, torch.float32, act_space.shape, torch.int64)
    generator = torch.Generator().manual_seed(seed)
    obs, _ = env.reset(seed=seed)
    episode = 0
    for t in range(n_steps):
        obs_t = torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)
        action, logp, value = policy.act(obs_t, generator)
        next_obs, reward, terminated, truncated, _ = env.step(int(action))
        buf.obs[t, 0], buf.actions[t, 0], buf.logp[t, 0], buf.values[t, 0] = obs_t[0], action[0], logp[0], value[0]
        buf.rewards[t, 0], buf.terminated[t, 0], buf.truncated[t, 0] = float(reward), terminated, truncated
        buf.episode_ids[t, 0] = episode
        if truncated and not terminated:
            with torch.no_grad():
                buf.final_values[t, 0] = policy.value(torch.as_tensor(next_obs, dtype=torch.float32).unsqueeze(0))[0]
        if terminated or truncated:
            next_obs, _ = env.reset()
            episode += 1
        obs = next_obs
    with torch.no_grad():
        buf.last_values = policy.value(torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0))
    buf.compute_advantages(GAMMA, GAE_LAMBDA)
    return buf


def ppo_round(
    policy: ActorCritic, tensors: dict[str, torch.Tensor], args: argparse.Namespace
) -> tuple[ActorCritic, list[MinibatchStep], torch.optim.Optimizer]:
    """One round of PPO updates on a copy of ``policy``.

    Returns (updated copy, the round's schedule, the optimiser over ``policy`` at theta(k)).
    """
    if args.optimizer == "adam":
        optimizer_k: torch.optim.Optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr, eps=1e-5)
    else:
        optimizer_k = torch.optim.SGD(policy.parameters(), lr=args.lr)
    trained, optimizer = copy.deepcopy((policy, optimizer_k))
    n = len(tensors["advantages"])
    generator = torch.Generator().manual_seed(args.seed)
    schedule = []
    for epoch in range(args.epochs):
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n - args.batch_size + 1, args.batch_size):
            idx = perm[start : start + args.batch_size]
            loss = ppo_loss(
                trained, tensors["obs"][idx], tensors["actions"][idx], tensors["logp"][idx],
                tensors["advantages"][idx], tensors["returns"][idx], tensors["values"][idx],
                clip_range=CLIP_RANGE,
            ).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.append(MinibatchStep(epoch, idx, args.lr))
    return trained, schedule, optimizer_k


def reference_contraction(train_xs, train_gs, val_xs, val_gs) -> torch.Tensor:
    """The authors' ``compute_sample_ip_layers_vec`` (LDA-ORL, compute_TracIn_surrogate_ghost.py)."""
    n_train = train_xs[0].shape[0]
    sample_ip = torch.zeros(n_train, dtype=train_xs[0].dtype)
    for x_t, g_t, x_v, g_v in zip(train_xs, train_gs, val_xs, val_gs, strict=True):
        p = g_v.transpose(0, 1) @ x_v  # [G, F]
        q = g_t.unsqueeze(2) * x_t.unsqueeze(1)  # [n_train, G, F]
        sample_ip += (q * p.unsqueeze(0)).sum(dim=(1, 2))
        sample_ip += (g_t * g_v.sum(dim=0).unsqueeze(0)).sum(dim=1)
    return sample_ip


def capture_layers(policy: ActorCritic, loss_fn: Callable[[], torch.Tensor]) -> tuple[list, list]:
    """Inputs and output-gradients of the policy's Linear layers for ``loss_fn().backward()``."""
    layers = [m for m in policy.modules() if isinstance(m, torch.nn.Linear) and m.weight is not None]
    layers = [m for m in layers if any(m.weight is p for p in policy.policy_parameters())]
    xs, outs = {}, {}

    def capture(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        xs[module], outs[module] = args[0].detach(), out

    hooks = [m.register_forward_hook(capture) for m in layers]
    try:
        loss = loss_fn()
    finally:
        for h in hooks:
            h.remove()
    gs = torch.autograd.grad(loss, [outs[m] for m in layers])
    return [xs[m] for m in layers], list(gs)


class LogProb(torch.nn.Module):
    """``forward = policy.log_prob``, so ``functional_call`` can swap the policy's parameters."""

    def __init__(self, policy: ActorCritic):
        super().__init__()
        self.policy = policy

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.policy.log_prob(obs, actions)


def brute_force(policy: ActorCritic, obs, actions, advantages, weights) -> torch.Tensor:
    """score_i = w_i <grad log pi(a_i|s_i), grad f>, per-record gradients by vmap(grad)."""
    params = dict(policy.named_parameters())
    names = [n for n, p in params.items() if any(p is q for q in policy.policy_parameters())]
    target = torch.autograd.grad((advantages * policy.log_prob(obs, actions)).mean(), [params[n] for n in names])
    wrapper = LogProb(policy)

    def logp_one(p: dict[str, torch.Tensor], o: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapper, {f"policy.{k}": v for k, v in p.items()}, (o[None], a[None]))[0]

    per_sample = vmap(grad(logp_one), in_dims=(None, 0, 0))({n: params[n].detach() for n in names}, obs, actions)
    dots = sum((per_sample[n].flatten(1) * t.flatten()).sum(1) for n, t in zip(names, target, strict=True))
    return weights * dots


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--n-steps", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--lr", type=float, default=None, help="default 5e-3 (sgd) / 1e-3 (adam), as the paper")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.lr = args.lr if args.lr is not None else (5e-3 if args.optimizer == "sgd" else 1e-3)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    print(f"torch {torch.__version__}, torch.set_num_threads(1); N={args.n_steps}, "
          f"{args.epochs} epochs x {args.n_steps // args.batch_size} minibatches of {args.batch_size}, {args.optimizer} lr {args.lr}")

    env = gym.make("LunarLander-v3")
    policy = make_policy(env.observation_space, env.action_space)
    start = time.perf_counter()
    buf = collect(env, policy, args.n_steps, args.seed)
    collect_s = time.perf_counter() - start
    tensors = {k: buf.flat(k) for k in ("obs", "actions", "logp", "values", "advantages", "returns")}
    obs, actions, adv = tensors["obs"], tensors["actions"], tensors["advantages"]

    start = time.perf_counter()
    trained, schedule, optimizer = ppo_round(policy, tensors, args)
    update_s = time.perf_counter() - start
    round_s = collect_s + update_s

    def score() -> torch.Tensor:
        return snapshot_influence(policy, obs, actions, adv, chunk_size=args.batch_size)

    start = time.perf_counter()
    ours = score()  # the first call on this policy also verifies the ghost terms against autograd
    first_s = time.perf_counter() - start
    ours_s, ours_best = seconds(score, args.repeats)

    weights = normalize_for_attribution(adv, "chunk", args.batch_size)
    train_xs, train_gs = capture_layers(policy, lambda: -(weights * policy.log_prob(obs, actions)).sum())
    val_xs, val_gs = capture_layers(policy, lambda: -(adv * policy.log_prob(obs, actions)).mean())
    reference = reference_contraction(train_xs, train_gs, val_xs, val_gs)
    reference_s, reference_best = seconds(lambda: reference_contraction(train_xs, train_gs, val_xs, val_gs), args.repeats)

    brute = brute_force(policy, obs, actions, adv, weights)
    brute_s, brute_best = seconds(lambda: brute_force(policy, obs, actions, adv, weights), args.repeats)

    start = time.perf_counter()
    tracin = tracin_influence(
        policy, obs, actions, tensors["logp"], adv, tensors["returns"], tensors["values"], schedule,
        clip_range=CLIP_RANGE, optimizer=optimizer if args.optimizer == "adam" else None,
    )
    tracin_s = time.perf_counter() - start
    target = ReturnTarget()
    change = target.value(trained, Records(obs, actions, adv)) - target.value(policy, Records(obs, actions, adv))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    print(f"collection ({args.n_steps} steps): {collect_s:.3f} s; PPO updates ({len(schedule)} steps): {update_s:.3f} s; "
          f"round {round_s:.3f} s (round_overhead_pct uses the median scoring time)")
    print(f"timings over {args.repeats} calls: best / median")
    print(f"snapshot_influence, whole call: {ours_best * 1e3:.2f} / {ours_s * 1e3:.2f} ms "
          f"(first call on the policy, with verification: {first_s * 1e3:.2f} ms)")
    print(f"authors' [N,G,F] contraction formula alone: {reference_best * 1e3:.2f} / {reference_s * 1e3:.2f} ms; "
          f"speedup by medians {reference_s / ours_s:.2f}; max rel. diff to ours {rel(ours, reference):.1e}")
    print(f"vmap(grad) brute force: {brute_best * 1e3:.2f} / {brute_s * 1e3:.2f} ms; "
          f"speedup by medians {brute_s / ours_s:.2f}; max rel. diff to ours {rel(ours, brute):.1e}")
    print(f"full TracIn over {len(schedule)} steps: {tracin_s:.2f} s; sum_i I_i = {float(tracin.sum()):.4e}, "
          f"actual f(theta(k+1)) - f(theta(k)) = {change:.4e}")
    print(f"speedup_vs_reference_formula: {reference_best / ours_best:.2f}")
    print(f"speedup_vs_vmap: {brute_best / ours_best:.2f}")
    print(f"round_overhead_pct: {100 * ours_s / round_s:.2f}")
    print(f"full_tracin_seconds: {tracin_s:.2f}")


if __name__ == "__main__":
    main()
