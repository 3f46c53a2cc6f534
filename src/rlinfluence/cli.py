"""``rlinfluence <command>``: each command's flags are generated from its dataclass (tyro).

Bad input (a ``UserError``) is printed as one line ``error: ...`` with exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import tyro

from rlinfluence.errors import UserError

USAGE = """usage: rlinfluence <command> [flags]

commands:
  train      train PPO on a gymnasium env (paper presets for its six environments)
             rlinfluence train --env LunarLander-v3 [--seed 3] [--total-timesteps N] ...
             rlinfluence train --resume RUN_DIR   (continue from the last completed round)
             rlinfluence train --env Acrobot-v1 --filter iif --drop-pct 50
  compare    multi-seed comparison with standard PPO: SE_ave, SE_peak, RT_peak, curves.png
             rlinfluence compare --env LunarLander-v3 --methods ppo,iif,random --seeds 5

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


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": train, "compare": compare}


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
