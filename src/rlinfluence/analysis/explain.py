"""Why did my run get worse? Find the updates that hurt, re-run each under counterfactuals, and
say whether the data, one source or the step was to blame.

**Drops.** Row k of a run's metrics evaluates theta(k+1), so the update theta(k) -> theta(k+1)
changed the evaluation return by d_k = R_k - R_{k-1}. It is a drop when -d_k exceeds both
``threshold`` and its noise across the run's U updates, z sqrt(s_k^2 / n + s_{k-1}^2 / n) with
z = Phi^-1(1 - 0.05 / U) (s the evaluation's standard deviation over its n episodes; Bonferroni
over the updates, so a run whose return only fluctuates shows a drop with probability <= 0.05,
where a fixed 2 s.e. would flag about one update in 44 of every run); an approx_kl above
``KL_SPIKE`` times the run's median is listed beside it.

**Counterfactuals** of update k, from the saved theta(k), its optimiser state and buffer, batched
(``rlinfluence.reruns``), each with the round's own kept records and step scale unless it says
otherwise:

    plain            the update as it ran (first: must reproduce the saved theta(k+1))
    harmful m% S     without the m% records most harmful by scorer S (snapshot influence on the
                     in-sample return target, and on the return target of a fresh rollout of
                     theta(k), one round's steps, which the round's own advantages did not
                     write; TracIn of the round where it was recorded; and, not attribution,
                     ``abs-advantage``: the m% records of largest |advantage|)
    random m% draw j without m% uniformly random records (``draws`` draws: the chance band), and
                     ``draws`` more without as many random records as a source has
    source s         without every record of env s (leave one source out)
    episode e        without one of the ``worst_episodes`` most harmful episodes
    lr/2, lr/4       every record, a shorter step; ``epochs/2``: half the epochs

Every policy theta(k), theta(k+1), theta'(k+1) is evaluated on the same ``episodes`` episodes
(the same episode seeds and action-sampling generator: common random numbers), so the fraction
of the drop a counterfactual recovers,

    recovered = (R(theta') - R(theta(k+1))) / (R(theta(k)) - R(theta(k+1))),

has a paired 95% t interval over episodes (the numerator's, divided by the measured drop). The
batched re-runs equal serial ones to float tolerance, not bit for bit, and in a sensitive round
(a large step, a near-deterministic policy) rounding alone can move the return: so theta(k+1)
here is the *batched* plain re-run, the same arithmetic as every counterfactual, and the serial
plain re-run is checked against the saved theta(k+1) (``plain_reproduces_run``), with the
largest parameter gap between the two (``plain_float_gap``). The drop is explained only where it
is reproduced beyond noise: the paired 95% interval of R(theta(k)) - R(theta(k+1)) over the
episodes lies above 0 (``drop_ci_low``); otherwise every recovered fraction would divide by noise.

**Verdict** (a counterfactual *recovers* when recovered >= ``RECOVERS`` and its interval lies
above 0; a removal counts *beyond its chance band* when it recovers more than every random
draw of its size and more than their mean plus ``BAND_SDS`` standard deviations, because in a
sensitive round any removal moves the return; for a source, the other sources left out count
among the draws, since with one source broken they are removals of a source's size by chance,
and one of many sources beats a band of a few draws by luck alone): *source s* when leaving s out recovers beyond it;
else *data* when removing the harmful records recovers beyond the band and the band's mean does
not recover; else *step* when a shorter step recovers and no targeted removal recovers beyond
the band; else *not explained*. When the update itself was a KL spike (the plain re-run's
approx_kl above ``KL_SPIKE`` times the median of the run's other updates), a removal explains the
drop only if it also brings the update's approx_kl back under that level: removing the culprit
restores a normal step, while after a step thirty times too long every re-run is chaotic and some
removal recovers by luck with the step as long as before.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import scipy.stats
import torch

from rlinfluence.errors import UserError
from rlinfluence.influence import ReturnTarget
from rlinfluence.rundir import RunDirectory
from rlinfluence.statistics import ci95

if TYPE_CHECKING:
    from rlinfluence.sections import Section

KL_SPIKE = 5.0
DROP_ALPHA = 0.05
"""The chance that a run whose return only fluctuates shows any drop (module docstring)."""
RECOVERS = 0.5
NOT_REPRODUCED = "the re-run does not reproduce the drop"
"""The verdict where the batched plain re-run does not fall beyond noise on the episodes."""
VERDICTS = ("source", "data", "step", "not explained")


@dataclass(frozen=True)
class Drop:
    """Update ``round`` (theta(k) -> theta(k+1)) lowered the evaluation return by ``size``
    (positive), with its noise (one s.e.) and the update's approx_kl."""

    round: int
    before: float
    after: float
    size: float
    se: float
    approx_kl: float
    kl_spike: bool


def find_drops(metrics: pd.DataFrame, eval_episodes: int, threshold: float = 0.0) -> list[Drop]:
    """The drops of a run's metrics (module docstring; ``eval_episodes`` per evaluation), largest
    first."""
    if "eval_return_mean" not in metrics or metrics["eval_return_mean"].isna().all():
        raise UserError("the run has no evaluation returns (train with --eval-episodes > 0)")
    rows = metrics.sort_values("round").reset_index(drop=True)
    if rows["eval_return_mean"].isna().any():
        raise UserError(f"the run was not evaluated after every round (round "
                        f"{int(rows['round'][rows['eval_return_mean'].isna()].iloc[0])} has no evaluation, as with "
                        "--eval-every > 1): a drop between two evaluations spans several updates; name one with --round K")
    kl = rows["approx_kl"].to_numpy(float) if "approx_kl" in rows else np.full(len(rows), np.nan)
    median_kl = float(np.nanmedian(kl)) if np.isfinite(kl).any() else math.nan
    spread = rows["eval_return_std"].fillna(0.0).to_numpy(float)
    z = float(scipy.stats.norm.ppf(1 - DROP_ALPHA / max(1, len(rows) - 1)))
    drops = []
    for i in range(1, len(rows)):
        before, after = float(rows["eval_return_mean"][i - 1]), float(rows["eval_return_mean"][i])
        se = math.sqrt((spread[i] ** 2 + spread[i - 1] ** 2) / eval_episodes)
        size = before - after
        if size > max(threshold, z * se):
            drops.append(Drop(int(rows["round"][i]), before, after, size, se, float(kl[i]),
                              bool(kl[i] > KL_SPIKE * median_kl)))
    return sorted(drops, key=lambda d: -d.size)


@dataclass(frozen=True)
class Counterfactual:
    """One re-run of the update: its name, keep mask, lr scale (times the round's) and epochs."""

    name: str
    kind: str
    keep: torch.Tensor
    lr_scale: float = 1.0
    n_epochs: int | None = None


def counterfactuals(saved, pct: float = 10.0, draws: int = 5, worst_episodes: int = 3, seed: int = 0
                    ) -> tuple[list[Counterfactual], dict[str, torch.Tensor]]:
    """(the counterfactuals of the module docstring, the harm scores they used: scorer -> [N],
    higher = more harmful)."""
    from rlinfluence.analysis.validation import score_round
    from rlinfluence.filters import drop_lowest

    buffer, keep = saved.buffer, saved.keep.bool()
    n, n_epochs = len(buffer), saved.trainer.config.n_epochs
    n_drop = round(pct / 100 * n)
    harm = {"influence": -score_round(saved, ReturnTarget(), "snapshot/batch", seed).double()}
    # the in-sample target carries the round's own advantages, wrong ones included: a fresh rollout
    # of theta(k) gives a target the round's records did not write
    trainer, cfg = saved.trainer, saved.trainer.config
    fresh = trainer.collect()
    fresh.compute_advantages(cfg.gamma, cfg.gae_lambda)
    target = ReturnTarget(fresh.flat("obs"), fresh.flat("actions"), fresh.flat("advantages"))
    harm["influence-fresh"] = -score_round(saved, target, "snapshot/batch", seed).double()
    if saved.tracin is not None:
        harm["tracin"] = -saved.tracin.double()
    # not attribution: a few records with absurd advantages (a reward-scale or sign bug) take over
    # every minibatch's normalisation, and no gradient score need see them
    harm["abs-advantage"] = buffer.flat("advantages").double().abs()
    out = [Counterfactual("plain", "plain", keep)]
    for name, h in harm.items():
        out.append(Counterfactual(f"harmful {pct:g}% {name}", "harmful", keep & drop_lowest(-h, n_drop)))
    generator = torch.Generator().manual_seed(seed)
    for j in range(draws):
        out.append(Counterfactual(f"random {pct:g}% draw {j + 1}", "random",
                                  keep & drop_lowest(torch.rand(n, generator=generator), n_drop)))
    if buffer.n_envs > 1:  # the chance band of a source's removal: as many random records as a source has
        for j in range(draws):
            out.append(Counterfactual(f"random {100 / buffer.n_envs:g}% draw {j + 1}", "random-source",
                                      keep & drop_lowest(torch.rand(n, generator=generator), n // buffer.n_envs)))
    ids = buffer.record_ids()
    for s in range(buffer.n_envs):
        out.append(Counterfactual(f"source {s}", "source", keep & (ids[:, 1] != s)))
    pairs = pd.DataFrame({"source": ids[:, 1].numpy(), "episode": buffer.flat("episode_ids").numpy(),
                          "harm": harm["influence"].numpy()})
    worst = pairs.groupby(["source", "episode"])["harm"].sum().sort_values(ascending=False, kind="stable")
    for source, episode in worst.index[:worst_episodes]:
        out.append(Counterfactual(f"episode {source}:{episode}", "episode",
                                  keep & ~torch.from_numpy((pairs["source"] == source).to_numpy()
                                                           & (pairs["episode"] == episode).to_numpy())))
    out += [Counterfactual("lr/2", "step", keep, 0.5), Counterfactual("lr/4", "step", keep, 0.25),
            Counterfactual("epochs/2", "step", keep, n_epochs=max(1, n_epochs // 2))]
    return [c for c in out if int(c.keep.sum()) >= saved.trainer.config.batch_size], harm


def _recovery(returns: np.ndarray, after: np.ndarray, drop: float) -> tuple[float, float, float]:
    mean, low, high = ci95(returns - after)
    return mean / drop, low / drop, high / drop


BAND_SDS = 3.0
"""How far beyond its chance band a removal must recover: more than the band's largest draw and
than its mean plus this many standard deviations."""


def _recovers(rows: pd.DataFrame) -> pd.Series:
    return (rows["recovered_fraction"] >= RECOVERS) & (rows["ci_low"] > 0)


def beyond_band(rows: pd.DataFrame) -> pd.Series:
    """Per counterfactual row: a removal that recovers the drop beyond the chance band of
    removals of its size (random records as many as a source has for ``source``, ``pct``% for
    ``harmful`` and ``episode``), and after a KL spike brings the step back under ``kl_level``
    (module docstring)."""
    recovers = _recovers(rows)

    def band(draws: pd.Series) -> tuple[float, float]:  # (mean, the level a removal must beat)
        draws = draws.dropna()
        if not len(draws):
            return 0.0, 0.0
        spread = float(draws.std(ddof=1)) if len(draws) > 1 else 0.0
        return float(draws.mean()), max(float(draws.max()), float(draws.mean()) + BAND_SDS * spread)

    recovered, kind = rows["recovered_fraction"], rows["kind"]
    pct_band = band(recovered[kind == "random"])
    level = pd.Series(pct_band[1], index=rows.index)
    for i in rows.index[kind == "source"]:  # the other sources left out are chance draws of a source's size too
        level[i] = band(pd.concat([recovered[kind == "random-source"], recovered[(kind == "source") & (rows.index != i)]]))[1]
    beyond = recovers & (recovered > level)
    plain_kl = rows.loc[kind == "plain", "approx_kl"] if "kl_level" in rows else pd.Series(dtype=float)
    if len(plain_kl) and plain_kl.iloc[0] > rows["kl_level"].iloc[0]:  # the update was a KL spike
        beyond &= rows["approx_kl"] <= rows["kl_level"]
    return beyond & rows["kind"].isin(["harmful", "source", "episode"])


def verdict_of(rows: pd.DataFrame) -> str:
    """The drop's verdict from its counterfactual rows (module docstring)."""
    beyond, kind = beyond_band(rows), rows["kind"]
    sources = rows[(kind == "source") & beyond]
    if len(sources):
        return sources.sort_values("recovered_fraction").iloc[-1]["counterfactual"]
    chance = rows.loc[kind == "random", "recovered_fraction"].mean()  # NaN without draws: no band to recover
    if (beyond & (kind == "harmful")).any() and not chance >= RECOVERS:
        return "data"
    if (_recovers(rows) & (kind == "step")).any() and not beyond.any():
        return "step"
    return "not explained"


def explain_round(run_dir: str | Path, round_index: int, pct: float = 10.0, episodes: int = 100, draws: int = 5,
                  worst_episodes: int = 3, seed: int = 0) -> tuple[pd.DataFrame, dict[str, torch.Tensor]]:
    """(one row per counterfactual of update ``round_index``, the harm scores): ``round``,
    ``counterfactual``, ``kind``, ``kept``, ``lr_scale``, ``return_mean``, ``recovered_fraction``,
    ``ci_low``, ``ci_high``, ``beyond_band`` (a removal beyond its chance band), the drop's
    ``verdict``, ``kl_level`` (``KL_SPIKE`` times the median approx_kl of the run's other
    updates), ``plain_reproduces_run`` and ``seconds``."""
    from rlinfluence.analysis.intervention import matches_checkpoint
    from rlinfluence.checkpoint import load_round
    from rlinfluence.reruns import Variant, batched_retrain

    if not 0 < pct < 100:
        raise UserError(f"--pct must be in (0, 100), got {pct}")
    if episodes < 2 or draws < 1:
        raise UserError(f"--episodes must be >= 2 and --draws >= 1, got {episodes} and {draws}")
    start = time.perf_counter()
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    saved = load_round(run.path, round_index)
    trainer = saved.trainer
    # the step the round took: its saved minibatch schedule's learning rate over the configured one
    # (a KL-adaptive rate moves within the round, and excludes step control: scale 1)
    step_scale = saved.schedule[0].lr / trainer.config.learning_rate \
        if saved.schedule and trainer.config.adaptive_kl is None else 1.0
    chosen, harm = counterfactuals(saved, pct, draws, worst_episodes, seed)
    before = trainer.evaluate(episodes)  # theta(k), on the episodes every policy below plays
    reruns = batched_retrain(saved, [Variant(c.keep, c.lr_scale * step_scale, c.n_epochs) for c in chosen])
    returns = []
    for k in range(len(chosen)):
        reruns.load(trainer.policy, k)
        returns.append(trainer.evaluate(episodes))
    saved.retrain(saved.keep, step_scale)  # the serial plain re-run: the recorded theta(k+1), bit for bit?
    reproduces = matches_checkpoint(trainer, run.path, round_index + 1)
    float_gap = max(float((p.detach() - reruns.params[0][n]).abs().max()) for n, p in trainer.policy.named_parameters())
    recorded = trainer.evaluate(episodes)
    # the batched counterfactuals are compared with the batched plain re-run, the same arithmetic:
    # where float rounding alone moves the return, that is the noise every counterfactual carries
    reference = returns[0]
    drop, drop_low, _ = ci95(before - reference)  # paired over the episodes: a fall within noise explains nothing
    reproduced = drop_low > 0
    rows = []
    for c, r, kl in zip(chosen, returns, reruns.approx_kl, strict=True):
        fraction, low, high = _recovery(r, reference, drop) if reproduced and c.kind != "plain" else (math.nan,) * 3
        rows.append({"round": round_index, "counterfactual": c.name, "kind": c.kind, "kept": int(c.keep.sum()),
                     "lr_scale": c.lr_scale * step_scale, "n_epochs": c.n_epochs or trainer.config.n_epochs,
                     "approx_kl": kl, "return_mean": float(r.mean()), "recovered_fraction": fraction,
                     "ci_low": low, "ci_high": high})
    table = pd.DataFrame(rows)
    table["return_before"], table["return_after"], table["drop"] = float(before.mean()), float(recorded.mean()), drop
    table["drop_ci_low"] = drop_low
    metrics = pd.read_csv(run.path / "metrics.csv")
    others = metrics.loc[metrics["round"] != round_index, "approx_kl"] if "approx_kl" in metrics else pd.Series()
    table["kl_level"] = KL_SPIKE * float(others.median()) if others.notna().any() else math.inf
    table["beyond_band"] = beyond_band(table) if reproduced else False
    table["verdict"] = verdict_of(table) if reproduced else NOT_REPRODUCED
    table["plain_reproduces_run"], table["plain_float_gap"] = reproduces, float_gap
    table["seconds"] = time.perf_counter() - start
    return table, harm


def driving_records(saved, harm: torch.Tensor, pct: float = 10.0) -> pd.DataFrame:
    """The m% most harmful records of the round, counted per source and episode (most first)."""
    ids = saved.buffer.record_ids()
    n_top = max(1, round(pct / 100 * len(harm)))
    top = torch.argsort(harm, descending=True, stable=True)[:n_top]
    frame = pd.DataFrame({"source": ids[top, 1].numpy(), "episode": saved.buffer.flat("episode_ids")[top].numpy(),
                          "harm": harm[top].numpy()})
    return (frame.groupby(["source", "episode"]).agg(records=("harm", "size"), harm=("harm", "sum"))
            .reset_index().sort_values("harm", ascending=False, kind="stable"))


def explain_section(table: pd.DataFrame) -> Section:
    """``explain``'s results as a report section: per explained update, its verdict, the
    counterfactuals' recovered fractions (with intervals) as a table and a plot."""
    from rlinfluence.analysis.report import Section, Table, figure_png, new_figure

    section = Section("explain", "Why did the run get worse? Counterfactual re-runs of its drops", paragraphs=[
        "Each update below lowered the evaluation return beyond its noise. It was re-run from its saved round "
        "without the most harmful records, without random records (the chance band), without each source, "
        "without its worst episodes and with a shorter step, every policy on the same evaluation episodes; "
        "recovered = (R' - R(plain re-run)) / (R(theta(k)) - R(plain re-run)), with a paired 95% t interval."])
    rounds = list(dict.fromkeys(table["round"]))
    fig, axes = new_figure(7.5, 0.28 * len(table) + 1.2 * len(rounds), nrows=len(rounds))
    for ax, k in zip(axes[:, 0], rounds, strict=True):
        rows = table[table["round"] == k]
        first = rows.iloc[0]
        section.paragraphs.append(f"Update {k}: {first['return_before']:.4g} -> {first['return_after']:.4g} "
                                  f"(batched plain re-run {rows['return_mean'].iloc[0]:.4g}); verdict: "
                                  f"{first['verdict']}.")
        section.tables.append(Table(f"Update {k}", ["counterfactual", "kept", "return", "recovered", "95% interval"],
                                    [[r.counterfactual, int(r.kept), f"{r.return_mean:.4g}",
                                      f"{r.recovered_fraction:.2f}", f"[{r.ci_low:.2f}, {r.ci_high:.2f}]"]
                                     for r in rows.itertuples()]))
        shown = rows.dropna(subset=["recovered_fraction"])
        y = np.arange(len(shown))
        ax.errorbar(shown["recovered_fraction"], y, xerr=[shown["recovered_fraction"] - shown["ci_low"],
                                                          shown["ci_high"] - shown["recovered_fraction"]],
                    fmt="o", ms=3, lw=1)
        ax.axvline(0, color="k", lw=0.6)
        ax.axvline(RECOVERS, color="k", lw=0.6, ls="--")
        ax.set_yticks(y, shown["counterfactual"], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"update {k}: {first['verdict']}", fontsize=9)
    axes[-1, 0].set_xlabel("fraction of the drop recovered (dashed: half)")
    section.figures["recovered"] = (figure_png(fig), "Fraction of each drop that each counterfactual recovers.")
    return section
