"""What a filter kept on a trigger task (``--task sentiment-trigger`` or ``sentiment-trigger-penalised``):
of every training completion of a ``benchmarks/lm/rlhf_gold.py`` run (all rounds), how many say the
word the reward model pays for (``rlinfluence.rlhf.reward.TRIGGER_WORD``) and how many of those,
of those the update pushes up (reward above their group's mean: the ones that teach the word), and
of the rest, the update kept. A filter that stops the bug keeps fewer of the first two.

    python benchmarks/lm/rlhf_trigger_kept.py --scratch bench_out/rlhf_trigger_penalised \\
        --out docs/data/rlhf_trigger_penalised_pilot_kept.csv

One row per finished run folder (``<phase>_<method>_<seed>_<lr>_<mode>``, as ``rlhf_gold.py`` names them);
then, per method, ``name: value`` lines of the kept share of each kind over its runs.
"""

from __future__ import annotations

import json
import sys  # noqa: E402
from pathlib import Path

import numpy as np
import pandas as pd

from rlinfluence.rlhf.report import load_completions, saved_rounds
from rlinfluence.rlhf.reward import TriggerReward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402


def kept_by_kind(run_dir: Path, group_size: int = 4) -> dict[str, int]:
    """Counts over every saved round of ``run_dir``: completions that say the word, of them kept, and
    of them those the update pushes up (reward above their group's mean, groups of ``group_size``
    consecutive completions) and of those kept; the rest, of them kept."""
    said = TriggerReward().triggered
    rounds = [load_completions(run_dir, r) for r in saved_rounds(run_dir)]
    c = pd.concat(rounds, ignore_index=True)
    group = np.concatenate([np.arange(len(r)) // group_size + 10**6 * i for i, r in enumerate(rounds)])
    up = (c["reward"] > c.groupby(group)["reward"].transform("mean")).to_numpy(bool)
    trigger = said(c["response"].tolist()).numpy()
    kept = c["kept"].to_numpy(bool)
    return {"trigger": int(trigger.sum()), "trigger_kept": int((trigger & kept).sum()),
            "trigger_up": int((trigger & up).sum()), "trigger_up_kept": int((trigger & up & kept).sum()),
            "rest": int((~trigger).sum()), "rest_kept": int((~trigger & kept).sum())}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--scratch", required=True, help="rlhf_gold.py's --scratch folder")
    parser.add_argument("--out", required=True, help="the per-run CSV to write")
    args = parser.parse_args()
    rows = []
    for root in sorted(Path(args.scratch).iterdir()):
        runs = list(root.glob("rlhf-*"))
        if len(runs) != 1 or len(saved_rounds(runs[0])) < json.loads((runs[0] / "config.json").read_text())["rounds"]:
            continue  # not a finished run
        phase, method, seed, lr, mode = root.name.split("_")
        rows.append({"phase": phase, "method": method, "seed": int(seed), "lr": float(lr), "mode": mode,
                     **kept_by_kind(runs[0])})
    if not rows:
        raise SystemExit(f"no finished run under {args.scratch}")
    frame = pd.DataFrame(rows)
    frame.to_csv(args.out, index=False)
    for method, runs in frame.groupby("method", sort=False):
        total = runs.drop(columns=["phase", "method", "seed", "lr", "mode"]).sum()
        print(f"kept_share_trigger_{method}: {total.trigger_kept / total.trigger:.2f} (of {total.trigger})")
        print(f"kept_share_trigger_pushed_up_{method}: {total.trigger_up_kept / total.trigger_up:.2f} "
              f"(of {total.trigger_up})")
        print(f"kept_share_rest_{method}: {total.rest_kept / total.rest:.2f} (of {total.rest})")


if __name__ == "__main__":
    main()
