"""Does `rlinfluence audit` flag the broken env, and nothing on a clean run? Flags per scorer.

    python benchmarks/faults/audit_flags.py --seeds 3 --rounds 6 --out bench_out/audit_flags

Per env and seed, two runs of plain PPO as in ``corruption_detection.py`` (8 envs of 256 steps,
the last one trusted, PPO's learning rate tuned on clean data, every round saved): one with
``--corrupt reward-flip:envs=1`` and one clean. Each run's first ``--rounds`` rounds are audited
with each scorer of ``SCORERS`` (the sources test, permutations within rounds, Holm-corrected,
alpha 0.01). A flip run scores a hit when the flipped env is flagged; every other flag, on either
run, is a false alarm. Rows go to ``<out>/flags.csv`` as each run finishes (a re-run skips
finished runs). Ends with one line per figure: ``<env>/<scorer>/flipped_env_flagged: k/n`` and
``<env>/<scorer>/clean_runs_with_a_flag: k/n`` (and the totals over envs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

from rlinfluence.analysis.audit import sources_table  # noqa: E402
from rlinfluence.analysis.harm import harm_table  # noqa: E402
from rlinfluence.checkpoint import load_round  # noqa: E402
from rlinfluence.ppo import PPO, PPOConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

STUDIES = harness.STUDIES
ENVS = "CartPole-v1,FrozenLake-v1,Acrobot-v1,MiniGrid-Empty-8x8-v0,LunarLander-v3"
SCORERS = ("influence", "influence-trusted", "negative-advantage", "abs-advantage", "td-error")
ALPHA = 0.01


def audit_seed(env: str, seed: int, rounds: int, flipped: bool, out: Path) -> list[dict]:
    study = STUDIES / f"{env}.json"
    lr = {"learning_rate": json.loads(study.read_text())["chosen"]["ppo"]["learning_rate"]} if study.is_file() else {}
    condition = "flip1of8" if flipped else "clean"
    config = PPOConfig.for_env(env, update_engine="torch", n_envs=8, n_steps=256, batch_size=64, **lr, seed=seed,
                               total_timesteps=rounds * 2048, eval_episodes=10, eval_envs=10,
                               corrupt=("reward-flip:envs=1",) if flipped else (), trusted_envs=1, save_buffers=True,
                               run_root=str(out / "runs"), method=f"{condition}__seed{seed}", progress=False,
                               tensorboard=False)
    trainer = PPO(config).learn()
    broken = int(trainer.corruptor.flipped.nonzero()[0][0]) if flipped else None
    table = pd.concat([harm_table(load_round(trainer.run.path, k), SCORERS) for k in range(rounds)], ignore_index=True)
    rows = []
    for scorer in SCORERS:
        sources = sources_table(table, scorer, ALPHA)
        flagged = [int(s) for s in sources.loc[sources["flagged"], "source"]]
        rows.append({"env": env, "seed": seed, "condition": condition, "scorer": scorer, "flagged": " ".join(map(str, flagged)),
                     "broken_flagged": broken in flagged if flipped else None,
                     "false_flags": len([s for s in flagged if s != broken])})
    return rows


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", default=ENVS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench_out/audit_flags")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "flags.csv"
    table = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["env", "seed", "condition"])
    for env in args.envs.split(","):
        for seed in range(1, args.seeds + 1):
            for flipped in (True, False):
                condition = "flip1of8" if flipped else "clean"
                done = (table["env"] == env) & (table["seed"] == seed) & (table["condition"] == condition)
                if done.any():
                    continue
                table = pd.concat([table, pd.DataFrame(audit_seed(env, seed, args.rounds, flipped, out))],
                                  ignore_index=True)
                table.to_csv(path, index=False)
                print(f"== {env} seed {seed} {condition}: done", flush=True)
    for (env, scorer), group in [*table.groupby(["env", "scorer"], sort=False),
                                 *((("all", s), g) for s, g in table.groupby("scorer", sort=False))]:
        flips, cleans = group[group["condition"] == "flip1of8"], group[group["condition"] == "clean"]
        print(f"{env}/{scorer}/flipped_env_flagged: {int(flips['broken_flagged'].astype(bool).sum())}/{len(flips)}")
        print(f"{env}/{scorer}/flip_runs_with_a_false_flag: {int((flips['false_flags'] > 0).sum())}/{len(flips)}")
        print(f"{env}/{scorer}/clean_runs_with_a_flag: {int((cleans['false_flags'] > 0).sum())}/{len(cleans)}")


if __name__ == "__main__":
    main()
