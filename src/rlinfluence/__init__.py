"""rlinfluence: local data attribution and influence-based filtering for online RL (PPO).

The names most programs start from are importable from here, loaded on first use (so that
``import rlinfluence`` stays light): the trainer, a saved round, the scorers and their targets.
"""

from rlinfluence.lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ppo": ("PPO", "PPOConfig"),
    "checkpoint": ("load_round",),
    "influence": ("ActionTarget", "ReturnTarget", "score_buffer", "snapshot_influence", "tracin_influence"),
})
