"""The RLHF speed claim of the IIF paper (IIF reaches the reward level about 4x sooner, with about
half the records filtered), measured against GRPO with each method at its own tuned lr.

    python benchmarks/lm/rlhf_speed.py --workers 2 --budget-minutes 120

Every run is one ``rlinfluence rlhf`` run of ``benchmarks/lm/rlhf_gold.py``'s set-up (SmolLM2-135M-
Instruct, LoRA, 8 prompts x 4 completions of at most 24 tokens a round, one pass of 4-sequence Adam
steps; CPU seconds of one torch thread with ``--clock cpu``) on ``--task sentiment-gold``, whose
training reward is VADER's sentiment score (the proxy; the gold reward is only logged). Arms:
``grpo`` and ``iif-proxy`` (the paper's IIF: the held-out half of the round's records as target,
every negative-scored record dropped), each in its natural step count (IIF takes fewer steps
when it drops records, as in the paper).

1. **tune**: each arm at each of ``--lrs`` on the tuning seeds, evaluated on the val prompts after
   every ``--eval-every`` rounds; an arm's lr is the one of its highest mean val proxy reward over
   the evaluations after training rounds (the test prompts play no part; a choice at the edge of
   the grid is printed as such).
2. **evaluate**: each arm at its own lr on the evaluation seeds ``--seeds``. A seed fixes the LoRA
   initialisation, the prompt order and round 0's samples, so the two runs of a seed are paired.

Speed is read off the training reward R(k), the mean VADER reward of the samples of theta(k)
(32 a round; one value per round, where the test reward is evaluated every ``--eval-every`` rounds
only), smoothed by a trailing mean over ``--window`` rounds. Per seed pair, with m(v) the rounds
trained when a curve first reaches v and T(v) its cumulative training CPU seconds then:

    level      = R(0) + 0.8 (R_grpo(last) - R(0))             80% of GRPO's gain on the training reward
    speed-up   = m_grpo(level) / m_iif(level)                   the paper's "x times sooner" (CPU: T)

A run that never reaches the level counts as reaching it one round after its last (its time is a
lower bound: ``rlinfluence.experiments.metrics.time_to_level``), so a seed that never gets there
still counts; the summary says how many did. Across seeds: the geometric mean speed-up with a 95%
t interval on ln(speed-up), the paired difference of the final test reward (proxy and gold, 100
test prompts) and of CPU seconds per round. ``name: value`` lines last.

Results: one row per (run, round) in ``--results`` (training reward, cumulative CPU seconds, kept
fraction, the val or test evaluations); a run already there is not run again, so the comparison
resumes from that file; a run cut off after a round continues from its last checkpoint.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from rlinfluence.experiments.metrics import smooth, time_to_level  # noqa: E402
from rlinfluence.statistics import ci95  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402
from rlhf_gold import KEY, Results, own_choices, run_all  # noqa: E402  (benchmarks/lm/rlhf_gold.py)

ARMS = ("grpo", "iif-proxy")
REFERENCE = "grpo"
FRACTION = 0.8


def round_rows(job: dict, run_dir: Path) -> pd.DataFrame:
    """One row per training round of a finished run: the training reward of theta(k)'s samples,
    the cumulative training seconds after round k's update, the kept fraction, and the
    evaluation after round k where there was one (``eval_*_initial``: theta(0)'s, on every row)."""
    rows = pd.read_csv(run_dir / "metrics.csv")
    return pd.DataFrame({
        **{name: job[name] for name in KEY},
        "round": rows["round"], "train_reward": rows["reward_mean"], "train_seconds": rows["train_seconds"],
        "kept_fraction": rows["kept_fraction"], "eval_proxy": rows["eval_return_mean"],
        "eval_gold": rows["eval_gold_mean"], "eval_proxy_initial": rows["eval_return_mean_initial"].iloc[0],
        "eval_gold_initial": rows["eval_gold_mean_initial"].iloc[0],
    })


def pair_speed(reference: pd.DataFrame, other: pd.DataFrame, window: int) -> dict[str, float] | None:
    """One seed pair's speed-up (module docstring), from each run's rows sorted by round; None when
    the reference gained nothing (no level). Row k's training reward is theta(k)'s, so the curve
    from row 1 on is indexed by rounds trained, and row k-1's cumulative seconds are the time it
    took to get theta(k)."""
    start = float(reference["train_reward"].iloc[0])
    ref_curve = smooth(reference["train_reward"].to_numpy(), window)[1:]
    other_curve = smooth(other["train_reward"].to_numpy(), window)[1:]
    if ref_curve[-1] <= start:
        return None
    level = start + FRACTION * (ref_curve[-1] - start)
    (m_ref, ref_reached), (m_other, other_reached) = time_to_level(ref_curve, level), time_to_level(other_curve, level)

    def seconds(rows: pd.DataFrame, m: int) -> float:  # m = len + 1 (never reached): all of the run, a lower bound
        return float(rows["train_seconds"].iloc[min(m, len(rows)) - 1])

    return {"level": level, "rounds_grpo": m_ref, "rounds_iif": m_other, "grpo_reached": ref_reached,
            "iif_reached": other_reached, "log_speedup_rounds": math.log(m_ref / m_other),
            "log_speedup_cpu": math.log(seconds(reference, m_ref) / seconds(other, m_other))}


def summarise(frame: pd.DataFrame, chosen: dict[str, float], window: int) -> tuple[pd.DataFrame, list[str]]:
    """The per-seed table (one row a seed pair) and the ``name: value`` lines."""
    runs = frame[frame["phase"] == "eval"]
    by_arm = {arm: runs[(runs["method"] == arm) & np.isclose(runs["lr"].astype(float), chosen[arm])] for arm in ARMS}
    seeds = sorted(set(by_arm[REFERENCE]["seed"].astype(int)) & set(by_arm["iif-proxy"]["seed"].astype(int)))
    per_seed = []
    for seed in seeds:
        ref, iif = (by_arm[arm][by_arm[arm]["seed"].astype(int) == seed].sort_values("round") for arm in ARMS)
        speed = pair_speed(ref, iif, window)
        final = {f"{name}_{arm}": float(rows[f"eval_{name}"].dropna().iloc[-1])
                 for arm, rows in zip(ARMS, (ref, iif), strict=True) for name in ("proxy", "gold")}
        # the training reward over the run: theta(1) ... theta(R-1)'s samples (an auc of the training curve)
        over_run = {f"train_reward_{arm}": float(rows["train_reward"].iloc[1:].mean())
                    for arm, rows in zip(("grpo", "iif"), (ref, iif), strict=True)}
        per_seed.append({"seed": seed, **(speed or {}), **final, **over_run,
                         "cpu_per_round_grpo": float(ref["train_seconds"].iloc[-1]) / len(ref),
                         "cpu_per_round_iif": float(iif["train_seconds"].iloc[-1]) / len(iif),
                         "kept_fraction_iif": float(iif["kept_fraction"].mean())})
    table = pd.DataFrame(per_seed)
    lines = [f"seeds: {len(table)}"]
    if not len(table):
        return table, lines
    with_level = table.dropna(subset=["level"]) if "level" in table else table.iloc[:0]
    lines.append(f"pairs_without_level: {len(table) - len(with_level)} (GRPO gained nothing on the training reward)")
    if len(with_level) > 1:
        for clock in ("rounds", "cpu"):
            mean, lo, hi = ci95(with_level[f"log_speedup_{clock}"].to_numpy(dtype=float))
            lines.append(f"speedup_{clock}_iif_over_grpo: {math.exp(mean):.2f}x [{math.exp(lo):.2f}, {math.exp(hi):.2f}] "
                         f"({len(with_level)} pairs, IIF sooner in {int((with_level[f'log_speedup_{clock}'] > 0).sum())})")
        lines += [f"rounds_to_level_grpo: {with_level['rounds_grpo'].mean():.2f}",
                  f"rounds_to_level_iif: {with_level['rounds_iif'].mean():.2f} "
                  f"(reached in {int(with_level['iif_reached'].sum())} of {len(with_level)})"]
    if len(table) > 1:
        mean, lo, hi = ci95((table["train_reward_iif"] - table["train_reward_grpo"]).to_numpy(dtype=float))
        lines.append(f"train_reward_over_run_iif_minus_grpo: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                     f"({len(table)} seeds, IIF higher in {int((table['train_reward_iif'] > table['train_reward_grpo']).sum())})")
        for name in ("proxy", "gold"):
            mean, lo, hi = ci95((table[f"{name}_iif-proxy"] - table[f"{name}_grpo"]).to_numpy(dtype=float))
            lines.append(f"final_test_{name}_iif_minus_grpo: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] ({len(table)} seeds)")
    lines += [f"cpu_per_round_iif_over_grpo: {(table['cpu_per_round_iif'] / table['cpu_per_round_grpo']).mean():.2f}",
              f"kept_fraction_iif: {table['kept_fraction_iif'].mean():.2f}"]
    return table, lines


def selection_lines(selection: pd.DataFrame, lr: float) -> list[str]:
    """What IIF kept against what it dropped, within prompt groups (``rlhf_gold.selection_rows``):
    the mean over seeds of kept minus dropped gold and proxy advantage, with 95% t intervals."""
    runs = selection[(selection["phase"] == "eval") & np.isclose(selection["lr"].astype(float), lr)] \
        if len(selection) else selection
    lines = []
    for name in ("proxy", "gold"):
        values = runs[f"kept_minus_dropped_{name}_advantage"].dropna().to_numpy(dtype=float) if len(runs) else []
        if len(values) > 1:
            mean, lo, hi = ci95(values)
            lines.append(f"kept_minus_dropped_{name}_advantage_iif: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] ({len(values)} seeds)")
    return lines


def per_seed_markdown(table: pd.DataFrame) -> str:
    """One row a seed pair: rounds to the level (">" where the run never got there: a lower bound),
    the speed-ups, the training reward over the run, the final test rewards, IIF's kept fraction."""
    out = ["| seed | level | rounds GRPO / IIF | speed-up, rounds / CPU | training reward over the run, GRPO / IIF "
           "| final test proxy, GRPO / IIF | final test gold, GRPO / IIF | IIF kept |", "|---|---|---|---|---|---|---|---|"]
    for row in table.to_dict("records"):
        if np.isnan(row.get("level", np.nan)):
            level, rounds, speed = "-", "- (GRPO gained nothing)", "-"
        else:
            level = f"{row['level']:.3f}"
            rounds = " / ".join(("" if reached else ">") + str(int(row[f"rounds_{arm}"]))
                                for arm, reached in (("grpo", row["grpo_reached"]), ("iif", row["iif_reached"])))
            speed = f"{math.exp(row['log_speedup_rounds']):.2f}x / {math.exp(row['log_speedup_cpu']):.2f}x"
        out.append(f"| {row['seed']} | {level} | {rounds} | {speed} | {row['train_reward_grpo']:.3f} / "
                   f"{row['train_reward_iif']:.3f} | {row['proxy_grpo']:.3f} / {row['proxy_iif-proxy']:.3f} | "
                   f"{row['gold_grpo']:.3f} / {row['gold_iif-proxy']:.3f} | {row['kept_fraction_iif']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 11)))
    parser.add_argument("--tune-seeds", nargs="+", type=int, default=[1001])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--window", type=int, default=3, help="trailing mean of the training reward (rounds)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--budget-minutes", type=float, default=float("inf"), help="start no run after this long")
    parser.add_argument("--model", default="builtin:smollm2-135m", help="builtin:tiny-gpt2 for a smoke test")
    parser.add_argument("--device", default="cpu", help="cpu (CPU seconds, one thread), cuda or cuda:N (wall seconds)")
    parser.add_argument("--results", default="docs/data/rlhf_speed_runs.csv")
    parser.add_argument("--selection", default="docs/data/rlhf_speed_selection.csv",
                        help="per IIF run, what it kept judged by gold and proxy (rlhf_gold.selection_rows)")
    parser.add_argument("--markdown", help="write the per-seed table and the summary lines to this file (the docs include it)")
    parser.add_argument("--scratch", default="bench_out/rlhf_speed", help="the run folders, not committed")
    args = parser.parse_args()
    # what rlhf_gold.command reads: the task, its tuning split and IIF-gold's val prompts (unused here)
    args.task, args.tune_split, args.val_prompts = "sentiment-gold", "val", 4
    deadline = time.monotonic() + 60 * args.budget_minutes
    results, selection = Results(Path(args.results)), Results(Path(args.selection))

    def own_tuning() -> tuple[dict[str, list[float]], dict[str, float], list[str]]:
        frame = results.frame
        tune = frame[frame["phase"] == "tune"].dropna(subset=["eval_proxy"]) if len(frame) else frame
        return own_choices(tune, ARMS, args.lrs, args.tune_seeds, "eval_proxy")

    def wanted() -> list[dict]:  # the arms still tuning (on a widened grid too), then each settled arm's pairs
        grids, chosen, _ = own_tuning()
        return ([dict(phase="tune", method=arm, seed=s, lr=lr, mode="natural")
                 for s in args.tune_seeds for arm in ARMS if arm not in chosen for lr in grids[arm]]
                + [dict(phase="eval", method=arm, seed=s, lr=chosen[arm], mode="natural")
                   for s in args.seeds for arm in ARMS if arm in chosen])

    run_all(wanted, args, results, selection, deadline, rows=round_rows)
    _, chosen, lines = own_tuning()
    if set(chosen) != set(ARMS):
        print("\n".join(lines) + "\ntuning incomplete: no summary until every arm's lr is settled")
        return
    print("\n".join(lines))
    table, summary = summarise(results.frame, chosen, args.window)
    summary += selection_lines(selection.frame, chosen["iif-proxy"])
    if args.markdown:
        Path(args.markdown).write_text(per_seed_markdown(table) + "\n```\n" + "\n".join(lines + summary) + "\n```\n")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    harness.summary(summary)


if __name__ == "__main__":
    main()
