"""``rlinfluence <command>``: each command's flags are generated from its dataclass (tyro).

Bad input (a ``UserError``) is printed as one line ``error: ...`` with exit code 2.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import tyro

from rlinfluence.errors import UserError
from rlinfluence.rundir import atomic_write, check_output_file

if TYPE_CHECKING:
    from rlinfluence.ppo import PPO

USAGE = """usage: rlinfluence <command> [flags]

commands:
  train      train PPO on a gymnasium env (paper presets for its six environments)
             rlinfluence train --env LunarLander-v3 [--seed 3] [--total-timesteps N] ...
             rlinfluence train --resume RUN_DIR   (continue from the last completed round)
             rlinfluence train --env Acrobot-v1 --filter iif --drop-pct 50
  compare    multi-seed comparison against a reference: SE/RT metrics, IQM, P(improvement), curves.png
             rlinfluence compare --env LunarLander-v3 --methods ppo,iif,random --seeds 5
             rlinfluence compare --env FrozenLake-v1 --methods 'ppo,iif,iif@drop_pct=25' \
                 --tune learning_rate=0.01,0.02,0.04,0.08 --tune-seeds 2   (tuned on other seeds)
  aggregate  several compare folders (one per env) -> IQM, P(improvement), performance profiles
             rlinfluence aggregate DIR [DIR ...] [--out DIR]
  attribute  influence of every record of a saved round (train with --save-buffers)
             rlinfluence attribute RUN_DIR --round 5 --target return|action [--state-index I] [--mode full]
  diagnose   harmful records of a saved round vs Monte-Carlo advantages (small discrete envs)
             rlinfluence diagnose RUN_DIR --round 5 [--bottom 100] [--html]
  timeline   formation of a fixed (s*, a*) across saved rounds: pi(a*|s*), top records, roughness
             rlinfluence timeline RUN_DIR --state-index I [--state-round K] [--action A] [--html]
  intervene  retrain rounds without their negatively influential records vs a random drop
             rlinfluence intervene RUN_DIR [RUN_DIR ...] --rounds 5,10,20 [--eval-episodes 100] [--html]
  validate   counterfactual check of the scores: LDS over retrains on random subsets of a round
             rlinfluence validate RUN_DIR --round 0,5,10 [--subsets 30] [--mode snapshot full]
  report     one self-contained HTML file: learning curve, influence statistics, saved analyses
             rlinfluence report RUN_DIR [--out report.html]

  rlhf       PPO or GRPO on a causal language model with LoRA, optionally with IIF
             rlinfluence rlhf --algo ppo --filter iif [--model builtin:smollm2-135m | HF_ID | PATH]

run `rlinfluence <command> --help` for the flags of a command."""


def _pop_flag(args: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` / ``flag=VALUE`` from ``args``; return VALUE (None if absent)."""
    for i, arg in enumerate(args):
        if arg == flag:
            if i + 1 >= len(args):
                raise UserError(f"{flag} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def train(args: list[str]) -> int:
    """Train PPO; the flags are the fields of ``PPOConfig``, defaults the env's preset."""
    from rlinfluence.ppo import PPO, PPOConfig

    resume = _pop_flag(args, "--resume")
    if resume is not None:
        if args:
            raise UserError(f"--resume continues with the run's saved config; unexpected flags {args}")
        trainer = PPO.resume(resume)
        print(f"resuming {trainer.run.path} from theta({trainer.round}): environment episodes "
              "restart (the envs are reset with a seed derived from (seed, round))")
    else:
        env = _pop_flag(list(args), "--env") or PPOConfig.env
        config = tyro.cli(
            PPOConfig, args=args, default=PPOConfig.for_env(env), prog="rlinfluence train",
            description="Train PPO. Defaults shown are the preset of --env (paper hyperparameters "
            "for its six environments). Add --resume RUN_DIR (alone) to continue a run.",
        )
        trainer = PPO(config)
    _learn(trainer, fresh=resume is None)
    last = trainer.run.rows[-1] if trainer.run and trainer.run.rows else None
    if last is not None:
        print(f"round {last['round']}: eval_return {last['eval_return_mean']:.3f} "
              f"+/- {last['eval_return_std']:.3f}, train_seconds {last['train_seconds']:.1f}")
    print(f"run directory: {trainer.run.path}")
    return 0


def _learn(trainer: PPO, fresh: bool) -> None:
    """``trainer.learn()``. A fresh run that fails before completing its first round leaves no
    directory; a later failure keeps the completed rounds and says how to resume."""
    try:
        trainer.learn()
    except BaseException as exc:
        path = trainer.run.path
        if fresh and trainer.round == 0:
            shutil.rmtree(path, ignore_errors=True)
        if not isinstance(exc, UserError | OSError):
            raise
        if fresh and trainer.round == 0:
            raise UserError(f"{exc} (no round completed; {str(path)!r} removed)") from None
        raise UserError(f"{exc}; the {trainer.round} completed rounds are kept: continue with "
                        f"rlinfluence train --resume {path}") from None


def compare(args: list[str]) -> int:
    """Multi-seed comparison of methods against a reference; prints the summary tables."""
    from rlinfluence.experiments import CompareConfig
    from rlinfluence.experiments import compare as run_compare

    config = tyro.cli(CompareConfig, args=args, prog="rlinfluence compare")
    out = run_compare(config)
    print((out / "summary.md").read_text())
    print(f"curves: {out / 'curves.png'}")
    return 0


@dataclass
class AggregateArgs:
    """Combine compare folders of several envs into one table with rliable's statistics and plots
    (IQM and mean with stratified-bootstrap intervals, performance profiles, P(improvement))."""

    folders: tyro.conf.Positional[tuple[str, ...]]
    """compare output folders, one per env (same reference method)"""
    out: str = "runs/aggregate"
    """output folder: aggregate.md/.csv/.html and the PNG plots"""
    bootstrap_reps: int = 2000
    """bootstrap replications of every interval"""


def aggregate(args: list[str]) -> int:
    """Aggregate compare folders; prints the table."""
    from rlinfluence.experiments.aggregate import aggregate as run_aggregate

    a = tyro.cli(AggregateArgs, args=args, prog="rlinfluence aggregate")
    if a.bootstrap_reps < 1:
        raise UserError(f"--bootstrap-reps must be >= 1, got {a.bootstrap_reps}")
    out = run_aggregate(a.folders, a.out, a.bootstrap_reps)
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
    advantage_norm: Literal["chunk", "batch", "none"] = "batch"
    """snapshot mode's training-side advantages: whole buffer (batch), consecutive chunks, raw"""
    top: int = 10
    """records shown from each end"""
    out: str | None = None
    """Parquet file (default RUN_DIR/attribution_round_K.parquet)"""


def attribute(args: list[str]) -> int:
    """Attribute a saved round; write a Parquet table and print top/bottom records."""
    from rlinfluence.analysis.tables import attribution_table, print_records
    from rlinfluence.influence import ActionTarget, ReturnTarget, score_buffer
    from rlinfluence.ppo import load_round

    a = tyro.cli(AttributeArgs, args=args, prog="rlinfluence attribute")
    if a.top < 0:
        raise UserError(f"--top must be >= 0, got {a.top}")
    out = check_output_file(a.out or Path(a.run_dir) / f"attribution_round_{a.round}.parquet")
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
    atomic_write(out, lambda p: table.to_parquet(p, index=False))
    print_records(table, a.top, title=f"round {a.round}, target {a.target}, {a.mode} influence")
    print(f"wrote {out}")
    return 0


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
    advantage_norm: Literal["chunk", "batch", "none"] = "batch"
    """training-side advantages of the scores: whole buffer (batch), consecutive chunks, raw"""
    html: bool = False
    """also write RUN_DIR/analyses/diagnosis_round_K.html"""


def diagnose(args: list[str]) -> int:
    """Diagnose a round; save RUN_DIR/analyses/diagnosis_round_K.{json,parquet,png}."""
    from rlinfluence.analysis.diagnosis import diagnose as run_diagnosis
    from rlinfluence.analysis.diagnosis import diagnosis_section
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.tables import print_records

    a = tyro.cli(DiagnoseArgs, args=args, prog="rlinfluence diagnose")
    d = run_diagnosis(a.run_dir, a.round, a.bottom, a.advantage_norm)
    print_records(d.table, a.top, title=f"round {a.round}, target return")
    if d.mc_reason is not None:
        print(f"Monte-Carlo advantage: not available ({d.mc_reason})")
    for key, value in d.stats.items():
        print(f"{key}: {value:.4g}")
    section = diagnosis_section(d)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    table = folder / f"{section.key}.parquet"
    atomic_write(table, lambda p: d.table.to_parquet(p, index=False))
    print(f"wrote {folder / (section.key + '.json')} and {table}")
    if a.html:
        print(f"wrote {write_html(folder / (section.key + '.html'), section.title, [section])}")
    return 0


@dataclass
class TimelineArgs:
    """Behaviour-formation timeline of (s*, a*) over the saved rounds: pi(a*|s*), top records and
    roughness of the action-target scores (method-spec 8.2)."""

    run_dir: tyro.conf.Positional[str]
    """run directory trained with --save-buffers"""
    state_index: int | None = None
    """s* = this record of --state-round's buffer (flat index)"""
    state_round: int | None = None
    """round whose buffer holds --state-index (default: the last saved round)"""
    state: str | None = None
    """s* given explicitly, comma-separated observation values (instead of --state-index)"""
    action: str | None = None
    """a* (an integer, or comma-separated values for continuous actions); default: the final
    policy's preferred action at s*"""
    rounds: str | None = None
    """comma-separated rounds (default: every saved round)"""
    neighbours: int = 50
    """u: nearest neighbours per record in the roughness graph"""
    top: int = 10
    """top records kept per round"""
    advantage_norm: Literal["chunk", "batch", "none"] = "batch"
    """training-side advantages of the scores: whole buffer (batch), consecutive chunks, raw"""
    html: bool = False
    """also write RUN_DIR/analyses/timeline.html"""


def timeline(args: list[str]) -> int:
    """Track (s*, a*) across rounds; save RUN_DIR/analyses/timeline.{json,parquet,png}."""
    from rlinfluence.analysis.intervention import parse_rounds
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.timeline import select_state_action, timeline_section
    from rlinfluence.analysis.timeline import timeline as run_timeline

    a = tyro.cli(TimelineArgs, args=args, prog="rlinfluence timeline")
    if a.top < 1:
        raise UserError(f"--top must be >= 1, got {a.top}")
    target = select_state_action(a.run_dir, state_round=a.state_round, state_index=a.state_index,
                                 state=a.state, action=a.action)
    print(target.description)
    rounds = parse_rounds(a.rounds) if a.rounds is not None else None
    t = run_timeline(a.run_dir, target, rounds, a.neighbours, a.top, a.advantage_norm)
    print(t.rounds.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"pi(a*|s*) at the final theta({t.final_round}): {t.final_pi:.4g}")
    print(f"estimated phase starts: clustering {t.phases['clustering']}, saturation {t.phases['saturation']}")
    section = timeline_section(t)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    top = t.top.drop(columns=[c for c in ("obs",) if c in t.top.columns])
    atomic_write(folder / "timeline_top.parquet", lambda p: top.to_parquet(p, index=False))
    print(f"wrote {folder / 'timeline.json'}")
    if a.html:
        print(f"wrote {write_html(folder / 'timeline.html', section.title, [section])}")
    return 0


@dataclass
class InterveneArgs:
    """Targeted intervention (method-spec 5.3): retrain chosen rounds of standard PPO runs from
    theta(k) on (a) the full buffer, (b) without all negatively influential records, (c) without a
    random subset of the same size; compare evaluation returns on the same episode seeds."""

    run_dirs: tyro.conf.Positional[tuple[str, ...]]
    """standard PPO run directories trained with --save-buffers (e.g. one per seed)"""
    rounds: str = "5,10,20"
    """comma-separated rounds k to retrain"""
    eval_episodes: int = 100
    """evaluation episodes per variant (the same seeds for a, b, c)"""
    advantage_norm: Literal["chunk", "batch", "none"] = "chunk"
    """IIF scorer's training-side advantages (chunk = IIF's default)"""
    out: str | None = None
    """folder for the results across runs (default: RUN_DIR/analyses for one run, else
    <parent of the first run>/intervention)"""
    html: bool = False
    """also write intervention.html in --out"""


def intervene(args: list[str]) -> int:
    """Run the intervention; write intervention.{csv,json,png} per run and across runs."""
    from rlinfluence.analysis.intervention import intervene as run_intervention
    from rlinfluence.analysis.intervention import intervention_section, parse_rounds, summarise
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html

    a = tyro.cli(InterveneArgs, args=args, prog="rlinfluence intervene")
    if not a.run_dirs:
        raise UserError("intervene needs at least one RUN_DIR (a standard PPO run with --save-buffers)")
    if a.eval_episodes < 1:
        raise UserError(f"--eval-episodes must be >= 1, got {a.eval_episodes}")
    if a.out and Path(a.out).exists() and not Path(a.out).is_dir():
        raise UserError(f"--out {a.out!r} is a file; give a folder")
    rounds = parse_rounds(a.rounds)
    rows = run_intervention(list(a.run_dirs), rounds, a.eval_episodes, a.advantage_norm, progress=True)
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
    out: str | None = None
    """HTML file (default RUN_DIR/report.html)"""
    score_rounds: int = 6
    """saved rounds scored for the influence histograms (0 = none)"""
    html: bool = True
    """write the HTML file (--no-html: only list what it would contain)"""


def report(args: list[str]) -> int:
    """Write the run's HTML report."""
    from rlinfluence.analysis.report import build_report, load_sections
    from rlinfluence.rundir import RunDirectory

    a = tyro.cli(ReportArgs, args=args, prog="rlinfluence report")
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
    round: str
    """round k, or comma-separated rounds (0,5,10: LDS per round as a curve)"""
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
    advantage_norm: tuple[Literal["chunk", "batch", "none"], ...] = ("batch",)
    """snapshot mode's training-side advantages, one scorer each: chunk (IIF's: random chunks of
    batch_size records), batch (whole buffer), none (raw); full mode ignores it"""
    random_draws: int = 5
    """random drops per percentage in the drop test"""
    seed: int = 0
    """seed of the subsets, random drops, chunking and bootstrap"""
    html: bool = False
    """also write RUN_DIR/analyses/validation.html"""


def validate(args: list[str]) -> int:
    """Validate saved rounds; write RUN_DIR/analyses/validation.{json,csv,png} (in the report)."""
    from rlinfluence.analysis.intervention import parse_rounds
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.validation import (
        drop_rows,
        lds_rows,
        scorer_names,
        validate_rounds,
        validation_section,
    )
    from rlinfluence.influence.validation import check_settings

    a = tyro.cli(ValidateArgs, args=args, prog="rlinfluence validate")
    check_settings(a.subsets, a.fraction)
    if a.seed < 0:
        raise UserError(f"--seed must be >= 0, got {a.seed}")
    try:
        rounds = parse_rounds(a.round)
    except UserError:
        raise UserError(f"--round must be round numbers >= 0, comma-separated, got {a.round!r}"
                        ) from None
    results = validate_rounds(
        a.run_dir, rounds, progress=True, target=a.target, state_index=a.state_index,
        scorers=scorer_names(a.mode, a.advantage_norm), subsets=a.subsets, fraction=a.fraction,
        random_draws=a.random_draws, seed=a.seed,
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


def rlhf(args: list[str]) -> int:
    """PPO / GRPO for causal language models, optionally with IIF (needs rlinfluence[rlhf])."""
    from rlinfluence.rlhf.cli import rlhf_command

    return rlhf_command(args)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": train, "compare": compare, "aggregate": aggregate, "attribute": attribute,
    "diagnose": diagnose, "timeline": timeline, "intervene": intervene, "report": report,
    "validate": validate,
    "rlhf": rlhf,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"error: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return command(args[1:])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
