"""Can the scores find a broken reward source? Detection AUROC per scorer, with ground truth.

    python benchmarks/corruption_detection.py --seeds 3 --rounds 6 --out bench_out/corruption_detection

Per env: plain PPO (every record kept, at the learning rate tuned for PPO in
``benchmarks/studies/<env>.json``; CartPole, which has no study, at PPOConfig's defaults: Adam 3e-4)
trains on 8 envs of 256 steps (a round of 2048 records, as
the paper's presets), one of which pays the negated reward (``--corrupt reward-flip:envs=1``)
and the last of which is trusted (``--trusted-envs 1``); every round is saved. Each of the first
``--rounds`` rounds is then scored at theta(k) by every scorer of
``rlinfluence.analysis.audit`` and detection is measured as AUROC at record and source (env)
level against the ground truth. Results go to ``<out>/detection.csv`` as each run finishes (a
re-run skips finished seeds). Ends with one line per figure:
``<env>/<scorer>/<level>/auroc: mean [95% CI] (n rounds x seeds)``, the interval a bootstrap
over seeds (seeded).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

from rlinfluence.analysis.audit import SCORERS, detection  # noqa: E402
from rlinfluence.experiments.statistics import bootstrap_mean  # noqa: E402
from rlinfluence.ppo import PPO, PPOConfig, load_round  # noqa: E402

STUDIES = Path(__file__).parent / "studies"
ENVS = "CartPole-v1,FrozenLake-v1,Acrobot-v1,MiniGrid-Empty-8x8-v0,LunarLander-v3"


def score_run(run_dir: Path, env: str, seed: int, rounds: int, scorers: tuple[str, ...] = tuple(SCORERS)
              ) -> list[dict]:
    """Detection rows of the first ``rounds`` saved rounds of one run."""
    config = json.loads((run_dir / "config.json").read_text())
    rows = []
    for k in range(rounds):
        saved = load_round(run_dir, k)
        flipped = int(saved.buffer.corrupted.any(0).nonzero()[0, 0])
        for row in detection(saved.buffer, saved.trainer.policy, config["trusted_envs"], config["batch_size"],
                             scorers):
            rows.append({"env": env, "seed": seed, "flipped_env": flipped, **row})
    return rows


def run_seed(env: str, seed: int, rounds: int, out: Path) -> list[dict]:
    study = STUDIES / f"{env}.json"
    lr = {"learning_rate": json.loads(study.read_text())["chosen"]["ppo"]["learning_rate"]} if study.is_file() else {}
    config = PPOConfig.for_env(env, n_envs=8, n_steps=256, batch_size=64, **lr, seed=seed,
                               total_timesteps=rounds * 2048, eval_episodes=10, eval_envs=10,
                               corrupt=("reward-flip:envs=1",), trusted_envs=1, save_buffers=True,
                               run_root=str(out / "runs"), method=f"flip1of8__seed{seed}", progress=False,
                               tensorboard=False)
    return score_run(PPO(config).learn().run.path, env, seed, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default=ENVS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench_out/corruption_detection")
    parser.add_argument("--rescore", metavar="SCORER", help="recompute one scorer's rows from the saved runs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "detection.csv"
    table = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["env", "seed"])
    if args.rescore:
        fresh = []
        for run_dir in sorted((out / "runs").glob("*flip1of8__seed*")):
            env, seed = run_dir.name.split("__")[0], int(run_dir.name.split("seed")[1].split("__")[0])
            fresh += score_run(run_dir, env, seed, args.rounds, (args.rescore,))
        table = pd.concat([table[table["scorer"] != args.rescore], pd.DataFrame(fresh)], ignore_index=True)
        table.to_csv(path, index=False)
    for env in args.envs.split(","):
        for seed in range(1, args.seeds + 1):
            if ((table["env"] == env) & (table["seed"] == seed)).any():
                continue
            table = pd.concat([table, pd.DataFrame(run_seed(env, seed, args.rounds, out))], ignore_index=True)
            table.to_csv(path, index=False)
            print(f"== {env} seed {seed}: done", flush=True)
    for (env, scorer, level), group in table.groupby(["env", "scorer", "level"], sort=False):
        per_seed = group.groupby("seed")["auroc"].mean().dropna()
        mean, lo, hi = bootstrap_mean(per_seed.to_numpy(), seed=0)
        print(f"{env}/{scorer}/{level}/auroc: {mean:.2f} [{lo:.2f}, {hi:.2f}] ({len(group)} rounds x seeds)")


if __name__ == "__main__":
    main()
