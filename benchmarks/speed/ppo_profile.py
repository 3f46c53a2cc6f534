"""Where our PPO's time goes: learn() on LunarLander-v3 with the paper's preset
(as ``ppo_throughput.py``: n_steps 2048, batch 64, 10 epochs, SGD 5e-3, one env, one torch
thread, no evaluation), with wall-clock timers around each phase:

- collect: ``PPO.collect``, of which env stepping (``SyncVectorEnv.step``: the env's own
  ``step``, and the rest, gymnasium's wrappers and vector env) and the policy's forward (the NumPy
  rollout actor); the rest is buffer writes and bookkeeping;
- advantages: ``RolloutBuffer.compute_advantages`` (GAE);
- update: ``PPO.update``, of which the loss forward (the policy's ``evaluate_actions`` and
  ``policy_terms``), ``backward`` and the
  optimiser's ``step``; the rest is minibatch indexing, diagnostics and Python;
- logging: ``RunDirectory.log_round`` (CSV and TensorBoard) and checkpoints.

With ``--update-engine numpy`` the loss forward is ``NumpyUpdate.forward`` and the backward row
is ``NumpyUpdate.step``, the written-out backward and the optimiser's step together.

Timers add about a microsecond per call. Prints a table, then ``name: value`` lines.

    python benchmarks/speed/ppo_profile.py [--rounds 10] [--update-engine numpy]
"""

from __future__ import annotations

import collections
import functools
import sys  # noqa: E402
import time
from collections.abc import Callable
from pathlib import Path  # noqa: E402
from typing import Any

import gymnasium as gym
import torch

import rlinfluence.ppo as ppo_module
from rlinfluence.buffer import RolloutBuffer
from rlinfluence.numpy_update import NumpyUpdate
from rlinfluence.policies import ActorCritic
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.rundir import RunDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

SECONDS: collections.defaultdict[str, float] = collections.defaultdict(float)


def timed(label: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
    return wrapper


def instrument(trainer: PPO) -> None:
    def patch(owner: Any, name: str, label: str) -> None:
        setattr(owner, name, timed(label, getattr(owner, name)))

    patch(gym.vector.SyncVectorEnv, "step", "env step")
    patch(type(trainer.env.envs[0].unwrapped), "step", "env's own step")  # the rest: wrappers, vector env
    patch(PPO, "collect", "collect")
    patch(RolloutBuffer, "compute_advantages", "advantages")
    patch(PPO, "update", "update")
    patch(trainer, "_policy_terms", "loss terms")  # the trainer's minibatch step calls both
    patch(ActorCritic, "evaluate_actions", "policy evaluate")
    patch(torch.Tensor, "backward", "backward")
    patch(torch.optim.SGD, "step", "optimiser step")
    patch(NumpyUpdate, "forward", "loss terms")
    patch(NumpyUpdate, "step", "backward")
    patch(RunDirectory, "log_round", "logging")
    patch(RunDirectory, "save_checkpoint", "checkpoints")
    actor = ppo_module.rollout_actor
    ppo_module.rollout_actor = lambda policy: timed("policy forward", actor(policy))


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--run-root", default="bench_out/ppo_profile")
    parser.add_argument("--update-engine", choices=["torch", "numpy", "auto"], default="torch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = PPOConfig.for_env("LunarLander-v3", total_timesteps=args.rounds * 2048, eval_episodes=0,
                               max_grad_norm=None, progress=False, run_root=args.run_root,
                               update_engine=args.update_engine)
    trainer = PPO(config)
    instrument(trainer)
    start = time.perf_counter()
    trainer.learn()
    total = time.perf_counter() - start
    rows = [
        ("collect", SECONDS["collect"], None),
        ("  env step", SECONDS["env step"], "collect"),
        ("    the env's own step", SECONDS["env's own step"], "collect"),
        ("    wrappers and vector env", SECONDS["env step"] - SECONDS["env's own step"], "collect"),
        ("  policy forward", SECONDS["policy forward"], "collect"),
        ("  rest of collect", SECONDS["collect"] - SECONDS["env step"] - SECONDS["policy forward"], "collect"),
        ("advantages", SECONDS["advantages"], None),
        ("update", SECONDS["update"], None),
        ("  loss forward", SECONDS["policy evaluate"] + SECONDS["loss terms"], "update"),
        ("  backward", SECONDS["backward"], "update"),
        ("  optimiser step", SECONDS["optimiser step"], "update"),
        ("  rest of update", SECONDS["update"] - SECONDS["policy evaluate"] - SECONDS["loss terms"] - SECONDS["backward"]
         - SECONDS["optimiser step"], "update"),
        ("logging + checkpoints", SECONDS["logging"] + SECONDS["checkpoints"], None),
        ("other", total - SECONDS["collect"] - SECONDS["advantages"] - SECONDS["update"] - SECONDS["logging"] - SECONDS["checkpoints"], None),
    ]
    steps = args.rounds * 2048
    print(f"learn(): {total:.2f} s for {steps} steps ({steps / total:.0f} steps/s)")
    print("| phase | seconds | share of learn() |\n|---|---|---|")
    for name, seconds, _ in rows:
        print(f"| {name} | {seconds:.3f} | {100 * seconds / total:.1f}% |")
    print(f"steps_per_s: {steps / total:.1f}")
    for name, seconds, _ in rows:
        print(f"share_{name.strip().replace(' + ', '_').replace(' ', '_').replace(chr(39), '')}_pct: {100 * seconds / total:.1f}")


if __name__ == "__main__":
    main()
