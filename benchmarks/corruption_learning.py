"""Learning through a broken reward source: PPO, IIF (buffer and trusted targets), random, oracle.

    python benchmarks/corruption_learning.py --envs FrozenLake-v1,Acrobot-v1 --seeds 5 --out bench_out/corruption

Per env, two ``rlinfluence compare`` folders (each resumes):
- ``<env>__flip1of8``: 8 training envs of 256 steps (rounds of 2048 records, as the presets), one
  paying the negated reward (``--corrupt reward-flip:envs=1``), the last one trusted (kept clean);
- ``<env>__clean``: the same without the corruption (what filtering costs when nothing is broken).
Methods: ``ppo``; ``iif`` (return target on the buffer itself, the paper's); ``iif-trusted``
(``scoring_target=trusted``: the target on the trusted env's records only); ``random`` (drops
as many records as IIF); ``oracle`` (drops exactly the corrupted records; flip folder only).
Learning rates are those tuned on clean data (``benchmarks/studies/<env>.json``): ppo, random and
oracle at PPO's, iif and iif-trusted at IIF's. No method is tuned under the corruption, which is
not the full protocol of tuning every method under it. Evaluation is clean and on episodes derived from the seeds, ``--clock cpu``.

Ends with one line per figure: ``<folder>/<method>/<stat>: value``, where gap_closed =
(auc_method - auc_ppo) / (auc_oracle - auc_ppo) on normalised auc (means over seeds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

from rlinfluence.experiments import CompareConfig, compare  # noqa: E402

STUDIES = Path(__file__).parent / "studies"
ROUNDS = {"FrozenLake-v1": 20, "Acrobot-v1": 30, "MiniGrid-Empty-8x8-v0": 20, "LunarLander-v3": 50}
def methods(study: dict, corrupted: bool) -> tuple[str, ...]:
    ppo, iif = (study["chosen"][m]["learning_rate"] for m in ("ppo", "iif"))
    return (f"ppo=ppo@learning_rate={ppo}", f"iif=iif@learning_rate={iif}",
            f"iif-trusted=iif@scoring_target=trusted,learning_rate={iif}", f"random=random@learning_rate={ppo}",
            *([f"oracle=oracle@learning_rate={ppo}"] if corrupted else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="FrozenLake-v1,Acrobot-v1")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="bench_out/corruption")
    args = parser.parse_args()
    for env in args.envs.split(","):
        study = json.loads((STUDIES / f"{env}.json").read_text())
        settings = ("n_envs=8", "n_steps=256", "batch_size=64", "trusted_envs=1", "eval_envs=32")
        for condition, corrupt in (("flip1of8", ("reward-flip:envs=1",)), ("clean", ())):
            folder = Path(args.out) / f"{env}__{condition}"
            print(f"== {folder}", flush=True)
            compare(CompareConfig(env=env, methods=methods(study, bool(corrupt)), seeds=args.seeds, rounds=ROUNDS.get(env),
                                  eval_episodes=study["eval_episodes"], set=settings, corrupt=corrupt,
                                  out=str(folder), workers=args.workers, clock="cpu", progress=False))
            summary = pd.read_csv(folder / "summary.csv").set_index("method")
            auc = summary["mean_auc_norm"]
            for method, row in summary.iterrows():
                cpu = [pd.read_csv(run / "metrics.csv")["train_cpu_seconds"].iloc[-1] / ROUNDS.get(env, 1)
                       for run in folder.glob(f"{method}__seed*") if (run / "metrics.csv").is_file()]
                print(f"{folder.name}/{method}/mean_auc_norm: {row['mean_auc_norm']:.3f} "
                      f"[{row['mean_auc_norm_lo']:.3f}, {row['mean_auc_norm_hi']:.3f}]")
                print(f"{folder.name}/{method}/cpu_s_per_round: {sum(cpu) / len(cpu):.2f}")
                if method == "ppo":
                    continue
                print(f"{folder.name}/{method}/paired_poi_auc: {row['poi_auc']:.2f} "
                      f"[{row['poi_auc_lo']:.2f}, {row['poi_auc_hi']:.2f}]")
                print(f"{folder.name}/{method}/rounds80: {row['verdict80']}, log ratio {row['log_ratio80']:.2f} "
                      f"[{row['log_ratio80_lo']:.2f}, {row['log_ratio80_hi']:.2f}], reached "
                      f"{row['reached80_n']}/{row['seeds']}")
                if "oracle" in auc and method != "oracle" and auc["oracle"] != auc["ppo"]:
                    print(f"{folder.name}/{method}/gap_closed: {(auc[method] - auc['ppo']) / (auc['oracle'] - auc['ppo']):.2f}")


if __name__ == "__main__":
    main()
