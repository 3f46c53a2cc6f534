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

**Slides** (``window`` m > 1): the return of theta(k) against theta(k+m), the same test over the
run's windows of m updates (a broken worker rarely makes one update fall beyond noise; it makes
several fall a little). Each counterfactual applies to every round of the window (the m% most
harmful records of each round by its own influence scores, random records of each, source s in
each, the whole window at a shorter step; episodes run across rounds and are not left out alone),
and the window's saved rounds are replayed one after the other from theta(k) (``replay_window``):
the records stay the ones the run collected, since a counterfactual policy cannot collect its own
from saved files. The plain replay lands on the saved theta(k+m) exactly for a run of
rlinfluence's trainer. Where the audit's verdict over rounds 0..k+m-1 (the cheap families) holds
two or more sources suspect (``suspects``: adjusted p below ``SUSPECT_LEVEL``, not a flag), the
window is also re-run without all of them (``source-set``, with its own band of as many random
records): several broken workers make a slide that no one of them makes alone. The verdict reads the same table; a source set is named after any single source.

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

import copy
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
    """Update ``round`` (theta(k) -> theta(k+1)), or the ``updates`` updates from it, lowered the
    evaluation return by ``size`` (positive), with its noise (one s.e.) and the largest approx_kl."""

    round: int
    before: float
    after: float
    size: float
    se: float
    approx_kl: float
    kl_spike: bool
    updates: int = 1
    """the updates the fall spans: 1 for a drop, m for a slide over a window"""


def find_drops(metrics: pd.DataFrame, eval_episodes: int, threshold: float = 0.0, window: int = 1) -> list[Drop]:
    """The drops of a run's metrics (module docstring; ``eval_episodes`` per evaluation), largest
    first. With ``window`` m > 1, the slides: the return of theta(k) against theta(k+m), over m
    updates (Bonferroni over the run's windows; ``Drop.round`` is the window's first update, its
    approx_kl the window's largest), the largest first and none overlapping a larger one."""
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
    z = float(scipy.stats.norm.ppf(1 - DROP_ALPHA / max(1, len(rows) - window)))
    drops = []
    for i in range(window, len(rows)):
        before, after = float(rows["eval_return_mean"][i - window]), float(rows["eval_return_mean"][i])
        se = math.sqrt((spread[i] ** 2 + spread[i - window] ** 2) / eval_episodes)
        size = before - after
        step_kl = float(np.nanmax(kl[i - window + 1:i + 1])) if np.isfinite(kl[i - window + 1:i + 1]).any() else math.nan
        if size > max(threshold, z * se):
            drops.append(Drop(int(rows["round"][i - window + 1]), before, after, size, se, step_kl,
                              bool(step_kl > KL_SPIKE * median_kl), window))
    chosen: list[Drop] = []
    for d in sorted(drops, key=lambda d: -d.size):
        if all(d.round + d.updates <= c.round or c.round + c.updates <= d.round for c in chosen):
            chosen.append(d)
    return chosen


def smallest_fall(metrics: pd.DataFrame, eval_episodes: int, window: int = 1) -> str:
    """What ``find_drops`` can see in this run: the fall over ``window`` updates that its test needs,
    z sqrt(2 s^2 / n), at the median evaluation standard deviation s over n = ``eval_episodes``."""
    spread = metrics["eval_return_std"].dropna() if "eval_return_std" in metrics else pd.Series(dtype=float)
    if not len(spread) or eval_episodes < 1:
        return "the run's evaluation has no spread recorded"
    z = float(scipy.stats.norm.ppf(1 - DROP_ALPHA / max(1, len(metrics) - window)))
    fall = z * math.sqrt(2 * float(spread.median()) ** 2 / eval_episodes)
    return (f"at its {eval_episodes} evaluation episodes a fall smaller than about {fall:.3g} (at the median "
            f"spread {float(spread.median()):.3g}) stays within noise")


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
    level[kind == "source-set"] = band(recovered[kind == "random-set"])[1]
    beyond = recovers & (recovered > level)
    plain_kl = rows.loc[kind == "plain", "approx_kl"] if "kl_level" in rows else pd.Series(dtype=float)
    if len(plain_kl) and plain_kl.iloc[0] > rows["kl_level"].iloc[0]:  # the update was a KL spike
        beyond &= rows["approx_kl"] <= rows["kl_level"]
    return beyond & rows["kind"].isin(["harmful", "source", "source-set", "episode"])


def verdict_of(rows: pd.DataFrame) -> str:
    """The drop's verdict from its counterfactual rows (module docstring)."""
    beyond, kind = beyond_band(rows), rows["kind"]
    for sources in (rows[(kind == "source") & beyond], rows[(kind == "source-set") & beyond]):
        if len(sources):  # one source before a set: the smaller claim that explains it
            return sources.sort_values("recovered_fraction").iloc[-1]["counterfactual"]
    chance = rows.loc[kind == "random", "recovered_fraction"].mean()  # NaN without draws: no band to recover
    if (beyond & (kind == "harmful")).any() and not chance >= RECOVERS:
        return "data"
    if (_recovers(rows) & (kind == "step")).any() and not beyond.any():
        return "step"
    return "not explained"


def check_sizes(pct: float, episodes: int, draws: int, threshold: float = 0.0) -> None:
    """``UserError`` for explain's sizes: --pct in (0, 100), --episodes >= 2, --draws >= 1, a finite --threshold >= 0."""
    if not (math.isfinite(threshold) and threshold >= 0):
        raise UserError(f"--threshold must be a finite number >= 0, got {threshold}")
    if not 0 < pct < 100:
        raise UserError(f"--pct must be in (0, 100), got {pct}")
    if episodes < 2 or draws < 1:
        raise UserError(f"--episodes must be >= 2 and --draws >= 1, got {episodes} and {draws}")


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

    check_sizes(pct, episodes, draws)
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
    table = _judged(pd.DataFrame(run.rows), [round_index], chosen, returns, reruns.approx_kl, before, recorded,
                    [c.lr_scale * step_scale for c in chosen], trainer.config.n_epochs)
    table["plain_reproduces_run"], table["plain_float_gap"] = reproduces, float_gap
    table["seconds"] = time.perf_counter() - start
    return table, harm


def _judged(metrics: pd.DataFrame, rounds: list[int], chosen: list, returns: list[np.ndarray], approx_kl: list[float],
            before: np.ndarray, recorded: np.ndarray, lr_scales: list[float], n_epochs: int) -> pd.DataFrame:
    """One row per counterfactual of the updates ``rounds`` (their returns on the common episodes,
    the first the plain re-run; ``metrics`` the run's rows, whose other updates' approx_kl set the
    spike level), with the recovered fractions, the chance bands and the verdict.

    The counterfactuals are compared with the plain re-run, the same arithmetic: where float rounding
    alone moves the return, that is the noise every counterfactual carries; a fall within noise
    (the paired interval of R(theta(k)) - R(plain re-run) reaching 0) explains nothing."""
    reference = returns[0]
    drop, drop_low, _ = ci95(before - reference)
    reproduced = drop_low > 0
    rows = []
    for c, r, kl, scale in zip(chosen, returns, approx_kl, lr_scales, strict=True):
        fraction, low, high = _recovery(r, reference, drop) if reproduced and c.kind != "plain" else (math.nan,) * 3
        rows.append({"round": rounds[0], "updates": len(rounds), "counterfactual": c.name, "kind": c.kind,
                     "kept": sum(int(k.sum()) for k in (c.keep if isinstance(c.keep, list) else [c.keep])), "lr_scale": scale,
                     "n_epochs": c.n_epochs or n_epochs, "approx_kl": kl, "return_mean": float(r.mean()),
                     "recovered_fraction": fraction, "ci_low": low, "ci_high": high})
    table = pd.DataFrame(rows)
    table["return_before"], table["return_after"], table["drop"] = float(before.mean()), float(recorded.mean()), drop
    table["drop_ci_low"] = drop_low
    others = metrics.loc[~metrics["round"].isin(rounds), "approx_kl"] if "approx_kl" in metrics else pd.Series()
    table["kl_level"] = KL_SPIKE * float(others.median()) if others.notna().any() else math.inf
    table["beyond_band"] = beyond_band(table) if reproduced else False
    table["verdict"] = verdict_of(table) if reproduced else NOT_REPRODUCED
    return table


@dataclass(frozen=True)
class WindowCounterfactual:
    """One re-run of a window's updates: its name, a keep mask per round, and the lr scale."""

    name: str
    kind: str
    keep: list[torch.Tensor]
    lr_scale: float = 1.0
    n_epochs: int | None = None


def window_counterfactuals(rounds: list, pct: float = 10.0, draws: int = 5, seed: int = 0,
                           suspects: list[int] | tuple[int, ...] = ()
                           ) -> tuple[list[WindowCounterfactual], list[torch.Tensor]]:
    """(the counterfactuals of a window of saved rounds, each round's influence harm [N]): plain;
    without the ``pct``% most harmful records of every round (snapshot influence on the round's
    in-sample return target at its own theta(j); and ``abs-advantage``); without ``pct``% random
    records of every round (``draws`` draws) and as many as a source has; without source s in every
    round; with two or more ``suspects`` (the sources an audit flags), without all of them, and
    ``draws`` draws of as many random records (``random-set``: that removal's chance band); and the
    whole window at lr/2 and lr/4. Episodes run across rounds, so none is left out alone."""
    from rlinfluence.analysis.validation import score_round
    from rlinfluence.filters import drop_lowest

    keeps = [saved.keep.bool() for saved in rounds]
    harm = [-score_round(saved, ReturnTarget(), "snapshot/batch", seed).double() for saved in rounds]
    extreme = [saved.buffer.flat("advantages").double().abs() for saved in rounds]
    sizes = [len(saved.buffer) for saved in rounds]
    n_envs = rounds[0].buffer.n_envs
    out = [WindowCounterfactual("plain", "plain", keeps)]
    for name, scores in (("influence", harm), ("abs-advantage", extreme)):
        out.append(WindowCounterfactual(f"harmful {pct:g}% {name}", "harmful",
                                        [k & drop_lowest(-h, round(pct / 100 * n)) for k, h, n in zip(keeps, scores, sizes, strict=True)]))
    generator = torch.Generator().manual_seed(seed)
    for kind, share, label in (("random", pct / 100, f"{pct:g}%"), ("random-source", 1 / n_envs, f"{100 / n_envs:g}%")):
        if kind == "random-source" and n_envs == 1:
            continue
        for j in range(draws):
            out.append(WindowCounterfactual(f"random {label} draw {j + 1}", kind,
                                            [k & drop_lowest(torch.rand(n, generator=generator), round(share * n))
                                             for k, n in zip(keeps, sizes, strict=True)]))
    sources = [saved.buffer.record_ids()[:, 1] for saved in rounds]  # each record's env, per round
    for s in range(n_envs if n_envs > 1 else 0):
        out.append(WindowCounterfactual(f"source {s}", "source",
                                        [k & (env != s) for k, env in zip(keeps, sources, strict=True)]))
    if len(suspects) >= 2:
        out.append(WindowCounterfactual(f"sources {','.join(map(str, sorted(suspects)))}", "source-set",
                                        [k & ~torch.isin(env, torch.tensor(sorted(suspects)))
                                         for k, env in zip(keeps, sources, strict=True)]))
        for j in range(draws):
            out.append(WindowCounterfactual(f"random {100 * len(suspects) / n_envs:g}% draw {j + 1}", "random-set",
                                            [k & drop_lowest(torch.rand(n, generator=generator), len(suspects) * n // n_envs)
                                             for k, n in zip(keeps, sizes, strict=True)]))
    out += [WindowCounterfactual("lr/2", "step", keeps, 0.5), WindowCounterfactual("lr/4", "step", keeps, 0.25)]
    batch = rounds[0].trainer.config.batch_size
    return [c for c in out if all(int(k.sum()) >= batch for k in c.keep)], harm


SUSPECT_LEVEL = 0.5
"""A source is a suspect when the audit's adjusted p-value for it is below this (``suspects``)."""
MAX_SUSPECTS = 3


def suspects(run_path: Path, n_rounds: int) -> list[int]:
    """The sources the audit's verdict over the run's rounds 0..``n_rounds`` - 1 holds most suspect,
    on the cheap families (the consistency checks and the reward, value and advantage statistics,
    as quarantine uses): those whose adjusted p-value is below ``SUSPECT_LEVEL``, the
    ``MAX_SUSPECTS`` smallest at most. Not a flag: a choice of which sources a window's explanation
    leaves out together, made on the records' consistency and not on the return, so that removal's
    chance band (as many random records) still holds. None where the run has fewer than 3
    untrusted sources."""
    from rlinfluence.analysis.audit import verdict_table
    from rlinfluence.analysis.harm import harm_table
    from rlinfluence.checkpoint import load_round
    from rlinfluence.consistency import CHECKS, STATISTICS

    families = [*STATISTICS, *CHECKS]
    table = pd.concat([harm_table(load_round(run_path, k), families) for k in range(n_rounds)], ignore_index=True)
    if table.loc[~table["trusted"], "source"].nunique() < 3:
        return []
    verdict = verdict_table(table, families).sort_values("p_adjusted_min", kind="stable")
    return [int(s) for s in verdict.loc[verdict["p_adjusted_min"] < SUSPECT_LEVEL, "source"][:MAX_SUSPECTS]]


def replay_window(rounds: list, keep: list[torch.Tensor], lr_scale: float = 1.0) -> tuple[dict[str, torch.Tensor], float]:
    """(theta'(k+m), the largest approx_kl of its updates): the window's m saved rounds re-run one
    after the other from theta(k) and its optimiser state, round j's update on its kept records
    ``keep[j]`` with its own minibatch generator, from the policy and optimiser state the re-run
    of round j - 1 left. The records are the ones the run collected: a counterfactual policy does
    not collect its own (the replay's approximation, as every re-run of a window)."""
    policy = optimizer = None
    largest = 0.0
    for saved, kept in zip(rounds, keep, strict=True):
        trainer = saved.trainer
        state = copy.deepcopy(saved.start)
        if policy is not None:
            state["policy"], state["optimizer"] = policy, optimizer
        trainer.load_state_dict(state)
        trainer.policy.noise((trainer.config.n_steps, trainer.config.n_envs), trainer.generator)
        stats = trainer.update(saved.buffer, kept, lr_scale=lr_scale)
        largest = max(largest, float(stats.get("approx_kl", 0.0)))
        policy = copy.deepcopy(trainer.policy.state_dict())
        optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    return policy, largest


def explain_window(run_dir: str | Path, first: int, updates: int, pct: float = 10.0, episodes: int = 100,
                   draws: int = 5, seed: int = 0) -> tuple[pd.DataFrame, list[torch.Tensor]]:
    """``explain_round`` for a slide: the ``updates`` updates theta(first) -> theta(first + updates),
    each counterfactual of ``window_counterfactuals`` applied to every round of the window and
    replayed (``replay_window``), every policy evaluated on the same ``episodes`` episodes; the
    same table and verdict (``updates`` = m; ``plain_reproduces_run``: the plain replay lands on
    the saved theta(first + updates) exactly), and each round's influence harm."""
    from rlinfluence.analysis.intervention import matches_checkpoint
    from rlinfluence.checkpoint import load_round

    if updates < 1:
        raise UserError(f"--window must be >= 1, got {updates}")
    check_sizes(pct, episodes, draws)
    start = time.perf_counter()
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    rounds = [load_round(run.path, j) for j in range(first, first + updates)]
    chosen, harm = window_counterfactuals(rounds, pct, draws, seed, suspects(run.path, first + updates))
    judge = rounds[0].trainer  # every policy is evaluated by theta(first)'s trainer: the same episodes
    judge.load_state_dict(copy.deepcopy(rounds[0].start))
    before = judge.evaluate(episodes)
    returns, kls, reproduces = [], [], False
    for c in chosen:
        policy, kl = replay_window(rounds, c.keep, c.lr_scale)
        judge.load_state_dict(copy.deepcopy(rounds[0].start))
        judge.policy.load_state_dict(policy)
        if c.kind == "plain":
            reproduces = matches_checkpoint(judge, run.path, first + updates)
        returns.append(judge.evaluate(episodes))
        kls.append(kl)
    judge.load_state_dict(copy.deepcopy(rounds[0].start))
    judge.policy.load_state_dict(run.read_checkpoint(run.checkpoint_path(first + updates))["policy"])
    recorded = judge.evaluate(episodes)  # the run's own theta(first + updates)
    table = _judged(pd.DataFrame(run.rows), list(range(first, first + updates)), chosen, returns, kls, before, recorded,
                    [c.lr_scale for c in chosen], judge.config.n_epochs)
    table["plain_reproduces_run"], table["plain_float_gap"] = reproduces, 0.0
    table["seconds"] = time.perf_counter() - start
    return table, harm


HARM_NOISE = 1e-6
"""A harm at most this fraction of the round's largest |harm| is float rounding (float32 sums), not harm."""


def driving_records(saved, harm: torch.Tensor, pct: float = 10.0) -> pd.DataFrame:
    """The m% most harmful records of the round, counted per source and episode (most first): only
    records whose harm is above float noise (``HARM_NOISE`` x the round's largest |harm|), so a
    round with fewer harmful records lists fewer, and one with none lists none."""
    ids = saved.buffer.record_ids()
    n_top = max(1, round(pct / 100 * len(harm)))
    top = torch.argsort(harm, descending=True, stable=True)[:n_top]
    top = top[harm[top] > HARM_NOISE * float(harm.abs().max())]
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
        updates = int(first["updates"]) if "updates" in rows else 1
        name = f"Update {k}" if updates == 1 else f"Updates {k}..{k + updates - 1}"
        section.paragraphs.append(f"{name}: {first['return_before']:.4g} -> {first['return_after']:.4g} "
                                  f"(plain re-run {rows['return_mean'].iloc[0]:.4g}); verdict: {first['verdict']}.")
        section.tables.append(Table(name, ["counterfactual", "kept", "return", "recovered", "95% interval"],
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
        ax.set_title(f"{name.lower()}: {first['verdict']}", fontsize=9)
    axes[-1, 0].set_xlabel("fraction of the drop recovered (dashed: half)")
    section.figures["recovered"] = (figure_png(fig), "Fraction of each drop that each counterfactual recovers.")
    return section
