"""Quarantine inside RLlib's PPO: does ``run_callback(..., quarantine=True)`` drop the broken env
runner's sub-env before the Learner's update, how soon, and does it drop a clean one?

RLlib's PPO as in ``hidden_faults.py --trainer rllib`` (its defaults but 2 env runners x 4 sub-envs
and 2048 steps an iteration, CartPole), one held-out kind of the second held-out set wrapping one
sub-env chosen by the seed, ``quarantine=True`` (``QuarantineFilter``: window 6, alpha 0.01 per
round); clean runs beside them. Per run, from the rounds' ``keep`` masks: the first round whose
update went without the broken sub-env, the share of rounds it was dropped from, and every clean
sub-env dropped at any round (a false quarantine).

    python benchmarks/faults/rllib_quarantine.py --seeds 3 --clean-seeds 3 --rounds 8 --out bench_out/rllib_quarantine

Rows go to ``<out>/runs.csv`` as runs finish (a re-run skips finished ones). Ends with the summary
lines ``<kind>/quarantined_within_5: k/n``, ``<kind>/rounds_quarantined_share: x`` and
``clean/runs_with_a_false_quarantine: k/n``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402
import held_out_faults  # noqa: E402
from hidden_faults import HELD_OUT, _train_rllib, append_row, finished  # noqa: E402

WITHIN = 5


def run_one(fault: str | None, seed: int, rounds: int, out: Path) -> dict:
    from rlinfluence.rundir import RunDirectory

    scratch = out / "scratch" / f"{fault or 'clean'}__{seed}".replace(":", "_")
    shutil.rmtree(scratch, ignore_errors=True)
    path, broken, _ = _train_rllib("CartPole-v1", fault, seed, rounds, scratch, quarantine=True)
    run = RunDirectory.at(path, tensorboard=False)
    dropped = []
    for k in range(rounds):
        keep = run.load_buffer(k)["keep"].reshape(8, -1)  # flat order is env-major: a row per source
        dropped.append(set(np.flatnonzero(~keep.all(1).numpy()).tolist()))
    hits = [k + 1 for k, d in enumerate(dropped) if broken & d]
    false = sorted({s for d in dropped for s in d} - broken)
    row = {"fault": fault or "clean", "seed": seed, "rounds": rounds, "broken": " ".join(map(str, sorted(broken))),
           "first_round": hits[0] if hits else np.nan, "rounds_quarantined": len(hits),
           "false_quarantines": " ".join(map(str, false))}
    shutil.rmtree(scratch, ignore_errors=True)
    append_row(out / "runs.csv", row)
    return row


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3, help="fault seeds per kind (the protocol's, from its first)")
    parser.add_argument("--clean-seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="bench_out/rllib_quarantine")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds, seeds, fault_seeds = held_out_faults.PROTOCOLS[3]
    jobs = [(f"{HELD_OUT}{kind}", seed) for seed in list(fault_seeds)[:args.seeds] for kind in kinds]
    jobs += [(None, seed) for seed in list(seeds)[:args.clean_seeds]]
    done = finished(out / "runs.csv", ["fault", "seed"])
    for fault, seed in jobs:
        if (fault or "clean", seed) not in done:
            row = run_one(fault, seed, args.rounds, out)
            print(f"{row['fault']} seed {seed}: first round {row['first_round']}, dropped in {row['rounds_quarantined']} "
                  f"rounds, false {row['false_quarantines'] or '-'}", flush=True)
    runs = pd.read_csv(out / "runs.csv", dtype={"false_quarantines": str})
    runs["false_quarantines"] = runs["false_quarantines"].fillna("")
    lines = []
    for fault, group in runs[runs["fault"] != "clean"].groupby("fault"):
        kind = fault.removeprefix(HELD_OUT)
        within = int((group["first_round"] <= WITHIN).sum())
        share = (group["rounds_quarantined"] / group["rounds"]).mean()
        lines += [f"{kind}/quarantined_within_{WITHIN}: {within}/{len(group)}", f"{kind}/rounds_quarantined_share: {share:.2f}",
                  f"{kind}/runs_with_a_false_quarantine: {int((group['false_quarantines'] != '').sum())}/{len(group)}"]
    clean = runs[runs["fault"] == "clean"]
    lines.append(f"clean/runs_with_a_false_quarantine: {int((clean['false_quarantines'] != '').sum())}/{len(clean)}")
    harness.summary(lines)


if __name__ == "__main__":
    main()
