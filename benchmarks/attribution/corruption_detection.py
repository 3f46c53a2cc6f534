"""Can the scores find corrupted data? Detection AUROC and precision per scorer, with ground truth.

    python benchmarks/attribution/corruption_detection.py --seeds 3 --rounds 6 --out bench_out/corruption_detection
    python benchmarks/attribution/corruption_detection.py --conditions noise25,trigger25,stale25 --envs FrozenLake-v1,Acrobot-v1

Per env: plain PPO (every record kept, at the learning rate tuned for PPO in
``benchmarks/studies/<env>.json``; CartPole, which has no study, at PPOConfig's defaults: Adam 3e-4)
trains on 8 envs of 256 steps (a round of 2048 records, as
the paper's presets), the last of which is trusted (``--trusted-envs 1``), under one corruption
per condition (``CONDITIONS``: flip1of8 = one env pays the negated reward, the default; noise25,
trigger25, stale25 as in ``benchmarks/learning/corruption.py``); every round is saved. Each of the first
``--rounds`` rounds is then scored at theta(k) by every scorer of ``rlinfluence.analysis.audit``
and detection is measured as AUROC and precision at the corrupted fraction, at record, episode
and source (env) level, against the ground truth. Results go to ``<out>/detection.csv`` as each
run finishes (a re-run skips finished runs). Ends with one line per figure:
``<condition>/<env>/<scorer>/<level>/auroc: mean [95% CI] (n rounds x seeds)``, the interval a
bootstrap over seeds (seeded).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

from rlinfluence.analysis.audit import detection  # noqa: E402
from rlinfluence.analysis.harm import SCORERS, harm_table  # noqa: E402
from rlinfluence.checkpoint import load_round  # noqa: E402
from rlinfluence.ppo import PPO, PPOConfig  # noqa: E402
from rlinfluence.statistics import ci95  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402
from corruption import BONUS, CONDITIONS  # noqa: E402  (benchmarks/learning/corruption.py: on the path through harness)

STUDIES = harness.STUDIES
ENVS = "CartPole-v1,FrozenLake-v1,Acrobot-v1,MiniGrid-Empty-8x8-v0,LunarLander-v3"


def score_run(run_dir: Path, rounds: int, scorers: tuple[str, ...] = tuple(SCORERS)) -> list[dict]:
    """Detection rows of the first ``rounds`` saved rounds of one run."""
    rows = []
    for k in range(rounds):
        saved = load_round(run_dir, k)
        rows += detection(harm_table(saved, scorers), scorers).to_dict("records")
    return rows


def run_seed(condition: str, env: str, seed: int, rounds: int, out: Path) -> list[dict]:
    study = STUDIES / f"{env}.json"
    lr = {"learning_rate": json.loads(study.read_text())["chosen"]["ppo"]["learning_rate"]} if study.is_file() else {}
    config = PPOConfig.for_env(env, update_engine="torch", n_envs=8, n_steps=256, batch_size=64, **lr, seed=seed,
                               total_timesteps=rounds * 2048, eval_episodes=10, eval_envs=10,
                               corrupt=CONDITIONS[condition](env), trusted_envs=1, save_buffers=True,
                               run_root=str(out / "runs"), method=f"{condition}__seed{seed}", progress=False,
                               tensorboard=False)
    return [{"condition": condition, "env": env, "seed": seed, **row}
            for row in score_run(PPO(config).learn().run.path, rounds)]


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", default=ENVS)
    parser.add_argument("--conditions", default="flip1of8", help=f"of {', '.join(c for c in CONDITIONS if c != 'clean')}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench_out/corruption_detection")
    parser.add_argument("--rescore", nargs="*", metavar="SCORER", default=None,
                        help="recompute these scorers' rows from the saved runs (e.g. after a fix of a metric)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "detection.csv"
    table = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["condition", "env", "seed"])
    if args.rescore:
        fresh = []
        for run_dir in sorted((out / "runs").iterdir()):
            env, condition, seed = run_dir.name.split("__")[:3]
            fresh += [{"condition": condition, "env": env, "seed": int(seed.removeprefix("seed")), **row}
                      for row in score_run(run_dir, args.rounds, tuple(args.rescore))]
            print(f"== rescored {run_dir.name}", flush=True)
        table = pd.concat([table[~table["scorer"].isin(args.rescore)], pd.DataFrame(fresh)], ignore_index=True)
        table.to_csv(path, index=False)
    for condition in args.conditions.split(","):
        if condition not in CONDITIONS or condition == "clean":
            parser.error(f"unknown condition {condition!r}")
        for env in args.envs.split(","):
            if condition == "trigger25" and env not in BONUS:
                print(f"== {condition} {env}: skipped (a trigger's bonus is set for {', '.join(BONUS)} only)")
                continue
            for seed in range(1, args.seeds + 1):
                if ((table["condition"] == condition) & (table["env"] == env) & (table["seed"] == seed)).any():
                    continue
                table = pd.concat([table, pd.DataFrame(run_seed(condition, env, seed, args.rounds, out))],
                                  ignore_index=True)
                table.to_csv(path, index=False)
                print(f"== {condition} {env} seed {seed}: done", flush=True)
    for (condition, env, scorer, level), group in table.groupby(["condition", "env", "scorer", "level"], sort=False):
        for stat in ("auroc", "precision"):
            per_seed = group.groupby("seed")[stat].mean().dropna()
            if per_seed.empty:
                continue
            mean, lo, hi = ci95(per_seed.to_numpy(), bounds=(0.0, 1.0))
            print(f"{condition}/{env}/{scorer}/{level}/{stat}: {mean:.2f} [{lo:.2f}, {hi:.2f}] "
                  f"({len(group)} rounds x seeds)")


if __name__ == "__main__":
    main()
