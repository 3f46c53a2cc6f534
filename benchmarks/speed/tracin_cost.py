"""What exact full-round TracIn costs next to the round's own update.

For each env, two runs of the paper's preset with the same seed (one torch thread, no
evaluation, buffers saved): one plain, one with ``PPOConfig.tracin`` (full local TracIn with the
return target recorded inside the update's own steps). The two runs' parameters are equal bit for
bit (tests/test_influence_tracin.py), so round k does the same work in both. Per round:

- ``update``: the plain run's update time (its ``update_seconds``);
- ``recorded``: what recording added to the other run's update (its ``tracin_seconds``);
- ``replay``: ``tracin_influence`` of the saved round afterwards (what ``audit --scorer tracin``
  does for a run trained without ``--tracin``), and its largest difference to the recorded scores.

The ratios are medians over the rounds (round 0 is left out: its first call builds the ghost
plan and verifies it). Where the time goes: one target gradient (a forward and backward of the
return target over all the round's records) per optimiser step, timed on the last round's theta
one step at a time (``target_gradient``, what TracIn does) and batched over S steps with
``torch.func.vmap(grad)`` (the alternative that was tried). Prints one summary line per figure last.

    python benchmarks/speed/tracin_cost.py [--envs LunarLander-v3 Acrobot-v1] [--rounds 6] [--out bench_out/tracin_cost]
"""

from __future__ import annotations

import statistics
import sys  # noqa: E402
import time
from pathlib import Path

import torch
from torch.func import grad, vmap

from rlinfluence.analysis.validation import score_round
from rlinfluence.checkpoint import SavedRound, load_round
from rlinfluence.influence import Records, ReturnTarget
from rlinfluence.influence.ghost import _substituted
from rlinfluence.influence.targets import target_gradient
from rlinfluence.ppo import PPO, PPOConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402


def train(env: str, rounds: int, tracin: bool, out: Path, seed: int) -> PPO:
    rollout = 2048  # the preset's n_steps * n_envs
    config = PPOConfig.for_env(env, update_engine="torch", total_timesteps=rounds * rollout, eval_episodes=0, save_buffers=True,
                               tracin=tracin, tensorboard=False, progress=False, seed=seed, torch_threads=1,
                               run_root=str(out / ("tracin" if tracin else "plain")))
    return PPO(config).learn()


def target_gradient_ms(saved: SavedRound, batched_steps: int | None, repeats: int = 64) -> float:
    """Milliseconds per optimiser step of grad f at theta (the return target over the round's
    records): ``target_gradient`` once per step, or ``vmap(grad(f))`` over ``batched_steps``
    stacked copies of theta."""
    policy = saved.trainer.policy.eval()
    buffer = saved.buffer
    records = Records(buffer.flat("obs"), buffer.flat("actions"), buffer.flat("advantages"))
    params = list(policy.policy_parameters())
    target = ReturnTarget()
    if batched_steps is None:
        def call() -> object:
            return target_gradient(target, policy, params, records)
        steps = 1
    else:
        def f(*values: torch.Tensor) -> torch.Tensor:
            with _substituted(policy, params, values):
                return sum(target.pieces(policy, records, 4096), torch.zeros(()))
        stacked = [p.detach().expand(batched_steps, *p.shape).clone() for p in params]
        batched = vmap(grad(f, argnums=tuple(range(len(params)))))

        def call() -> object:
            return batched(*stacked)
        steps = batched_steps
    call()
    calls = max(1, repeats // steps)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / (calls * steps) * 1e3


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", nargs="+", default=["LunarLander-v3", "Acrobot-v1"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out/tracin_cost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    summary = []
    for env in args.envs:
        out = Path(args.out) / env
        plain = train(env, args.rounds, False, out, args.seed)
        recorded = train(env, args.rounds, True, out, args.seed)
        rows = []
        for k in range(1, args.rounds):
            update = plain.run.rows[k]["update_seconds"]
            extra = recorded.run.rows[k]["tracin_seconds"]
            saved = load_round(recorded.run.path, k)
            start = time.perf_counter()
            replay = score_round(saved, ReturnTarget(), "full", 0)
            replay_s = time.perf_counter() - start
            diff = float((replay - saved.tracin).abs().max() / replay.abs().max())
            rows.append((update, extra, replay_s, diff))
            print(f"{env} round {k}: update {update:.3f} s, recorded +{extra:.3f} s ({extra / update:.2f}x), "
                  f"replay {replay_s:.3f} s ({replay_s / update:.2f}x), max rel. diff {diff:.1e}", flush=True)
        ratio_recorded = statistics.median(e / u for u, e, _, _ in rows)
        ratio_replay = statistics.median(r / u for u, _, r, _ in rows)
        last = load_round(recorded.run.path, args.rounds - 1)
        per_step = {label: target_gradient_ms(last, steps) for label, steps in
                    (("per_step", None), ("vmap8", 8), ("vmap32", 32))}
        print(f"{env}: target gradient per optimiser step " +
              ", ".join(f"{label} {ms:.2f} ms" for label, ms in per_step.items()), flush=True)
        summary += [f"target_gradient_ms_{label}_{env}: {ms:.2f}" for label, ms in per_step.items()]
        summary += [f"update_seconds_{env}: {statistics.median(u for u, *_ in rows):.3f}",
                    f"tracin_recorded_ratio_{env}: {ratio_recorded:.2f}",
                    f"tracin_replay_ratio_{env}: {ratio_replay:.2f}",
                    f"tracin_recorded_vs_replay_max_rel_diff_{env}: {max(d for *_, d in rows):.1e}"]
    harness.summary(summary)


if __name__ == "__main__":
    main()
