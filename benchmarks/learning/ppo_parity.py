"""Learning parity: our PPO vs Stable-Baselines3's PPO with identical hyperparameters.

Each (implementation, env, seed) run trains from scratch in a fresh subprocess with SB3's PPO
defaults, passed explicitly to both (Adam lr 3e-4 eps 1e-5, n_steps 2048, batch 64, 10 epochs,
gamma 0.99, GAE lambda 0.95, clip 0.2, no value clipping, ent 0, vf 0.5, max_grad_norm 0.5,
per-minibatch advantage normalisation, separate 64-64 tanh actor and critic, one env), then is
evaluated by ONE function, ``evaluate``, used for both: episode e is reset with seed
``eval_seed + e`` and actions are sampled from the policy's categorical distribution (the
stochastic policy) by the same inverse-CDF sampler driven by the same per-episode random
stream. So both implementations face the same episodes and the same sampling noise.

Results go to ``--out`` (JSON) as each run finishes; re-running with the same ``--out`` skips
the runs already there (same env, seed, timesteps and evaluation settings).

    python benchmarks/learning/ppo_parity.py                       # CartPole-v1 + Acrobot-v1, 3 seeds
    python benchmarks/learning/ppo_parity.py --workers 2 --out bench_out/ppo_parity.json
    python benchmarks/learning/ppo_parity.py --cartpole-timesteps 50000 --acrobot-timesteps 50000

Summary lines, per env: ``parity_<env>: ours A +/- se vs sb3 B +/- se`` (mean over seeds of the
per-seed mean eval return, +/- its standard error) and ``verdict_<env>: ...``: PASS when ours
is better or at most one standard error of the difference below SB3.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

ENVS = ("CartPole-v1", "Acrobot-v1")
IMPLS = ("ours", "sb3")

# SB3's PPO defaults: the one set of hyperparameters both implementations are given.
HPARAMS = dict(
    learning_rate=3e-4, n_steps=2048, batch_size=64, n_epochs=10, gamma=0.99, gae_lambda=0.95,
    clip_range=0.2, clip_range_vf=None, normalize_advantage=True, ent_coef=0.0, vf_coef=0.5,
    max_grad_norm=0.5, target_kl=None,
)


# -- the one evaluation function, used for both implementations ------------------------------
LogitsFn = Callable[[np.ndarray], np.ndarray]


def evaluate(logits_fn: LogitsFn, env_id: str, n_episodes: int, eval_seed: int) -> list[float]:
    """Undiscounted returns of ``n_episodes`` episodes of the stochastic policy.

    ``logits_fn(obs[1, ...]) -> logits[1, n_actions]``. Episode e is reset with seed
    ``eval_seed + e``; its actions are drawn by inverse CDF from uniforms of the random stream
    ``(eval_seed, e)``, so two policies are compared on identical episodes and noise.
    """
    import gymnasium as gym

    env = gym.make(env_id)
    returns = []
    for e in range(n_episodes):
        rng = np.random.default_rng([eval_seed, e])
        obs, _ = env.reset(seed=eval_seed + e)
        total, done = 0.0, False
        while not done:
            logits = np.asarray(logits_fn(obs[None]), dtype=np.float64)[0]
            p = np.exp(logits - logits.max())
            cdf = np.cumsum(p / p.sum())
            action = int(min(np.searchsorted(cdf, rng.random(), side="right"), len(cdf) - 1))
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


# -- one run (in a worker subprocess) --------------------------------------------------------
def run_ours(env_id: str, seed: int, timesteps: int, eval_episodes: int, eval_seed: int, threads: int) -> dict:
    import torch

    from rlinfluence.ppo import PPO, PPOConfig

    config = PPOConfig(
        env=env_id, seed=seed, total_timesteps=timesteps, n_envs=1, optimizer="adam",
        adam_eps=1e-5, hidden_sizes=(64, 64), encoder="flatten", eval_episodes=0, update_engine="torch",
        eval_seed=eval_seed, torch_threads=threads, progress=False, tensorboard=False,
        save_checkpoints=False, save_buffers=False, record_minibatches=False, **HPARAMS,
    )
    trainer = PPO(config, run_dir=False)
    curve: list[float] = []

    def on_round(_trainer: PPO, metrics: dict) -> None:
        curve.append(metrics["train_return_mean"])

    t0 = time.perf_counter()
    trainer.learn(callback=on_round)
    train_seconds = time.perf_counter() - t0
    policy = trainer.policy

    @torch.no_grad()
    def logits(obs: np.ndarray) -> np.ndarray:
        return policy.action_head(policy.actor(policy.encoder(torch.as_tensor(obs)))).numpy()

    torch.set_num_threads(threads)
    returns = evaluate(logits, env_id, eval_episodes, eval_seed)
    # cross-check only (not used for the verdict): the trainer's own batched evaluator
    builtin = trainer.evaluate(eval_episodes)
    return {"env_steps": trainer.env_steps, "train_seconds": train_seconds, "eval_returns": returns,
            "builtin_eval_mean": float(np.mean(builtin)), "train_curve": curve}


def run_sb3(env_id: str, seed: int, timesteps: int, eval_episodes: int, eval_seed: int, threads: int) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(threads)

    class Curve(BaseCallback):
        """Mean return of the training episodes that ended in each rollout (as ours reports)."""

        def __init__(self) -> None:
            super().__init__()
            self.curve: list[float] = []
            self.ended: list[float] = []

        def _on_step(self) -> bool:
            self.ended += [info["episode"]["r"] for info in self.locals["infos"] if "episode" in info]
            return True

        def _on_rollout_end(self) -> None:
            self.curve.append(float(np.mean(self.ended)) if self.ended else float("nan"))
            self.ended = []

    model = PPO(
        "MlpPolicy", env_id, seed=seed, device="cpu", verbose=0,
        policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh,
                           ortho_init=True, optimizer_class=torch.optim.Adam,
                           optimizer_kwargs=dict(eps=1e-5)),
        **HPARAMS,
    )
    curve = Curve()
    t0 = time.perf_counter()
    model.learn(total_timesteps=timesteps, callback=curve)
    train_seconds = time.perf_counter() - t0
    policy = model.policy
    policy.set_training_mode(False)

    @torch.no_grad()
    def logits(obs: np.ndarray) -> np.ndarray:
        obs_t, _ = policy.obs_to_tensor(obs)
        return policy.get_distribution(obs_t).distribution.logits.numpy()

    returns = evaluate(logits, env_id, eval_episodes, eval_seed)
    return {"env_steps": model.num_timesteps, "train_seconds": train_seconds, "eval_returns": returns,
            "train_curve": curve.curve}


# -- driver ----------------------------------------------------------------------------------
def check_defaults() -> list[str]:
    """Differences between PPOConfig's defaults and SB3 PPO's (both get HPARAMS anyway)."""
    from stable_baselines3 import PPO as SB3PPO

    from rlinfluence.ppo import PPOConfig

    ours = PPOConfig()
    sb3 = {k: v.default for k, v in inspect.signature(SB3PPO.__init__).parameters.items()}
    diffs = [f"{k}: ours {getattr(ours, k)!r} vs sb3 {sb3[k]!r}" for k in HPARAMS
             if getattr(ours, k) != sb3[k]]
    if ours.n_envs != 1 or ours.optimizer != "adam" or ours.adam_eps != 1e-5 or tuple(ours.hidden_sizes) != (64, 64):
        diffs.append(f"network/optimizer: ours n_envs={ours.n_envs} optimizer={ours.optimizer} "
                     f"adam_eps={ours.adam_eps} hidden={ours.hidden_sizes} vs sb3 1/adam/1e-5/(64, 64)")
    return diffs


def run_key(run: dict) -> tuple:
    return (run["impl"], run["env"], run["seed"], run["timesteps"], run["eval_episodes"], run["eval_seed"])


def spawn(job: dict, threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job), "--threads", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**job, **result, "wall_seconds": time.perf_counter() - t0,
            "eval_mean": float(np.mean(result["eval_returns"]))}


def save(path: Path, runs: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"hparams": HPARAMS, "runs": runs}, indent=1))
    os.replace(tmp, path)


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return mean, se


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--cartpole-timesteps", type=int, default=100_000)
    parser.add_argument("--acrobot-timesteps", type=int, default=100_000)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--eval-seed", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (one process each)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", type=Path, default=Path("bench_out/ppo_parity.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        job = json.loads(args.worker)
        run = run_ours if job["impl"] == "ours" else run_sb3
        result = run(job["env"], job["seed"], job["timesteps"], job["eval_episodes"], job["eval_seed"], args.threads)
        print(json.dumps(result))
        return

    timesteps = {"CartPole-v1": args.cartpole_timesteps, "Acrobot-v1": args.acrobot_timesteps}
    diffs = check_defaults()
    print("PPOConfig defaults vs SB3 PPO defaults: " + ("identical" if not diffs else "; ".join(diffs)))
    print(f"hyperparameters given to both: {HPARAMS}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    done = {run_key(r) for r in runs}
    jobs = [dict(impl=impl, env=env, seed=seed, timesteps=timesteps[env],
                 eval_episodes=args.eval_episodes, eval_seed=args.eval_seed)
            for env in args.envs for seed in args.seeds for impl in IMPLS]
    todo = [j for j in jobs if run_key(j) not in done]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already in {args.out}, {len(todo)} to do "
          f"with {args.workers} worker(s)", flush=True)

    lock = threading.Lock()
    failures = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        futures = {pool.submit(spawn, job, args.threads): job for job in todo}
        for future in as_completed(futures):
            job = futures[future]
            name = f"{job['impl']:4s} {job['env']} seed {job['seed']}"
            try:
                result = future.result()
            except Exception as exc:  # keep the other runs going; report at the end
                failures += 1
                print(f"  FAILED {name}: {exc}", flush=True)
                continue
            with lock:
                runs.append(result)
                save(args.out, runs)
            print(f"  {name}: eval {result['eval_mean']:8.2f} ({result['env_steps']} steps, "
                  f"train {result['train_seconds']:.0f} s, wall {result['wall_seconds']:.0f} s, "
                  f"elapsed {time.perf_counter() - t0:.0f} s)", flush=True)

    wanted = {run_key(j) for j in jobs}
    current = [r for r in runs if run_key(r) in wanted]
    for env in args.envs:
        by_impl = {impl: sorted((r for r in current if r["env"] == env and r["impl"] == impl),
                                key=lambda r: r["seed"]) for impl in IMPLS}
        for impl in IMPLS:
            per_seed = ", ".join(f"seed {r['seed']}: {r['eval_mean']:.2f}" for r in by_impl[impl])
            print(f"{env} {impl}: {per_seed}")
        if not all(by_impl.values()):
            print(f"parity_{env}: incomplete")
            continue
        (mo, so), (ms, ss) = (mean_se([r["eval_mean"] for r in by_impl[i]]) for i in IMPLS)
        se_diff = math.hypot(so, ss)
        gap = mo - ms
        ok = gap >= -se_diff
        print(f"parity_{env}: ours {mo:.2f} +/- {so:.2f} vs sb3 {ms:.2f} +/- {ss:.2f}")
        print(f"verdict_{env}: {'PASS' if ok else 'FAIL'} (ours - sb3 = {gap:+.2f}, "
              f"se of the difference {se_diff:.2f}; {len(by_impl['ours'])} vs {len(by_impl['sb3'])} seeds, "
              f"{timesteps[env]} timesteps, {args.eval_episodes} eval episodes)")
    if failures:
        sys.exit(f"{failures} run(s) failed; re-run with the same --out to retry them")


if __name__ == "__main__":
    main()
