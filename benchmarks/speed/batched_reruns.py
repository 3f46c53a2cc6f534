"""K re-runs of one paper-preset PPO round (2048 records, 64-record minibatches, 10 epochs) batched
(``rlinfluence.reruns.batched_retrain``) against one serial update, and ``validate`` of a round
(30 subsets) with batched and with serial re-runs.

    python benchmarks/speed/batched_reruns.py --env LunarLander-v3 --ks 8,32,64 --repeats 3

One thread (``torch.set_num_threads(1)``), process CPU time, the median of ``--repeats``; the
variants are random 50% keep masks. Prints per K ``reruns_<K>_vs_update: X`` (the batched time
of K re-runs over one serial update), ``reruns_<K>_peak_mib`` (resident set growth), and
``validate_speedup: X`` (serial over batched time of one round's validate).
"""

from __future__ import annotations

import resource
import statistics
import sys  # noqa: E402
import tempfile
import time
from pathlib import Path  # noqa: E402

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402


def _cpu(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--env", default="LunarLander-v3")
    parser.add_argument("--ks", default="8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--subsets", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlinfluence.analysis.validation import validate_round
    from rlinfluence.checkpoint import load_round
    from rlinfluence.ppo import PPO, PPOConfig
    from rlinfluence.reruns import Variant, batched_retrain

    root = tempfile.mkdtemp()
    config = PPOConfig.for_env(args.env, update_engine="torch", total_timesteps=2 * 2048, eval_episodes=0, save_buffers=True, seed=1,
                               run_root=root, progress=False, tensorboard=False)
    run = PPO(config).learn().run.path
    saved = load_round(run, 1)
    n = len(saved.buffer)
    update = _cpu(lambda: saved.retrain(), args.repeats)
    print(f"one serial update ({n} records): {update:.2f} s CPU", flush=True)
    rng = np.random.default_rng(0)
    for k in [int(x) for x in args.ks.split(",")]:
        variants = [Variant(keep=torch.from_numpy(rng.random(n) < 0.5)) for _ in range(k)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        batched = _cpu(lambda variants=variants: batched_retrain(saved, variants), args.repeats)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(f"{k} batched re-runs: {batched:.2f} s CPU", flush=True)
        print(f"reruns_{k}_vs_update: {batched / update:.2f}")
        print(f"reruns_{k}_peak_mib: {grown:.0f}")
    timed = {}
    for mode in ("serial", "batched"):
        start = time.process_time()
        validate_round(run, 1, subsets=args.subsets, batched=mode == "batched")
        timed[mode] = time.process_time() - start
        print(f"validate ({mode}): {timed[mode]:.1f} s CPU", flush=True)
    print(f"validate_speedup: {timed['serial'] / timed['batched']:.2f}")


if __name__ == "__main__":
    main()
