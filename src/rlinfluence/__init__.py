"""rlinfluence: local data attribution and influence-based filtering for online RL (PPO)."""

__version__ = "0.1.0"
