"""Learning through corrupted training data: every filter against a tuned PPO and the oracle.

    nice python benchmarks/learning/corruption.py --seeds 5 --out bench_out/corruption      # resumes
    python benchmarks/learning/corruption.py --only FrozenLake-v1__flip1of8 ...              # one folder

Every run: 8 training envs of 256 steps (rounds of 2048 records, as the presets), the last one
trusted (kept clean; its records are training data for every method, so the trusted target's
cost is inside every comparison), evaluation on clean envs and on episodes derived from the
seeds, ``--clock cpu``. One ``rlinfluence compare`` folder per env and condition, in the order of
``FOLDERS`` (each resumes, so a cut session continues where it stopped):

- ``<env>__flip1of8``: one env pays the negated reward;
- ``<env>__clean``: no corruption, at the rates tuned on clean data by the earlier studies
  (``benchmarks/studies/<env>.json``; iif and iif-trusted at IIF's, the rest at PPO's), so a
  user sees what a filter costs when nothing is broken;
- the other corruptions (``CONDITIONS``): reward noise in 25% of the episodes, stale actors, a
  trigger (FrozenLake and Acrobot), 2 of 8 envs flipped and noise in 10% of the episodes.

In every corrupted folder the learning rates of ``ppo``, ``iif`` and ``advantage-sign`` (the
cheap filter practitioners try first) are tuned under that corruption on tuning seeds 1001-1002
over a 3-point grid around the clean study's PPO rate (``--tune-only``); every other method runs
at PPO's tuned rate (labelled so).

Methods: ``ppo``; ``iif`` (return target on the buffer, the paper's); ``iif-trusted`` (the target
on the trusted env's records); ``iif-robust`` (flip folders); ``advantage-sign`` (drops the most
negative-advantage records, as many of the negatives as iif drops); ``dtv`` (gradient alignment,
no target); ``td-error`` (prioritised minibatches; flip folders); ``random`` (drops as many
records as iif); ``oracle`` (drops exactly the corrupted records).

Ends with one line per figure: ``<folder>/<method>/<stat>: value``; gap_closed =
(auc_method - auc_ppo) / (auc_oracle - auc_ppo) on the mean normalised auc.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

from rlinfluence.experiments import CompareConfig, compare  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

STUDIES = harness.STUDIES
ENVS = ("FrozenLake-v1", "Acrobot-v1", "MiniGrid-Empty-8x8-v0", "LunarLander-v3")
ROUNDS = {"FrozenLake-v1": 20, "Acrobot-v1": 30, "MiniGrid-Empty-8x8-v0": 20, "LunarLander-v3": 50}
# the learning-rate grid under corruption: the clean study's PPO rate, half and double it
GRIDS = {"FrozenLake-v1": (0.16, 0.32, 0.64), "Acrobot-v1": (0.0025, 0.005, 0.01),
         "MiniGrid-Empty-8x8-v0": (0.08, 0.16, 0.32), "LunarLander-v3": (0.01, 0.02, 0.04)}
# the trigger's bonus against each env's reward scale (FrozenLake pays 1 at the goal, Acrobot -1 a step)
BONUS = {"FrozenLake-v1": 1.0, "Acrobot-v1": 5.0}
CONDITIONS = {
    "flip1of8": lambda env: ("reward-flip:envs=1",),
    "flip2of8": lambda env: ("reward-flip:envs=2",),
    "noise10": lambda env: ("reward-noise:frac=0.1,scale=3",),
    "noise25": lambda env: ("reward-noise:frac=0.25,scale=3",),
    "trigger25": lambda env: (f"trigger:frac=0.25,bonus={BONUS[env]:g}",),
    "stale25": lambda env: ("stale:frac=0.25,lag=4",),
    "clean": lambda env: (),
}
# cheapest first within each step, so that a cut session has the most envs of each: LunarLander's
# 50 rounds cost about 3x the others' 20-30
FOLDERS = ([f"{env}__flip1of8" for env in ENVS[:3]] + [f"{env}__{c}" for c in ("clean", "noise25", "stale25", "trigger25")
                                                     for env in ENVS[:2]]
           + ["LunarLander-v3__flip1of8", "MiniGrid-Empty-8x8-v0__clean", "LunarLander-v3__clean"]
           + [f"{env}__noise25" for env in ENVS[2:]] + [f"{env}__{c}" for c in ("flip2of8", "noise10") for env in ENVS])
SETTINGS = ("n_envs=8", "n_steps=256", "batch_size=64", "trusted_envs=1", "eval_envs=32")
TUNED = ("ppo", "iif", "advantage-sign")


def methods(rates: dict[str, float], corrupted: bool) -> tuple[str, ...]:
    """Method specs, each at ``rates[method]`` if given (iif's variants at iif's, the rest at ppo's;
    none given: the folder's tuning decides); iif-robust, td-error and the oracle in corrupted
    folders only."""
    specs = {"ppo": "ppo", "iif": "iif", "iif-trusted": "iif@scoring_target=trusted", "iif-robust": "iif-robust",
             "advantage-sign": "advantage-sign", "dtv": "dtv", "td-error": "td-error", "random": "random",
             "oracle": "oracle"}
    if not corrupted:
        del specs["iif-robust"], specs["td-error"], specs["oracle"]
    out = []
    for name, spec in specs.items():
        lr = rates.get(name, rates.get("iif" if name.startswith("iif") else "ppo"))
        if lr is not None:
            spec += ("," if "@" in spec else "@") + f"learning_rate={lr}"
        out.append(name if spec == name else f"{name}={spec}")
    return tuple(out)


def run_folder(name: str, out: Path, seeds: int, workers: int) -> Path:
    env, condition = name.split("__")
    study = json.loads((STUDIES / f"{env}.json").read_text())
    corrupt = CONDITIONS[condition](env)
    common = dict(env=env, seeds=seeds, rounds=ROUNDS[env], eval_episodes=study["eval_episodes"], set=SETTINGS,
                  corrupt=corrupt, out=str(out / name), workers=workers, clock="cpu", progress=False)
    if corrupt:
        cfg = CompareConfig(methods=methods({}, True), tune=(f"learning_rate={','.join(map(str, GRIDS[env]))}",),
                            tune_only=TUNED, **common)
    else:
        rates = {m: study["chosen"][m]["learning_rate"] for m in ("ppo", "iif")}
        cfg = CompareConfig(methods=methods(rates, False), **common)
    return compare(cfg)


def report(folder: Path, rounds: int) -> None:
    summary = pd.read_csv(folder / "summary.csv").set_index("method")
    auc = summary["mean_auc_norm"]
    for method, row in summary.iterrows():
        cpu = [pd.read_csv(run / "metrics.csv")["train_cpu_seconds"].iloc[-1] / rounds
               for run in folder.glob(f"{method}__seed*") if (run / "metrics.csv").is_file()]
        print(f"{folder.name}/{method}/mean_auc_norm: {row['mean_auc_norm']:.3f}")
        if cpu:  # a method whose every seed diverged in round 0 has no timed round
            print(f"{folder.name}/{method}/cpu_s_per_round: {sum(cpu) / len(cpu):.2f}")
        if method == "ppo":
            continue
        print(f"{folder.name}/{method}/paired_poi_auc: {row['poi_auc']:.2f} [{row['poi_auc_lo']:.2f}, {row['poi_auc_hi']:.2f}]")
        print(f"{folder.name}/{method}/rounds80: {row['verdict80']}, log ratio {row['log_ratio80']:.2f} "
              f"[{row['log_ratio80_lo']:.2f}, {row['log_ratio80_hi']:.2f}], reached {row['reached80_n']}/{row['seeds']}")
        if "oracle" in auc and method != "oracle" and auc["oracle"] > auc["ppo"]:
            print(f"{folder.name}/{method}/gap_closed: {(auc[method] - auc['ppo']) / (auc['oracle'] - auc['ppo']):.2f}")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--only", nargs="*", default=None, help=f"folders to run, of {', '.join(FOLDERS)}")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="bench_out/corruption")
    args = parser.parse_args()
    for name in args.only or FOLDERS:
        if name not in FOLDERS:
            parser.error(f"unknown folder {name!r} (of {', '.join(FOLDERS)})")
        print(f"== {name}", flush=True)
        folder = run_folder(name, Path(args.out), args.seeds, args.workers)
        report(folder, ROUNDS[name.split("__")[0]])


if __name__ == "__main__":
    main()
