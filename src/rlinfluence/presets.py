"""The paper's per-environment presets (docs/method.md, section 6): how each env is built and the
PPO hyperparameters the paper used. Plain data (no gymnasium, no torch), so ``PPOConfig`` and the
command line read them at start-up; ``rlinfluence.envs`` builds the envs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The paper's shared PPO settings (docs/method.md, section 6.1): SGD 5e-3, no gradient clipping (as the authors'
# code ran), n_steps 2048, batch 64, 10 epochs, gamma 0.99, lambda 0.95, clip 0.2, ent 0, vf 0.5.
_PAPER_PPO: dict[str, Any] = dict(
    n_envs=1, n_steps=2048, batch_size=64, n_epochs=10, optimizer="sgd", learning_rate=5e-3,
    max_grad_norm=None, gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, vf_coef=0.5,
)


@dataclass(frozen=True)
class EnvPreset:
    """A paper environment: how to build it and the hyperparameters the paper used."""

    env_id: str
    rounds: int
    """Rounds of the standard PPO run (one round = n_steps * n_envs environment steps)."""
    drop_pct: float
    """IIF's p: percentage of the negatively-influential records dropped each round (docs/method.md, section 5.4)."""
    eval_episodes: int
    make_kwargs: dict[str, Any] = field(default_factory=dict)
    ppo: dict[str, Any] = field(default_factory=dict)
    """PPOConfig overrides on top of the paper's shared settings."""

    def config_overrides(self) -> dict[str, Any]:
        rollout = _PAPER_PPO["n_steps"] * _PAPER_PPO["n_envs"]
        return {**_PAPER_PPO, "total_timesteps": self.rounds * rollout,
                "eval_episodes": self.eval_episodes, "drop_pct": self.drop_pct, **self.ppo}


HIGHWAY_CONFIG = {
    "observation": {"type": "Kinematics"},
    "action": {"type": "DiscreteMetaAction"},
    "vehicles_count": 10,
}

PRESETS: dict[str, EnvPreset] = {
    p.env_id: p
    for p in [
        EnvPreset("FrozenLake-v1", rounds=50, drop_pct=50.0, eval_episodes=1000,
                  make_kwargs={"map_name": "4x4", "is_slippery": False}),
        EnvPreset("Acrobot-v1", rounds=50, drop_pct=50.0, eval_episodes=1000),
        EnvPreset("MiniGrid-Empty-8x8-v0", rounds=40, drop_pct=12.5, eval_episodes=1000),
        EnvPreset("highway-v0", rounds=100, drop_pct=50.0, eval_episodes=100,
                  make_kwargs={"config": HIGHWAY_CONFIG}),
        EnvPreset("LunarLander-v3", rounds=150, drop_pct=12.5, eval_episodes=1000),
        EnvPreset("BipedalWalker-v3", rounds=500, drop_pct=6.25, eval_episodes=100,
                  ppo={"optimizer": "adam", "learning_rate": 3e-4}),
    ]
}
