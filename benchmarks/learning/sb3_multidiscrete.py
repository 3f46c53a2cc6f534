"""IIF on multi-dimensional discrete actions: SB3 PPO vs + IIF vs + random drops on SB3's identity envs.

Setting = SB3's own ``tests/test_identity.py::test_discrete`` for PPO: ``MlpPolicy``, one env
(``IdentityEnv(4)``: Discrete(4), the single-dimension control; ``IdentityEnvMultiDiscrete(4)``:
MultiDiscrete([4, 4]); ``IdentityEnvMultiBinary(4)``: MultiBinary(4); reward 1 per step iff every
action dimension equals the observation, 100-step episodes), gamma 0.4, lr 0.002, n_steps 256,
n_epochs 4, batch 64, ``learn(1200)`` (5 rounds of 256 steps). Arms per seed, all from the same
initial policy and env seed:

- ``ppo``: plain SB3 PPO;
- ``iif``: ``FilteredRolloutBuffer`` + ``InfluenceFilterCallback(drop_pct=12.5)`` (neg-bottom);
- ``random``: the same number of records as IIF drops that round, chosen uniformly at random
  (scores computed only to count). IIF and random lose the same number of minibatch steps, so
  ``iif - random`` is the effect of *which* records are dropped.

Per-dimension diagnostic (iif arm): with log pi(a|s) = sum_d log pi_d(a_d|s), a record's score
splits exactly into per-dimension parts,

    score_i = sum_d score_id,   score_id = A_norm_i < grad log pi_d(a_id|s_i), grad f >,

(f the return target of the whole action); the script checks the sum against the callback's
scores and reports, over the records IIF dropped, the fraction whose parts have mixed signs and
the share of their |parts| that is positive (helpful dimensions thrown away with the record).

Prints ``name: value`` lines: final deterministic return (``evaluate_policy``, 20 episodes,
max 100) mean +/- s.e. over seeds per env and arm, and the diagnostic.

    nice python benchmarks/learning/sb3_multidiscrete.py --seeds 8
"""

from __future__ import annotations

import math
import statistics
import sys  # noqa: E402
import time
from pathlib import Path  # noqa: E402

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.envs import (
    IdentityEnv,
    IdentityEnvMultiBinary,
    IdentityEnvMultiDiscrete,
)
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import DummyVecEnv

from rlinfluence.influence import (
    Records,
    ReturnTarget,
    normalize_for_attribution,
    per_record_dots,
    plan_ghost,
)
from rlinfluence.influence.targets import target_gradient
from rlinfluence.integrations.sb3 import (
    FilteredRolloutBuffer,
    InfluenceFilterCallback,
    SB3PolicyAdapter,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

ENVS = {"Discrete": lambda: IdentityEnv(4), "MultiDiscrete": lambda: IdentityEnvMultiDiscrete(4),
        "MultiBinary": lambda: IdentityEnvMultiBinary(4)}
ARMS = ("ppo", "iif", "random")


class RandomMatched(InfluenceFilterCallback):
    """Drops as many records as IIF would, uniformly at random (own generator, global RNG untouched)."""

    def __init__(self, seed: int, **kwargs: object):
        super().__init__(**kwargs)
        self.rng = np.random.default_rng(seed)

    def _on_rollout_end(self) -> None:
        super()._on_rollout_end()
        n, n_drop = len(self.keep), int((~self.keep).sum())
        keep = np.ones(n, bool)
        keep[self.rng.choice(n, n_drop, replace=False)] = False
        self.model.rollout_buffer.set_keep_mask(keep)


def per_dimension_log_prob(policy: SB3PolicyAdapter, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log pi_d(a_d|s) for every record and action dimension, [N, D]."""
    dist = policy.policy.get_distribution(obs)
    if isinstance(dist.distribution, list):  # MultiCategoricalDistribution
        return torch.stack([d.log_prob(a) for d, a in zip(dist.distribution, actions.unbind(1), strict=True)], 1)
    if actions.dim() == 1:  # Discrete
        return dist.log_prob(actions)[:, None]
    return dist.distribution.log_prob(actions)  # Bernoulli: [N, D]


class PerDimension(BaseCallback):
    """After the IIF callback: split its scores into per-dimension parts (module docstring)."""

    def __init__(self, iif: InfluenceFilterCallback):
        super().__init__()
        self.iif = iif
        self.rows: list[dict[str, float]] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        np_state = np.random.get_state()
        with torch.random.fork_rng():
            self._split()
        np.random.set_state(np_state)

    def _split(self) -> None:
        buffer, iif = self.model.rollout_buffer, self.iif
        adapter = SB3PolicyAdapter(self.model.policy)
        n = buffer.buffer_size * buffer.n_envs
        obs = torch.as_tensor(buffer.swap_and_flatten(buffer.observations))
        actions = torch.as_tensor(buffer.swap_and_flatten(buffer.actions).astype(np.float32))
        actions = actions.reshape(n).long() if adapter.discrete else actions
        adv = torch.as_tensor(buffer.swap_and_flatten(buffer.advantages).reshape(n))
        order = torch.as_tensor(iif.order)
        norm = torch.empty_like(adv)
        norm[order] = normalize_for_attribution(adv[order], "chunk", self.model.batch_size)
        params = adapter.policy_parameters()
        direction = target_gradient(ReturnTarget(), adapter, params, Records(obs, actions, adv))
        plan = plan_ghost(adapter, params)
        n_dims = per_dimension_log_prob(adapter, obs[:1], actions[:1]).shape[1]
        parts = torch.stack([
            per_record_dots(adapter, plan, lambda p, o, a, d=d: per_dimension_log_prob(p, o, a)[:, d],
                            (obs, actions), direction, accumulate_dtype=torch.float64) * norm.double()
            for d in range(n_dims)], 1)
        dropped = ~iif.keep
        mixed = (parts.max(1).values > 0) & (parts.min(1).values < 0)
        part = parts[dropped]
        self.rows.append({
            "sum_check": float((parts.sum(1) - iif.scores.double()).abs().max() / iif.scores.abs().max()),
            "n_dropped": float(dropped.sum()),
            "mixed_all": float(mixed.double().mean()),
            "mixed_dropped": float(mixed[dropped].double().mean()) if dropped.any() else math.nan,
            "positive_share_dropped": float(part.clamp(min=0).sum() / part.abs().sum()) if dropped.any() else math.nan,
            "positive_adv_dropped": float((adv[dropped] > 0).double().mean()) if dropped.any() else math.nan,
        })


def run(env_name: str, arm: str, seed: int) -> tuple[float, list[dict[str, float]]]:
    def make():
        env = ENVS[env_name]()
        env.action_space.seed(seed)
        return env

    vec = DummyVecEnv([make])
    model = PPO("MlpPolicy", vec, gamma=0.4, learning_rate=0.002, n_epochs=4, n_steps=256, seed=seed,
                device="cpu", rollout_buffer_class=None if arm == "ppo" else FilteredRolloutBuffer)
    callbacks: list[BaseCallback] = []
    diag = None
    if arm == "iif":
        iif = InfluenceFilterCallback(drop_pct=12.5)
        diag = PerDimension(iif)
        callbacks = [iif, diag]
    elif arm == "random":
        callbacks = [RandomMatched(seed, drop_pct=12.5)]
    model.learn(1200, callback=CallbackList(callbacks))
    eval_env = make()
    eval_env.action_space.seed(10_000 + seed)
    mean, _ = evaluate_policy(model, DummyVecEnv([lambda: eval_env]), n_eval_episodes=20, warn=False)
    return float(mean), diag.rows if diag else []


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return f"{statistics.fmean(values):.1f} +/- {se:.1f}"


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--envs", default=",".join(ENVS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.process_time()
    for env_name in args.envs.split(","):
        finals: dict[str, list[float]] = {arm: [] for arm in ARMS}
        diag: list[dict[str, float]] = []
        for seed in range(args.seeds):
            for arm in ARMS:
                final, rows = run(env_name, arm, seed)
                finals[arm].append(final)
                diag.extend(rows)
        for arm in ARMS:
            print(f"{env_name}_{arm}_final_return: {mean_se(finals[arm])}  per seed {[round(v) for v in finals[arm]]}")
        deltas = [a - b for a, b in zip(finals["iif"], finals["random"], strict=True)]
        print(f"{env_name}_iif_minus_random: {mean_se(deltas)}")
        for key in ("sum_check", "n_dropped", "mixed_all", "mixed_dropped", "positive_share_dropped", "positive_adv_dropped"):
            values = [r[key] for r in diag if not math.isnan(r[key])]
            stat = max(values) if key == "sum_check" else statistics.fmean(values)
            print(f"{env_name}_{key}{'_max' if key == 'sum_check' else '_mean'}: {stat:.3g}")
    print(f"cpu_seconds: {time.process_time() - start:.0f}")


if __name__ == "__main__":
    main()
