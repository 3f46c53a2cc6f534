"""Per-round picture of the IIF options in compare folders: return, approx_kl, step_scale and the
p that ``--drop-pct auto`` chose, mean +/- s.e. over the evaluation seeds (docs/results/variants.md,
"Robust IIF").

    python benchmarks/learning/robust_iif_plots.py bench_out/robust14/Acrobot-v1 --out docs/figures/iif-variants-acrobot.png

Ends with summary lines per method: ``<env>/<method>/approx_kl_ratio_to_ppo: x`` (mean approx_kl
over rounds and seeds, over the reference's), ``<env>/<method>/cpu_seconds_per_round: x`` and,
for auto, ``<env>/<method>/drop_pct_share_<p>: x`` (the share of rounds that chose p), and
``<env>/<method>/longest_stall_minus_ppo: x`` (the largest, over seed pairs, of the rounds a run
stays at its first-round return minus its PPO pair's), the reduction (%) of rounds to 80% of the
PPO pair's range per seed and how many seeds were slower than their PPO pair, and the approx_kl
ratio to PPO at the same learning rate (from the tuning runs).
"""

from __future__ import annotations

import json
import sys  # noqa: E402
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rlinfluence.analysis.report import ROUND_LABEL, round_axis
from rlinfluence.experiments import parse_methods
from rlinfluence.experiments.metrics import Curve, pair_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402


def stall(returns: np.ndarray) -> int:
    """Rounds before the eval return first leaves its round-0 value (Acrobot: -500)."""
    moved = np.flatnonzero(returns != returns[0])
    return int(moved[0]) if moved.size else len(returns)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("folder", type=Path, help="a compare output folder")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--reference", default="ppo")
    parser.add_argument("--title", default=None, help="plot title (default: the env)")
    a = parser.parse_args()
    plan = json.loads((a.folder / "compare.json").read_text())
    env = plan.get("env", a.folder.name)
    seeds = list(range(plan["first_seed"], plan["first_seed"] + plan["seeds"]))
    methods = [spec.label for spec in parse_methods(plan["methods"])]
    runs = {(m, s): pd.read_csv(a.folder / f"{m}__seed{s}" / "metrics.csv")
            for m in methods for s in seeds if (a.folder / f"{m}__seed{s}" / "metrics.csv").exists()}
    methods = [m for m in methods if all((m, s) in runs for s in seeds)]
    columns = [("eval_return_mean", "eval return"), ("approx_kl", "approx_kl"), ("step_scale", "step_scale"),
               ("drop_pct", "p chosen by auto (%)")]
    # a panel only where some method varies it (step_scale is 1 without step control)
    columns = [(c, label) for c, label in columns
               if any(c in runs[m, s] and runs[m, s][c].nunique() > 1 for m in methods for s in seeds)]
    fig = Figure(figsize=(9, 2.5 * len(columns)), layout="constrained")
    axes = fig.subplots(len(columns), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (column, label) in zip(axes, columns, strict=True):
        for i, m in enumerate(methods):
            if column not in runs[m, seeds[0]]:
                continue
            n = min(len(runs[m, s]) for s in seeds)
            y = np.stack([runs[m, s][column].to_numpy(dtype=float)[:n] for s in seeds])
            mean, se = np.nanmean(y, 0), np.nanstd(y, 0, ddof=1) / np.sqrt(len(seeds))
            ax.plot(np.arange(n), mean, label=m, color=f"C{i}")  # one colour per method in every panel
            ax.fill_between(np.arange(n), mean - se, mean + se, alpha=0.2, color=f"C{i}")
        ax.set_ylabel(label)
        if column == "approx_kl":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8, title=f"mean +/- s.e. over {len(seeds)} seeds", title_fontsize=8)
    round_axis(axes[-1], ROUND_LABEL)
    fig.suptitle(a.title or env)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)

    ref_kl = np.mean([runs[a.reference, s]["approx_kl"].mean() for s in seeds])
    for m in methods:
        kl = np.mean([runs[m, s]["approx_kl"].mean() for s in seeds])
        cpu = np.mean([runs[m, s]["train_cpu_seconds"].iloc[-1] / len(runs[m, s]) for s in seeds])
        worst = max(stall(runs[m, s]["eval_return_mean"].to_numpy())
                    - stall(runs[a.reference, s]["eval_return_mean"].to_numpy()) for s in seeds)
        print(f"{env}/{m}/approx_kl_ratio_to_{a.reference}: {kl / ref_kl:.2f}")
        print(f"{env}/{m}/cpu_seconds_per_round: {cpu:.3f}")
        print(f"{env}/{m}/longest_stall_minus_{a.reference}: {worst}")
        per_seed = [pair_metrics(Curve.from_run(a.folder / f"{a.reference}__seed{s}"),
                                 Curve.from_run(a.folder / f"{m}__seed{s}"))["se_80pct"] for s in seeds]
        slower = sum(r is None or r < 0 for r in per_seed)
        print(f"{env}/{m}/rounds_to_80pct_reduction_per_seed: "
              + ", ".join("unreached" if r is None else f"{r:.0f}" for r in per_seed))
        print(f"{env}/{m}/seeds_slower_than_{a.reference}_to_80pct: {slower}/{len(seeds)}")
        if "drop_pct" in runs[m, seeds[0]] and "auto" in m:
            chosen = pd.concat([runs[m, s]["drop_pct"] for s in seeds]).dropna()
            for p, share in chosen.value_counts(normalize=True).sort_index().items():
                print(f"{env}/{m}/drop_pct_share_{p:g}: {share:.2f}")
    same_lr_kl_ratios(a.folder, env, methods, a.reference)
    print(f"plot: {a.out}")


def same_lr_kl_ratios(folder: Path, env: str, methods: list[str], reference: str) -> None:
    """``<env>/<method>/approx_kl_ratio_same_lr_<lr>``: mean approx_kl over the tuning runs of a
    method at one learning rate, over the reference's at the same rate (step control's goal)."""
    tune = folder / "tune"
    if not tune.is_dir():
        return
    kl: dict[tuple[str, str], list[float]] = {}
    for run in tune.iterdir():
        label, _, seed = run.name.rpartition("__seed")
        method, _, lr = label.partition("@learning_rate=")
        if lr and (run / "metrics.csv").exists() and (run / "done.json").exists():
            kl.setdefault((method, lr), []).append(pd.read_csv(run / "metrics.csv")["approx_kl"].mean())
    for m in methods:
        for (method, lr), values in sorted(kl.items()):
            if method == m != reference and (reference, lr) in kl:
                print(f"{env}/{m}/approx_kl_ratio_same_lr_{lr}: {np.mean(values) / np.mean(kl[reference, lr]):.2f}")


if __name__ == "__main__":
    main()
