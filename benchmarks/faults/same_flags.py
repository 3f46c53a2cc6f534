"""Do two runs tables of the hidden-faults benchmark flag the same? Run by run (env, fault, seed):
under each of the verdict's three arms (per audit, per run, per run at looks), the round of the
first flag, its reading and candidates, its signature and the false flags; and the flags of the
last audit. Then the audit's CPU seconds per run, B against A.

    python benchmarks/faults/same_flags.py docs/data/hidden_faults_held_out_v3_runs.csv bench_out/hf_sameflags_v3/runs.csv

Prints every run that differs (each differing column, A -> B), then the summary lines:
``runs_compared`` (the runs in both), ``runs_same`` (every compared column equal), ``same_<arm>`` per arm,
``same_final_flags``, ``audit_cpu_ratio_median`` (B's audit CPU seconds over A's, median over the
runs) and ``audit_cpu_seconds_median_a`` / ``_b``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

KEYS = ["env", "fault", "seed"]
ARMS = {"audit": "", "run": "seq_", "looks": "looks_"}
"""The verdict's arms and their columns' prefixes in the runs table (hidden_faults.py)."""
OUTCOME = ["verdict_round", "reading", "candidates", "signature", "false_flags"]


def differences(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, pd.Series]]:
    """(the runs of both tables, joined on env, fault, seed; per compared column, whether A and B
    agree on each run, two missing values agreeing)."""
    both = a.merge(b, on=KEYS, suffixes=("_a", "_b"), validate="one_to_one")
    columns = [prefix + column for prefix in ARMS.values() for column in OUTCOME] + ["final_flagged"]
    same = {}
    for column in columns:
        x, y = both[f"{column}_a"], both[f"{column}_b"]
        same[column] = (x == y) | (x.isna() & y.isna())
    return both, same


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("a", help="runs.csv of the reference (e.g. the published held-out runs)")
    parser.add_argument("b", help="runs.csv of the same runs measured again")
    args = parser.parse_args()
    a, b = pd.read_csv(args.a), pd.read_csv(args.b)
    both, same = differences(a, b)
    for i, row in both.iterrows():
        changed = [f"{c}: {row[f'{c}_a']!r} -> {row[f'{c}_b']!r}" for c, ok in same.items() if not ok[i]]
        if changed:
            print(f"{row['env']} {row['fault']} seed {row['seed']}: " + "; ".join(changed))
    everything = pd.concat(same, axis=1).all(axis=1)
    lines = [f"runs_compared: {len(both)}", f"runs_same: {int(everything.sum())}"]
    for arm, prefix in ARMS.items():
        arm_same = pd.concat([same[prefix + c] for c in OUTCOME], axis=1).all(axis=1)
        lines.append(f"same_{arm}: {int(arm_same.sum())}")
    lines.append(f"same_final_flags: {int(same['final_flagged'].sum())}")
    ratio = both["audit_cpu_s_b"] / both["audit_cpu_s_a"]
    lines += [f"audit_cpu_ratio_median: {ratio.median():.3f}",
              f"audit_cpu_seconds_median_a: {both['audit_cpu_s_a'].median():.3g}",
              f"audit_cpu_seconds_median_b: {both['audit_cpu_s_b'].median():.3g}"]
    harness.summary(lines)


if __name__ == "__main__":
    main()
