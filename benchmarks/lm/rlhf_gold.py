"""Language-model RL where the data matters: GRPO and the rollout filters on a gold task
(``--task`` one of ``rlinfluence.rlhf.data.GOLD_TASKS``), where the training reward (VADER, or
VADER with a bug) can be gamed and a gold reward judges the completions independently
(``rlinfluence.rlhf.reward``).

Two phases, each (method, seed, lr, step mode) one ``rlinfluence rlhf`` run (SmolLM2-135M-Instruct,
LoRA; on the CPU one torch thread and CPU seconds with ``--clock cpu``, with ``--device cuda``
wall seconds on the GPU):

1. **tune**: GRPO at each of ``--lrs`` on the tuning seeds ``--tune-seeds``, evaluated on the
   prompts of ``--tune-split`` (default val: the test prompts play no part in any choice); the
   chosen lr is the one with the highest mean *proxy* reward over the evaluations after training
   rounds (the reward a practitioner can see; the gold reward plays no part in the choice).
2. **evaluate**: every method of ``--methods`` at that lr (or at ``--eval-lr``: a number, a stress
   test where GRPO is known to game the proxy, or ``gap``: the smallest tuning lr at which GRPO's
   proxy - gold gap widened by ``--gap-threshold`` or more on the tuning seeds' val prompts, else
   the lr of the widest gap) on the evaluation seeds ``--seeds``, in the step modes of ``--modes``
   (``equal``: every method takes GRPO's number of optimiser steps; ``natural``: a filter trains on
   fewer steps). Jobs go seed by seed, so a cut-off comparison has every method on its first seeds.

With ``--own-lr`` every method is tuned, not only GRPO: each runs at every lr of its grid on the
tuning seeds (val prompts) and is evaluated at the lr of its own highest mean val proxy reward
after training rounds (``best_lrs``: the criterion GRPO's choice uses, the proxy a practitioner
sees); a choice at a grid's edge widens that grid (x2 or /2, up to ``MAX_GRID`` points) and tunes
again, so that every choice is interior. An arm's evaluation runs start as soon as its own choice
is settled, while other arms still tune (``schedule``).

Every finished run appends its test curve (proxy and gold before training and after every
``--eval-every`` rounds, on the 100 test prompts) and its CPU seconds per round to ``--results``
(CSV, one row per evaluation); a run already there is not run again, so the comparison resumes
from that file, across sessions too; a run cut off after a round (its folder under ``--scratch``)
continues from its last checkpoint. ``--budget-minutes`` stops starting new runs after that long.

Summary per method and mode over the evaluation seeds: final proxy and gold test reward, the
proxy - gold gap and how much it widened from theta(0) (the hack: proxy rising faster than
gold), the paired difference of final gold against GRPO's and against every other
method for IIF-gold, paired P(improvement) (95% bootstrap intervals, seeds paired), and CPU
seconds per round against GRPO's. ``name: value`` lines last.

    python benchmarks/lm/rlhf_gold.py --workers 2 --budget-minutes 120
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
from filelock import FileLock

from rlinfluence.experiments.tuning import widen_past_edge
from rlinfluence.rlhf.data import GOLD_TASKS
from rlinfluence.rlhf.report import load_completions, saved_rounds
from rlinfluence.statistics import ci95, probability_of_improvement

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

METHODS: dict[str, list[str]] = {
    "grpo": ["--filter", "none"],
    "iif-gold": ["--filter", "iif", "--target", "seq", "--target-source", "fresh", "--target-reward", "gold"],
    "advantage-sign": ["--filter", "advantage-sign"],
    "random": ["--filter", "random", "--random-keep", "0.54"],
    "pods": ["--filter", "pods", "--pods-keep", "2"],
    "dtv": ["--filter", "dtv"],
    "iif-proxy": ["--filter", "iif"],
    "dynamic-sampling": ["--filter", "dynamic-sampling"],
    "ceiling": ["--filter", "gold-oracle"],
    "grpo-on-gold": ["--filter", "none", "--train-reward", "gold"],
}
"""The arms. ``ceiling`` drops each completion the update moves against its gold advantage, what
a perfect scorer could do (``rlinfluence.rlhf.filters.gold_agreement``): if it cannot beat GRPO's
gold at equal proxy, the set-up has nothing for a gold-targeted filter to find. ``grpo-on-gold``
trains on the gold reward itself, what no fix to the data or the reward can exceed: if even it
does not gain gold over GRPO, the gold is out of reach of this set-up's steps."""
SETUP = ["--algo", "grpo", "--prompts-per-round", "8", "--group-size", "4", "--response-length", "24",
         "--ppo-epochs", "1", "--mini-batch-size", "4", "--torch-threads", "1", "--no-progress", "--no-tensorboard",
         "--checkpoint-every", "1"]
"""What every run shares: 8 prompts x 4 completions of at most 24 tokens per round, one pass of
4-sequence Adam steps (8 steps per unfiltered round, GRPO's usual single iteration), 100 test prompts."""
KEY = ["phase", "method", "seed", "lr", "mode"]
NO_FILTER = "grpo"
"""Keeps every completion, so its equal-steps and natural runs are the same run, bit for bit
(tests/test_rlhf.py): it runs once, in equal-steps mode, and serves as the reference of both."""
MAX_GRID = 6
"""The most points a widened tuning grid gets (``widened``)."""


def command(job: dict, args: argparse.Namespace, run_root: str) -> list[str]:
    device = ["--clock", "cpu"] if args.device == "cpu" else ["--device", args.device, "--clock", "wall",
                                                               "--records-per-pass", "128"]
    split = args.tune_split if job["phase"] == "tune" else "test"
    # a gold task's test split has 100 prompts, its val split 50
    evaluation = ["--eval-split", split, "--test-prompts", "50" if split == "val" else "100"]
    return [sys.executable, "-m", "rlinfluence.cli", "rlhf", *SETUP, "--task", args.task, *device, *evaluation,
            "--model", args.model, "--rounds", str(args.rounds), "--eval-every", str(args.eval_every),
            "--learning-rate", str(job["lr"]), "--seed", str(job["seed"]), "--method", job["method"],
            "--run-root", run_root, *(["--equal-steps"] if job["mode"] == "equal" else []), *METHODS[job["method"]],
            *(["--val-prompts", str(args.val_prompts)] if job["method"] == "iif-gold" else [])]


def curve_rows(job: dict, run_dir: Path) -> pd.DataFrame:
    """One row per evaluation of the finished run: after_round 0 (theta(0)), then after every
    evaluated round, with the proxy and gold test rewards and the run's CPU seconds per round."""
    rows = pd.read_csv(run_dir / "metrics.csv")
    evaluated = rows.dropna(subset=["eval_gold_mean"])
    curve = pd.DataFrame({
        **{name: job[name] for name in KEY},
        "after_round": [0, *(evaluated["round"] + 1)],
        "proxy": [rows["eval_return_mean_initial"].iloc[0], *evaluated["eval_return_mean"]],
        "gold": [rows["eval_gold_mean_initial"].iloc[0], *evaluated["eval_gold_mean"]],
    })
    curve["cpu_per_round"] = float(rows["train_seconds"].iloc[-1]) / len(rows)
    # how collinear proxy and gold are on the run's own training completions, first and last round
    for name, round_index in (("first", 0), ("last", len(rows) - 1)):
        c = load_completions(run_dir, round_index)
        curve[f"proxy_gold_r_{name}_round"] = c["reward"].corr(c["gold"]) if c["reward"].std() > 0 else np.nan
    curve["kept_fraction"] = float(rows["kept_fraction"].mean())
    curve["steps_per_round"] = float(rows["n_updates"].mean())
    return curve


def selection_rows(job: dict, run_dir: Path) -> pd.DataFrame:
    """What a filter kept, judged within each group of ``--group-size`` completions (one prompt): with
    A_gold = gold - the group's mean gold and A_proxy likewise for the proxy, per round the mean
    A of the kept minus that of the dropped (rounds that dropped nothing left out), averaged over
    rounds; and the fraction of completions kept exactly when A_proxy > 0 (1 for a sign filter)."""
    size = int(SETUP[SETUP.index("--group-size") + 1])
    gold_gaps, proxy_gaps, agreement = [], [], []
    for round_index in saved_rounds(run_dir):
        c = load_completions(run_dir, round_index)
        group = np.arange(len(c)) // size
        a_gold = c["gold"] - c.groupby(group)["gold"].transform("mean")
        a_proxy = c["reward"] - c.groupby(group)["reward"].transform("mean")
        agreement.append(float((c["kept"] == (a_proxy > 0)).mean()))
        if c["kept"].all() or not c["kept"].any():
            continue
        gold_gaps.append(a_gold[c["kept"]].mean() - a_gold[~c["kept"]].mean())
        proxy_gaps.append(a_proxy[c["kept"]].mean() - a_proxy[~c["kept"]].mean())
    return pd.DataFrame([{**{name: job[name] for name in KEY},
                          "kept_minus_dropped_gold_advantage": np.mean(gold_gaps) if gold_gaps else np.nan,
                          "kept_minus_dropped_proxy_advantage": np.mean(proxy_gaps) if proxy_gaps else np.nan,
                          "agreement_with_advantage_sign": np.mean(agreement)}])


class Results:
    """A results CSV (``KEY`` columns first): appended to as runs finish, under a file lock and
    from the file as it is then, so that two invocations (say, of different methods) can share it."""

    def __init__(self, path: Path):
        self.path = path
        self.frame = self.read()

    def read(self) -> pd.DataFrame:
        return pd.read_csv(self.path) if self.path.is_file() else pd.DataFrame(columns=KEY)

    def has(self, job: dict) -> bool:
        match = np.ones(len(self.frame), dtype=bool)
        for name in KEY:
            column = self.frame[name]
            match &= np.isclose(column.astype(float), job[name]) if name == "lr" else column.astype(str) == str(job[name])
        return bool(match.any())

    def add(self, rows: pd.DataFrame) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{self.path}.lock"):
            current = self.read()
            self.frame = pd.concat([current, rows], ignore_index=True) if len(current) else rows
            self.frame.to_csv(self.path, index=False, float_format="%.6g")


def run_counts(results: Results, jobs: dict[str, list[dict]], name: str) -> list[str]:
    """Per arm of ``jobs`` (its runs wanted now), how many of them ``results`` holds:
    ``{name}_{arm}: k of n`` lines, for a run cut off part way."""
    return [f"{name}_{arm}: {sum(results.has(job) for job in wanted)} of {len(wanted)}" for arm, wanted in jobs.items()]


def run_root(job: dict, args: argparse.Namespace) -> Path:
    return Path(args.scratch) / "_".join(str(job[k]) for k in KEY)


def schedule(wanted: Callable[[], list[dict]], start: Callable[[dict], None], workers: int, deadline: float) -> None:
    """Run ``start`` on the jobs ``wanted`` gives, ``workers`` at a time, each job once, until it
    gives none that has not started and none is running, or until ``deadline`` (``time.monotonic``)
    has passed. ``wanted`` is asked again whenever a worker is free, so a job can appear once the
    runs it depends on have finished (an arm's evaluation runs once its tuning has settled its lr,
    while another arm is still tuning); its first job not yet started goes next."""
    begun: set[tuple] = set()
    running = 0
    changed = threading.Condition()

    def worker() -> None:
        nonlocal running
        while True:
            with changed:
                while True:
                    if time.monotonic() > deadline:
                        return
                    job = next((j for j in wanted() if tuple(j[k] for k in KEY) not in begun), None)
                    if job is not None:
                        break
                    if not running:  # nothing left and nothing running that could add a job
                        changed.notify_all()
                        return
                    changed.wait()
                begun.add(tuple(job[k] for k in KEY))
                running += 1
            try:
                start(job)
            finally:
                with changed:
                    running -= 1
                    changed.notify_all()

    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(worker) for _ in range(workers)]:
            future.result()


def run_all(jobs: list[dict] | Callable[[], list[dict]], args: argparse.Namespace, results: Results,
            selection: Results, deadline: float, rows: Callable[[dict, Path], pd.DataFrame] = curve_rows) -> None:
    """Run every job not in ``results`` yet (``jobs``: a list, or a function giving the jobs wanted
    now, see ``schedule``); each finished run adds its ``rows`` (by default its test curve) to
    ``results`` and, for a filter, what it kept to ``selection``."""
    def run(job: dict) -> None:
        root = run_root(job, args)
        cut_off = [r for r in root.glob("rlhf-*") if any((r / "checkpoints").glob("round_*.pt"))]
        if cut_off:  # a run stopped after a round: continue it from its last checkpoint
            call = [sys.executable, "-m", "rlinfluence.cli", "rlhf", "--resume", str(cut_off[0])]
        else:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            call = command(job, args, str(root))
        started = time.monotonic()
        with (root / "log.txt").open("a") as f:
            failed = subprocess.run(call, stdout=f, stderr=subprocess.STDOUT).returncode
        if failed:  # one broken run costs its row, not the comparison: the others go on
            tail = "\n".join((root / "log.txt").read_text().splitlines()[-40:])
            print(f"failed: {root.name} (exit {failed}); the end of its log:\n{tail}", flush=True)
            return
        (run_dir,) = root.glob("rlhf-*")
        results.add(rows(job, run_dir))
        if job["method"] != NO_FILTER:
            selection.add(selection_rows(job, run_dir))
        print(f"done: {root.name} ({time.monotonic() - started:.0f} s wall)", flush=True)

    def wanted() -> list[dict]:
        return [job for job in (jobs() if callable(jobs) else jobs) if not results.has(job)]

    schedule(wanted, run, args.workers, deadline)


def with_reference_in_every_mode(frame: pd.DataFrame) -> pd.DataFrame:
    """The evaluation rows with plain GRPO's equal-steps runs repeated under every other step mode
    that has runs (see ``NO_FILTER``)."""
    evaluation = frame[frame["phase"] == "eval"]
    reference = evaluation[(evaluation["method"] == NO_FILTER) & (evaluation["mode"] == "equal")]
    others = [m for m in evaluation["mode"].unique() if m != "equal"]
    return pd.concat([evaluation, *(reference.assign(mode=m) for m in others)], ignore_index=True)


def tuning_table(frame: pd.DataFrame, lrs: list[float], seeds: list[int]) -> pd.DataFrame | None:
    """Per tuning lr, over the tuning seeds: the mean proxy reward over the evaluations after
    training rounds, and the proxy - gold gap's widening from theta(0) to the last evaluation
    (its mean and 95% interval). None until every (lr, seed) ran."""
    tune = frame[(frame["phase"] == "tune") & (frame["method"] == NO_FILTER) & frame["seed"].astype(int).isin(seeds)]
    rows = []
    for lr in lrs:
        runs = tune[np.isclose(tune["lr"].astype(float), lr)]
        if runs["seed"].nunique() < len(seeds):
            return None
        gap = runs["proxy"] - runs["gold"]
        widening = [gap[r.index].iloc[r["after_round"].argmax()] - gap[r.index].iloc[r["after_round"].argmin()]
                    for _, r in runs.groupby("seed")]
        mean, lo, hi = ci95(np.asarray(widening)) if len(widening) > 1 else (widening[0], np.nan, np.nan)
        rows.append({"lr": lr, "proxy": runs[runs["after_round"] > 0]["proxy"].mean(), "widening": mean,
                     "widening_lo": lo, "widening_hi": hi})
    return pd.DataFrame(rows)


def gold_at(run: pd.DataFrame, proxy: float) -> float:
    """A run's gold when its proxy was ``proxy``: linear in proxy between its evaluations (``run``'s
    rows, theta(0) included) ordered by proxy; past either end, the gold of that end."""
    run = run.sort_values("proxy")
    return float(np.interp(proxy, run["proxy"].to_numpy(float), run["gold"].to_numpy(float)))


def gold_at_equal_proxy(arm: pd.DataFrame, reference: pd.DataFrame) -> float:
    """One seed's gold at equal proxy, g_arm(p) - g_reference(p) at p = min(the two runs' last test
    proxies), each g along that run's own evaluations (``gold_at``). Both runs start at theta(0), so
    both reached p: neither is credited with proxy progress the other did not make, and the run
    that ended lower is met at its own last evaluation."""
    proxy = min(run.loc[run["after_round"].idxmax(), "proxy"] for run in (arm, reference))
    return gold_at(arm, proxy) - gold_at(reference, proxy)


def run_rows(frame: pd.DataFrame, method: str, seed: int, lr: float | None = None) -> pd.DataFrame:
    """The rows of one run of ``frame``: ``method`` on ``seed`` (at ``lr`` where given)."""
    rows = frame[(frame["method"] == method) & (frame["seed"].astype(int) == seed)]
    return rows if lr is None else rows[np.isclose(rows["lr"].astype(float), lr)]


def tuning_pairs(frame: pd.DataFrame, methods: list[str], lrs: list[float], seeds: list[int]) -> list[str]:
    """Each arm run on the tuning seeds against GRPO there, seed for seed: its gold minus GRPO's and
    its proxy - gold gap minus GRPO's (a smaller gap at the same round: more gold at equal proxy),
    at the last evaluation (``tune_gold_minus_grpo``, ``tune_gap_minus_grpo``) and averaged over the
    evaluations after training rounds (``tune_run_...``: where the arms stand through the run, less
    noisy than one evaluation); and its gold minus GRPO's where both had the lower of their two last
    proxies (``tune_gold_at_equal_proxy_minus_grpo``, ``gold_at_equal_proxy``: a slower run of GRPO
    scores 0). ``name: value`` lines, each a mean with its 95% t interval."""
    tune = frame[(frame["phase"] == "tune") & frame["seed"].astype(int).isin(seeds)]
    by_run = ["method", "seed", "lr"]
    final = tune.loc[tune.groupby(by_run)["after_round"].idxmax()]
    over_run = tune[tune["after_round"] > 0].groupby(by_run, as_index=False)[["proxy", "gold"]].mean()
    lines = []
    for method in methods:
        for lr in lrs:
            for prefix, evaluations in (("tune_", final), ("tune_run_", over_run)):
                at = evaluations[np.isclose(evaluations["lr"].astype(float), lr)].set_index(["method", "seed"])
                if method not in at.index.get_level_values(0) or NO_FILTER not in at.index.get_level_values(0):
                    continue
                x, y = at.loc[method], at.loc[NO_FILTER]
                common = sorted(set(x.index) & set(y.index))
                if len(common) < 2:
                    continue
                x, y = x.loc[common], y.loc[common]
                # (name, the paired differences, the arm's better side: more gold, a smaller gap)
                pairs = [("gold_minus_grpo", x["gold"] - y["gold"], 1),
                         ("gap_minus_grpo", (x["proxy"] - x["gold"]) - (y["proxy"] - y["gold"]), -1)]
                if prefix == "tune_":
                    pairs.append(("gold_at_equal_proxy_minus_grpo", pd.Series(
                        [gold_at_equal_proxy(run_rows(tune, method, seed, lr), run_rows(tune, NO_FILTER, seed, lr))
                         for seed in common], index=common), 1))
                for name, values, better in pairs:
                    mean, lo, hi = ci95(values.to_numpy(dtype=float))
                    lines.append(f"{prefix}{name}_{method}_lr{lr:g}: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                                 f"({len(common)} seeds, better on {int((better * values > 0).sum())})")
    return lines


def chosen_lr(table: pd.DataFrame) -> float:
    """The tuning lr of the highest mean proxy reward after training rounds."""
    for row in table.itertuples():
        print(f"tune: lr {row.lr:g}: mean proxy reward after training rounds {row.proxy:.3f}, "
              f"gap widening {row.widening:+.3f} [{row.widening_lo:+.3f}, {row.widening_hi:+.3f}]")
    return float(table.loc[table["proxy"].idxmax(), "lr"])


def best_lrs(tune: pd.DataFrame, grids: dict[str, list[float]], seeds: list[int],
             column: str) -> tuple[dict[str, float], list[str]]:
    """Per method of ``grids``, the lr of its grid with the highest mean of ``column`` (the val
    proxy reward) over ``tune``'s rows (the tuning evaluations after training rounds), each tuning
    seed weighted alike, and a ``name: value`` line per method and lr. A method is left out until
    all its (lr, seed) runs are there."""
    tune = tune[tune["seed"].astype(int).isin(seeds)]
    chosen, lines = {}, []
    for method, grid in grids.items():
        runs = tune[tune["method"] == method]
        means = {}
        for lr in grid:
            at = runs[np.isclose(runs["lr"].astype(float), lr)]
            if at["seed"].nunique() < len(seeds):
                break
            means[lr] = float(at.groupby("seed")[column].mean().mean())
        else:
            best = max(means, key=means.get)
            edge = " (at the grid's edge)" if best in (min(grid), max(grid)) else ""
            chosen[method] = best
            lines += [f"tune_val_proxy_{method}_lr{lr:g}: {v:.3f}" for lr, v in means.items()]
            lines.append(f"chosen_lr_{method}: {best:g}{edge}")
    return chosen, lines


def widened(grids: dict[str, list[float]], chosen: dict[str, float]) -> bool:
    """Add a point past the edge (x2 or /2) to the grid of every method of ``chosen`` whose choice
    sits on that edge, up to ``MAX_GRID`` points, so that a choice is interior to the grid it was
    made from; whether any grew."""
    grew = False
    for method, choice in chosen.items():
        wider = widen_past_edge(grids[method], choice, MAX_GRID)
        if wider:
            grids[method], grew = wider, True
    return grew


def own_choices(tune: pd.DataFrame, methods: list[str], lrs: list[float], seeds: list[int],
                column: str) -> tuple[dict[str, list[float]], dict[str, float], list[str]]:
    """Per method, its tuning grid as the runs of ``tune`` have grown it from ``lrs`` (``widened``
    while a choice of ``best_lrs`` sits on an edge) and, where it is settled, its lr: the best of a
    grid whose runs are all there, interior to it (or the grid is full); with ``best_lrs``'s lines.
    A method missing from the choices still has tuning runs to come, at every lr of its grid."""
    grids = {method: sorted(lrs) for method in methods}
    while True:
        chosen, lines = best_lrs(tune, grids, seeds, column)
        if not widened(grids, chosen):
            return grids, chosen, lines


def at_lrs(frame: pd.DataFrame, lrs: dict[str, float]) -> pd.DataFrame:
    """The evaluation-phase rows of ``frame`` of each method of ``lrs`` at its lr there."""
    runs = frame[frame["phase"] == "eval"]
    chosen = runs["method"].map(lrs).astype(float)
    return runs[np.isclose(runs["lr"].astype(float), chosen)]


def lrs_text(lrs: dict[str, float]) -> str:
    """``lr 0.002`` where every method shares one, else each method's."""
    values = set(lrs.values())
    return f"lr {values.pop():g}" if len(values) == 1 else "lr " + ", ".join(f"{m} {lr:g}" for m, lr in lrs.items())


def gap_lr(table: pd.DataFrame, threshold: float) -> float:
    """The smallest tuning lr whose mean gap widening is >= ``threshold``, else that of the widest."""
    wide = table[table["widening"] >= threshold]
    return float(wide["lr"].min() if len(wide) else table.loc[table["widening"].idxmax(), "lr"])


def summarise(frame: pd.DataFrame, selection: pd.DataFrame, lrs: dict[str, float]) -> list[str]:
    """Per step mode and method (each at its lr of ``lrs``): curves, finals, what the filter kept
    (``selection_rows``), and paired comparisons, seed for seed (``name: value`` lines)."""
    lines = []
    runs = at_lrs(frame, lrs)
    kept = at_lrs(selection, lrs) if len(selection) else selection
    for mode, per_mode in runs.groupby("mode"):
        final = per_mode.loc[per_mode.groupby(["method", "seed"])["after_round"].idxmax()].set_index(["method", "seed"])
        methods = [m for m in METHODS if m in final.index.get_level_values(0)]
        for method in methods:
            rows = per_mode[per_mode["method"] == method]
            curve = rows.groupby("after_round")[["proxy", "gold"]].mean()
            f = final.loc[method]
            print(f"[{mode}] {method} ({len(f)} seeds) after rounds {' '.join(map(str, curve.index))}:\n"
                  f"  proxy {' '.join(f'{v:.3f}' for v in curve['proxy'])}\n  gold  {' '.join(f'{v:.3f}' for v in curve['gold'])}")
            gold, lo, hi = ci95(f["gold"].to_numpy())
            start = rows[rows["after_round"] == 0].set_index("seed").loc[f.index]
            widening = ci95(((f["proxy"] - f["gold"]) - (start["proxy"] - start["gold"])).to_numpy())
            lines += [f"{mode}_final_gold_{method}: {gold:.3f} [{lo:.3f}, {hi:.3f}] ({len(f)} seeds)",
                      f"{mode}_final_proxy_{method}: {f['proxy'].mean():.3f}",
                      f"{mode}_proxy_gold_gap_{method}: {(f['proxy'] - f['gold']).mean():.3f}",
                      f"{mode}_gap_widening_{method}: {widening[0]:+.3f} [{widening[1]:+.3f}, {widening[2]:+.3f}]",
                      f"{mode}_cpu_per_round_{method}: {f['cpu_per_round'].mean():.1f}",
                      f"{mode}_kept_fraction_{method}: {f['kept_fraction'].mean():.2f}"]
            chosen = kept[(kept["method"] == method) & (kept["mode"] == mode)].dropna()
            if len(chosen):
                a_gold = ci95(chosen["kept_minus_dropped_gold_advantage"].to_numpy(dtype=float))
                lines += [f"{mode}_kept_minus_dropped_gold_advantage_{method}: {a_gold[0]:+.3f} "
                          f"[{a_gold[1]:+.3f}, {a_gold[2]:+.3f}] ({len(chosen)} seeds)",
                          f"{mode}_kept_minus_dropped_proxy_advantage_{method}: "
                          f"{chosen['kept_minus_dropped_proxy_advantage'].mean():+.3f}",
                          f"{mode}_agreement_with_advantage_sign_{method}: "
                          f"{chosen['agreement_with_advantage_sign'].mean():.2f}"]
        # every arm against GRPO, IIF-gold against every other arm, every field filter against the ceiling
        field = [m for m in methods if m not in ("grpo", "iif-gold", "ceiling")]
        pairs = [(m, "grpo") for m in methods if m != "grpo"]
        pairs += [("iif-gold", m) for m in methods if m not in ("grpo", "iif-gold") and "iif-gold" in methods]
        pairs += [(m, "ceiling") for m in field]
        for method, reference in pairs:
            if reference not in methods:
                continue
            seeds = sorted(set(final.loc[method].index) & set(final.loc[reference].index))
            if len(seeds) < 2:
                continue
            x, y = final.loc[method].loc[seeds], final.loc[reference].loc[seeds]
            diff = ci95((x["gold"] - y["gold"]).to_numpy())
            p = probability_of_improvement(x[["gold"]].to_numpy(), y[["gold"]].to_numpy(), paired=True)
            cpu = (x["cpu_per_round"] / y["cpu_per_round"]).mean()
            # a smaller proxy - gold gap than the reference's at the same round, seed for seed
            gap = ci95(((x["proxy"] - x["gold"]) - (y["proxy"] - y["gold"])).to_numpy())
            # gold where both runs had the lower of their two last proxies (a slower run of the reference scores 0)
            at_proxy = ci95(np.array([gold_at_equal_proxy(run_rows(per_mode, method, seed), run_rows(per_mode, reference, seed))
                                      for seed in seeds]))
            lines += [f"{mode}_gold_minus_{reference}_{method}: {diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}] "
                      f"({len(seeds)} paired seeds)",
                      f"{mode}_gap_minus_{reference}_{method}: {gap[0]:+.3f} [{gap[1]:+.3f}, {gap[2]:+.3f}]",
                      f"{mode}_gold_at_equal_proxy_minus_{reference}_{method}: {at_proxy[0]:+.3f} "
                      f"[{at_proxy[1]:+.3f}, {at_proxy[2]:+.3f}]",
                      f"{mode}_p_gold_beats_{reference}_{method}: {p[0]:.2f} [{p[1]:.2f}, {p[2]:.2f}]",
                      f"{mode}_cpu_per_round_vs_{reference}_{method}: {cpu:.2f}"]
    return lines


def tuning_grid_table(tune: pd.DataFrame, grids: dict[str, list[float]], seeds: list[int],
                      chosen: dict[str, float]) -> str:
    """Markdown: per arm and lr of its grid, the mean val proxy after training rounds (``tune``'s
    rows), each tuning seed weighted alike as ``best_lrs`` weighs them, with the mean val gold beside
    it, which no choice reads; the seeds run so far where not all of ``seeds``, the chosen lr in bold."""
    tune = tune[tune["seed"].astype(int).isin(seeds)]
    lrs = sorted(set().union(*grids.values()))
    out = ["| arm | " + " | ".join(f"{lr:g}" for lr in lrs) + " | choice |", "|---|" + "---|" * (len(lrs) + 1)]
    for method, grid in grids.items():
        cells = []
        for lr in lrs:
            at = tune[(tune["method"] == method) & np.isclose(tune["lr"].astype(float), lr)]
            if lr not in grid or not len(at):
                cells.append("-")
                continue
            proxy, gold = at.groupby("seed")[["proxy", "gold"]].mean().mean()
            value = f"**{proxy:.3f}**" if np.isclose(chosen.get(method, np.nan), lr) else f"{proxy:.3f}"
            done = at["seed"].nunique()
            cells.append(f"{value} (gold {gold:.3f})" + ("" if done == len(seeds) else f", {done} of {len(seeds)} seeds"))
        choice = f"{chosen[method]:g}" if method in chosen else "tuning"
        out.append(f"| {method} | " + " | ".join(cells) + f" | {choice} |")
    return "\n".join(out) + "\n"


def per_seed_table(frame: pd.DataFrame, lrs: dict[str, float]) -> str:
    """Markdown, per step mode: each run's proxy and gold test curves, CPU seconds per round, kept
    fraction and optimiser steps per round, as in the results CSV."""
    runs = at_lrs(frame, lrs)
    out = []
    for mode, per_mode in runs.groupby("mode"):
        rounds = " / ".join(str(r) for r in sorted(per_mode["after_round"].unique()))
        out += [f"**{mode} steps, {lrs_text(lrs)}** (test reward after rounds {rounds})", "",
                "| method | seed | proxy | gold | CPU s / round | kept | steps / round |", "|---|---|---|---|---|---|---|"]
        for method in (m for m in METHODS if m in set(per_mode["method"])):
            for seed, rows in per_mode[per_mode["method"] == method].groupby("seed"):
                rows = rows.sort_values("after_round")
                curve = {k: " / ".join(f"{v:.3f}" for v in rows[k]) for k in ("proxy", "gold")}
                last = rows.iloc[-1]
                out.append(f"| {method} | {seed} | {curve['proxy']} | {curve['gold']} | {last['cpu_per_round']:.1f} "
                           f"| {last['kept_fraction']:.2f} | {last['steps_per_round']:.0f} |")
        out.append("")
    return "\n".join(out)


def plot(frame: pd.DataFrame, lrs: dict[str, float], path: Path) -> None:
    """Per step mode: mean proxy (dashed) and gold (solid) test reward against rounds, one colour a
    method, and gold against proxy (the hack moves a curve right of the others, not up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = at_lrs(frame, lrs)
    modes = sorted(runs["mode"].unique())
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes, strict=True):
        per_mode = runs[runs["mode"] == mode]
        for colour, method in enumerate(m for m in METHODS if m in set(per_mode["method"])):
            rows = per_mode[per_mode["method"] == method]
            curve = rows.groupby("after_round")[["proxy", "gold"]].mean()
            label = f"{method} (lr {lrs[method]:g}, {rows['seed'].nunique()} seeds)"
            row[0].plot(curve.index, curve["gold"], "-o", color=f"C{colour}", label=label)
            row[0].plot(curve.index, curve["proxy"], "--", color=f"C{colour}", alpha=0.6)
            row[1].plot(curve["proxy"], curve["gold"], "-o", color=f"C{colour}", label=label)
        row[0].set(xlabel="training rounds", ylabel="test reward (gold solid, proxy dashed)",
                   title=f"{mode} steps, each arm at its lr: mean over seeds")
        row[1].set(xlabel="proxy test reward (the training reward)", ylabel="gold test reward", title="gold against proxy")
        row[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--task", default="sentiment-gold", choices=list(GOLD_TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--tune-seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--tune-split", default="val", choices=["val", "test"],
                        help="the prompts the tuning runs are evaluated on")
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 2e-3, 4e-3, 8e-3])
    parser.add_argument("--eval-lr", help="evaluate at this lr instead of the tuned one (a stress test), "
                                          "or 'gap' (see the module docstring)")
    parser.add_argument("--gap-threshold", type=float, default=0.1)
    parser.add_argument("--own-lr", action="store_true",
                        help="tune every method of --methods over --lrs and evaluate each at its own choice")
    parser.add_argument("--tune-only", action="store_true", help="stop after the tuning table and the lr choices")
    parser.add_argument("--tune-methods", nargs="+", default=[NO_FILTER], choices=list(METHODS),
                        help="also run these arms on the tuning seeds and lrs (equal steps), each paired with GRPO there")
    parser.add_argument("--val-prompts", type=int, default=4,
                        help="iif-gold: val prompts of its fresh gold-labelled rollout each round (x group size)")
    parser.add_argument("--device", default="cpu", help="cpu (CPU seconds, one thread), cuda or cuda:N (wall seconds)")
    parser.add_argument("--modes", nargs="+", default=["equal"], choices=["equal", "natural"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--budget-minutes", type=float, default=float("inf"), help="start no run after this long")
    parser.add_argument("--model", default="builtin:smollm2-135m", help="builtin:tiny-gpt2 for a smoke test")
    parser.add_argument("--results", default="docs/data/rlhf_gold_runs.csv")
    parser.add_argument("--selection", default="docs/data/rlhf_gold_selection.csv",
                        help="per filter run, what it kept judged by gold and proxy (selection_rows)")
    parser.add_argument("--png", help="write the curves of the evaluation phase to this PNG")
    parser.add_argument("--markdown", help="write the per-seed table and the summary lines to this file (the docs include it)")
    parser.add_argument("--tuning-markdown", help="--own-lr: write each arm's tuning table (tuning_grid_table) and "
                                                  "its runs held of those wanted to this file, complete or not")
    parser.add_argument("--scratch", default="bench_out/rlhf_gold", help="the run folders (report.html, completions), not committed")
    args = parser.parse_args()
    deadline = time.monotonic() + 60 * args.budget_minutes
    results, selection = Results(Path(args.results)), Results(Path(args.selection))
    if args.own_lr and args.eval_lr is not None:
        parser.error("--own-lr tunes every method's lr; --eval-lr sets one for all: give one of them")
    if args.tuning_markdown and not args.own_lr:
        parser.error("--tuning-markdown writes each arm's own tuning: give --own-lr with it")
    tune_methods = [NO_FILTER, *(m for m in (args.methods if args.own_lr else args.tune_methods) if m != NO_FILTER)]

    def tuning_jobs(grids: dict[str, list[float]], methods: list[str]) -> list[dict]:
        # seed by seed, as in the evaluation phase: a cut-off tuning pass has every arm on its first seeds
        return [dict(phase="tune", method=m, seed=s, lr=lr, mode="natural" if m == NO_FILTER else "equal")
                for s in args.tune_seeds for m in methods for lr in grids[m]]

    def evaluation_jobs(lrs: dict[str, float]) -> list[dict]:
        jobs = [dict(phase="eval", method=m, seed=s, lr=lrs[m], mode="equal" if m == NO_FILTER else mode)
                for s in args.seeds for mode in args.modes for m in args.methods if m in lrs]
        return list({tuple(job.values()): job for job in jobs}.values())

    def tuned() -> pd.DataFrame:
        frame = results.frame  # theta(0)'s evaluation left out (a file with no rows has no column for it yet)
        after_training = frame["after_round"] > 0 if "after_round" in frame else False
        return frame[(frame["phase"] == "tune") & after_training]

    def own_tuning() -> tuple[dict[str, list[float]], dict[str, float], list[str]]:
        return own_choices(tuned(), tune_methods, args.lrs, args.tune_seeds, "proxy")

    if args.own_lr:
        def wanted() -> list[dict]:  # the arms still tuning (on a widened grid too), then the settled arms' evaluation
            grids, own, _ = own_tuning()
            unsettled = [m for m in tune_methods if m not in own]
            return tuning_jobs(grids, unsettled) + ([] if args.tune_only else evaluation_jobs(own))

        run_all(wanted, args, results, selection, deadline)
        grids, own, own_lines = own_tuning()
        counts = run_counts(results, {m: tuning_jobs(grids, [m]) for m in grids}, "tuning_runs")
        counts += run_counts(results, {m: evaluation_jobs({m: lr}) for m, lr in own.items()}, "evaluation_runs")
        if args.tuning_markdown:
            Path(args.tuning_markdown).write_text(tuning_grid_table(tuned(), grids, args.tune_seeds, own)
                                                  + "\n```\n" + "\n".join([*own_lines, *counts]) + "\n```\n")
        if set(own) != set(grids):
            waiting = ", ".join(m for m in grids if m not in own)
            print("\n".join([*own_lines, *counts,
                             f"tuning incomplete ({waiting} not yet): no summary until every arm's lr is settled"]))
            return
    else:
        grids = {m: sorted(args.lrs) for m in tune_methods}
        run_all(tuning_jobs(grids, tune_methods), args, results, selection, deadline)
    table = tuning_table(results.frame, grids[NO_FILTER], args.tune_seeds)
    if table is None:
        print("tuning incomplete: no evaluation run started")
        return
    lr = chosen_lr(table)
    print(f"chosen_lr: {lr:g}")
    if args.eval_lr == "gap":  # where GRPO games the proxy on the tuning seeds
        lr = gap_lr(table, args.gap_threshold)
        print(f"gap_lr: {lr:g}")
    elif args.eval_lr is not None:  # e.g. twice the tuned lr
        lr = float(args.eval_lr)
        print(f"evaluated at lr {lr:g}, not the tuned one")
    lrs = own if args.own_lr else {m: lr for m in args.methods}
    if args.own_lr:
        print("\n".join(own_lines))
    if args.tune_only:
        for row in table.itertuples():
            print(f"tune_proxy_lr{row.lr:g}: {row.proxy:.3f}")
            print(f"tune_gap_widening_lr{row.lr:g}: {row.widening:+.3f} [{row.widening_lo:+.3f}, {row.widening_hi:+.3f}]")
        print("\n".join(tuning_pairs(results.frame, tune_methods[1:], sorted(set().union(*grids.values())),
                                     args.tune_seeds)))
        return
    jobs = evaluation_jobs(lrs)
    run_all(jobs, args, results, selection, deadline)
    for job in jobs:  # runs finished before the selection file existed, while their folders are here
        if job["method"] != NO_FILTER and results.has(job) and not selection.has(job):
            for run_dir in run_root(job, args).glob("rlhf-*"):
                selection.add(selection_rows(job, run_dir))
    frame = with_reference_in_every_mode(results.frame)
    if args.png:
        plot(frame, lrs, Path(args.png))
    summary = summarise(frame, selection.frame, lrs)
    if args.markdown:
        Path(args.markdown).write_text(f"{per_seed_table(frame, lrs)}\n```\n" + "\n".join(summary) + "\n```\n")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
