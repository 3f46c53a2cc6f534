"""How close rlinfluence's re-run of an SB3 round lands to SB3's own update.

An SB3 PPO run is written as a run directory by ``RunDirectoryCallback``; every round k is then
re-run from theta(k) and SB3's Adam state with rlinfluence's update (``SavedRound.retrain``, what
``validate``, ``intervene`` and ``explain`` do), and compared with SB3's theta(k+1):

    gap_k  = |theta'(k+1) - theta_SB3(k+1)| / |theta_SB3(k+1) - theta(k)|     (all parameters, L2)
    ratio_k = |theta'(k+1) - theta(k)| / |theta_SB3(k+1) - theta(k)|

    python benchmarks/sb3_rundir.py --env CartPole-v1 --rounds 6 --out bench_out/sb3_rundir

Prints one line per round and the summary lines ``gap_median``, ``gap_max``, ``ratio_median``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import torch


def norm(a: dict, b: dict) -> float:
    """|a - b| over every tensor of the state dicts (L2)."""
    return float(sum(((a[n] - b[n]) ** 2).sum() for n in b) ** 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--n-steps", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench_out/sb3_rundir")
    args = parser.parse_args()
    from stable_baselines3 import PPO

    from rlinfluence.checkpoint import load_round
    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback
    from rlinfluence.rundir import load_checkpoint

    torch.set_num_threads(1)
    run = Path(args.out) / f"{args.env}_{args.seed}"
    shutil.rmtree(run, ignore_errors=True)
    model = PPO("MlpPolicy", args.env, n_steps=args.n_steps, seed=args.seed, device="cpu")
    model.learn(args.n_steps * args.rounds, callback=RunDirectoryCallback(run, eval_episodes=0))
    gaps, ratios = [], []
    for k in range(args.rounds):
        saved = load_round(run, k)
        before = {n: p.detach().clone() for n, p in saved.trainer.policy.state_dict().items()}
        saved.retrain()
        after = saved.trainer.policy.state_dict()
        sb3 = load_checkpoint(run / "checkpoints" / f"round_{k + 1:04d}.pt")["policy"]

        step = norm(sb3, before)
        gaps.append(norm(after, sb3) / step)
        ratios.append(norm(after, before) / step)
        print(f"round {k}: gap {gaps[-1]:.3f}  step ratio {ratios[-1]:.3f}", flush=True)
    print(f"gap_median: {statistics.median(gaps):.3f}")
    print(f"gap_max: {max(gaps):.3f}")
    print(f"ratio_median: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
