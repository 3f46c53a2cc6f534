"""``rlinfluence rlhf``: PPO or GRPO (optionally with IIF) on a causal LM; flags = ``RLHFConfig``.

    rlinfluence rlhf --algo grpo --filter iif --rounds 20           # SmolLM2-135M, sentiment task
    rlinfluence rlhf --task toxicity --device cuda                  # the toxicity task, on a GPU
    rlinfluence rlhf --model EleutherAI/gpt-neo-2.7B --prompts-per-round 256 --response-length 30
    rlinfluence rlhf --resume runs/rlhf-smollm2-135m__grpo__1__...    # continue a stopped run
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys

import tyro

from rlinfluence.errors import UserError
from rlinfluence.rlhf.config import RLHFArgs
from rlinfluence.rlhf.trainer import RLHFConfig, RLHFTrainer


def rlhf_command(args: list[str]) -> int:
    """Parse ``args`` as ``RLHFArgs`` flags, then ``run_rlhf``."""
    return run_rlhf(tyro.cli(RLHFArgs, args=args, prog="rlinfluence rlhf", description=DESCRIPTION))


DESCRIPTION = "RLHF (PPO/GRPO with LoRA) on the sentiment or toxicity task, optionally with IIF."


def run_rlhf(args: RLHFArgs) -> int:
    """Train, or resume a run; print the last round's figures and the run directory. Bad input
    raises ``UserError``."""
    if args.resume is None:
        trainer = RLHFTrainer(args.config)
    else:
        default = RLHFConfig()
        flags = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(RLHFConfig)
                 if getattr(args.config, f.name) != getattr(default, f.name)]
        if flags:
            raise UserError(f"--resume continues with the run's saved config; unexpected flags {flags}")
        trainer = RLHFTrainer.resume(args.resume)
        print(f"resuming {trainer.run.path} from round {trainer.round} of {trainer.config.rounds}", flush=True)
    try:
        trainer.learn()
    except KeyboardInterrupt:
        path = trainer.run.path if trainer.run is not None else None
        if args.resume is None and trainer.round == 0 and path is not None:
            shutil.rmtree(path, ignore_errors=True)
            where = f"no round completed; {str(path)!r} removed"
        else:
            where = (f"{trainer.round} of {trainer.config.rounds} rounds are saved in {path}; continue with "
                     f"rlinfluence rlhf --resume {path}")
        print(f"\ninterrupted: {where}", file=sys.stderr)
        raise SystemExit(130) from None
    last = trainer.run.rows[-1] if trainer.run is not None and trainer.run.rows else None
    if last is not None:
        tox = last.get("test_toxicity", math.nan)
        print(f"round {last['round']}: training reward {last['reward_mean']:.4f}, "
              f"test reward {last.get('eval_return_mean', math.nan):.4f}, "
              + (f"test toxicity {tox:.4f}, " if math.isfinite(tox) else "")
              + f"kept fraction {last['kept_fraction']:.2f}, train_seconds {last['train_seconds']:.1f}")
    if trainer.run is not None:
        print(f"run directory: {trainer.run.path}  (report: {trainer.run.path / 'report.html'})")
    return 0
