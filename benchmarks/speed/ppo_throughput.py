"""Training throughput: our PPO vs Stable-Baselines3's PPO on the same problem.

Both train LunarLander-v3 (or ``--env CartPole-v1``) with the paper's preset (n_steps 2048, batch 64, 10 epochs, plain SGD
lr 5e-3, gamma 0.99, lambda 0.95, clip 0.2, ent 0, vf 0.5, no gradient clipping) for 20,480
environment steps, one environment, on the CPU, with no evaluation. Every run happens in a
fresh subprocess, runs alternate (ours, sb3, ours, sb3, ...), and both get the same torch
thread count (and the same OMP/MKL/OpenBLAS thread variables). The figure is
``steps / wall-clock seconds of learn()`` (construction and imports excluded for both). Ours runs
twice: as a user gets it (``update_engine`` auto, which takes the NumPy update wherever it covers
the run: here it does) and with ``update_engine="torch"`` (autograd; not bit-identical to NumPy's).

SB3 cannot switch gradient clipping off, so it gets ``max_grad_norm=1e10`` (a clip that never
binds; it still pays for computing the norm, which is part of its cost as a library).

    python benchmarks/speed/ppo_throughput.py                  # 3 repeats, 1 thread
    python benchmarks/speed/ppo_throughput.py --env CartPole-v1
    python benchmarks/speed/ppo_throughput.py --repeats 5 --threads 2
    python benchmarks/speed/ppo_throughput.py --compile --total-timesteps 102400   # + ours compiled

The last lines are the summary: ``ours_steps_per_s``, ``sb3_steps_per_s``, ``speedup_vs_sb3`` (the
default trainer's), ``torch_steps_per_s``, ``torch_speedup_vs_sb3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

TARGET = 4.0

# The single set of hyperparameters both implementations are given.
HPARAMS = dict(
    n_steps=2048, batch_size=64, n_epochs=10, learning_rate=5e-3, gamma=0.99, gae_lambda=0.95,
    clip_range=0.2, ent_coef=0.0, vf_coef=0.5,
)


def run_ours(env_id: str, total_timesteps: int, seed: int, threads: int, compile: bool = False,
             update_engine: str = "auto") -> dict:
    import torch

    torch.set_num_threads(threads)
    from rlinfluence.ppo import PPO, PPOConfig

    config = PPOConfig(
        env=env_id, seed=seed, total_timesteps=total_timesteps, n_envs=1, optimizer="sgd",
        max_grad_norm=None, clip_range_vf=None, normalize_advantage=True, target_kl=None,
        hidden_sizes=(64, 64), eval_episodes=0, torch_threads=threads, progress=False,
        tensorboard=False, save_checkpoints=False, save_buffers=False, record_minibatches=False, compile=compile,
        update_engine=update_engine,
        **HPARAMS,
    )
    trainer = PPO(config, run_dir=False)
    t0 = time.perf_counter()
    trainer.learn()
    seconds = time.perf_counter() - t0
    return {"steps": trainer.env_steps, "seconds": seconds, "threads": torch.get_num_threads(),
            "engine": trainer.config.update_engine}


def run_sb3(env_id: str, total_timesteps: int, seed: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from stable_baselines3 import PPO

    model = PPO(
        "MlpPolicy", env_id, seed=seed, device="cpu", verbose=0, max_grad_norm=1e10,
        clip_range_vf=None, normalize_advantage=True, target_kl=None,
        policy_kwargs=dict(optimizer_class=torch.optim.SGD, net_arch=dict(pi=[64, 64], vf=[64, 64])),
        **HPARAMS,
    )
    t0 = time.perf_counter()
    model.learn(total_timesteps=total_timesteps)
    seconds = time.perf_counter() - t0
    return {"steps": model.num_timesteps, "seconds": seconds, "threads": torch.get_num_threads()}


def spawn(impl: str, args: argparse.Namespace, seed: int) -> dict:
    """One run of ``impl`` in a fresh Python process; returns its result dict."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(args.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--seed", str(seed), "--env", args.env,
           "--threads", str(args.threads), "--total-timesteps", str(args.total_timesteps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{impl} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--env", default="LunarLander-v3", help="gymnasium id (LunarLander-v3, CartPole-v1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each implementation")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both")
    parser.add_argument("--total-timesteps", type=int, default=20_480)
    parser.add_argument("--seed", type=int, default=1, help="seed of the first repeat")
    parser.add_argument("--compile", action="store_true",
                        help="also ours with compile=True (its compile time counted), alternated with the others")
    parser.add_argument("--worker", choices=list(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(RUNNERS[args.worker](args.env, args.total_timesteps, args.seed, args.threads)))
        return

    print(f"{args.env}: {args.total_timesteps} steps, {HPARAMS}, SGD, no grad clipping, "
          f"{args.threads} torch thread(s), {args.repeats} alternated repeats")
    impls = ("ours", "sb3", "ours-torch", "ours-compiled") if args.compile else ("ours", "sb3", "ours-torch")
    rates: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(args.repeats):
        for impl in impls:
            res = spawn(impl, args, args.seed + r)
            rate = res["steps"] / res["seconds"]
            rates[impl].append(rate)
            engine = f", {res['engine']} update" if "engine" in res else ""
            print(f"  repeat {r + 1} {impl:13s}: {res['steps']} steps in {res['seconds']:7.2f} s "
                  f"= {rate:7.1f} steps/s (torch threads {res['threads']}{engine})", flush=True)

    ours, sb3 = statistics.median(rates["ours"]), statistics.median(rates["sb3"])
    speedup = ours / sb3
    verdict = "meets" if speedup >= TARGET else "MISSES"
    print(f"median steps/s: ours {ours:.1f}, sb3 {sb3:.1f}; speedup {speedup:.2f}x "
          f"({verdict} the {TARGET}x target)")
    print(f"ours_steps_per_s: {ours:.1f}")
    print(f"sb3_steps_per_s: {sb3:.1f}")
    print(f"speedup_vs_sb3: {speedup:.2f}")
    autograd = statistics.median(rates["ours-torch"])
    print(f"torch_steps_per_s: {autograd:.1f}")
    print(f"torch_speedup_vs_sb3: {autograd / sb3:.2f}")
    if args.compile:
        compiled = statistics.median(rates["ours-compiled"])
        print(f"ours_compiled_steps_per_s: {compiled:.1f}")
        print(f"compiled_speedup_vs_sb3: {compiled / sb3:.2f}")


RUNNERS = {"ours": run_ours, "sb3": run_sb3, "ours-torch": partial(run_ours, update_engine="torch"),
           "ours-compiled": partial(run_ours, compile=True)}

if __name__ == "__main__":
    main()
