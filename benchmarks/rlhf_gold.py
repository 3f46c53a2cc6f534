"""Language-model RL where the data matters: GRPO and the rollout filters on the
``sentiment-gold`` task, where the training reward (VADER) can be gamed and a gold reward judges
the completions independently (``rlinfluence.rlhf.reward.GoldSentimentReward``).

Every (method, seed) is one ``rlinfluence rlhf`` run (SmolLM2-135M-Instruct, LoRA, CPU seconds
with ``--clock cpu``), written to ``--out``/METHOD/; a finished run (its ``report.html``) is not
run again, so the script resumes. All methods run at the same learning rate (GRPO's, ``--lr``) in
the chosen step mode (``--equal-steps``: every method takes GRPO's number of optimiser steps).
Proxy and gold test rewards are measured before training and every ``--eval-every`` rounds.

Summary per method, over the seeds: final proxy and gold test reward (mean), the proxy - gold
gap, the paired probability that the method's final gold reward beats GRPO's (seeds paired, 95%
bootstrap interval) and its CPU seconds per round against GRPO's. ``name: value`` lines last.

    python benchmarks/rlhf_gold.py --seeds 1 2 3 4 5 --methods grpo iif-gold advantage-sign ... [--workers 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlinfluence.experiments.statistics import probability_of_improvement

METHODS: dict[str, list[str]] = {
    "grpo": ["--filter", "none"],
    "iif-proxy": ["--filter", "iif"],
    "iif-gold": ["--filter", "iif", "--target", "seq", "--target-source", "fresh", "--target-reward", "gold",
                 "--val-prompts", "16"],
    "dtv": ["--filter", "dtv"],
    "advantage-sign": ["--filter", "advantage-sign"],
    "pods": ["--filter", "pods", "--pods-keep", "2"],
    "random": ["--filter", "random", "--random-keep", "0.54"],
    "dynamic-sampling": ["--filter", "dynamic-sampling"],
}


def command(method: str, seed: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "rlinfluence.cli", "rlhf", "--task", "sentiment-gold", "--algo", "grpo",
            "--model", args.model, "--rounds", str(args.rounds), "--prompts-per-round", "8",
            "--response-length", "24", "--eval-every", str(args.eval_every), "--test-prompts", "50",
            "--learning-rate", str(args.lr), "--seed", str(seed), "--clock", "cpu", "--no-progress",
            "--method", method, "--run-root", str(Path(args.out) / method),
            *(["--equal-steps"] if args.equal_steps else []), *METHODS[method]]


def finished(method: str, seed: int, out: Path) -> Path | None:
    runs = sorted((out / method).glob(f"rlhf-*__{method}__{seed}__*"))
    done = [r for r in runs if (r / "report.html").is_file()]
    return done[-1] if done else None


def run(method: str, seed: int, args: argparse.Namespace) -> None:
    if finished(method, seed, Path(args.out)) is not None:
        return
    log = Path(args.out) / f"{method}_{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        subprocess.run(command(method, seed, args), stdout=f, stderr=subprocess.STDOUT, check=True)
    print(f"done: {method} seed {seed}", flush=True)


def final(run_dir: Path) -> dict[str, Any]:
    """The run's final test rewards, CPU seconds per round, and its test curves: theta(0), then
    after every evaluated round (proxy, gold)."""
    rows = pd.read_csv(run_dir / "metrics.csv")
    evaluated = rows.dropna(subset=["eval_gold_mean"])
    last = evaluated.iloc[-1]
    curve = [(0, float(rows["eval_return_mean_initial"].iloc[0]), float(rows["eval_gold_mean_initial"].iloc[0]))]
    curve += [(int(r["round"]) + 1, float(r["eval_return_mean"]), float(r["eval_gold_mean"])) for _, r in evaluated.iterrows()]
    return {"proxy": float(last["eval_return_mean"]), "gold": float(last["eval_gold_mean"]),
            "cpu_per_round": float(rows["train_seconds"].iloc[-1]) / len(rows), "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--equal-steps", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--model", default="builtin:smollm2-135m", help="builtin:tiny-gpt2 for a smoke test")
    parser.add_argument("--out", default="bench_out/rlhf_gold")
    args = parser.parse_args()
    jobs = [(m, s) for s in args.seeds for m in args.methods]
    with ThreadPoolExecutor(args.workers) as pool:
        for future in [pool.submit(run, m, s, args) for m, s in jobs]:
            future.result()
    out = Path(args.out)
    results = {m: {s: final(d) for s in args.seeds if (d := finished(m, s, out)) is not None} for m in args.methods}
    reference = results.get("grpo", {})
    lines = []
    for method, per_seed in results.items():
        if not per_seed:
            continue
        gold = np.array([r["gold"] for r in per_seed.values()])
        proxy = np.array([r["proxy"] for r in per_seed.values()])
        curves = np.array([[point[1:] for point in r["curve"]] for r in per_seed.values()])  # [seeds, evals, 2]
        after = " ".join(str(point[0]) for point in next(iter(per_seed.values()))["curve"][1:])
        print(f"{method} ({len(per_seed)} seeds), test reward before training and after rounds {after}:\n"
              f"  proxy {' '.join(f'{v:.3f}' for v in curves[:, :, 0].mean(0))}\n"
              f"  gold  {' '.join(f'{v:.3f}' for v in curves[:, :, 1].mean(0))}")
        lines += [f"final_gold_{method}: {gold.mean():.3f}", f"final_proxy_{method}: {proxy.mean():.3f}",
                  f"proxy_gold_gap_{method}: {(proxy - gold).mean():.3f}",
                  f"cpu_per_round_{method}: {np.mean([r['cpu_per_round'] for r in per_seed.values()]):.1f}"]
        shared = sorted(set(per_seed) & set(reference))
        if method != "grpo" and len(shared) >= 2:
            x = np.array([[per_seed[s]["gold"]] for s in shared])
            y = np.array([[reference[s]["gold"]] for s in shared])
            p, lo, hi = probability_of_improvement(x, y, paired=True)
            cpu = np.mean([per_seed[s]["cpu_per_round"] / reference[s]["cpu_per_round"] for s in shared])
            lines += [f"p_gold_beats_grpo_{method}: {p:.2f} [{lo:.2f}, {hi:.2f}] ({len(shared)} paired seeds)",
                      f"cpu_per_round_vs_grpo_{method}: {cpu:.2f}"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
