"""``rlinfluence <command>``: tyro subcommands, each command's flags generated from its dataclass.

Lists are typed (``tuple[int, ...]``, ``tuple[Literal[...], ...]``), so tyro checks them before
anything runs. Bad input -- a ``UserError`` or a command line tyro rejects -- is printed as one
line ``error: ...`` with exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union

import tyro

from rlinfluence.cli_analyses import (
    AttributeArgs,
    DiagnoseArgs,
    InterveneArgs,
    ReportArgs,
    TimelineArgs,
    ValidateArgs,
    attribute,
    diagnose,
    intervene,
    report,
    timeline,
    validate,
)
from rlinfluence.cli_faults import AuditArgs, ExplainArgs, audit, explain
from rlinfluence.config import ROBUST_IIF, PPOConfig
from rlinfluence.errors import UserError
from rlinfluence.experiments.specs import CompareConfig, check_bootstrap_reps
from rlinfluence.helptext import StatedDefault, shown_as
from rlinfluence.rlhf.config import RLHFArgs
from rlinfluence.rundir import check_output_dir, run_lock

# Every module imported above is free of torch, pandas and scipy, so that `rlinfluence --help`
# and each command's --help start fast; the commands import what they run.
if TYPE_CHECKING:
    from rlinfluence.ppo import PPO


@dataclass
class TrainArgs:
    """Train PPO. Defaults shown are the preset of --env (paper hyperparameters for its six
    environments). Add --resume RUN_DIR to continue a run (with --total-timesteps N: extend it)."""

    config: Annotated[PPOConfig, tyro.conf.arg(name="")]
    resume: Annotated[str | None, shown_as("RUN")] = None
    """continue RUN_DIR from its newest checkpoint with its saved config (no other flag but
    --total-timesteps, which extends the run to N env steps)"""


def train(a: TrainArgs) -> int:
    """Train PPO, or resume a run; print the run directory first, the last round's figures at the end.
    A resume holds the run's lock from before it truncates the run's logs to after its last round:
    a second resume of the same run is refused instead of logging rounds twice."""
    if a.resume is None or not Path(a.resume).is_dir():  # not a folder: resume's own error says so
        return _train(a)
    with run_lock(Path(a.resume), "training"):
        return _train(a)


def _chosen_for_the_run(trainer) -> list[str]:
    """What the trainer chose that the flags left open: the device of ``--device auto``, and the
    training envs each ``--corrupt`` kind that breaks whole envs broke (a seeded choice)."""
    lines = [f"device: {trainer.device} (--device auto)"] if trainer.config.device == "auto" else []
    corruptor = trainer.corruptor
    for spec in corruptor.specs if corruptor is not None else ():
        if spec.kind in corruptor.broken:
            envs = ", ".join(str(i) for i, broken in enumerate(corruptor.broken[spec.kind]) if broken)
            lines.append(f"--corrupt {spec}: breaks training env{'s' * (spec['envs'] > 1)} {envs}"
                         + (f" from round {spec.start}" if spec.start else ""))
    return lines


def _train(a: TrainArgs) -> int:
    from rlinfluence.ppo import PPO

    made_root = False  # a fresh run's root folder made by this call: removed again if no round completes
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
        made_root = not Path(a.config.run_root).exists()
        trainer = PPO(a.config)
        print(f"run directory: {trainer.run.path}", flush=True)
    for line in _chosen_for_the_run(trainer):
        print(line, flush=True)
    _learn(trainer, fresh=a.resume is None, made_root=made_root)
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


def _learn(trainer: PPO, fresh: bool, made_root: bool = False) -> None:
    """``trainer.learn()``. A fresh run that fails before completing its first round leaves no
    directory (nor the run root it made); a later failure keeps the completed rounds and says how to
    resume; Ctrl-C says where the run is and how to continue it."""
    try:
        trainer.learn()
    except BaseException as exc:
        path = trainer.run.path
        if fresh and trainer.round == 0:
            shutil.rmtree(path, ignore_errors=True)
            if made_root:
                with contextlib.suppress(OSError):  # another run may have started in it meanwhile
                    path.parent.rmdir()
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

        from rlinfluence.experiments.summary import summary_table

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


def rlhf(args: RLHFArgs) -> int:
    """PPO / GRPO for causal language models, optionally with IIF (needs rlinfluence[rlhf])."""
    from rlinfluence.rlhf.cli import run_rlhf

    return run_rlhf(args)


COMMANDS: dict[str, tuple[type, Callable[[Any], int], str]] = {
    "train": (TrainArgs, train, "train PPO on a gymnasium env (paper presets for its six environments; the "
                                "defaults shown are --env's: give --env X before --help for X's preset)"),
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
    "explain": (ExplainArgs, explain, "why did the run get worse: the updates that hurt, re-run without harmful "
                "records, a random share, each source, or with a shorter step"),
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
    if args[:1] and args[0] in COMMANDS:
        _refuse_unclear_arguments(args[1:], COMMANDS[args[0]][0])
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


def _flags(kind: type) -> dict[str, str]:
    """Every flag of the dataclass ``kind`` (and of the dataclasses flattened into it) -> how it is given
    (``--seed``; a list flag ``--corrupt A B``; ``--no-progress`` sets what ``--progress`` does)."""
    flags: dict[str, str] = {}
    for name, tp in typing.get_type_hints(kind).items():
        if dataclasses.is_dataclass(tp):
            flags |= _flags(tp)
            continue
        flag = f"--{name.replace('_', '-')}"
        options = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
        flags[flag] = f"{flag} A B" if any(typing.get_origin(option) is tuple for option in options) else flag
        if tp is bool:
            flags[f"--no-{name.replace('_', '-')}"] = flag
    return flags


def _refuse_unclear_arguments(args: list[str], kind: type) -> None:
    """``UserError`` for a command line whose meaning the parser would settle silently: a flag given
    twice (the parser keeps the last: ``--env A --env B`` would train B), a value holding a control
    character (a name with a newline makes a folder whose printed path breaks), a value ``nan``."""
    flags = _flags(kind)
    names = ["--" + a[2:].partition("=")[0].replace("_", "-") if a.startswith("--") else a for a in args]
    given = [flags[name] for name in names if name in flags]  # --n_envs is --n-envs to the parser too
    repeated = next((flag for flag in given if given.count(flag) > 1), None)
    if repeated:
        name, _, values = repeated.partition(" ")
        raise UserError(f"{name} is given {given.count(repeated)} times: give it once"
                        + (f" with all its values ({repeated})" if values else ""))
    flag = "argument"  # a positional value before any flag
    for arg in args:
        flag = arg.partition("=")[0] if arg.startswith("--") else flag
        value = arg.partition("=")[2] if arg.startswith("--") else arg
        if any(ord(c) < 32 or ord(c) == 127 for c in arg):
            raise UserError(f"{flag} {arg!r} holds a control character: names and paths are printed on one line")
        if value.strip().lower().lstrip("+-") == "nan":
            raise UserError(f"{flag} {value}: not a number")


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


def _check_run_argument(run: str | None) -> None:
    """``UserError`` for a RUN argument that cannot be a run directory (empty, missing, a file), before
    a command reads it as one (``''`` would read the current folder)."""
    if run is None:
        return
    if not run.strip():
        raise UserError("RUN is empty: give a run directory (the folder `rlinfluence train` printed)")
    if not Path(run).exists():
        raise UserError(f"{run!r} does not exist: not a run directory")
    if not Path(run).is_dir():
        raise UserError(f"{run!r} is a file, not a run directory")


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
        for run in [getattr(a, "run_dir", None), *getattr(a, "run_dirs", ())]:
            _check_run_argument(run)
        return RUNNERS[type(a)](a)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
