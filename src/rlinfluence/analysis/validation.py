"""``rlinfluence validate``: the linear datamodeling score (LDS) of saved rounds of a run.

For round k (a run trained with ``--save-buffers``) the records are scored at theta(k) by each
requested scorer, then ``rlinfluence.influence.validate`` retrains the round from theta(k)
(policy, optimiser state, minibatch generator: ``SavedRound.retrain``, the trainer's own
``update``) on M seeded random subsets S and measures the real change of the target on the
whole buffer with raw advantages,

    real(S) = f(theta_S) - f(theta(k)),   LDS = Spearman(sum_{i in S} score_i, real(S)),

plus the drop test (lowest-scored p% vs random p%). A retrain on the run's own kept records
is compared with the saved theta(k+1) (``reproduces_run``).

Scorers: ``snapshot/<norm>`` (snapshot influence, training-side advantages normalised over
``chunk``s of ``batch_size`` records of a seeded random permutation as IIF's scorer does, over
the whole ``batch``, or ``none``) and ``full`` (TracIn over the round's recorded optimiser
steps, which normalise as the trainer did).

Runs of the Stable-Baselines3 adapter are not supported here: SB3 writes no run directory
(theta(k) with optimiser and generator state, the buffer, the schedule). The trainer-free core
``rlinfluence.influence.validate`` takes any ``retrain`` callable instead.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from rlinfluence.analysis.intervention import matches_checkpoint
from rlinfluence.analysis.report import Section, Table, figure_png, new_figure, round_axis
from rlinfluence.errors import UserError
from rlinfluence.influence import (
    DEFAULT_ADVANTAGE_NORM,
    ActionTarget,
    Records,
    ReturnTarget,
    Target,
    score_buffer,
    snapshot_influence,
)
from rlinfluence.influence.validation import (
    DROP_PCTS,
    LDS,
    Retrain,
    Validation,
    check_settings,
    one_by_one,
    validate,
)
from rlinfluence.seeding import derived_seed

if TYPE_CHECKING:
    from rlinfluence.buffer import RolloutBuffer
    from rlinfluence.checkpoint import SavedRound

SCORERS = ("snapshot/chunk", "snapshot/batch", "snapshot/none", "full")


def scorer_names(modes: Sequence[str], advantage_norms: Sequence[str]) -> list[str]:
    """``snapshot/<norm>`` for each norm if ``snapshot`` is among ``modes``, then ``full``."""
    names = [f"snapshot/{norm}" for norm in advantage_norms] if "snapshot" in modes else []
    names += ["full"] if "full" in modes else []
    unknown = [name for name in names if name not in SCORERS]
    if unknown or not names:
        raise UserError(f"scorers must be among {list(SCORERS)}, got {names}")
    return list(dict.fromkeys(names))


def round_target(buffer: RolloutBuffer, target: str, state_index: int | None) -> Target:
    """``return``: ReturnTarget() on the buffer; ``action``: log pi(a|s) of the record
    ``state_index``."""
    if target == "return":
        return ReturnTarget()
    if target == "action":
        n = len(buffer)
        if state_index is None or not 0 <= state_index < n:
            raise UserError(f"--target action needs --state-index in [0, {n}), got {state_index}")
        return ActionTarget(buffer.flat("obs")[state_index], buffer.flat("actions")[state_index])
    raise UserError(f"--target must be return or action, got {target!r}")


def score_round(saved: SavedRound, target: Target, scorer: str, seed: int) -> torch.Tensor:
    """Scores ``[N]`` of a ``SavedRound`` whose trainer is at theta(k), by ``scorer`` (module
    docstring); ``seed`` fixes the chunk permutation of ``snapshot/chunk``."""
    trainer, buffer, cfg = saved.trainer, saved.buffer, saved.trainer.config
    if scorer == "full":
        if not saved.schedule:
            raise UserError(f"round {buffer.round} has no saved minibatch schedule "
                            "(train with --save-buffers)")
        return score_buffer(
            trainer.policy, buffer, mode="full", schedule=saved.schedule, target=target,
            clip_range=cfg.clip_range, clip_range_vf=cfg.clip_range_vf, vf_coef=cfg.vf_coef,
            ent_coef=cfg.ent_coef, normalize_advantage=cfg.normalize_advantage,
            max_grad_norm=cfg.max_grad_norm,
            optimizer=trainer.optimizer if cfg.optimizer != "sgd" else None,
        )
    norm = scorer.split("/", 1)[1]
    n = len(buffer)
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if norm == "chunk"
             else torch.arange(n))
    obs, actions, advantages = (buffer.flat(k)[order] for k in ("obs", "actions", "advantages"))
    permuted = snapshot_influence(trainer.policy, obs, actions, advantages, target=target,
                                  advantage_norm=norm, chunk_size=cfg.batch_size,
                                  ent_coef=cfg.ent_coef)
    scores = torch.empty_like(permuted)
    scores[order] = permuted
    return scores


RERUN_CHUNK = 64
"""Re-runs batched together (``rlinfluence.reruns``): memory grows with it, time per re-run falls."""


def target_change(saved: SavedRound, target: Target, batched: bool = True) -> Retrain:
    """``retrain(masks) -> [f(theta_keep) - f(theta(k)), ...]``: f on the whole buffer, raw
    advantages; the re-runs batched ``RERUN_CHUNK`` at a time (``rlinfluence.reruns``), or one by
    one through ``SavedRound.retrain``."""
    from rlinfluence.reruns import Variant, batched_retrain

    buffer = saved.buffer
    records = Records(buffer.flat("obs"), buffer.flat("actions"), buffer.flat("advantages"))
    saved.trainer.load_state_dict(copy.deepcopy(saved.start))  # f(theta(k)), wherever the trainer was left
    before = target.value(saved.trainer.policy, records)

    def one(keep: torch.Tensor) -> float:
        saved.retrain(keep)
        return target.value(saved.trainer.policy, records) - before

    def many(masks: Sequence[torch.Tensor]) -> list[float]:
        changes = []
        for start in range(0, len(masks), RERUN_CHUNK):
            reruns = batched_retrain(saved, [Variant(keep=m) for m in masks[start:start + RERUN_CHUNK]])
            changes += [target.value(reruns.load(saved.trainer.policy, k), records) - before
                        for k in range(len(reruns.params))]
        saved.trainer.load_state_dict(copy.deepcopy(saved.start))
        return changes

    return many if batched else one_by_one(one)


@dataclass(frozen=True)
class RoundValidation:
    """One round's validation; ``seconds``: scoring per scorer and ``retrain`` (all retrains)."""

    run: str
    env: str
    seed: int
    round: int
    records: int
    target: str
    result: Validation
    reproduces_run: bool | None
    seconds: dict[str, float]



def validate_round(run_dir: str | Path, round_index: int, *, target: str | Target = "return",
                   state_index: int | None = None, scorers: Sequence[str] = (f"snapshot/{DEFAULT_ADVANTAGE_NORM}",),
                   subsets: int = 30, fraction: float = 0.5, drop_pcts: Sequence[float] = DROP_PCTS,
                   random_draws: int = 5, seed: int = 0, batched: bool = True) -> RoundValidation:
    """Validate round ``round_index`` of a saved run (module docstring). ``target``: ``"return"``,
    ``"action"`` (with ``state_index``) or any ``Target``; ``batched``: the re-runs together
    (``rlinfluence.reruns``), else one by one (the same changes to float tolerance)."""
    from rlinfluence.checkpoint import load_round

    check_settings(subsets, fraction)
    saved = load_round(run_dir, round_index)
    cfg, buffer = saved.trainer.config, saved.buffer
    f = target if isinstance(target, Target) else round_target(buffer, target, state_index)
    seconds, scores = {}, {}
    for scorer in scorers:
        start = time.perf_counter()
        scores[scorer] = score_round(saved, f, scorer, derived_seed(seed, round_index, 1))
        seconds[scorer] = time.perf_counter() - start
    start = time.perf_counter()
    result = validate(scores, target_change(saved, f, batched), subsets=subsets, fraction=fraction,
                      drop_pcts=drop_pcts, random_draws=random_draws, seed=(seed, round_index))
    seconds["retrain"] = time.perf_counter() - start
    saved.retrain(saved.keep)
    reproduces = matches_checkpoint(saved.trainer, run_dir, round_index + 1)
    return RoundValidation(Path(run_dir).name, cfg.env, cfg.seed, round_index, len(buffer),
                           target if isinstance(target, str) else repr(target), result,
                           reproduces, seconds)


def validate_rounds(run_dir: str | Path, rounds: Sequence[int], progress: bool = False, workers: int = 1,
                    ray_address: str | None = None, **kwargs: object) -> list[RoundValidation]:
    """``validate_round`` for each round (an LDS curve over training), in the order of ``rounds``;
    same keyword arguments. One round per job: in this process (``workers`` 1), in ``workers``
    local processes or as Ray tasks on ``ray_address`` (``rlinfluence.executor.run_calls``), the same
    results whichever ran them (but the timings). ``progress`` prints each round's LDS as it ends."""
    from rlinfluence.executor import check_executor, run_calls

    check_executor(workers, ray_address)

    def show(r: RoundValidation) -> None:
        for name, s in r.result.scorers.items():
            lds = s.lds
            print(f"round {r.round} {name}: LDS {lds.value:+.3f} [{lds.low:+.3f}, {lds.high:+.3f}]"
                  + (f"  ({lds.message})" if lds.message else ""), flush=True)

    return run_calls(validate_round, [(run_dir, k) for k in rounds], workers, ray_address,
                     show if progress else None, keywords=kwargs)


def lds_rows(results: Sequence[RoundValidation]) -> pd.DataFrame:
    """One row per (run, round, scorer): LDS and interval, spread of the real changes, timings."""
    rows = []
    for r in results:
        for name, s in r.result.scorers.items():
            rows.append({
                "run": r.run, "env": r.env, "seed": r.seed, "round": r.round, "scorer": name,
                "target": r.target, "subsets": len(r.result.real), "lds": s.lds.value,
                "lds_low": s.lds.low, "lds_high": s.lds.high,
                "real_mean": float(r.result.real.mean()),
                "real_std": float(r.result.real.std(ddof=1)), "full_change": r.result.full_change,
                "score_seconds": r.seconds[name], "retrain_seconds": r.seconds["retrain"],
                "retrains": r.result.retrains, "reproduces_run": r.reproduces_run,
                "message": s.lds.message or "",
            })
    return pd.DataFrame(rows)


def drop_rows(results: Sequence[RoundValidation]) -> pd.DataFrame:
    """One row per (run, round, scorer, p): real change without the lowest-scored p% vs
    without a random p%."""
    rows = []
    for r in results:
        for name, s in r.result.scorers.items():
            for d in s.drops:
                rows.append({
                    "run": r.run, "round": r.round, "scorer": name, "pct": d.pct,
                    "dropped": d.dropped, "negative_dropped": d.negative_dropped,
                    "full_change": r.result.full_change, "lowest_change": d.lowest_change,
                    "random_mean": d.random_mean, "random_se": d.random_se,
                })
    return pd.DataFrame(rows)


def scatter_title(round_index: int, scorer: str, lds: LDS) -> str:
    """A scatter panel's title: the round and scorer, then the LDS with its 95% interval on a line
    of its own (one line would be cut at a panel's width)."""
    if math.isnan(lds.value):
        return f"round {round_index}, {scorer}\nLDS undefined"
    return f"round {round_index}, {scorer}\nLDS {lds.value:+.2f} [{lds.low:+.2f}, {lds.high:+.2f}]"


def scatter_png(results: Sequence[RoundValidation]) -> bytes:
    """Predicted vs real change, one panel per (scorer, round)."""
    names = list(results[0].result.scorers)
    fig, axes = new_figure(2.8 * len(results), 2.6 * len(names), ncols=len(results),
                           nrows=len(names))
    for col, r in enumerate(results):
        for row, name in enumerate(names):
            ax, s = axes[row, col], r.result.scorers[name]
            ax.scatter(s.predicted, r.result.real, s=12)
            ax.set(title=scatter_title(r.round, name, s.lds), xlabel="predicted (sum of scores)",
                   ylabel="real change of f")
            ax.title.set_fontsize(8)
            ax.grid(alpha=0.3)
    fig.suptitle(results[0].env)
    return figure_png(fig)


def curve_png(results: Sequence[RoundValidation]) -> bytes:
    """LDS per round with its bootstrap interval, one line per scorer."""
    rows = lds_rows(results)
    fig, axes = new_figure(5.5, 3.4)
    ax = axes[0, 0]
    for name, g in rows.groupby("scorer", sort=False):
        below = (g["lds"] - g["lds_low"]).clip(lower=0)  # a percentile interval may miss the value
        above = (g["lds_high"] - g["lds"]).clip(lower=0)
        ax.errorbar(g["round"], g["lds"], yerr=[below, above], marker="o", capsize=3, label=name)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(ylabel="LDS (Spearman)", ylim=(-1.05, 1.05), title=f"{results[0].env}: LDS over training")
    round_axis(ax)
    ax.legend(fontsize=8, title="95% bootstrap interval over the subsets", title_fontsize=8)
    ax.grid(alpha=0.3)
    return figure_png(fig)


def _cells(frame: pd.DataFrame) -> list[list[object]]:
    return [[v.item() if isinstance(v, np.generic) else v for v in row]
            for row in frame.itertuples(index=False)]


def validation_section(results: Sequence[RoundValidation]) -> Section:
    """The report section: LDS table (and curve for several rounds), drop test, scatter plots."""
    if not results:
        raise ValueError("no validated round")
    first = results[0]
    subsets = len(first.result.real)
    fraction = float(first.result.masks[0].sum()) / first.records
    section = Section("validation", "Counterfactual validation of the scores (LDS)")
    section.paragraphs.append(
        f"Each round k is retrained from theta(k) with the trainer's own update on {subsets} "
        f"seeded random subsets S of {fraction:.0%} of its records. LDS = Spearman(sum of the "
        "scores over S, f(theta_S) - f(theta(k))), f the target on the whole buffer with raw "
        "advantages; interval: 95% percentile bootstrap over the subsets. Drop test: the real "
        "change of f without the lowest-scored p% of the records against p% dropped at random "
        "(mean +/- s.e. over draws).")
    lds = lds_rows(results)
    reproduced = lds.drop_duplicates("round")["reproduces_run"].dropna()
    section.summary = {
        "target": first.target, "subsets": subsets, "fraction": fraction,
        "seconds per round (scoring + retrains)": float(np.mean(
            [sum(r.seconds.values()) for r in results])),
        "retrain reproduces the run's theta(k+1)":
            f"{int(reproduced.sum())} of {len(reproduced)} rounds",
    }
    for message in dict.fromkeys(m for m in lds["message"] if m):
        section.paragraphs.append(f"LDS undefined: {message}.")
    columns = ["round", "scorer", "lds", "lds_low", "lds_high", "real_mean", "real_std",
               "full_change", "score_seconds", "retrain_seconds"]
    section.tables.append(Table("LDS per round", columns, _cells(lds[columns])))
    drops = drop_rows(results)
    columns = ["round", "scorer", "pct", "dropped", "negative_dropped", "full_change",
               "lowest_change", "random_mean", "random_se"]
    section.tables.append(Table("Real change of f: full buffer, without the lowest-scored p%, "
                                "without a random p%", columns, _cells(drops[columns])))
    if len(results) > 1:
        section.figures["curve"] = (curve_png(results),
                                    "LDS per round with its 95% bootstrap interval.")
    section.figures["scatter"] = (scatter_png(results), "Predicted (sum of scores over the "
                                  "subset) vs real change of the target, one point per subset.")
    return section
