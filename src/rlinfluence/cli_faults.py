"""The ``rlinfluence`` commands that ask what went wrong in a run: ``audit`` (which worker is broken,
and what kind of fault) and ``explain`` (why the run got worse: data, a source or the step).

Free of torch, pandas and scipy at import, as ``rlinfluence.cli``: each command imports what it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from rlinfluence.cli_analyses import Rounds, _check_writes_into
from rlinfluence.errors import UserError
from rlinfluence.helptext import RunName, StatedDefault, shown_as
from rlinfluence.rundir import atomic_write


@dataclass
class AuditArgs:
    """Which source (training env, worker) of a run is broken, and what kind of fault is it? Every
    saved round is scored by every family (reward statistics, value, advantage, and consistency
    checks: logged log-probs, values and actions against theta(k), observation statistics,
    episode-end types, a one-step dynamics, reward and termination model; the gradient families with
    --gradient-families);
    each source's mean per round (over its episodes that started in that round) is tested against
    the other sources' with an exact permutation test within rounds (step-down maxT across sources
    x families; once every source has 5 episodes, a t test of its mean normal score beside it; the
    logged actions' calibration against its known law), and a flagged source's signature is read
    as a likely fault class (--scorer X: the test by one scorer alone).
    A run trained with --corrupt also gets the detection AUROC and precision of every scorer at
    record, episode and source level. Runs of the Stable-Baselines3 adapter: train with its
    AuditCallback."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory trained with --save-buffers and --n-envs > 1 (or with the SB3 AuditCallback)"""
    rounds: Annotated[Rounds, StatedDefault] = ()
    """saved rounds to score (default: every saved round)"""
    scorer: Annotated[str | None, shown_as("FAMILY")] = None
    """test one scorer alone instead of the verdict over every family: influence, influence-chunk,
    influence-trusted (with --trusted-envs), tracin, dtv, negative-advantage, abs-advantage, td-error,
    reward-extremes, random, or a check: logp-gap, value-gap, action-surprise, action-calibration,
    obs-shift, truncations, dynamics, action-fit, lag-fit, reward-model, termination (the verdict
    takes tracin only from a run trained with --tracin, where it is recorded; --scorer tracin replays it)"""
    by: Literal["source", "episode", "record"] = "source"
    """episode or record: also rank those items by harm (audit/ranked_<by>.csv, the 10 worst printed)"""
    alpha: float = 0.01
    """family-wise error rate of the flags across the sources"""
    guarantee: Literal["audit", "run"] = "audit"
    """audit: at most alpha chance of a false flag in this audit; run: at most alpha in all the audits
    of a run audited after each of its rounds (this one at alpha / (R (R + 1)), R the rounds audited:
    few faults flagged within 5 rounds, most by round 8)"""
    permutations: int = 2000
    """permutation draws of the --scorer test where it is not exact (the verdict's maxT draws 10,000)"""
    seed: int = 0
    """seed of the --scorer test's permutations and bootstrap intervals"""
    workers: int = 1
    """local worker processes, each scoring one saved round at a time (the same tables as 1)"""
    ray_address: Annotated[str | None, shown_as("ADDRESS")] = None
    """score the saved rounds as Ray tasks on this cluster (auto or HOST:PORT) instead"""
    progress: bool = True
    """show the scoring's progress on stderr (a line per round when not on a terminal)"""
    gradient_families: bool = False
    """also score and test the gradient (attribution) families: influence, influence-chunk,
    influence-trusted, dtv, and tracin where recorded (version 3's families; left out by default,
    since on held-out runs they flagged no broken worker the others missed, at most of the cost)"""


def audit(a: AuditArgs) -> int:
    """Audit a run; write RUN_DIR/audit/sources.csv (+ detection.csv with ground truth, ranked_<by>.csv),
    sources.png, and its section of the run's report."""
    from rlinfluence.analysis.audit import (
        audit_run,
        audit_section,
        detection_summary,
        is_verdict,
        ranked,
        ranking_scorer,
        unreachable_note,
    )
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section

    _check_writes_into(a.run_dir, "audit")
    sources, found, table = audit_run(a.run_dir, a.rounds, a.scorer, a.alpha, a.permutations, a.seed, a.workers,
                                      a.ray_address, progress=a.progress, guarantee=a.guarantee,
                                      gradient_families=a.gradient_families)
    folder = Path(a.run_dir) / "audit"
    folder.mkdir(exist_ok=True)
    level = float(sources["level"].iloc[0])
    section = audit_section(sources, found, level)
    # the verdict's table, or one scorer's beside it (named by the scorer: neither overwrites the other)
    stem = "sources" if a.scorer is None else f"sources_{a.scorer}"
    outputs = [(folder / f"{stem}.csv", lambda p: sources.to_csv(p, index=False)),
               (folder / f"{stem}.png", lambda p: p.write_bytes(section.figures["sources"][0]))]
    if len(found):
        outputs.append((folder / "detection.csv", lambda p: found.to_csv(p, index=False)))
    if a.by != "source":
        items = ranked(table, a.by, ranking_scorer(sources))
        outputs.append((folder / f"ranked_{a.by}.csv", lambda p: items.to_csv(p, index=False)))
    # every file of the audit and its section of the report (`rlinfluence report` shows it), or none
    save_section(Path(a.run_dir) / ANALYSES_DIR, section, beside=outputs)
    flagged = sources[sources["flagged"]]["source"].tolist()
    if is_verdict(sources):
        print(sources[["source", "records", "rounds", "flagged", "signature", "signature_p", "fault_class"]]
              .to_string(index=False))
        per_run = f", the per-run level for {int(sources['rounds'].iloc[0])} rounds" if a.guarantee == "run" else ""
        print(f"flagged (verdict v{sources['verdict_version'].iloc[0]}, adjusted p < {level:.3g}{per_run} across "
              f"sources x families): {', '.join(f'source {s}' for s in flagged) or 'none'}")
        for row in sources[sources["flagged"]].itertuples():
            print(f"source {row.source} ({row.fault_class}): {row.reading}")
        print(unreachable_note(sources, level) if not flagged else "", end="")
    else:
        print(sources.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        print(f"flagged (Holm-adjusted p < {level:.3g}): {', '.join(f'source {s}' for s in flagged) or 'none'}")
    written = [f"{stem}.csv", f"{stem}.png"]
    if len(found):
        written.append("detection.csv")
        print("detection against the ground truth, mean over rounds [95% interval] (AUROC 0.5 = chance):")
        print(detection_summary(found).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    if a.by != "source":
        written.append(f"ranked_{a.by}.csv")
        print(f"the 10 most harmful {a.by}s:")
        print(items.head(10).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"wrote {', '.join(str(folder / name) for name in written)}")
    return 0


@dataclass
class ExplainArgs:
    """Why did the run get worse? The updates whose evaluation return fell beyond its noise, each
    re-run from its saved round (theta(k), optimiser state, buffer) without the most harmful records,
    without random records, without each source, without its worst episodes and with a shorter
    step, all evaluated on the same episodes; a verdict per drop: source, data, step or not
    explained. Writes RUN_DIR/explain.csv (one row per counterfactual)."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory trained with --save-buffers and --eval-episodes > 0"""
    round: Annotated[int | None, shown_as("INT")] = None
    """explain this update (theta(k) -> theta(k+1)) instead of the largest drop"""
    threshold: float = 0.0
    """a drop must also exceed this much evaluation return (beside its noise across the run's updates)"""
    pct: float = 10.0
    """share of records the harmful and random counterfactuals remove, in (0, 100)"""
    episodes: int = 100
    """evaluation episodes of every policy (the same episodes for all: common random numbers)"""
    draws: int = 5
    """random-removal draws (the chance band)"""
    drops: int = 1
    """explain this many of the largest drops (without --round)"""
    window: int = 1
    """explain slides over this many updates (theta(k) -> theta(k+m), every round of the window re-run
    under each counterfactual) instead of single updates"""


def explain(a: ExplainArgs) -> int:
    """Find a run's drops and explain them; print each verdict and the records that drove it."""
    import pandas as pd

    from rlinfluence.analysis.explain import (
        check_sizes,
        driving_records,
        explain_round,
        explain_section,
        explain_window,
        find_drops,
        smallest_fall,
    )
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section
    from rlinfluence.checkpoint import load_round
    from rlinfluence.config import PPOConfig
    from rlinfluence.rundir import RunDirectory

    _check_writes_into(a.run_dir)
    check_sizes(a.pct, a.episodes, a.draws, a.threshold)  # before reading the run: also when there is nothing to explain
    if a.drops < 1:
        raise UserError(f"--drops must be >= 1, got {a.drops}")
    run = RunDirectory.open_existing(a.run_dir, tensorboard=False)
    config = PPOConfig.from_dict(run.read_config())
    if not config.save_buffers:
        raise UserError(f"{a.run_dir!r} was trained without --save-buffers: there is no saved round to re-run")
    if not run.rows:
        raise UserError(f"{str(run.path / 'metrics.csv')!r} has no round: the run has nothing to explain yet")
    metrics = pd.DataFrame(run.rows)  # read and checked with the run (numbers, each round once)
    last = int(metrics["round"].max())
    if a.window < 1 or a.window > last + 1:
        raise UserError(f"--window must be in 1..{last + 1} (the run's updates), got {a.window}")
    span = "update" if a.window == 1 else f"{a.window} updates"
    if a.round is not None:
        if not 0 <= a.round <= last - a.window + 1:
            raise UserError(f"--round {a.round} is out of range: the run has rounds 0..{last}"
                            + (f" (a window of {a.window} must start at {last - a.window + 1} or before)" if a.window > 1 else ""))
        rounds = [a.round]
    else:
        found = find_drops(metrics, config.eval_episodes, a.threshold, a.window) if config.eval_episodes else []
        for d in found:
            print(f"{'drop at update' if a.window == 1 else 'slide over the updates from'} {d.round}: {d.before:.4g} -> "
                  f"{d.after:.4g} (-{d.size:.3g}, noise s.e. {d.se:.2g})"
                  f"{', approx_kl spike ' + format(d.approx_kl, '.3g') if d.kl_spike else ''}")
        if not found:
            print(f"no {span} lowered the evaluation return beyond its noise: nothing to explain (name one with "
                  f"--round{'' if a.window > 1 else ', or look for slides with --window 3'}); {smallest_fall(metrics, config.eval_episodes, a.window)}")
            return 0
        rounds = [d.round for d in found[: a.drops]]
    tables = []
    for k in rounds:
        if a.window == 1:
            table, harm = explain_round(run.path, k, a.pct, a.episodes, a.draws)
            harms = [harm["influence"]]
        else:
            table, harms = explain_window(run.path, k, a.window, a.pct, a.episodes, a.draws)
        tables.append(table)
        print(table[["counterfactual", "kept", "return_mean", "recovered_fraction", "ci_low", "ci_high"]]
              .to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        row = table.iloc[0]
        reproduced = ("yes" if row["plain_reproduces_run"] else
                      "no: the re-run's update is not the trainer's (a run written from another trainer, such as "
                      "SB3's, draws its own minibatches), so each counterfactual is compared with the plain re-run, "
                      "not with the run")
        where = f"update {k}" if a.window == 1 else f"updates {k}..{k + a.window - 1}"
        rerun = (f"batched plain re-run: {table['return_mean'].iloc[0]:.4g}, its parameters within "
                 f"{row['plain_float_gap']:.1g} of the serial re-run's" if a.window == 1 else
                 f"plain replay: {table['return_mean'].iloc[0]:.4g}")
        print(f"{where}: {row['return_before']:.4g} -> {row['return_after']:.4g} on {a.episodes} episodes "
              f"({rerun}); verdict: {row['verdict']} (the plain re-run lands on the run's saved "
              f"theta({k + a.window}): {reproduced}; {row['seconds']:.0f} s)")
        for j, harm in enumerate(harms):
            drivers = driving_records(load_round(run.path, k + j), harm, a.pct)
            if len(drivers):
                print(f"round {k + j}: the {a.pct:g}% most harmful records (influence on the return), per source "
                      "and episode:")
                print(drivers.head(10).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
            else:
                print(f"round {k + j}: no record has a harm above float noise (influence on the return)")
    out = pd.concat(tables, ignore_index=True)
    atomic_write(run.path / "explain.csv", lambda p: out.to_csv(p, index=False))
    save_section(run.path / ANALYSES_DIR, explain_section(out))  # `rlinfluence report` shows it
    print(f"wrote {run.path / 'explain.csv'}")
    return 0
