"""What watching a run costs: the CPU time of scoring one round for the audit, part by part,
against the CPU time of training that round.

    python benchmarks/speed/audit_cost.py --update-engine auto --repeats 3 --sb3-envs CartPole-v1 LunarLander-v3 --out bench_out/audit_cost_auto
    python benchmarks/speed/audit_cost.py --repeats 3 --out bench_out/audit_cost   # against the torch update

Per env: one run of 8 envs x 256 steps (the hidden-faults benchmark's size), 6 rounds, saved
buffers; the training CPU seconds of its rounds (metrics.csv ``train_cpu_seconds``, evaluation
excluded); then, on each saved round after the first, the process CPU time of the audit's harm
table part by part, as ``harm_table`` scores them (``rlinfluence.analysis.audit``): the gradient
families from their one pass (``gradient-families``: influence, influence-chunk, dtv), the
statistics together, the consistency checks group by group (``policy_checks``, ``obs_shift``,
``truncations``, ``model_checks``), tracin and random; one thread, median over the rounds. The
verdict's permutation tests are not included (they run once per audit, not per family).

Ends with one line per figure: ``<env>/audit_share_of_round: x`` (the seconds of the families the
audit scores by default, the gradient families left out, over a round's training seconds),
``<env>/audit_with_gradient_families_share_of_round`` (``audit --gradient-families`` on a run trained
without ``--tracin``), ``<env>/audit_with_replayed_tracin_share_of_round`` (every family, the replayed
TracIn too),
``<env>/quarantine_share_of_round`` (the statistics and consistency checks
``--filter quarantine`` scores every round), ``<env>/live_quarantine_share_of_round`` (a run trained
with ``--filter quarantine`` for twice its window: the filter's wall seconds a round, its scoring
and its verdict's tests, over the rest of the round's, one thread, once the window is full; and
``live_quarantine_seconds_per_round``; ``live_quarantine_with_broken_worker_*`` the same with one
worker broken, ``BROKEN_WORKER``: the rounds it is flagged in run every maxT draw),
``<env>/train_cpu_seconds_per_round``,
``<env>/<part>_seconds``. With ``--sb3-envs``, per env also what the Stable-Baselines3 audit costs a
Stable-Baselines3 run (SB3's PPO with its defaults, 8 envs x 256 steps, ``AuditCallback`` with its
default scorers; the callback's process CPU time against the rest of ``learn()``'s, per rollout):
``<env>/sb3_audit_callback_share_of_round`` and ``<env>/sb3_train_cpu_seconds_per_round``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread: CPU time = work done
    os.environ.setdefault(_var, "1")

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from rlinfluence.analysis.harm import GRADIENT_FAMILIES, GROUPS, SCORERS  # noqa: E402
from rlinfluence.checkpoint import load_round  # noqa: E402
from rlinfluence.consistency import (  # noqa: E402
    STATISTICS,
    action_count,
    model_checks,
    obs_shift,
    policy_checks,
    truncations,
)
from rlinfluence.filters import QuarantineFilter  # noqa: E402
from rlinfluence.ppo import PPO, PPOConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

CHECK_GROUPS = {
    "policy-checks": lambda saved: policy_checks(saved.trainer.policy, saved.buffer, action_count(saved.trainer.policy)),
    "obs-shift": lambda saved: obs_shift(saved.buffer),
    "truncations": lambda saved: truncations(saved.buffer),
    "model-checks": lambda saved: model_checks(saved.buffer, action_count(saved.trainer.policy)),
}
"""The consistency checks as ``consistency_scores`` computes them, group by group."""


def cpu_seconds(call) -> float:
    start = time.process_time()
    call()
    return time.process_time() - start


def measure(env: str, out: Path, rounds: int, update_engine: str) -> dict[str, float]:
    config = PPOConfig.for_env(env, update_engine=update_engine, n_envs=8, n_steps=256, batch_size=256, total_timesteps=rounds * 8 * 256,
                               save_buffers=True, eval_episodes=0, progress=False, tensorboard=False,
                               run_root=str(out / "runs"))
    run = PPO(config).learn().run.path
    metrics = pd.read_csv(run / "metrics.csv")
    train = metrics["train_cpu_seconds"].diff().fillna(metrics["train_cpu_seconds"]).iloc[1:]
    parts = {"gradient-families": GROUPS[GRADIENT_FAMILIES], "statistics": GROUPS[STATISTICS],
             "tracin": SCORERS["tracin"], "random": SCORERS["random"], **CHECK_GROUPS}
    seconds: dict[str, list[float]] = {name: [] for name in parts}
    for k in range(1, rounds):
        saved = load_round(run, k)
        for name, part in parts.items():
            seconds[name].append(cpu_seconds(lambda part=part, saved=saved: part(saved)))
    median = {name: statistics.median(v) for name, v in seconds.items()}
    per_round = float(train.median())
    figures = {f"{name}_seconds": value for name, value in median.items()}
    figures["train_cpu_seconds_per_round"] = per_round
    # the audit's default families (no gradient family); with --gradient-families on a run trained without
    # --tracin (tracin is then left out); and with --scorer-style replay of every record's full TracIn as well
    gradient = ("gradient-families", "tracin")
    figures["audit_share_of_round"] = sum(v for name, v in median.items() if name not in gradient) / per_round
    figures["audit_with_gradient_families_share_of_round"] = sum(v for name, v in median.items() if name != "tracin") / per_round
    figures["audit_with_replayed_tracin_share_of_round"] = sum(median.values()) / per_round
    cheap = ["statistics", *CHECK_GROUPS]  # what --filter quarantine scores every round (QuarantineFilter.CHEAP)
    figures["quarantine_share_of_round"] = sum(median[name] for name in cheap) / per_round
    return figures | measure_live_quarantine(env, out, update_engine)


BROKEN_WORKER = "reward-flip:envs=1"
"""The fault of the live quarantine's second run: a worker whose rewards are flipped from the start,
which the filter flags and quarantines (its maxT then runs every draw)."""


def measure_live_quarantine(env: str, out: Path, update_engine: str) -> dict[str, float]:
    """Runs of the same size trained with ``--filter quarantine`` for twice its window of rounds, one
    clean and one with ``BROKEN_WORKER``: the filter's seconds a round (its scoring and its verdict's
    tests, which grow with the records in the window) against the rest of the round's (collection
    and update), wall time of one thread, median over the rounds once the window is full."""
    window = QuarantineFilter().window
    figures = {}
    for label, corrupt in (("", ()), ("_with_broken_worker", (BROKEN_WORKER,))):
        config = PPOConfig.for_env(env, update_engine=update_engine, n_envs=8, n_steps=256, batch_size=256,
                                   total_timesteps=2 * window * 8 * 256, filter="quarantine", corrupt=corrupt,
                                   eval_episodes=0, progress=False, tensorboard=False,
                                   run_root=str(out / f"quarantine_runs{label}"))
        metrics = pd.read_csv(PPO(config).learn().run.path / "metrics.csv").iloc[window - 1:]
        rest = metrics["collect_seconds"] + metrics["update_seconds"]
        figures[f"live_quarantine{label}_seconds_per_round"] = float(metrics["filter_seconds"].median())
        figures[f"live_quarantine{label}_share_of_round"] = float((metrics["filter_seconds"] / rest).median())
    return figures


def measure_sb3(env: str, out: Path, rounds: int) -> dict[str, float]:
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.env_util import make_vec_env

    from rlinfluence.integrations.sb3_audit import AuditCallback

    class TimedAuditCallback(AuditCallback):
        seconds = 0.0

        def _on_rollout_end(self) -> None:
            start = time.process_time()
            super()._on_rollout_end()
            self.seconds += time.process_time() - start

    callback = TimedAuditCallback(out / "sb3")
    model = SB3PPO("MlpPolicy", make_vec_env(env, n_envs=8, seed=0), n_steps=256, seed=0, device="cpu")
    start = time.process_time()
    model.learn(rounds * 8 * 256, callback=callback)
    per_round = (time.process_time() - start - callback.seconds) / rounds
    return {"sb3_train_cpu_seconds_per_round": per_round,
            "sb3_audit_callback_share_of_round": callback.seconds / rounds / per_round}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "LunarLander-v3", "MiniGrid-Empty-8x8-v0"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench_out/audit_cost")
    parser.add_argument("--update-engine", choices=["torch", "auto"], default="torch",
                        help="the training round's engine: torch (the published figures') or auto (the default trainer's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per env (each its own training and scoring); every figure is the median over them")
    parser.add_argument("--sb3-envs", nargs="*", default=[],
                        help="also the Stable-Baselines3 AuditCallback's share of an SB3 round on these envs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    lines = []
    parts = [(env, partial(measure, env, update_engine=args.update_engine)) for env in args.envs]
    parts += [(env, partial(measure_sb3, env)) for env in args.sb3_envs]
    for env, part in parts:
        repeats = [part(out / env / f"repeat_{r}", rounds=args.rounds) for r in range(args.repeats)]
        figures = {name: statistics.median(r[name] for r in repeats) for name in repeats[0]}
        lines += [f"{env}/{name}: {value:.3g}" for name, value in sorted(figures.items())]
        harness.summary(lines[-len(figures):])
    (out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
