"""IIF vs PPO vs random on the paper's environments: the runs behind docs/results/paper-protocol.md and docs/results/first-tuned-study.md.

    python benchmarks/learning/iif_results.py --envs FrozenLake-v1,Acrobot-v1 --seeds 5 --out bench_out/results
    python benchmarks/learning/iif_results.py --envs FrozenLake-v1 --methods ppo,iif --clock cpu \
        --tune learning_rate=0.005,0.01,0.02,0.04,0.08,0.16,0.32 --tune-seeds 2 --out bench_out/tuned

Each environment is one ``rlinfluence compare`` folder under ``--out``; re-running the same
command skips finished (method, seed) pairs and resumes unfinished ones, so the script can be
killed and restarted. Evaluation episodes per round are below the paper's 1000 to fit 2 cores;
the defaults per env are in EVAL_EPISODES and are printed with the results. Ends with one
summary line per figure: ``<env>/<method>/<metric>: mean +/- se (n/N seeds)`` for the paper's
metrics, ``<env>/<method>/<stat>: point [low, high]`` for the rliable statistics and
``<env>/<method>/chosen: key=value`` for a tuned method.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: idle BLAS threads spin on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import csv  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.experiments import CompareConfig, compare, parse_methods, write_summary  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

# Evaluation episodes per round (paper: 1000; 100 for highway and BipedalWalker).
EVAL_EPISODES = {"FrozenLake-v1": 100, "Acrobot-v1": 100, "MiniGrid-Empty-8x8-v0": 100,
                 "LunarLander-v3": 50, "highway-v0": 20, "BipedalWalker-v3": 20}
METRICS = ("se_ave", "se_peak", "rt_peak", "se_80pct", "rt_80pct")
ROBUST = ("iqm_auc_norm", "poi_auc", "iqm_final_norm", "poi_final", "se_80pct", "rt_80pct")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", default="FrozenLake-v1,Acrobot-v1,MiniGrid-Empty-8x8-v0,LunarLander-v3")
    parser.add_argument("--methods", default="ppo,iif,random")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=None, help="default: each preset's round count")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="bench_out/results")
    parser.add_argument("--tag", default="", help="suffix of the per-env folder (variants: adam, p25, ...)")
    parser.add_argument("--set", nargs="*", default=[], help="PPOConfig overrides key=value for every run")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="RT figures from wall seconds or process CPU seconds (runs must have logged them)")
    parser.add_argument("--reference", default="ppo", help="the method every metric is computed against")
    parser.add_argument("--tune", nargs="*", default=[], help="key=v1,v2,... tuned for every method on tuning seeds")
    parser.add_argument("--tune-seeds", type=int, default=2)
    parser.add_argument("--summarize-only", action="store_true",
                        help="run nothing: summarise the seeds whose every method has finished")
    args = parser.parse_args()
    labels = [spec.label for spec in parse_methods(args.methods)]

    for env in args.envs.split(","):
        folder = Path(args.out) / (env + (f"__{args.tag}" if args.tag else ""))
        config = CompareConfig(
            env=env, methods=args.methods, seeds=args.seeds, rounds=args.rounds,
            eval_episodes=EVAL_EPISODES.get(env), set=("eval_envs=32", *args.set), out=str(folder),
            workers=args.workers, progress=False, clock=args.clock, reference=args.reference,
            tune=tuple(args.tune), tune_seeds=args.tune_seeds,
        )
        if args.summarize_only:
            seeds = [s for s in range(1, args.seeds + 1)
                     if all((folder / f"{m}__seed{s}" / "done.json").exists() for m in labels)]
            if not seeds:
                print(f"== {env}: no seed finished yet", flush=True)
                continue
            write_summary(folder, labels, seeds, clock=args.clock, reference=args.reference)
            print(f"== {env}: summary of finished seeds {seeds} -> {folder}", flush=True)
        else:
            print(f"== {env}: {args.seeds} seeds, eval {config.eval_episodes} episodes/round -> {folder}", flush=True)
            compare(config)
        with (folder / "summary.csv").open() as f:
            for row in csv.DictReader(f):
                name = f"{folder.name}/{row['method']}"
                if row.get("chosen") not in (None, "", "{}"):
                    print(f"{name}/chosen: {row['chosen']}", flush=True)
                if row["method"] == args.reference:
                    continue
                for metric in METRICS:
                    mean, se, n = row[f"{metric}_mean"], row[f"{metric}_se"], row[f"{metric}_n"]
                    value = f"{float(mean):.1f} +/- {float(se):.1f}" if mean else "undefined"
                    print(f"{name}/{metric}: {value} ({n}/{row['seeds']} seeds)", flush=True)
                for stat in ROBUST:
                    point = row[stat] if stat in row else row[f"{stat}_mean"]
                    lo, hi = row.get(f"{stat}_lo"), row.get(f"{stat}_hi")
                    value = f"{float(point):.3g} [{float(lo):.3g}, {float(hi):.3g}]" if point and lo else "undefined"
                    print(f"{name}/{stat}_ci: {value}", flush=True)

if __name__ == "__main__":
    try:
        main()
    except UserError as exc:  # bad input (a method spec, an override, a run folder): one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
