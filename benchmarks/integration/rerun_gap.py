"""How close rlinfluence's re-run of another trainer's round lands to that trainer's own update.

A run of SB3's PPO (written by ``RunDirectoryCallback``), of the CleanRL-style loop of
examples/cleanrl_ppo.py (written by ``RunWriter``, its defaults: 4 envs x 128 steps) or of RLlib's
PPO (written by ``integrations.rllib.run_callback``; its defaults but 2 env runners x 4 sub-envs and
2048 steps an iteration, on a local Ray cluster; needs ray[rllib]) is written as a run directory; every round k is then re-run from theta(k) and the trainer's Adam state with
rlinfluence's update (``SavedRound.retrain``, what ``validate``, ``intervene`` and ``explain`` do),
and compared with the trainer's theta(k+1):

    gap_k  = |theta'(k+1) - theta_T(k+1)| / |theta_T(k+1) - theta(k)|     (all parameters, L2)
    ratio_k = |theta'(k+1) - theta(k)| / |theta_T(k+1) - theta(k)|

    python benchmarks/integration/rerun_gap.py --trainer sb3 --env CartPole-v1 --rounds 6 --out bench_out/rerun_gap
    python benchmarks/integration/rerun_gap.py --trainer cleanrl --env CartPole-v1 --rounds 6 --out bench_out/rerun_gap
    python benchmarks/integration/rerun_gap.py --trainer rllib --env CartPole-v1 --rounds 6 --out bench_out/rerun_gap

Prints one line per round and the summary lines ``gap_median``, ``gap_max``, ``ratio_median``.
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402


def example_module():
    """examples/cleanrl_ppo.py, imported."""
    spec = importlib.util.spec_from_file_location("cleanrl_ppo", Path(__file__).parents[1] / "examples" / "cleanrl_ppo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cleanrl_ppo"] = module
    spec.loader.exec_module(module)
    return module


def norm(a: dict, b: dict) -> float:
    """|a - b| over every tensor of the state dicts (L2)."""
    return float(sum(((a[n] - b[n]) ** 2).sum() for n in b) ** 0.5)


def train_rllib(env: str, seed: int, rounds: int, run: Path) -> None:
    """``rounds`` iterations of RLlib's PPO written at ``run``."""
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig

    from rlinfluence.integrations.rllib import run_callback

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    algorithm = (PPOConfig().environment(env).env_runners(num_env_runners=2, num_envs_per_env_runner=4)
                 .training(train_batch_size_per_learner=2048).debugging(seed=seed).callbacks(run_callback(run))
                 .build_algo())
    for _ in range(rounds):
        algorithm.train()
    algorithm.stop()
    ray.shutdown()


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--trainer", choices=("sb3", "cleanrl", "rllib"), default="sb3")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--n-steps", type=int, default=512, help="SB3's (one env)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench_out/rerun_gap")
    args = parser.parse_args()
    from rlinfluence.checkpoint import load_round
    from rlinfluence.rundir import load_checkpoint

    torch.set_num_threads(1)
    run = Path(args.out) / f"{args.trainer}_{args.env}_{args.seed}"
    shutil.rmtree(run, ignore_errors=True)
    if args.trainer == "sb3":
        from stable_baselines3 import PPO

        from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback

        model = PPO("MlpPolicy", args.env, n_steps=args.n_steps, seed=args.seed, device="cpu")
        model.learn(args.n_steps * args.rounds, callback=RunDirectoryCallback(run, eval_episodes=0))
    elif args.trainer == "rllib":
        train_rllib(args.env, args.seed, args.rounds, run)
    else:
        cleanrl = example_module()
        defaults = cleanrl.Args()
        cleanrl.train(cleanrl.Args(env_id=args.env, seed=args.seed, run_dir=str(run),
                                   total_timesteps=args.rounds * defaults.num_envs * defaults.num_steps))
    gaps, ratios = [], []
    for k in range(args.rounds):
        saved = load_round(run, k)
        before = {n: p.detach().clone() for n, p in saved.trainer.policy.state_dict().items()}
        saved.retrain()
        after = saved.trainer.policy.state_dict()
        theirs = load_checkpoint(run / "checkpoints" / f"round_{k + 1:04d}.pt")["policy"]

        step = norm(theirs, before)
        gaps.append(norm(after, theirs) / step)
        ratios.append(norm(after, before) / step)
        print(f"round {k}: gap {gaps[-1]:.3f}  step ratio {ratios[-1]:.3f}", flush=True)
    print(f"gap_median: {statistics.median(gaps):.3f}")
    print(f"gap_max: {max(gaps):.3f}")
    print(f"ratio_median: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
