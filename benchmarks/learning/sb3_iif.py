"""SB3 PPO vs SB3 PPO + rlinfluence's InfluenceFilterCallback (IIF) on LunarLander-v3.

Both arms are Stable-Baselines3's own PPO with the paper's LunarLander preset: MlpPolicy
(separate 64-64 tanh actor and critic), SGD lr 5e-3 (``policy_kwargs=dict(optimizer_class=
torch.optim.SGD)``), n_steps 2048, batch 64, 10 epochs, gamma 0.99, GAE lambda 0.95, clip 0.2,
ent 0, vf 0.5, ``max_grad_norm=1e10`` (no clipping), one env. The IIF arm adds
``rollout_buffer_class=FilteredRolloutBuffer`` and ``InfluenceFilterCallback(drop_pct=12.5)``
(neg-bottom, chunk-normalised advantages, return target); the PPO arm is plain SB3 (its own
RolloutBuffer). Per seed both arms start from the same initial policy (``PPO(seed=s)``).

One round = one ``model.learn(2048, reset_num_timesteps=False)``. After each round (and once
before training, round 0) the policy is evaluated: ``--eval-episodes`` episodes of the
stochastic policy, episode e reset with seed ``eval_seed + e`` and its actions drawn by inverse
CDF from the random stream ``(eval_seed, e)``, so every policy faces the same episodes and
noise; evaluation uses neither NumPy's nor torch's global random state, so it does not perturb
training. Timings: ``round_seconds`` is the wall time of ``learn()`` (collection + callback +
update), split into ``collect_seconds`` (rollout + GAE) and ``update_seconds`` (the rest:
``train()`` and logging, the callback excluded), and ``influence_seconds`` the callback's own
time (scoring + masking).

Results go to ``--out``/results.jsonl, one line per (seed, method, round), as they are produced;
re-running with the same ``--out`` and settings skips finished (seed, method) runs. The script
ends with ``name: value`` summary lines (also written to ``--out``/summary.txt).

    python benchmarks/learning/sb3_iif.py                                   # 4 seeds x 30 rounds, ~20 min
    python benchmarks/learning/sb3_iif.py --seeds 2 --rounds 20 --out bench_out/sb3_iif_short
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys  # noqa: E402
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList

from rlinfluence.integrations.sb3 import FilteredRolloutBuffer, InfluenceFilterCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

ENV_ID = "LunarLander-v3"
METHODS = ("ppo", "iif")


class Timer(BaseCallback):
    """Splits a round: collection (rollout start -> end, GAE included) and the rest of learn()."""

    rollout_start = rollout_end = 0.0

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        self.rollout_start = time.perf_counter()

    def _on_rollout_end(self) -> None:
        self.rollout_end = time.perf_counter()


def make_model(method: str, seed: int, drop_pct: float):
    model = PPO(
        "MlpPolicy", ENV_ID, learning_rate=5e-3, n_steps=2048, batch_size=64, n_epochs=10,
        gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=1e10,
        policy_kwargs=dict(optimizer_class=torch.optim.SGD), seed=seed, device="cpu", verbose=0,
        rollout_buffer_class=FilteredRolloutBuffer if method == "iif" else None,
    )
    callback = InfluenceFilterCallback(drop_pct=drop_pct) if method == "iif" else None
    return model, callback


@torch.no_grad()
def evaluate(policy, n_episodes: int, eval_seed: int) -> list[float]:
    """Undiscounted returns of the stochastic policy on episodes ``eval_seed + e`` (all episodes
    stepped together, one batched forward per step)."""
    envs = [gym.make(ENV_ID) for _ in range(n_episodes)]
    rngs = [np.random.default_rng([eval_seed, e]) for e in range(n_episodes)]
    obs = [env.reset(seed=eval_seed + e)[0] for e, env in enumerate(envs)]
    returns = [0.0] * n_episodes
    alive = list(range(n_episodes))
    while alive:
        batch = torch.as_tensor(np.stack([obs[e] for e in alive]))
        probs = policy.get_distribution(batch).distribution.probs.double().numpy()
        cdf = np.cumsum(probs, axis=1)
        still = []
        for row, e in enumerate(alive):
            action = int(min(np.searchsorted(cdf[row] / cdf[row, -1], rngs[e].random(), side="right"), cdf.shape[1] - 1))
            obs[e], reward, terminated, truncated, _ = envs[e].step(action)
            returns[e] += float(reward)
            if not (terminated or truncated):
                still.append(e)
        alive = still
    for env in envs:
        env.close()
    return returns


def run(method: str, seed: int, args: argparse.Namespace, settings: dict, out: Path) -> None:
    model, callback = make_model(method, seed, args.drop_pct)
    timer = Timer()  # first in the list: its rollout end precedes the IIF scoring
    callbacks = CallbackList([timer] if callback is None else [timer, callback])

    def write(round_: int, returns: list[float], **extra: float) -> None:
        line = dict(settings, seed=seed, method=method, round=round_, env_steps=int(model.num_timesteps),
                    eval_return_mean=statistics.fmean(returns), eval_return_std=statistics.pstdev(returns), **extra)
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"{method} seed {seed} round {round_:3d}: return {line['eval_return_mean']:8.2f}"
              + "".join(f"  {k} {v:.3f}" for k, v in extra.items()), flush=True)

    write(0, evaluate(model.policy, args.eval_episodes, args.eval_seed))
    for round_ in range(1, args.rounds + 1):
        start = time.perf_counter()
        model.learn(2048, callback=callbacks, reset_num_timesteps=round_ == 1)
        end = time.perf_counter()
        influence = callback.history[-1]["seconds"] if callback is not None else 0.0
        extra = dict(round_seconds=end - start, collect_seconds=timer.rollout_end - timer.rollout_start,
                     update_seconds=end - timer.rollout_end - influence)
        if callback is not None:
            stats = callback.history[-1]
            extra.update(influence_seconds=influence, kept_fraction=stats["kept_fraction"],
                         n_negative=stats["n_negative"])
        write(round_, evaluate(model.policy, args.eval_episodes, args.eval_seed), **extra)


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.2f} +/- {se:.2f}"


def summarize(rows: list[dict], seeds: list[int], rounds: int) -> list[str]:
    by = {(r["method"], r["seed"]): {} for r in rows}
    for r in rows:
        by[(r["method"], r["seed"])][r["round"]] = r
    done = [s for s in seeds if all(len(by.get((m, s), {})) == rounds + 1 for m in METHODS)]
    if not done:
        return ["summary: no seed finished both methods"]
    lines = [f"seeds: {len(done)} ({', '.join(map(str, done))}), rounds: {rounds}, env steps per run: {rounds * 2048}"]

    def per_seed(method: str, fn) -> list[float]:
        return [fn([by[(method, s)][k] for k in range(1, rounds + 1)]) for s in done]

    def mean_ret(rs: list[dict]) -> float:
        return statistics.fmean(r["eval_return_mean"] for r in rs)

    def final_ret(rs: list[dict]) -> float:
        return rs[-1]["eval_return_mean"]

    def last5(rs: list[dict]) -> float:
        return statistics.fmean(r["eval_return_mean"] for r in rs[-5:])

    def timing(key: str):
        return lambda rs: statistics.fmean(r[key] for r in rs)

    for method in METHODS:
        lines.append(f"{method}_mean_return_rounds_1_{rounds}: {mean_se(per_seed(method, mean_ret))}")
        lines.append(f"{method}_last5_return: {mean_se(per_seed(method, last5))}")
        lines.append(f"{method}_final_return: {mean_se(per_seed(method, final_ret))}")
    diff = [a - b for a, b in zip(per_seed("iif", mean_ret), per_seed("ppo", mean_ret), strict=True)]
    lines.append(f"iif_minus_ppo_mean_return: {mean_se(diff)}")
    diff5 = [a - b for a, b in zip(per_seed("iif", last5), per_seed("ppo", last5), strict=True)]
    lines.append(f"iif_minus_ppo_last5_return: {mean_se(diff5)}")
    infl = [r["influence_seconds"] for r in rows if r["method"] == "iif" and r["round"] > 0 and r["seed"] in done]
    lines.append(f"callback_seconds_per_round: mean {statistics.fmean(infl):.3f}, median {statistics.median(infl):.3f}, max {max(infl):.3f}")
    for key in ("round_seconds", "collect_seconds", "update_seconds"):
        ppo_s, iif_s = (statistics.fmean(per_seed(m, timing(key))) for m in METHODS)
        lines.append(f"{key}: ppo {ppo_s:.2f}, iif {iif_s:.2f}")
    ppo_round = statistics.fmean(per_seed("ppo", timing("round_seconds")))
    lines.append(f"callback_overhead_vs_ppo_round: {100 * statistics.fmean(infl) / ppo_round:.1f}%")
    kept = [r["kept_fraction"] for r in rows if r["method"] == "iif" and r["round"] > 0 and r["seed"] in done]
    lines.append(f"iif_kept_fraction: mean {statistics.fmean(kept):.4f}, min {min(kept):.4f}")
    return lines


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seeds", type=int, default=4, help="seeds 1..N")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--eval-seed", type=int, default=100_000)
    parser.add_argument("--drop-pct", type=float, default=12.5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("bench_out/sb3_iif"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    settings = dict(rounds=args.rounds, eval_episodes=args.eval_episodes, eval_seed=args.eval_seed, drop_pct=args.drop_pct)
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    rows = [r for r in rows if all(r.get(k) == v for k, v in settings.items())]
    seeds = list(range(1, args.seeds + 1))
    start = time.perf_counter()
    for seed in seeds:
        for method in METHODS if seed % 2 else METHODS[::-1]:  # alternate which arm runs first
            have = {r["round"] for r in rows if r["seed"] == seed and r["method"] == method}
            if len(have) == args.rounds + 1:
                print(f"{method} seed {seed}: done, skipped")
                continue
            rows = [r for r in rows if not (r["seed"] == seed and r["method"] == method)]
            run(method, seed, args, settings, results)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows = [r for r in rows if all(r.get(k) == v for k, v in settings.items())]
    lines = summarize(rows, seeds, args.rounds)
    lines.append(f"wall_seconds_this_invocation: {time.perf_counter() - start:.0f}")
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    harness.summary(lines)


if __name__ == "__main__":
    main()
