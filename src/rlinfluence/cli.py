"""``rlinfluence <command>``: tyro subcommands, each command's flags generated from its dataclass.

Lists are typed (``tuple[int, ...]``, ``tuple[Literal[...], ...]``), so tyro checks them before
anything runs. Bad input -- a ``UserError`` or a command line tyro rejects -- is printed as one
line ``error: ...`` with exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import tyro

from rlinfluence.config import DEFAULT_ADVANTAGE_NORM, ROBUST_IIF, PPOConfig
from rlinfluence.errors import UserError
from rlinfluence.experiments.specs import CompareConfig, check_bootstrap_reps
from rlinfluence.helptext import EmptyMeansNone, StatedDefault
from rlinfluence.rlhf.config import RLHFArgs
from rlinfluence.rundir import atomic_write, check_output_dir, check_output_file

# Every module imported above is free of torch, pandas and scipy, so that `rlinfluence --help`
# and each command's --help start fast; the commands import what they run.
if TYPE_CHECKING:
    from rlinfluence.analysis.report import Section
    from rlinfluence.ppo import PPO


def _round_list(flag: str) -> Any:
    """The type of a flag listing rounds: ``tuple[int, ...]`` of rounds >= 0, sorted, each once;
    written space-separated (``5 10 20``) or, as before, comma-separated (``5,10,20``). tyro
    rejects anything else before the command runs."""

    def parse(texts: list[str]) -> tuple[int, ...]:
        items = [item.strip() for text in texts for item in text.split(",")]
        if not items or not all(item.isdigit() for item in items):
            raise ValueError(f"{flag} must be comma-separated or space-separated round numbers >= 0, "
                             f"got {' '.join(texts)!r}")
        return tuple(sorted({int(item) for item in items}))

    return Annotated[tuple[int, ...], tyro.constructors.PrimitiveConstructorSpec(
        nargs="*", metavar="K [K ...]", instance_from_str=parse,
        is_instance=lambda value: isinstance(value, tuple), str_from_instance=lambda value: [str(k) for k in value],
    ), EmptyMeansNone]


Rounds = _round_list("--rounds")
RoundsOfValidate = _round_list("--round")
AdvantageNorm = Literal["chunk", "batch", "none"]
"""``rlinfluence.influence.ADVANTAGE_NORMS``, as a type tyro checks."""


@dataclass
class TrainArgs:
    """Train PPO. Defaults shown are the preset of --env (paper hyperparameters for its six
    environments). Add --resume RUN_DIR to continue a run (with --total-timesteps N: extend it)."""

    config: Annotated[PPOConfig, tyro.conf.arg(name="")]
    resume: str | None = None
    """continue RUN_DIR from its newest checkpoint with its saved config (no other flag but
    --total-timesteps, which extends the run to N env steps)"""


def train(a: TrainArgs) -> int:
    """Train PPO, or resume a run; print the run directory first, the last round's figures at the end."""
    from rlinfluence.ppo import PPO

    if a.resume is not None:
        preset = PPOConfig.for_env(a.config.env)
        flags = ["--env"] if a.config.env != PPOConfig.env else []
        flags += [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(PPOConfig)
                  if f.name != "total_timesteps" and getattr(a.config, f.name) != getattr(preset, f.name)]
        if flags:
            raise UserError(f"--resume continues with the run's saved config; unexpected flags {flags} "
                            "(only --total-timesteps, to extend it)")
        trainer = PPO.resume(a.resume)
        if a.config.total_timesteps != preset.total_timesteps:
            _extend(trainer, a.config.total_timesteps)
        if trainer.round >= trainer.config.rounds:
            trainer.run.close()
            print(f"{trainer.run.path} is complete: {trainer.round} rounds, {trainer.env_steps} env steps; extend it "
                  f"with rlinfluence train --resume {trainer.run.path} --total-timesteps N")
            return 0
        print(f"resuming {trainer.run.path} from theta({trainer.round}) of {trainer.config.rounds} rounds: "
              "environment episodes restart (the envs are reset with a seed derived from (seed, round))")
    else:
        trainer = PPO(a.config)
        print(f"run directory: {trainer.run.path}", flush=True)
    _learn(trainer, fresh=a.resume is None)
    last = trainer.run.rows[-1] if trainer.run and trainer.run.rows else None
    if last is not None:
        print(f"round {last['round']}: eval_return {last['eval_return_mean']:.3f} "
              f"+/- {last['eval_return_std']:.3f}, train_seconds {last['train_seconds']:.1f}")
    print(f"run directory: {trainer.run.path}")
    return 0


def _extend(trainer: PPO, total_timesteps: int) -> None:
    """Extend a resumed run to ``total_timesteps`` env steps (written to its config.json)."""
    if total_timesteps < trainer.env_steps:
        raise UserError(f"--total-timesteps {total_timesteps} is below the {trainer.env_steps} env steps "
                        f"{trainer.run.path} has already trained")
    trainer.config.total_timesteps = total_timesteps
    trainer.run.write_config(trainer.config.to_dict())


def _learn(trainer: PPO, fresh: bool) -> None:
    """``trainer.learn()``. A fresh run that fails before completing its first round leaves no
    directory; a later failure keeps the completed rounds and says how to resume; Ctrl-C says
    where the run is and how to continue it."""
    try:
        trainer.learn()
    except BaseException as exc:
        path = trainer.run.path
        if fresh and trainer.round == 0:
            shutil.rmtree(path, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt):
            where = (f"no round completed; {str(path)!r} removed" if fresh and trainer.round == 0 else
                     f"{trainer.round} of {trainer.config.rounds} rounds are saved in {path}; continue with "
                     f"rlinfluence train --resume {path}")
            print(f"\ninterrupted: {where}", file=sys.stderr)
            raise SystemExit(130) from None
        if not isinstance(exc, UserError | OSError):
            raise
        if fresh and trainer.round == 0:
            raise UserError(f"{exc} (no round completed; {str(path)!r} removed)") from None
        raise UserError(f"{exc}; the {trainer.round} completed rounds are kept: continue with "
                        f"rlinfluence train --resume {path}") from None


def compare(config: CompareConfig) -> int:
    """Multi-seed comparison of methods against a reference; prints the summary tables."""
    from rlinfluence.experiments import compare as run_compare

    out = run_compare(config)
    if sys.stdout.isatty():  # a terminal gets the robust table drawn; Markdown stays in summary.md
        from rich.console import Console

        from rlinfluence.experiments.comparison import summary_table

        Console().print(summary_table(out))
        print(f"every table: {out / 'summary.md'}")
    else:
        print((out / "summary.md").read_text())
    print(f"curves: {out / 'curves.png'}")
    return 0


@dataclass
class AggregateArgs:
    """Combine compare folders of several envs into one table with rliable's statistics and plots
    (IQM and mean with stratified-bootstrap intervals, performance profiles, P(improvement))."""

    folders: tyro.conf.Positional[Annotated[tuple[str, ...], StatedDefault]]
    """compare output folders, one per env (same reference method)"""
    out: str = "runs/aggregate"
    """output folder: aggregate.md/.csv/.html and the PNG plots"""
    bootstrap_reps: int = 2000
    """bootstrap replications of every interval"""
    bootstrap_seed: int = 0
    """seed of every bootstrap: the same seed gives the same intervals"""


def aggregate(a: AggregateArgs) -> int:
    """Aggregate compare folders; prints the table."""
    from rlinfluence.experiments.aggregate import aggregate as run_aggregate

    check_bootstrap_reps(a.bootstrap_reps)
    check_output_dir(a.out)
    out = run_aggregate(a.folders, a.out, a.bootstrap_reps, a.bootstrap_seed, progress=True)
    print((out / "aggregate.md").read_text())
    print(f"wrote {out / 'aggregate.html'}")
    return 0


@dataclass
class AttributeArgs:
    """Score every record of a saved round's buffer by its influence on a target."""

    run_dir: tyro.conf.Positional[str]
    """run directory trained with --save-buffers"""
    round: int
    """round k to attribute (its buffer and theta(k) are loaded)"""
    target: Literal["return", "action"] = "return"
    """return: mean A log pi over the buffer; action: log pi(a|s) of the record --state-index"""
    state_index: int | None = None
    """flat buffer index of the (state, action) of the action target"""
    mode: Literal["snapshot", "full"] = "snapshot"
    """snapshot: at theta(k) (ghost dot products); full: TracIn over the round's optimiser steps"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """snapshot mode's training-side advantages: IIF's (chunk: chunks of batch_size records of a
    seeded random permutation), the whole buffer (batch), raw (none)"""
    top: int = 10
    """records shown from each end"""
    out: Annotated[str | None, StatedDefault] = None
    """Parquet file (default RUN_DIR/attribution_round_K_<target>_<mode>[_<norm>].parquet, see
    attribution_file_name)"""
    html: bool = False
    """also write the top and bottom records (with their frames, if saved) next to it as .html"""


ATTRIBUTION_METADATA = b"rlinfluence"
"""The key of an attribution file's Parquet schema metadata: how it was made, as JSON."""


def attribution_file_name(a: AttributeArgs) -> str:
    """``attribution_round_5_return_snapshot_chunk.parquet``,
    ``attribution_round_5_action17_full.parquet``: the round, the target (with the state index of
    an action target), the mode and the snapshot's normalisation, so that attributions made with
    other settings sit side by side."""
    target = f"action{a.state_index}" if a.target == "action" else a.target
    mode = f"snapshot_{a.advantage_norm}" if a.mode == "snapshot" else a.mode
    return f"attribution_round_{a.round}_{target}_{mode}.parquet"


def _write_attribution(path: Path, table: Any, settings: dict[str, Any]) -> None:
    """``table`` as Parquet at ``path`` (atomically), ``settings`` in its schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = pa.Table.from_pandas(table, preserve_index=False)
    metadata = {**(arrow.schema.metadata or {}), ATTRIBUTION_METADATA: json.dumps(settings).encode()}
    atomic_write(path, lambda p: pq.write_table(arrow.replace_schema_metadata(metadata), p))


def attribute(a: AttributeArgs) -> int:
    """Attribute a saved round; write a Parquet table and print top/bottom records."""
    from rlinfluence.analysis.tables import attribution_table, print_records
    from rlinfluence.checkpoint import load_round
    from rlinfluence.influence import ActionTarget, ReturnTarget, score_buffer

    if a.top < 0:
        raise UserError(f"--top must be >= 0, got {a.top}")
    out = check_output_file(a.out or Path(a.run_dir) / attribution_file_name(a))
    saved = load_round(a.run_dir, a.round)
    buffer, trainer = saved.buffer, saved.trainer
    if a.target == "action":
        if a.state_index is None or not 0 <= a.state_index < len(buffer):
            raise UserError(f"--target action needs --state-index in [0, {len(buffer)}), got {a.state_index}")
        target = ActionTarget(buffer.flat("obs")[a.state_index], buffer.flat("actions")[a.state_index])
    else:
        target = ReturnTarget()
    cfg = trainer.config
    if a.mode == "snapshot":
        scores = score_buffer(trainer.policy, buffer, target=target, advantage_norm=a.advantage_norm,
                              chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef)
    else:
        if not saved.schedule:
            raise UserError(f"round {a.round} has no saved minibatch schedule (train with --save-buffers)")
        scores = score_buffer(
            trainer.policy, buffer, mode="full", schedule=saved.schedule, target=target,
            clip_range=cfg.clip_range, clip_range_vf=cfg.clip_range_vf, vf_coef=cfg.vf_coef,
            ent_coef=cfg.ent_coef, normalize_advantage=cfg.normalize_advantage,
            max_grad_norm=cfg.max_grad_norm, optimizer=trainer.optimizer if cfg.optimizer == "adam" else None,
        )
    table = attribution_table(buffer, scores)
    out.parent.mkdir(parents=True, exist_ok=True)
    trainer_norm = "minibatch" if cfg.normalize_advantage else "none"  # what full mode retraces
    _write_attribution(out, table, {
        "run": Path(a.run_dir).resolve().name, "round": a.round, "target": a.target,
        "state_index": a.state_index, "mode": a.mode,
        "advantage_norm": a.advantage_norm if a.mode == "snapshot" else trainer_norm,
        "chunk_size": cfg.batch_size,
    })
    title = f"round {a.round}, target {a.target}, {a.mode} influence"
    print_records(table, a.top, title=title)
    print(f"wrote {out}")
    if a.html:
        from rlinfluence.analysis.report import write_html
        from rlinfluence.analysis.tables import attribution_section
        from rlinfluence.frames import load_frames

        section = attribution_section(table, f"Attribution of {title}", load_frames(a.run_dir, a.round, len(buffer)),
                                      a.top)
        print(f"wrote {write_html(out.with_suffix('.html'), section.title, [section])}")
        _print_frames_hint(section)
    return 0


def _print_frames_hint(*sections: Section) -> None:
    """Say how to get frames when none of the sections' records has any."""
    from rlinfluence.frames import HOW_TO_SAVE

    if not any(section.galleries for section in sections):
        print(f"no frames of the records: {HOW_TO_SAVE}")


@dataclass
class DiagnoseArgs:
    """Diagnose a saved round: its most harmful records (return target) and, for small discrete
    envs, how their estimated advantages disagree with Monte-Carlo advantages."""

    run_dir: tyro.conf.Positional[str]
    """run directory trained with --save-buffers"""
    round: int
    """round k to diagnose"""
    bottom: int = 100
    """bottom records compared with all records (the paper: 100 on FrozenLake)"""
    top: int = 10
    """records printed from each end"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """training-side advantages of the scores: IIF's (chunk: chunks of batch_size records of a
    seeded random permutation), the whole buffer (batch), raw (none)"""
    html: bool = False
    """also write RUN_DIR/analyses/diagnosis_round_K.html"""


def _check_writes_into(run_dir: str) -> None:
    """``UserError`` before any work if an analysis could not write its results into ``run_dir``
    (and its analyses folder): a read-only run would otherwise fail after all the computing."""
    from rlinfluence.analysis.report import ANALYSES_DIR

    for folder in (Path(run_dir), Path(run_dir) / ANALYSES_DIR):
        if folder.is_dir() and not os.access(folder, os.W_OK):
            raise UserError(f"{str(folder)!r} is not writable: the analysis writes its results there")


def diagnose(a: DiagnoseArgs) -> int:
    """Diagnose a round; save RUN_DIR/analyses/diagnosis_round_K.{json,parquet,png}."""
    from rlinfluence.analysis.diagnosis import diagnose as run_diagnosis
    from rlinfluence.analysis.diagnosis import diagnosis_section
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.tables import print_records

    if a.top < 1:
        raise UserError(f"--top must be >= 1, got {a.top}")
    _check_writes_into(a.run_dir)
    d = run_diagnosis(a.run_dir, a.round, a.bottom, a.advantage_norm)
    print_records(d.table, a.top, title=f"round {a.round}, target return")
    if d.mc_reason is not None:
        print(f"Monte-Carlo advantage: not available ({d.mc_reason})")
    for key, value in d.stats.items():
        print(f"{key}: {value:.4g}")
    if "A_bar coverage" in d.stats:
        print("(A_hat: the GAE advantage PPO trains on; A_bar: the Monte-Carlo advantage from the buffer's complete "
              "episodes; coverage: the fraction of records that have one; mismatch: A_bar * A_hat < 0; bottom / top: "
              "the most harmful / helpful records)")
    section = diagnosis_section(d)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    table = folder / f"{section.key}.parquet"
    atomic_write(table, lambda p: d.table.to_parquet(p, index=False))
    print(f"wrote {folder / (section.key + '.json')} and {table}")
    if a.html:
        print(f"wrote {write_html(folder / (section.key + '.html'), section.title, [section])}")
    _print_frames_hint(section)
    return 0


@dataclass
class TimelineArgs:
    """Behaviour-formation timeline of (s*, a*) over the saved rounds: pi(a*|s*), top records and
    roughness of the action-target scores (method-spec 8.2)."""

    run_dir: tyro.conf.Positional[str]
    """run directory trained with --save-buffers"""
    state_index: int | None = None
    """s* = this record of --state-round's buffer (flat index)"""
    state_round: Annotated[int | None, StatedDefault] = None
    """round whose buffer holds --state-index (default: the last saved round)"""
    state: tuple[float, ...] | None = None
    """s* given explicitly: its observation values, flattened (instead of --state-index)"""
    action: tuple[float, ...] | None = None
    """a* (one integer, or the values of a continuous action); default: the final policy's
    preferred action at s*"""
    rounds: Annotated[Rounds, StatedDefault] = ()
    """rounds to track (default: every saved round)"""
    neighbours: int = 50
    """u: nearest neighbours per record in the roughness graph"""
    top: int = 10
    """top records kept per round"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """training-side advantages of the scores: IIF's (chunk: chunks of batch_size records of a
    seeded random permutation), the whole buffer (batch), raw (none)"""
    html: bool = False
    """also write RUN_DIR/analyses/timeline.html"""


def timeline(a: TimelineArgs) -> int:
    """Track (s*, a*) across rounds; save RUN_DIR/analyses/timeline.{json,parquet,png}."""
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.timeline import select_state_action, timeline_section
    from rlinfluence.analysis.timeline import timeline as run_timeline

    if a.top < 1:
        raise UserError(f"--top must be >= 1, got {a.top}")
    _check_writes_into(a.run_dir)
    target = select_state_action(a.run_dir, state_round=a.state_round, state_index=a.state_index,
                                 state=a.state, action=a.action)
    print(target.description)
    t = run_timeline(a.run_dir, target, list(a.rounds) or None, a.neighbours, a.top, a.advantage_norm)
    print(t.rounds.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"pi(a*|s*) at the final theta({t.final_round}): {t.final_pi:.4g}")
    print(f"estimated phase starts: clustering {t.phases['clustering']}, saturation {t.phases['saturation']}")
    print("(roughness: how unevenly the positive scores vary between neighbouring states, a normalised Dirichlet "
          "energy; high = helpful records scattered, low = clustered; top_same_action: the share of the top records "
          "whose action is a*)")
    section = timeline_section(t)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    top = t.top.drop(columns=[c for c in ("obs",) if c in t.top.columns])
    atomic_write(folder / "timeline_top.parquet", lambda p: top.to_parquet(p, index=False))
    print(f"wrote {folder / 'timeline.json'}")
    if a.html:
        print(f"wrote {write_html(folder / 'timeline.html', section.title, [section])}")
    _print_frames_hint(section)
    return 0


@dataclass
class InterveneArgs:
    """Targeted intervention (method-spec 5.3): retrain chosen rounds of standard PPO runs from
    theta(k) on (a) the full buffer, (b) without all negatively influential records, (c) without a
    random subset of the same size; compare evaluation returns on the same episode seeds."""

    run_dirs: tyro.conf.Positional[Annotated[tuple[str, ...], StatedDefault]]
    """standard PPO run directories trained with --save-buffers (e.g. one per seed)"""
    rounds: Rounds = (5, 10, 20)
    """rounds k to retrain"""
    eval_episodes: int = 100
    """evaluation episodes per variant (the same seeds for a, b, c)"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """IIF scorer's training-side advantages (chunk = IIF's default)"""
    out: Annotated[str | None, StatedDefault] = None
    """folder for the results across runs (default: RUN_DIR/analyses for one run, else
    <parent of the first run>/intervention)"""
    html: bool = False
    """also write intervention.html in --out"""


def intervene(a: InterveneArgs) -> int:
    """Run the intervention; write intervention.{csv,json,png} per run and across runs."""
    from rlinfluence.analysis.intervention import intervene as run_intervention
    from rlinfluence.analysis.intervention import intervention_section, summarise
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html

    if not a.run_dirs:
        raise UserError("intervene needs at least one RUN_DIR (a standard PPO run with --save-buffers)")
    if a.eval_episodes < 1:
        raise UserError(f"--eval-episodes must be >= 1, got {a.eval_episodes}")
    repeated = next((r for r in a.run_dirs if [Path(x).resolve() for x in a.run_dirs].count(Path(r).resolve()) > 1), None)
    if repeated is not None:
        raise UserError(f"intervene lists {repeated!r} twice: every run would be counted twice")
    if a.out:
        check_output_dir(a.out)
    for run_dir in a.run_dirs:
        _check_writes_into(run_dir)
    rows = run_intervention(list(a.run_dirs), list(a.rounds), a.eval_episodes, a.advantage_norm, progress=True)
    print(summarise(rows).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for run_dir in a.run_dirs:  # each run's report shows its own rows
        own = rows[rows["run"] == Path(run_dir).name]
        save_section(Path(run_dir) / ANALYSES_DIR, intervention_section(own))
    out = Path(a.out) if a.out else (Path(a.run_dirs[0]) / ANALYSES_DIR if len(a.run_dirs) == 1
                                      else Path(a.run_dirs[0]).parent / "intervention")
    section = intervention_section(rows)
    save_section(out, section)
    atomic_write(out / "intervention.csv", lambda p: rows.to_csv(p, index=False))
    print(f"wrote {out / 'intervention.csv'}")
    if a.html:
        print(f"wrote {write_html(out / 'intervention.html', section.title, [section])}")
    return 0


@dataclass
class ReportArgs:
    """One self-contained HTML report of a run: learning curve, per-round influence statistics and
    every analysis saved in RUN_DIR/analyses (diagnose, timeline, intervene)."""

    run_dir: tyro.conf.Positional[str]
    """run directory"""
    out: Annotated[str | None, StatedDefault] = None
    """HTML file (default RUN_DIR/report.html)"""
    score_rounds: int = 6
    """saved rounds scored for the influence histograms (0 = none)"""
    html: bool = True
    """write the HTML file (--no-html: only list what it would contain)"""


def report(a: ReportArgs) -> int:
    """Write the run's HTML report."""
    from rlinfluence.analysis.report import build_report, load_sections
    from rlinfluence.rundir import RunDirectory

    if a.score_rounds < 0:
        raise UserError(f"--score-rounds must be >= 0, got {a.score_rounds}")
    if a.out is not None:
        check_output_file(a.out)
    if not a.html:
        run = RunDirectory.open_existing(a.run_dir, tensorboard=False)
        print("sections: learning curve, influence statistics, "
              + ", ".join(s.title for s in load_sections(run.path / "analyses")))
        return 0
    path, sections = build_report(a.run_dir, a.out, a.score_rounds)
    print(f"wrote {path} ({len(sections)} sections: {', '.join(s.key for s in sections)})")
    _print_frames_hint(*sections)
    return 0


@dataclass
class ValidateArgs:
    """Counterfactual check of the scores of saved rounds: retrain each round from theta(k) on
    --subsets random subsets of --fraction of its records and report the linear datamodeling
    score LDS = Spearman(sum of scores over the subset, real change of the target) with a 95%
    bootstrap interval, and the real change without the lowest-scored 5/10/25% vs a random drop.
    Runs of this library's trainer only (not Stable-Baselines3: it saves no run directory)."""

    run_dir: tyro.conf.Positional[str]
    """run directory trained with --save-buffers"""
    round: RoundsOfValidate
    """round k, or several (0 5 10: LDS per round as a curve)"""
    subsets: int = 30
    """M random subsets, each retrained (at least 5)"""
    fraction: float = 0.5
    """fraction of the records kept in each subset, in (0, 1)"""
    target: Literal["return", "action"] = "return"
    """return: mean A log pi over the buffer; action: log pi(a|s) of the record --state-index"""
    state_index: int | None = None
    """flat buffer index of the (state, action) of the action target"""
    mode: tuple[Literal["snapshot", "full"], ...] = ("snapshot",)
    """scorers: snapshot (at theta(k)) and/or full (TracIn over the round's optimiser steps)"""
    advantage_norm: tuple[AdvantageNorm, ...] = (DEFAULT_ADVANTAGE_NORM,)
    """snapshot mode's training-side advantages, one scorer each: chunk (IIF's: random chunks of
    batch_size records), batch (whole buffer), none (raw); full mode ignores it"""
    random_draws: int = 5
    """random drops per percentage in the drop test"""
    seed: int = 0
    """seed of the subsets, random drops, chunking and bootstrap"""
    workers: int = 1
    """local worker processes, each validating one round at a time (the same tables as 1)"""
    ray_address: str | None = None
    """validate the rounds as Ray tasks on this cluster (auto or HOST:PORT) instead"""
    html: bool = False
    """also write RUN_DIR/analyses/validation.html"""


def validate(a: ValidateArgs) -> int:
    """Validate saved rounds; write RUN_DIR/analyses/validation.{json,csv,png} (in the report)."""
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.validation import (
        drop_rows,
        lds_rows,
        scorer_names,
        validate_rounds,
        validation_section,
    )
    from rlinfluence.influence.validation import check_settings

    check_settings(a.subsets, a.fraction)
    if a.seed < 0:
        raise UserError(f"--seed must be >= 0, got {a.seed}")
    _check_writes_into(a.run_dir)
    results = validate_rounds(
        a.run_dir, list(a.round), progress=True, target=a.target, state_index=a.state_index,
        scorers=scorer_names(a.mode, a.advantage_norm), subsets=a.subsets, fraction=a.fraction,
        random_draws=a.random_draws, seed=a.seed, workers=a.workers, ray_address=a.ray_address,
    )
    lds, drops = lds_rows(results), drop_rows(results)
    fmt = {"float_format": lambda v: f"{v:.4g}", "index": False}
    print(lds[["round", "scorer", "lds", "lds_low", "lds_high", "full_change", "retrain_seconds",
               "reproduces_run"]].to_string(**fmt))
    print(drops.drop(columns="run").to_string(**fmt))
    for message in dict.fromkeys(m for m in lds["message"] if m):
        print(f"LDS undefined: {message}")
    section = validation_section(results)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    atomic_write(folder / "validation.csv", lambda p: lds.to_csv(p, index=False))
    atomic_write(folder / "validation_drops.csv", lambda p: drops.to_csv(p, index=False))
    print(f"wrote {folder / 'validation.json'}, validation.csv, validation_drops.csv")
    if a.html:
        print(f"wrote {write_html(folder / 'validation.html', section.title, [section])}")
    return 0


@dataclass
class AuditArgs:
    """Which source (training env, worker) of a run is broken, and what kind of fault is it? Every
    saved round is scored by every family (reward statistics, value, advantage, gradient
    attribution, and consistency checks: logged log-probs and values against theta(k), observation
    statistics, a one-step dynamics, reward and termination model); each source's mean per round
    (over its episodes that started in that round) is tested against the other sources' with an
    exact permutation test within rounds, Holm-corrected across sources x families, and a flagged
    source's signature is read as a likely fault class (--scorer X: the test by one scorer alone).
    A run trained with --corrupt also gets the detection AUROC and precision of every scorer at
    record, episode and source level. Runs of the Stable-Baselines3 adapter: train with its
    AuditCallback."""

    run_dir: tyro.conf.Positional[str]
    """run directory trained with --save-buffers and --n-envs > 1 (or with the SB3 AuditCallback)"""
    rounds: Annotated[Rounds, StatedDefault] = ()
    """saved rounds to score (default: every saved round)"""
    scorer: str | None = None
    """test one scorer alone instead of the verdict over every family: influence, influence-chunk,
    influence-trusted (with --trusted-envs), tracin, dtv, negative-advantage, abs-advantage, td-error,
    reward-extremes, random, or a check: logp-gap, value-gap, action-surprise, obs-shift, dynamics,
    action-fit, reward-model, termination"""
    by: Literal["source", "episode", "record"] = "source"
    """episode or record: also rank those items by harm (audit/ranked_<by>.csv, the 10 worst printed)"""
    alpha: float = 0.01
    """family-wise error rate of the flags across the sources"""
    permutations: int = 2000
    """permutation draws of the --scorer test where it is not exact (the verdict's test has none)"""
    seed: int = 0
    """seed of the --scorer test's permutations and bootstrap intervals"""
    workers: int = 1
    """local worker processes, each scoring one saved round at a time (the same tables as 1)"""
    ray_address: str | None = None
    """score the saved rounds as Ray tasks on this cluster (auto or HOST:PORT) instead"""


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

    _check_writes_into(a.run_dir)
    sources, found, table = audit_run(a.run_dir, a.rounds, a.scorer, a.alpha, a.permutations, a.seed, a.workers,
                                      a.ray_address)
    folder = Path(a.run_dir) / "audit"
    folder.mkdir(exist_ok=True)
    section = audit_section(sources, found, a.alpha)
    atomic_write(folder / "sources.csv", lambda p: sources.to_csv(p, index=False))
    atomic_write(folder / "sources.png", lambda p: p.write_bytes(section.figures["sources"][0]))
    save_section(Path(a.run_dir) / ANALYSES_DIR, section)  # `rlinfluence report` shows it
    flagged = sources[sources["flagged"]]["source"].tolist()
    if is_verdict(sources):
        print(sources[["source", "records", "rounds", "flagged", "signature", "signature_p", "fault_class"]]
              .to_string(index=False))
        print(f"flagged (Holm-adjusted p < {a.alpha} across sources x families): "
              f"{', '.join(f'source {s}' for s in flagged) or 'none'}")
        for row in sources[sources["flagged"]].itertuples():
            print(f"source {row.source} ({row.fault_class}): {row.reading}")
        print(unreachable_note(sources, a.alpha) if not flagged else "", end="")
    else:
        print(sources.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        print(f"flagged (Holm-adjusted p < {a.alpha}): {', '.join(f'source {s}' for s in flagged) or 'none'}")
    written = ["sources.csv", "sources.png"]
    if len(found):
        atomic_write(folder / "detection.csv", lambda p: found.to_csv(p, index=False))
        written.append("detection.csv")
        print("detection against the ground truth, mean over rounds [95% interval] (AUROC 0.5 = chance):")
        print(detection_summary(found).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    if a.by != "source":
        items = ranked(table, a.by, ranking_scorer(sources))
        atomic_write(folder / f"ranked_{a.by}.csv", lambda p: items.to_csv(p, index=False))
        written.append(f"ranked_{a.by}.csv")
        print(f"the 10 most harmful {a.by}s:")
        print(items.head(10).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"wrote {', '.join(str(folder / name) for name in written)}")
    return 0


def rlhf(args: RLHFArgs) -> int:
    """PPO / GRPO for causal language models, optionally with IIF (needs rlinfluence[rlhf])."""
    from rlinfluence.rlhf.cli import run_rlhf

    return run_rlhf(args)


COMMANDS: dict[str, tuple[type, Callable[[Any], int], str]] = {
    "train": (TrainArgs, train, "train PPO on a gymnasium env (paper presets for its six environments)"),
    "compare": (CompareConfig, compare, "multi-seed comparison against a reference: SE/RT metrics, IQM, "
                "P(improvement), curves.png"),
    "aggregate": (AggregateArgs, aggregate, "several compare folders (one per env) -> IQM, P(improvement), "
                  "performance profiles"),
    "attribute": (AttributeArgs, attribute, "influence of every record of a saved round (train with --save-buffers)"),
    "diagnose": (DiagnoseArgs, diagnose, "harmful records of a saved round vs Monte-Carlo advantages"),
    "timeline": (TimelineArgs, timeline, "formation of a fixed (s*, a*) across saved rounds: pi(a*|s*), top "
                 "records, roughness"),
    "intervene": (InterveneArgs, intervene, "retrain rounds without their negatively influential records vs a "
                  "random drop"),
    "validate": (ValidateArgs, validate, "counterfactual check of the scores: LDS over retrains on random "
                 "subsets of a round"),
    "audit": (AuditArgs, audit, "which training envs of a run are harmful: a permutation test per env "
              "(and detection AUROC for runs trained with --corrupt)"),
    "report": (ReportArgs, report, "one self-contained HTML file: learning curve, influence statistics, saved "
               "analyses"),
    "rlhf": (RLHFArgs, rlhf, "PPO or GRPO on a causal language model with LoRA, optionally with IIF"),
}
"""Every command: its arguments (a dataclass, the command's flags), what runs it, its summary."""
DESCRIPTION = ("Local data attribution and influence-based filtering (IIF) for PPO. "
               "rlinfluence COMMAND --help lists the flags of a command.")
RUNNERS: dict[type, Callable[[Any], int]] = {kind: run for kind, run, _ in COMMANDS.values()}


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` (``--flag v`` or ``--flag=v``; the last one wins), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _parse(args: list[str]) -> Any:
    """The arguments of the command ``args`` name, parsed by tyro (one subcommand per command);
    train's defaults are the preset of its --env. ``UserError`` if tyro rejects ``args``."""
    if args and not args[0].startswith("-") and args[0] not in COMMANDS:
        raise UserError(f"unknown command {args[0]!r} (commands: {', '.join(COMMANDS)})")
    env = _flag_value(args[1:], "--env") or PPOConfig.env  # the one value the other flags' defaults depend on
    if args[:1] == ["train"] and _flag_value(args, "--filter") == "iif-robust":
        given = [f"--{key.replace('_', '-')}" for key in ROBUST_IIF
                 if any(a == f"--{key.replace('_', '-')}" or a.startswith(f"--{key.replace('_', '-')}=") for a in args)]
        if given:  # its preset value would replace the one given, while the run is labelled with it
            raise UserError(f"--filter iif-robust sets {given[0]} itself; use --filter iif to choose {given[0]}")
    defaults = {"train": TrainArgs(PPOConfig.for_env(env))} if args[:1] == ["train"] else {}
    commands = Union[tuple(  # noqa: UP007 -- a Union built at run time
        Annotated[kind, tyro.conf.subcommand(name, default=defaults.get(name), description=summary)]
        for name, (kind, _, summary) in COMMANDS.items()
    )]
    with _tyro_errors_as_user_errors():
        return tyro.cli(commands, args=args, prog="rlinfluence", description=DESCRIPTION)


@contextlib.contextmanager
def _tyro_errors_as_user_errors() -> Iterator[None]:
    """tyro reports a rejected command line as a framed box on stderr and exits with status 2;
    raise it as a one-line ``UserError`` instead (help, exit status 0, is left as it is)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise UserError(_tyro_message(captured.getvalue())) from None
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())  # anything else tyro printed (warnings)


_ANSI_STYLE = re.compile(r"\x1b\[[0-9;]*m")
_BOX_SIDES = " \u256d\u256e\u2570\u256f\u2502"  # the corners and sides of tyro's UTF-8 frame
_RULE = set(" -\u2500")  # a rule: ASCII or UTF-8 dashes


def _tyro_message(text: str) -> str:
    """The first paragraph of tyro's framed error (after its title), on one line, whichever
    frame tyro drew (UTF-8, or ASCII when stdout is not UTF-8); ``Error parsing --x: --x must
    ...`` is shortened to ``--x must ...``."""
    lines = [_ANSI_STYLE.sub("", line).strip(_BOX_SIDES) for line in text.splitlines()]
    lines = lines[next((i for i, line in enumerate(lines) if line.strip()), len(lines)):]
    title, body = (lines[0].strip("".join(_RULE)) if lines else ""), []
    for line in lines[1:]:
        if set(line) <= _RULE:
            if body:
                break
            continue
        body.append(line.strip())
    message = " ".join(body) or title or "invalid command line"
    return re.sub(r"^Error parsing (\S+): (?=\1 )", "", message)


def main(argv: Sequence[str] | None = None) -> int:
    """``rlinfluence <command> [flags]``: run the command; exit status 0, or 2 on bad input."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        print(f"rlinfluence {version('rlinfluence')}")
        return 0
    try:
        if not args:  # the list of commands, as for --help, but a failed call
            with contextlib.suppress(SystemExit):
                _parse(["--help"])
            return 2
        a = _parse(args)
        return RUNNERS[type(a)](a)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
