"""LDS of saved rounds across envs, seeds, rounds and scorers (docs/analyses.md).

For every run directory under ``--runs`` (standard PPO trained with ``--save-buffers``) and each
of ``--rounds``, ``rlinfluence.analysis.validation.validate_round`` scores round k by all four
scorers (snapshot with chunk / batch / none advantage normalisation, full TracIn), retrains it
from theta(k) on ``--subsets`` random halves (shared by the scorers) and reports, per scorer,

    LDS = Spearman(sum_{i in S} score_i, f(theta_S) - f(theta(k)))   (return target)

with its 95% bootstrap interval, and the drop test (lowest-scored p% vs random p%). Then one
validation with the CLI's defaults (snapshot/batch, 30 subsets, 5 random draws) is timed per
env, wall and process CPU seconds. Single-threaded (``torch.set_num_threads(1)``). Writes
``lds.csv``, ``drops.csv`` and ``timing.csv`` into ``--out``, saves each run's section into its
``analyses/`` (``rlinfluence report`` shows it) and ends with one ``name: value`` line per figure.

    python benchmarks/attribution/lds.py --runs bench_out/lds/runs --rounds 0,4,8,11 --out bench_out/lds
"""

from __future__ import annotations

import sys  # noqa: E402
import time
from pathlib import Path

import pandas as pd
import torch

from rlinfluence.analysis.intervention import parse_rounds
from rlinfluence.analysis.report import ANALYSES_DIR, save_section
from rlinfluence.analysis.validation import (
    SCORERS,
    drop_rows,
    lds_rows,
    validate_round,
    validate_rounds,
    validation_section,
)
from rlinfluence.rundir import atomic_write

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402


def timed_default(run_dir: Path, k: int) -> dict[str, object]:
    """Wall and CPU seconds of one validation with the CLI's defaults, load included."""
    wall, cpu = time.perf_counter(), time.process_time()
    r = validate_round(run_dir, k)
    return {"env": r.env, "run": r.run, "round": k, "retrains": r.result.retrains + 1,
            "wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}


def summary_lines(lds: pd.DataFrame, drops: pd.DataFrame, timing: pd.DataFrame) -> list[str]:
    """``name: value`` per figure of docs/analyses.md."""
    lines = []
    for (env, scorer), g in lds.groupby(["env", "scorer"], sort=False):
        for k, gk in g.groupby("round"):
            lines.append(f"lds {env} {scorer} round {k} (mean over {len(gk)} seeds): "
                         f"{gk['lds'].mean():+.3f}")
        excludes = int((g["lds_low"] > 0).sum())
        lines.append(f"lds {env} {scorer} mean over rounds and seeds: {g['lds'].mean():+.3f}")
        lines.append(f"lds {env} {scorer} intervals above 0: {excludes} of {len(g)}")
    for scorer, g in lds.groupby("scorer", sort=False):
        lines.append(f"lds all envs {scorer} mean: {g['lds'].mean():+.3f}")
    merged = drops.merge(lds[["run", "env", "round", "scorer"]], on=["run", "round", "scorer"])
    for (env, scorer, pct), g in merged.groupby(["env", "scorer", "pct"], sort=False):
        lowest = (g["lowest_change"] - g["full_change"]).mean()
        random = (g["random_mean"] - g["full_change"]).mean()
        wins = int((g["lowest_change"] > g["random_mean"]).sum())
        lines.append(f"drop {env} {scorer} {pct:g}%: lowest - full {lowest:+.4g}, random - full "
                     f"{random:+.4g}, lowest > random in {wins} of {len(g)}")
    rounds = lds.drop_duplicates(["run", "round"])
    lines.append(f"retrain reproduces theta(k+1): {int(rounds['reproduces_run'].sum())} of "
                 f"{len(rounds)}")
    for scorer, g in lds.groupby("scorer", sort=False):
        lines.append(f"score seconds {scorer} (median): {g['score_seconds'].median():.3f}")
    for _, t in timing.iterrows():
        lines.append(f"seconds one default validation {t['env']} ({t['retrains']} retrains): "
                     f"wall {t['wall_seconds']:.1f}, cpu {t['cpu_seconds']:.1f}")
    return lines


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--runs", type=Path, default=Path("bench_out/lds/runs"))
    parser.add_argument("--rounds", default="0,4,8,11")
    parser.add_argument("--subsets", type=int, default=30)
    parser.add_argument("--random-draws", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_out/lds"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = parse_rounds(args.rounds)
    runs = sorted(p for p in args.runs.iterdir() if (p / "config.json").is_file())
    results, first_per_env = [], {}
    for run_dir in runs:
        own = validate_rounds(run_dir, rounds, progress=True, scorers=SCORERS,
                              subsets=args.subsets, random_draws=args.random_draws)
        save_section(run_dir / ANALYSES_DIR, validation_section(own))
        first_per_env.setdefault(own[0].env, run_dir)
        results += own
    lds, drops = lds_rows(results), drop_rows(results)
    middle = rounds[len(rounds) // 2]
    timing = pd.DataFrame([timed_default(run_dir, middle) for run_dir in first_per_env.values()])
    args.out.mkdir(parents=True, exist_ok=True)
    for name, frame in (("lds", lds), ("drops", drops), ("timing", timing)):
        atomic_write(args.out / f"{name}.csv", lambda p, frame=frame: frame.to_csv(p, index=False))
    harness.summary(summary_lines(lds, drops, timing))


if __name__ == "__main__":
    main()
