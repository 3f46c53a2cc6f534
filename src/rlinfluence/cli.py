"""``rlinfluence <command>``: each command's flags are generated from its dataclass (tyro).

Bad input (a ``UserError``) is printed as one line ``error: ...`` with exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from rlinfluence.errors import UserError
from rlinfluence.rundir import atomic_write

USAGE = """usage: rlinfluence <command> [flags]

commands:
  train      train PPO on a gymnasium env (paper presets for its six environments)
             rlinfluence train --env LunarLander-v3 [--seed 3] [--total-timesteps N] ...
             rlinfluence train --resume RUN_DIR   (continue from the last completed round)
             rlinfluence train --env Acrobot-v1 --filter iif --drop-pct 50
  compare    multi-seed comparison with standard PPO: SE_ave, SE_peak, RT_peak, curves.png
             rlinfluence compare --env LunarLander-v3 --methods ppo,iif,random --seeds 5
  attribute  influence of every record of a saved round (train with --save-buffers)
             rlinfluence attribute RUN_DIR --round 5 --target return|action [--state-index I] [--mode full]

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
    else:
        env = _pop_flag(list(args), "--env") or PPOConfig.env
        config = tyro.cli(
            PPOConfig, args=args, default=PPOConfig.for_env(env), prog="rlinfluence train",
            description="Train PPO. Defaults shown are the preset of --env (paper hyperparameters "
            "for its six environments). Add --resume RUN_DIR (alone) to continue a run.",
        )
        trainer = PPO(config)
    trainer.learn()
    last = trainer.run.rows[-1] if trainer.run and trainer.run.rows else None
    if last is not None:
        print(f"round {last['round']}: eval_return {last['eval_return_mean']:.3f} "
              f"+/- {last['eval_return_std']:.3f}, train_seconds {last['train_seconds']:.1f}")
    print(f"run directory: {trainer.run.path}")
    return 0


def compare(args: list[str]) -> int:
    """Multi-seed comparison of methods against standard PPO; prints the summary table."""
    from rlinfluence.experiments import CompareConfig
    from rlinfluence.experiments import compare as run_compare

    config = tyro.cli(CompareConfig, args=args, prog="rlinfluence compare")
    out = run_compare(config)
    print((out / "summary.md").read_text())
    print(f"curves: {out / 'curves.png'}")
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
    out = Path(a.out or Path(a.run_dir) / f"attribution_round_{a.round}.parquet")
    atomic_write(out, lambda p: table.to_parquet(p, index=False))
    print_records(table, a.top, title=f"round {a.round}, target {a.target}, {a.mode} influence")
    print(f"wrote {out}")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": train, "compare": compare, "attribute": attribute}


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
