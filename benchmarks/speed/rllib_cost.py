"""What writing an RLlib PPO run costs per training iteration, and what it sends over the network.

RLlib's PPO (its defaults but 2 env runners x 4 sub-envs and 2048 steps an iteration) on a local
Ray cluster, three arms alternated within each repeat, each a fresh algorithm with the same seed:
plain RLlib; with ``rlinfluence.integrations.rllib.run_callback`` (the run written); with
``quarantine=True`` too. Per arm, the wall time of each iteration after the first (``algo.train()``),
and, in the callback's arms, the time spent in the callback's own work (the Learner connector's
recording and quarantine, and ``on_train_result``'s writing), on the driver where the Learner runs:

    callback_share_of_iteration = callback seconds per iteration / the plain arm's median iteration

The bytes: what the callback adds to the episodes RLlib sends from the env runners to the Learner
(the source tag), measured as the pickled size of an iteration's episodes with and without it.

    python benchmarks/speed/rllib_cost.py --envs CartPole-v1,LunarLander-v3 --repeats 3 --iterations 6

Prints per env and arm the median iteration, and the summary lines
``<env>/<arm>/iteration_s``, ``<env>/<arm>/callback_s``, ``<env>/<arm>/callback_share_of_iteration``
and ``<env>/tag_bytes_per_iteration`` (of ``<env>/episode_bytes_per_iteration``).
"""

from __future__ import annotations

import pickle
import shutil
import statistics
import sys  # noqa: E402
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

ARMS = ("plain", "record", "quarantine")


def timed_callback(base: type) -> type:
    """``base`` with its driver-side work timed (``spent``: seconds per iteration) and one
    iteration's episodes measured pickled with and without the source tag (``sizes``)."""
    from rlinfluence.integrations.rllib_episodes import SOURCE_KEY

    class Timed(base):
        spent: list[float] = []
        sizes: list[tuple[int, int]] = []

        def take(self, episodes):
            if not Timed.sizes:
                with_tag = sum(len(pickle.dumps(e)) for e in episodes)
                tags = [e.custom_data.pop(SOURCE_KEY) for e in episodes]
                without = sum(len(pickle.dumps(e)) for e in episodes)
                for e, tag in zip(episodes, tags, strict=True):
                    e.custom_data[SOURCE_KEY] = tag
                Timed.sizes.append((with_tag, without))
            start = time.perf_counter()
            kept = super().take(episodes)
            self._took = time.perf_counter() - start
            return kept

        def on_train_result(self, **kwargs):
            start = time.perf_counter()
            super().on_train_result(**kwargs)
            Timed.spent.append(self._took + time.perf_counter() - start)

    Timed.__qualname__ = "timed_callback.<locals>.Timed"
    return Timed


def run_arm(env: str, arm: str, iterations: int, seed: int, scratch: Path) -> tuple[list[float], list[float], tuple]:
    """(wall seconds of iterations 2.., the callback's seconds of those, the episode bytes) of one arm."""
    from ray.rllib.algorithms.ppo import PPOConfig

    from rlinfluence.integrations.rllib import run_callback

    config = (PPOConfig().environment(env).env_runners(num_env_runners=2, num_envs_per_env_runner=4)
              .training(train_batch_size_per_learner=2048).debugging(seed=seed))
    callback = None
    if arm != "plain":
        path = scratch / f"{env}_{arm}"
        shutil.rmtree(path, ignore_errors=True)
        callback = timed_callback(run_callback(path, quarantine=arm == "quarantine"))
        callback.spent, callback.sizes = [], []
        config = config.callbacks(callback)
    algorithm = config.build_algo()
    walls = []
    try:
        for _ in range(iterations + 1):
            start = time.perf_counter()
            algorithm.train()
            walls.append(time.perf_counter() - start)
    finally:
        algorithm.stop()
    spent = callback.spent[1:] if callback else []
    return walls[1:], spent, callback.sizes[0] if callback else ()


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", default="CartPole-v1,LunarLander-v3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6, help="timed iterations per arm (after a first, untimed)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    scratch = Path(tempfile.mkdtemp(prefix="rllib_cost_"))
    lines = []
    try:
        for env in args.envs.split(","):
            walls = {arm: [] for arm in ARMS}
            spent = {arm: [] for arm in ARMS}
            sizes = ()
            for repeat in range(args.repeats):
                for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                    w, s, measured = run_arm(env, arm, args.iterations, args.seed, scratch)
                    walls[arm] += w
                    spent[arm] += s
                    sizes = sizes or measured
                    print(f"{env} {arm} repeat {repeat}: iterations {[round(x, 2) for x in w]} callback "
                          f"{[round(x, 3) for x in s]}", flush=True)
            plain = statistics.median(walls["plain"])
            for arm in ARMS:
                lines.append(f"{env}/{arm}/iteration_s: {statistics.median(walls[arm]):.3f}")
                if arm != "plain":
                    callback = statistics.median(spent[arm])
                    lines += [f"{env}/{arm}/callback_s: {callback:.3f}",
                              f"{env}/{arm}/callback_share_of_iteration: {callback / plain:.3f}"]
            lines += [f"{env}/episode_bytes_per_iteration: {sizes[0]}",
                      f"{env}/tag_bytes_per_iteration: {sizes[0] - sizes[1]}"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        ray.shutdown()
    harness.summary(lines)


if __name__ == "__main__":
    main()
