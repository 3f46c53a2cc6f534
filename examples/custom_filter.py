"""A custom record filter for rlinfluence's PPO: drop the most harmful *episodes*.

A filter is any object with a ``name``, ``state_dict`` / ``load_state_dict`` and
``__call__(buffer, context) -> keep``: a boolean mask over the round's records in the buffer's
flat (env-major) order. The trainer calls it after computing the round's advantages and before
the update, which then trains on the kept records only.

This one scores every record by its snapshot influence on the return at theta(k) (as IIF does),
sums the scores per episode, and drops the whole episodes with the lowest sums.

    python examples/custom_filter.py                        # CartPole-v1, 10 rounds, ~1 minute
    python examples/custom_filter.py --env Acrobot-v1 --rounds 20 --drop-pct 20
"""

from __future__ import annotations

import argparse
from typing import Any

import pandas as pd
import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.filters import FilterContext, guard_minibatch
from rlinfluence.influence import ReturnTarget, ZeroTargetGradient, snapshot_influence
from rlinfluence.ppo import PPO, PPOConfig


class DropHarmfulEpisodes:
    """Drop the ``drop_pct`` % of the round's episodes whose records' scores sum lowest."""

    name = "harmful-episodes"

    def __init__(self, drop_pct: float = 10.0):
        self.drop_pct = drop_pct

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        keep_all = torch.ones(len(buffer), dtype=torch.bool)
        try:  # score_i = A_norm_i <grad log pi(a_i|s_i), grad f>, f = the return target, at theta(k)
            scores = snapshot_influence(
                context.policy, buffer.flat("obs"), buffer.flat("actions"), buffer.flat("advantages"),
                target=ReturnTarget(), advantage_norm="batch",
            )
        except ZeroTargetGradient:  # no signal this round (e.g. every advantage is 0): keep everything
            context.stats["skipped"] = 1.0
            return keep_all
        # an episode's id is unique across envs and rounds; one may have started in an earlier round
        episodes, episode_of = torch.unique(buffer.flat("episode_ids"), return_inverse=True)
        totals = torch.zeros(len(episodes), dtype=scores.dtype).index_add_(0, episode_of, scores)
        n_drop = int(len(episodes) * self.drop_pct / 100)
        dropped = torch.sort(totals, stable=True).indices[:n_drop]
        keep = ~torch.isin(episode_of, dropped)
        keep = guard_minibatch(keep, scores, context)  # always leave at least one full minibatch
        # numbers written into context.stats go to metrics.csv and TensorBoard, one value per round
        context.stats.update(skipped=0.0, episodes=float(len(episodes)), dropped_episodes=float(n_drop))
        return keep

    # A filter's own state (e.g. a torch.Generator) goes into every checkpoint, so that
    # PPO.resume(run_dir, filter=DropHarmfulEpisodes()) continues it; this one has none.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--drop-pct", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="runs", help="parent folder of the two run directories")
    args = parser.parse_args()

    results = {}
    for label, make_filter in (("ppo", lambda: None), ("harmful-episodes", lambda: DropHarmfulEpisodes(args.drop_pct))):
        config = PPOConfig.for_env(args.env, seed=args.seed, eval_episodes=20, progress=False,
                                   run_root=args.out, method=label)
        config.total_timesteps = args.rounds * config.rollout_size
        trainer = PPO(config, filter=make_filter()).learn()
        results[label] = pd.read_csv(trainer.run.path / "metrics.csv")
        print(f"{label}: {trainer.run.path}")

    ours = results["harmful-episodes"]
    table = pd.DataFrame({
        "round": ours["round"],
        "ppo eval return": results["ppo"]["eval_return_mean"],
        "filtered eval return": ours["eval_return_mean"],
        "kept_fraction": ours["kept_fraction"],
        "dropped_episodes": ours["dropped_episodes"],
    })
    print(table.to_string(index=False, float_format="%.3g"))


if __name__ == "__main__":
    main()
