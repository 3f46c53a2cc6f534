"""What watching a run costs: the CPU time of scoring one round for the audit, family by family,
against the CPU time of training that round.

    python benchmarks/speed/audit_cost.py --envs CartPole-v1 LunarLander-v3 MiniGrid-Empty-8x8-v0 --out bench_out/audit_cost
    python benchmarks/speed/audit_cost.py --update-engine auto --out bench_out/audit_cost_auto   # against the default trainer

Per env: one run of 8 envs x 256 steps (the hidden-faults benchmark's size), 6 rounds, saved
buffers; the training CPU seconds of its rounds (metrics.csv ``train_cpu_seconds``, evaluation
excluded); then, on each saved round after the first, the process CPU time of every family of the
audit's harm table (``rlinfluence.analysis.audit.SCORERS``; the consistency checks group by group:
``policy_checks``, ``obs_shift``, ``truncations``, ``model_checks``), one thread, median over the
rounds. The verdict's permutation tests are not included (they run once per audit, not per family).

Ends with one line per figure: ``<env>/audit_share_of_round: x`` (the seconds of the families the
audit runs on a run trained without ``--tracin`` over a round's training seconds),
``<env>/audit_with_replayed_tracin_share_of_round`` (every family, the replayed TracIn too),
``<env>/quarantine_share_of_round`` (the statistics and consistency checks
``--filter quarantine`` scores every round), ``<env>/train_cpu_seconds_per_round``,
``<env>/<family>_seconds``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread: CPU time = work done
    os.environ.setdefault(_var, "1")

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from rlinfluence.analysis.audit import SCORERS  # noqa: E402
from rlinfluence.checkpoint import load_round  # noqa: E402
from rlinfluence.consistency import (  # noqa: E402
    STATISTICS,
    action_count,
    model_checks,
    obs_shift,
    policy_checks,
    truncations,
)
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
    families = {name: scorer for name, scorer in SCORERS.items() if name != "influence-trusted"}
    seconds: dict[str, list[float]] = {name: [] for name in [*families, *CHECK_GROUPS]}
    for k in range(1, rounds):
        saved = load_round(run, k)
        for name, scorer in families.items():
            seconds[name].append(cpu_seconds(lambda scorer=scorer, saved=saved: scorer(saved)))
        for name, group in CHECK_GROUPS.items():
            seconds[name].append(cpu_seconds(lambda group=group, saved=saved: group(saved)))
    median = {name: statistics.median(v) for name, v in seconds.items()}
    per_round = float(train.median())
    figures = {f"{name}_seconds": value for name, value in median.items()}
    figures["train_cpu_seconds_per_round"] = per_round
    # the audit's default families on a run trained without --tracin (tracin is then left out), and with
    # --scorer-style replay of every record's full TracIn as well
    figures["audit_share_of_round"] = sum(v for name, v in median.items() if name != "tracin") / per_round
    figures["audit_with_replayed_tracin_share_of_round"] = sum(median.values()) / per_round
    cheap = [*STATISTICS, *CHECK_GROUPS]  # what --filter quarantine scores every round (QuarantineFilter.CHEAP)
    figures["quarantine_share_of_round"] = sum(median[name] for name in cheap) / per_round
    return figures


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "LunarLander-v3", "MiniGrid-Empty-8x8-v0"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench_out/audit_cost")
    parser.add_argument("--update-engine", choices=["torch", "auto"], default="torch",
                        help="the training round's engine: torch (the published figures') or auto (the default trainer's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    lines = []
    for env in args.envs:
        figures = measure(env, out / env, args.rounds, args.update_engine)
        lines += [f"{env}/{name}: {value:.3g}" for name, value in sorted(figures.items())]
        harness.summary(lines[-len(figures):])
    (out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
