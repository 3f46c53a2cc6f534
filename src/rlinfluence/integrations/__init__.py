"""Integrations with other RL libraries (each an optional extra, imported only when used).

- ``rlinfluence.integrations.sb3``: Stable-Baselines3's PPO -- ``attribute`` (snapshot scores of
  SB3's rollout buffer), ``FilteredRolloutBuffer`` and ``InfluenceFilterCallback`` (IIF);
  ``sb3_audit``: ``AuditCallback`` (harm tables for ``rlinfluence audit``), ``QuarantineCallback``
  (drops the envs the sources test flags); ``sb3_rundir``: ``RunDirectoryCallback`` (a run directory).
- ``rlinfluence.integrations.trl``: TRL's ``GRPOTrainer`` -- ``IIFGRPOTrainer`` and
  ``IIFGRPOConfig`` (IIF on each generation batch's completions), ``completion_influence``.
"""

from __future__ import annotations

from typing import Any

_SB3_NAMES = ("FilteredRolloutBuffer", "InfluenceFilterCallback", "SB3PolicyAdapter", "attribute")
_SB3_AUDIT_NAMES = ("AuditCallback", "QuarantineCallback")
_TRL_NAMES = ("IIFGRPOConfig", "IIFGRPOTrainer", "completion_influence")

__all__ = [*_SB3_NAMES, *_SB3_AUDIT_NAMES, *_TRL_NAMES]


def __getattr__(name: str) -> Any:
    # Lazy: importing rlinfluence.integrations must not need stable-baselines3 or trl.
    if name in _SB3_NAMES:
        from rlinfluence.integrations import sb3

        return getattr(sb3, name)
    if name in _SB3_AUDIT_NAMES:
        from rlinfluence.integrations import sb3_audit

        return getattr(sb3_audit, name)
    if name in _TRL_NAMES:
        from rlinfluence.integrations import trl

        return getattr(trl, name)
    raise AttributeError(f"module 'rlinfluence.integrations' has no attribute {name!r}")
