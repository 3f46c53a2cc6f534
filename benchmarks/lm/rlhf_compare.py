"""Summarise `rlinfluence rlhf` runs: the standard method (GRPO, PPO) against the same method + IIF.

    python benchmarks/lm/rlhf_compare.py bench_out/rlhf15c bench_out/rlhf15 --png docs/figures/lm-grpo-vs-iif-speed.png

Reads every finished run directory under the given folders (``config.json`` + ``metrics.csv``
with ``rounds`` rows; the newest per (algo, filter, seed)) and pairs the runs of a seed: the
same seed means the same LoRA initialisation, prompt order and round-0 sampling noise. Per
pair, with m(v) = rounds trained when a curve first reaches v and T(v) its cumulative training
seconds (the runs' own clock: CPU seconds with ``--clock cpu``):

    level      = R_0 + 0.8 (R_std(final) - R_0)          80% of the standard method's final gain
    reduction  = 1 - m_iif(level) / m_std(level)          rounds, in percent (time: T instead of m)

on two curves: the mean test reward (evaluated every ``eval_every`` rounds, so m is known to
that resolution) and the training reward (mean reward of the round's own samples, one value per
round, of the samples of theta(k) drawn before round k's update, so at k rounds trained;
smoothed by a trailing mean over ``--window`` rounds; R_std(final) = its last value).
The training-reward level starts from the raw round-0 value (the trailing mean of one round)
and ends at the trailing mean of the last rounds, which lags the policy by about
(window - 1) / 2 rounds. The test-reward reductions move in steps of ``eval_every`` rounds.

A pair whose standard run gained nothing has no level; a pair whose IIF run never reaches the
level has no reduction: both are counted and printed, and the reduction's interval is over the
pairs where both runs reached it only (a censored pair is IIF's worst case, so that mean is
optimistic for IIF). Across seeds: means with 95% t intervals
(``rlinfluence.statistics.ci95``); the
paired difference iif - std of the final test reward and of its mean over the evaluations, with
the number of seeds where IIF is higher; and, unpaired, rliable's probability of improvement
P(iif > std) (every IIF seed against every standard seed). With 3 seeds these intervals are wide.

Paired runs must agree on every setting but the filter (an error names the first that
differs); the newest run (by the time stamp in its name) of each (algo, filter, seed) is used.

Ends with one ``name: value`` line per figure.
"""

from __future__ import annotations

import json
import sys  # noqa: E402
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from rlinfluence.experiments.metrics import first_reach, smooth
from rlinfluence.statistics import ci95, probability_of_improvement

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

FRACTION = 0.8
UNPAIRED_SETTINGS = ("filter", "run_root", "method", "drop_pct", "drop_mode", "target", "target_source",
                     "score_value_loss", "val_prompts")  # IIF-only settings may differ from the standard run's


def finished_runs(folders: Sequence[Path]) -> dict[tuple[str, str, int], Path]:
    """(algo, filter, seed) -> the newest run directory with all its rounds logged."""
    found: dict[tuple[str, str, int], Path] = {}
    for folder in folders:
        for config_path in sorted(folder.glob("rlhf-*/config.json")):
            config = json.loads(config_path.read_text())
            metrics = config_path.parent / "metrics.csv"
            if not metrics.exists() or len(pd.read_csv(metrics)) < config["rounds"]:
                continue
            key = (config["algo"], config["filter"], int(config["seed"]))
            if key not in found or _stamp(config_path.parent) > _stamp(found[key]):
                found[key] = config_path.parent
    return found


def _stamp(run_dir: Path) -> str:
    """The run directory's time stamp (its name ends in ``__<YYYYmmdd-HHMMSS>``)."""
    return run_dir.name.rsplit("__", 1)[-1]


def check_paired(std: Run, iif: Run) -> None:
    """SystemExit naming the first setting (other than the filter's own) the two runs differ in."""
    for key in sorted(set(std.config) | set(iif.config)):
        if key not in UNPAIRED_SETTINGS and std.config.get(key) != iif.config.get(key):
            raise SystemExit(f"error: {std.path} and {iif.path} differ in {key}: "
                             f"{std.config.get(key)!r} vs {iif.config.get(key)!r}")


class Run:
    """One run's curves: test reward at the evaluations, training reward, KL, seconds per round."""

    def __init__(self, path: Path, window: int):
        rows = pd.read_csv(path / "metrics.csv")
        self.path = path
        self.config = json.loads((path / "config.json").read_text())
        evaluated = rows["eval_return_mean"].notna().to_numpy()
        self.eval_rounds = np.concatenate([[0], rows["round"].to_numpy()[evaluated] + 1])  # rounds trained
        self.test = np.concatenate([[rows["eval_return_mean_initial"].iloc[0]], rows["eval_return_mean"][evaluated]])
        self.seconds = rows["train_seconds"].to_numpy(float)  # cumulative, after each round
        self.train_reward = smooth(rows["reward_mean"].to_numpy(float), window)
        self.kl = rows["kl"].to_numpy(float)
        self.kept = rows["kept_fraction"].to_numpy(float)

    def seconds_at(self, rounds: int) -> float:
        return 0.0 if rounds == 0 else float(self.seconds[rounds - 1])


def first_rounds(rounds: np.ndarray, curve: np.ndarray, level: float) -> int | None:
    """Rounds trained at the first point of ``curve`` (taken after ``rounds``) at or above ``level``."""
    hit = first_reach(curve, level)
    return None if hit is None else int(rounds[hit - 1])


def pair_figures(std: Run, iif: Run) -> dict[str, float | None]:
    """Reductions (percent) in rounds and seconds to 80% of the standard run's final gain."""
    out: dict[str, float | None] = {}
    per_round = np.arange(len(std.train_reward))  # round k's samples come from theta(k): k rounds trained
    for name, xs, s_curve, i_curve, start in (
        ("test", std.eval_rounds, std.test, iif.test, float(std.test[0])),
        ("train", per_round, std.train_reward, iif.train_reward, float(std.train_reward[0])),
    ):
        gain = float(s_curve[-1]) - start
        level = start + FRACTION * gain
        m_std = first_rounds(xs, s_curve, level) if gain > 0 else None
        m_iif = first_rounds(xs, i_curve, level) if m_std is not None else None
        out[f"{name}_level"] = level
        out[f"{name}_rounds_std"], out[f"{name}_rounds_iif"] = m_std, m_iif
        ok = m_std is not None and m_iif is not None and m_std > 0
        out[f"{name}_round_reduction"] = 100 * (1 - m_iif / m_std) if ok else None
        out[f"{name}_seconds_reduction"] = (100 * (1 - iif.seconds_at(m_iif) / std.seconds_at(m_std)) if ok else None)
    return out


def interval(values: Sequence[float], fmt: str = ".3f") -> str:
    point, low, high = ci95(values)
    return f"{point:{fmt}} [{low:{fmt}}, {high:{fmt}}]" if len(values) > 1 else f"{point:{fmt}} (n=1)"


def plot(pairs: dict[str, dict[int, tuple[Run, Run]]], path: Path) -> None:
    """Per algo: test reward, training reward and KL per round, mean +/- s.e. over the paired seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(pairs), 3, figsize=(14, 3.6 * len(pairs)), squeeze=False)
    for row, (algo, by_seed) in zip(axes, pairs.items(), strict=True):
        for side, colour in ((0, "tab:blue"), (1, "tab:red")):
            group = [pair[side] for pair in by_seed.values()]
            label = f"{algo}{' + iif' if side else ''} ({len(group)} seeds)"
            for ax, x, ys in (
                (row[0], group[0].eval_rounds, [r.test for r in group]),
                (row[1], np.arange(len(group[0].train_reward)), [r.train_reward for r in group]),
                (row[2], np.arange(len(group[0].kl)), [r.kl for r in group]),
            ):
                y = np.vstack(ys)
                mean, se = y.mean(0), (y.std(0, ddof=1) / np.sqrt(len(y)) if len(y) > 1 else np.zeros(y.shape[1]))
                ax.plot(x, mean, color=colour, label=label, marker="o" if ax is row[0] else None)
                ax.fill_between(x, mean - se, mean + se, color=colour, alpha=0.2)
        test_prompts = next(iter(by_seed.values()))[0].config["test_prompts"]
        for ax, title in zip(row, (f"test reward ({test_prompts} test prompts)", "training reward (trailing mean)",
                                   "KL to the reference (per sequence)"), strict=True):
            ax.set_title(f"{algo.upper()}: {title}", fontsize=10)
            ax.set_xlabel("rounds trained (samples of theta(k) after k rounds)")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8, title="mean +/- s.e. over seeds", title_fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, sentiment task: standard vs + IIF (shared seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=3, help="trailing mean of the training reward (rounds)")
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    paths = finished_runs(args.folders)
    runs = {key: Run(path, args.window) for key, path in paths.items()}
    algos = [a for a in ("grpo", "ppo") if any(k[0] == a for k in runs)]
    for key, run in sorted(runs.items()):
        print(f"# {key[0]} {key[1]} seed {key[2]}: {run.path}")
    lines: list[str] = []
    paired: dict[str, dict[int, tuple[Run, Run]]] = {}
    for algo in algos:
        seeds = sorted(s for (a, f, s) in runs if a == algo and f == "none" and (a, "iif", s) in runs)
        if not seeds:
            continue
        pairs = paired[algo] = {s: (runs[(algo, "none", s)], runs[(algo, "iif", s)]) for s in seeds}
        for pair in pairs.values():
            check_paired(*pair)
        figures = {s: pair_figures(*pair) for s, pair in pairs.items()}
        print(f"\n## {algo}: {len(seeds)} seed pairs {seeds}")
        for s in seeds:
            std, iif = pairs[s]
            f = figures[s]
            print(f"seed {s}: test {np.round(std.test, 3).tolist()} vs iif {np.round(iif.test, 3).tolist()}; "
                  f"rounds to 80% (test, level {f['test_level']:.3f}) {f['test_rounds_std']} vs {f['test_rounds_iif']}, "
                  f"(train, level {f['train_level']:.3f}) {f['train_rounds_std']} vs {f['train_rounds_iif']}; "
                  f"seconds {std.seconds[-1]:.0f} vs {iif.seconds[-1]:.0f}; kept {iif.kept.mean():.3f}")
        window = args.window
        for side, tag in ((0, algo), (1, f"{algo}_iif")):
            group = [pairs[s][side] for s in seeds]
            lines += [
                f"{tag}_test_reward_initial: {interval([r.test[0] for r in group])}",
                f"{tag}_test_reward_final: {interval([r.test[-1] for r in group])}",
                f"{tag}_test_reward_mean_over_evals: {interval([r.test[1:].mean() for r in group])}",
                # round k's samples are theta(k)'s: the last rounds' are those of theta(R-window..R-1)
                f"{tag}_train_reward_last{window}: {interval([r.train_reward[-1] for r in group])}",
                f"{tag}_kl_last_round: {interval([r.kl[-1] for r in group])}",
                f"{tag}_train_seconds: {interval([r.seconds[-1] for r in group], '.0f')}",
            ]
        lines.append(f"{algo}_iif_kept_fraction_mean: {np.mean([pairs[s][1].kept.mean() for s in seeds]):.3f}")
        for name in ("test_round_reduction", "test_seconds_reduction", "train_round_reduction", "train_seconds_reduction"):
            values = [figures[s][name] for s in seeds if figures[s][name] is not None]
            text = interval(values, ".1f") if values else "undefined"
            lines.append(f"{algo}_iif_{name}_pct: {text} ({len(values)} of {len(seeds)} pairs reached the level)")
        for name, pick in (("final", lambda r: r.test[-1]), ("mean_over_evals", lambda r: r.test[1:].mean())):
            x = np.array([[pick(pairs[s][1])] for s in seeds])
            y = np.array([[pick(pairs[s][0])] for s in seeds])
            diff = (x - y)[:, 0]
            lines.append(f"{algo}_iif_minus_{algo}_test_reward_{name}: {interval(diff.tolist())} "
                         f"(paired; iif higher in {int((diff > 0).sum())} of {len(seeds)} seeds)")
            p, low, high = probability_of_improvement(x, y)
            lines.append(f"{algo}_iif_p_improvement_test_reward_{name}: {p:.2f} [{low:.2f}, {high:.2f}] (unpaired)")
    if args.png is not None:
        plot(paired, args.png)
        lines.append(f"figure: {args.png}")
    print()
    harness.summary(lines)


if __name__ == "__main__":
    main()
