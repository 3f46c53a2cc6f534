"""Stable-Baselines3 integration: snapshot attribution and IIF for SB3's PPO, without a fork.

    from stable_baselines3 import PPO
    from rlinfluence.integrations.sb3 import FilteredRolloutBuffer, InfluenceFilterCallback

    model = PPO("MlpPolicy", "LunarLander-v3", rollout_buffer_class=FilteredRolloutBuffer)
    model.learn(200_000, callback=InfluenceFilterCallback(drop_pct=12.5))

- ``attribute(model, rollout_buffer, target="return")``: snapshot influence (docs/method.md, section 4.2)
  of every record of SB3's rollout buffer, in SB3's flat order (see below), at the policy's
  current parameters -- call it after a rollout and before ``train()`` (e.g. in a callback's
  ``_on_rollout_end``), when the policy is still theta(k), the one that collected the buffer.
- ``FilteredRolloutBuffer``: SB3's ``RolloutBuffer`` whose ``get()`` draws minibatches from the
  kept records only and records each minibatch's record indices.
- ``InfluenceFilterCallback``: IIF (docs/method.md, section 5) -- after GAE and before ``train()``, scores the
  buffer and sets the buffer's keep mask; logs ``influence/*`` through SB3's logger.
- ``AuditCallback(path)``: after GAE, writes each rollout's harm table (one row per record, its
  source = the vec env index; ``rlinfluence.analysis.audit``) to ``path/audit/scores/``, so that
  ``rlinfluence audit path`` tests which envs push the updates the wrong way.

Record order. SB3 stores the buffer as ``[n_steps, n_envs, ...]``; ``get()`` flattens it with
``swap_and_flatten`` into env-major order, record ``i = env * n_steps + step``, and draws its
minibatch indices in that order. Scores, keep masks and minibatch indices here all use that
flat order (``scores.reshape(n_envs, n_steps).T`` gives ``[n_steps, n_envs]``). ``attribute``
reads the buffer in either state (before ``get()``: ``[n_steps, n_envs]``; after: flat).

Which parameters are attributed: every trainable parameter of SB3's ``ActorCriticPolicy`` except
the value-only ones (``value_net``, ``mlp_extractor.value_net`` and, when the feature extractor
is not shared, ``vf_features_extractor``): the policy feature extractor (shared or not), the
policy MLP, ``action_net`` and a Gaussian ``log_std``. ``nn.Linear``/``nn.Conv2d`` weights take
ghost dot products, everything else (``log_std``) exact per-record gradients.

Spaces (one test per space in ``tests/test_sb3_adapter.py``, scores equal to per-record
autograd): actions ``Discrete``, ``Box`` (diagonal Gaussian with ``log_std``), ``MultiDiscrete``
and ``MultiBinary``; observations ``Box`` (vectors and images), ``Discrete``, ``MultiDiscrete``,
``MultiBinary`` (SB3's own one-hot / float preprocessing). Not supported: ``Dict`` observation
spaces (``DictRolloutBuffer``). On ``MultiDiscrete`` / ``MultiBinary`` actions the scores are
exact but one record is the whole joint action, and IIF measured worse than dropping as many
records at random on SB3's identity tasks (``docs/sb3.md``), so the callback warns once.

A rollout whose target has zero gradient (every advantage exactly 0) is kept whole: the callback
logs ``influence/skipped = 1``, warns with the reason and lets ``train()`` run as plain SB3.

stable-baselines3 is optional; this module needs it (``pip install "rlinfluence[sb3]"``).
"""

from __future__ import annotations

import numbers
import os
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

try:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import RolloutBuffer
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.policies import ActorCriticPolicy
    from stable_baselines3.common.utils import obs_as_tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rlinfluence.integrations.sb3 needs stable-baselines3 (an optional dependency): "
        'pip install "rlinfluence[sb3]"'
    ) from exc

from rlinfluence.buffer import RolloutBuffer as OurRolloutBuffer
from rlinfluence.filters import (
    FilterContext,
    QuarantineFilter,
    drop_lowest,
    guard_minibatch,
    iif_drop_count,
)
from rlinfluence.influence import (
    DEFAULT_ADVANTAGE_NORM,
    ReturnTarget,
    Target,
    ZeroTargetGradient,
    gradient_alignment,
    snapshot_influence,
)
from rlinfluence.rundir import AUDIT_SCORES, atomic_write
from rlinfluence.sources import MIN_SOURCES

__all__ = ["AuditCallback", "FilteredRolloutBuffer", "InfluenceFilterCallback", "QuarantineCallback", "SB3PolicyAdapter",
           "as_rollout_buffer", "attribute",
           "next_permutation"]

ADVANTAGE_NORMS = ("auto", "chunk", "batch", "none")
JOINT_ACTION_SPACES = (spaces.MultiDiscrete, spaces.MultiBinary)
"""Action spaces where one record is a joint action over several dimensions (IIF warns)."""


# -- the policy adapter ---------------------------------------------------------------------------
class SB3PolicyAdapter(nn.Module):
    """SB3's ``ActorCriticPolicy`` behind the interface our scorers use.

    - ``log_prob(obs, actions) -> [N]``: ``policy.get_distribution(obs).log_prob(actions)`` (the
      actor path only; SB3's own observation preprocessing, e.g. images / 255);
    - ``evaluate_actions(obs, actions) -> (log_prob, entropy, value)`` (our order, not SB3's);
    - ``policy_parameters()``: every trainable parameter except the value-only ones.

    Discrete actions may be given as ``[N]`` or ``[N, 1]`` (SB3's buffer stores ``[N, 1]``
    floats); other action spaces as SB3's buffer stores them.
    """

    def __init__(self, policy: ActorCriticPolicy):
        super().__init__()
        if not isinstance(policy, ActorCriticPolicy):
            raise TypeError(f"expected an SB3 ActorCriticPolicy (PPO/A2C), got {type(policy).__name__}")
        if isinstance(policy.observation_space, spaces.Dict):
            raise ValueError("Dict observation spaces are not supported by rlinfluence's SB3 adapter")
        self.policy = policy
        self.discrete = isinstance(policy.action_space, spaces.Discrete)
        self.n_actions = int(policy.action_space.n) if self.discrete else None

    def _actions(self, actions: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return actions.reshape(actions.shape[0]).long()
        return actions if actions.is_floating_point() else actions.float()  # as SB3's own buffer stores them

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.policy.get_distribution(obs).log_prob(self._actions(actions))

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values, log_prob, entropy = self.policy.evaluate_actions(obs, self._actions(actions))
        if entropy is None:
            raise ValueError("this SB3 distribution has no analytic entropy; pass ent_coef=0")
        return log_prob, entropy, values.flatten()

    def policy_parameters(self) -> list[nn.Parameter]:
        p = self.policy
        pi_extractor = getattr(p, "pi_features_extractor", p.features_extractor)
        vf_extractor = getattr(p, "vf_features_extractor", p.features_extractor)
        mlp = getattr(p, "mlp_extractor", None)
        value_side = [getattr(p, "value_net", None), getattr(mlp, "value_net", None)]
        if vf_extractor is not pi_extractor:
            value_side.append(vf_extractor)
        policy_side = [pi_extractor, getattr(mlp, "policy_net", None), getattr(p, "action_net", None)]

        def ids(modules: list[Any]) -> set[int]:
            return {id(q) for m in modules if isinstance(m, nn.Module) for q in m.parameters()}

        value_only = ids(value_side) - ids(policy_side)
        return [q for q in p.parameters() if q.requires_grad and id(q) not in value_only]


# -- reading SB3's buffer -------------------------------------------------------------------------
def _flat(buffer: RolloutBuffer, name: str) -> np.ndarray:
    """A buffer field in flat env-major order (SB3's ``get()`` order), whichever state it is in."""
    array = getattr(buffer, name)
    return array if buffer.generator_ready else buffer.swap_and_flatten(array)


def _records(buffer: RolloutBuffer, adapter: SB3PolicyAdapter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(obs, actions, raw advantages) of every record, flat env-major, on the policy's device."""
    if not isinstance(buffer, RolloutBuffer) or isinstance(buffer.observations, dict):
        raise ValueError(f"expected an SB3 RolloutBuffer with array observations, got {type(buffer).__name__}")
    if not buffer.full:
        raise ValueError("the rollout buffer is not full: collect a rollout (and compute GAE) first")
    device = adapter.policy.device
    n = buffer.buffer_size * buffer.n_envs
    obs = torch.as_tensor(_flat(buffer, "observations"), device=device)
    actions = torch.as_tensor(_flat(buffer, "actions").astype(np.float32, copy=False), device=device)
    if adapter.discrete:
        actions = actions.reshape(n).long()
    advantages = torch.as_tensor(_flat(buffer, "advantages").reshape(n), device=device)
    return obs, actions, advantages


POLICY_TOLERANCE = 1e-4
"""The largest |logged log-prob - the policy's log-prob| of a record that ``attribute`` takes as the
same policy (float32 rounding between SB3's rollout and a recomputation is ~1e-6)."""


def _check_collected_by(adapter: SB3PolicyAdapter, buffer: RolloutBuffer, obs: torch.Tensor,
                        actions: torch.Tensor) -> None:
    """``ValueError`` unless the adapter's policy gives the buffer's logged log-probs: it collected it."""
    logged = torch.as_tensor(_flat(buffer, "log_probs").reshape(len(obs)), device=obs.device)
    with torch.no_grad():
        gap = float((adapter.log_prob(obs, actions).double() - logged.double()).abs().max())
    if not gap <= POLICY_TOLERANCE:
        raise ValueError(f"the model's policy is not the one that collected this rollout buffer (its log-probs differ "
                         f"from the logged ones by up to {gap:.3g}): after learn() the policy has been updated on it. "
                         "Attribute at the end of a rollout (a callback's _on_rollout_end, as InfluenceFilterCallback "
                         "does), or pass check_policy=False to score at the current policy anyway")


def next_permutation(n: int) -> np.ndarray:
    """The permutation SB3's next ``RolloutBuffer.get()`` will draw (``np.random.permutation(n)``
    on NumPy's global state), computed on a copy of that state: nothing is consumed."""
    peek = np.random.RandomState()
    peek.set_state(np.random.get_state())
    return peek.permutation(n)


@contextmanager
def _global_rng_untouched(device: torch.device) -> Iterator[None]:
    """Leave NumPy's and torch's global random states exactly as they were (SB3 samples actions
    and minibatches from them, so scoring must not shift them)."""
    np_state = np.random.get_state()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        np.random.set_state(np_state)


def _resolve_norm(model: Any, advantage_norm: str) -> str:
    if advantage_norm not in ADVANTAGE_NORMS:
        raise ValueError(f"advantage_norm must be one of {ADVANTAGE_NORMS}, got {advantage_norm!r}")
    if advantage_norm == "auto":
        return "chunk" if getattr(model, "normalize_advantage", False) else "none"
    return advantage_norm


def _resolve_target(target: str | Target) -> Target:
    if isinstance(target, Target):
        return target
    if target == "return":
        return ReturnTarget()
    raise ValueError(f"target must be 'return' or an rlinfluence.influence.Target (e.g. ActionTarget), got {target!r}")


def attribute(
    model: Any,
    rollout_buffer: RolloutBuffer | None = None,
    target: str | Target = "return",
    *,
    advantage_norm: str = DEFAULT_ADVANTAGE_NORM,
    chunk_size: int | None = None,
    order: np.ndarray | torch.Tensor | None = None,
    ent_coef: float | None = None,
    check_policy: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """Snapshot influence of every record of ``rollout_buffer`` (default ``model.rollout_buffer``)
    on ``target``, shape ``[n_steps * n_envs]``, CPU, in SB3's flat env-major order (record
    ``env * n_steps + step``). Positive = helpful, negative = harmful.

    ``model``: an SB3 PPO (or A2C) model; its policy must still be the one that collected the
    buffer. ``target``: ``"return"`` (``ReturnTarget()``, the buffer as its own validation set)
    or any ``rlinfluence.influence.Target`` (e.g. ``ActionTarget(obs, action)``).

    ``advantage_norm``: ``"chunk"`` (the default of every entry point, IIF's:
    ``rlinfluence.influence.DEFAULT_ADVANTAGE_NORM``) normalises within chunks of ``chunk_size``
    (default ``model.batch_size``) records taken in ``order``, by default the permutation SB3's
    next ``get()`` will draw (``next_permutation``), i.e. the first-epoch minibatches of the
    unfiltered update (docs/method.md, section 2.2); ``"auto"`` = ``"chunk"`` if ``model.normalize_advantage`` else
    ``"none"``, matching the loss SB3 trains; ``"batch"``, ``"none"`` as in
    ``snapshot_influence``. ``ent_coef`` (default ``model.ent_coef``) adds the entropy term of
    SB3's loss. Other keyword arguments go to ``snapshot_influence``. NumPy's and torch's global
    random states are left untouched.

    ``check_policy``: refuse (``ValueError``) a buffer whose logged log-probs the model's policy
    does not give (by more than ``POLICY_TOLERANCE``): after ``learn()`` the policy has been updated
    on ``model.rollout_buffer``, and scoring at theta(k+1) would silently answer another question.
    """
    buffer = model.rollout_buffer if rollout_buffer is None else rollout_buffer
    adapter = SB3PolicyAdapter(model.policy)
    obs, actions, advantages = _records(buffer, adapter)
    n = len(advantages)
    if check_policy:
        _check_collected_by(adapter, buffer, obs, actions)
    norm = _resolve_norm(model, advantage_norm)
    chunk = chunk_size or getattr(model, "batch_size", None) or n
    if norm == "chunk" and order is None:
        order = next_permutation(n)
    coef = float(getattr(model, "ent_coef", 0.0)) if ent_coef is None else float(ent_coef)
    with _global_rng_untouched(adapter.policy.device):
        if order is not None:
            index = torch.as_tensor(np.asarray(order), dtype=torch.long)
            if index.shape != (n,) or not torch.equal(torch.sort(index).values, torch.arange(n)):
                raise ValueError(f"order must be a permutation of range({n})")
            index = index.to(obs.device)
            obs, actions, advantages = obs[index], actions[index], advantages[index]
        scores = snapshot_influence(
            adapter, obs, actions, advantages, target=_resolve_target(target),
            advantage_norm=norm, chunk_size=chunk, ent_coef=coef, **kwargs,
        ).detach()
        if order is not None:
            scores = torch.empty_like(scores).index_copy_(0, index, scores)
    return scores.cpu()


# -- the filtered buffer --------------------------------------------------------------------------
class FilteredRolloutBuffer(RolloutBuffer):
    """SB3's ``RolloutBuffer`` with a keep mask: ``get()`` trains on kept records only.

    Pass it as ``PPO(..., rollout_buffer_class=FilteredRolloutBuffer)``. ``set_keep_mask(keep)``
    (a bool array ``[n_steps * n_envs]`` in flat env-major order; cleared by ``reset()``, i.e.
    every rollout) restricts every epoch's minibatches to the kept records: a fresh permutation
    of the kept records per ``get()`` call, full minibatches only (the remainder is dropped).
    With no mask, or every record kept, ``get()`` is exactly SB3's -- same permutation from
    ``np.random``, same minibatches (a last partial one included) -- so PPO is reproduced
    bit-for-bit.

    ``minibatch_indices``: since the last ``reset()``, one list per ``get()`` call (one PPO
    epoch) of the record indices of each minibatch yielded, in order. (With ``target_kl`` early
    stopping, PPO skips the update of the last minibatch yielded.)
    """

    keep: np.ndarray | None
    minibatch_indices: list[list[np.ndarray]]

    def reset(self) -> None:
        super().reset()
        self.keep = None
        self.minibatch_indices = []

    def set_keep_mask(self, keep: np.ndarray | torch.Tensor | None) -> None:
        """Train on the records where ``keep`` is True (``None``: all of them) until ``reset()``."""
        if keep is None:
            self.keep = None
            return
        keep = keep.detach().cpu().numpy() if isinstance(keep, torch.Tensor) else np.asarray(keep)
        n = self.buffer_size * self.n_envs
        if keep.dtype != np.bool_ or keep.shape != (n,):
            raise ValueError(f"keep must be a bool array of shape ({n},), got {keep.dtype} {keep.shape}")
        if not keep.any():
            raise ValueError("keep mask keeps no record")
        self.keep = keep.copy()

    def get(self, batch_size: int | None = None) -> Iterator[Any]:
        assert self.full, ""
        n = self.buffer_size * self.n_envs
        kept = np.arange(n) if self.keep is None else np.flatnonzero(self.keep)
        # kept == arange(n) when nothing is filtered: the same draw and result as SB3's get()
        indices = kept[np.random.permutation(len(kept))]
        if not self.generator_ready:
            for name in ("observations", "actions", "values", "log_probs", "advantages", "returns"):
                self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
            self.generator_ready = True
        if batch_size is None:
            batch_size = len(indices)
        stop = len(indices) if len(kept) == n else len(indices) // batch_size * batch_size
        epoch: list[np.ndarray] = []
        self.minibatch_indices.append(epoch)
        for start in range(0, stop, batch_size):
            batch = indices[start : start + batch_size]
            epoch.append(batch)
            yield self._get_samples(batch)


# -- the IIF callback -----------------------------------------------------------------------------
class InfluenceFilterCallback(BaseCallback):
    """IIF for SB3's PPO: drop the most harmful records of every rollout before ``train()``.

    In ``_on_rollout_end`` (after GAE, before ``train()``) the callback scores the rollout buffer
    with ``attribute`` and keeps all but the ``iif_drop_count(scores, drop_pct, drop_mode)``
    lowest-scoring records (``rlinfluence.filters``: ``neg-bottom`` drops floor(p% of the
    negative records), ``bottom`` floor(p% of all), ``neg`` every negative one; ``drop_pct=0``
    with ``neg-bottom``/``bottom`` scores but keeps everything). At least one full minibatch is
    always kept (``guard_minibatch``). Needs
    ``PPO(..., rollout_buffer_class=FilteredRolloutBuffer)``.

    Logged through SB3's logger each rollout: ``influence/kept_fraction``, ``influence/n_negative``,
    ``influence/n_dropped``, ``influence/minibatch_guard``, ``influence/skipped``,
    ``influence/seconds`` (scoring and masking time). ``skipped = 1``: the return target had zero
    gradient (every advantage exactly 0, e.g. constant rewards and values), every score is 0,
    every record is kept and a RuntimeWarning says why; training goes on as plain SB3.
    On ``MultiDiscrete`` / ``MultiBinary`` action spaces the callback warns once (see
    ``docs/sb3.md``: IIF measured worse than random drops there). ``history`` keeps the same numbers per rollout; ``scores``, ``keep`` and
    ``order`` (the chunk order of ``advantage_norm="chunk"``) are the last rollout's.
    ``advantage_norm``, ``chunk_size``, ``ent_coef`` and other keyword arguments are
    ``attribute``'s.
    """

    def __init__(
        self,
        target: str | Target = "return",
        drop_mode: str = "neg-bottom",
        drop_pct: float = 12.5,
        advantage_norm: str = DEFAULT_ADVANTAGE_NORM,
        chunk_size: int | None = None,
        ent_coef: float | None = None,
        verbose: int = 0,
        **score_kwargs: Any,
    ):
        super().__init__(verbose)
        if isinstance(drop_pct, bool) or not isinstance(drop_pct, (int, float)) or not 0 <= drop_pct <= 100:
            raise ValueError(f"drop_pct must be in [0, 100], got {drop_pct!r}")
        iif_drop_count(torch.zeros(1), drop_pct, drop_mode)  # validates drop_mode
        _resolve_target(target)
        if advantage_norm not in ADVANTAGE_NORMS:
            raise ValueError(f"advantage_norm must be one of {ADVANTAGE_NORMS}, got {advantage_norm!r}")
        self.target, self.drop_mode, self.drop_pct = target, drop_mode, drop_pct
        self.advantage_norm, self.chunk_size, self.ent_coef = advantage_norm, chunk_size, ent_coef
        self.score_kwargs = score_kwargs
        self.history: list[dict[str, float]] = []
        self.scores: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.order: np.ndarray | None = None
        self._warned_joint_actions = False

    def _init_callback(self) -> None:
        if not isinstance(self.model.rollout_buffer, FilteredRolloutBuffer):
            raise TypeError(
                "InfluenceFilterCallback needs the model built with "
                "rollout_buffer_class=FilteredRolloutBuffer (from rlinfluence.integrations.sb3), "
                f"got {type(self.model.rollout_buffer).__name__}"
            )
        space = self.model.action_space
        if isinstance(space, JOINT_ACTION_SPACES) and self.drop_pct > 0 and not self._warned_joint_actions:
            self._warned_joint_actions = True
            warnings.warn(
                f"InfluenceFilterCallback on a {type(space).__name__} action space: scores are exact, but a "
                "record is the whole joint action and IIF learned worse than dropping as many records at "
                "random on SB3's identity tasks (docs/sb3.md, 'Multi-dimensional discrete actions')",
                UserWarning, stacklevel=2,
            )

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        start = time.perf_counter()
        buffer = self.model.rollout_buffer
        n = buffer.buffer_size * buffer.n_envs
        norm = _resolve_norm(self.model, self.advantage_norm)
        self.order = next_permutation(n) if norm == "chunk" else None
        context = FilterContext(policy=self.model.policy, round=len(self.history),
                                batch_size=getattr(self.model, "batch_size", None) or n)
        try:
            scores = attribute(
                self.model, buffer, self.target, advantage_norm=norm, chunk_size=self.chunk_size,
                order=self.order, ent_coef=self.ent_coef, **self.score_kwargs,
            )
        except ZeroTargetGradient as exc:  # no attribution signal: every score is 0, keep everything
            warnings.warn(f"InfluenceFilterCallback: rollout {context.round} kept every record "
                          f"(influence/skipped = 1): {exc}", RuntimeWarning, stacklevel=2)
            scores, keep = torch.zeros(n), torch.ones(n, dtype=torch.bool)
            context.stats.update(minibatch_guard=0.0, skipped=1.0)
        else:
            n_drop = iif_drop_count(scores, self.drop_pct, self.drop_mode)
            keep = guard_minibatch(drop_lowest(scores, n_drop), scores, context)
            context.stats["skipped"] = 0.0
        buffer.set_keep_mask(keep)
        self.scores, self.keep = scores, keep
        stats = {
            "kept_fraction": float(keep.float().mean()),
            "n_negative": float((scores < 0).sum()),
            "n_dropped": float(n - int(keep.sum())),
            "minibatch_guard": context.stats["minibatch_guard"],
            "skipped": context.stats["skipped"],
            "seconds": time.perf_counter() - start,
        }
        for key, value in stats.items():
            self.logger.record(f"influence/{key}", value)
        self.history.append(stats)
        if self.verbose >= 1:
            print(f"influence: kept {stats['kept_fraction']:.3f} of {n} records "
                  f"({int(stats['n_negative'])} negative) in {stats['seconds']:.3f} s")


# -- quarantine -----------------------------------------------------------------------------------
class TimeLimitEnds:
    """The env's own rewards and the time-limit ends of a rollout, recorded step by step.

    SB3's ``collect_rollouts`` adds gamma * V(final observation) to the reward of a step that a time
    limit cut, in place, *after* the callbacks' ``on_step``, and stores only the sum, with every end
    alike in ``episode_starts``. Recorded at ``on_step`` (``record(self.locals)``), the env's reward
    and which ends were time-limit ends are kept apart, so that no family reads the bootstrap as a
    reward (on CartPole it is the largest reward of a run)."""

    def __init__(self) -> None:
        self._rewards: list[np.ndarray] = []
        self._truncated: list[np.ndarray] = []

    def record(self, step_locals: dict[str, Any]) -> None:
        """One step of ``collect_rollouts``'s locals (``rewards``, ``dones``, ``infos``)."""
        self._rewards.append(np.asarray(step_locals["rewards"], dtype=np.float64).copy())  # SB3 adds in place later
        self._truncated.append(np.array([bool(done) and info.get("terminal_observation") is not None
                                         and bool(info.get("TimeLimit.truncated", False))
                                         for done, info in zip(step_locals["dones"], step_locals["infos"],
                                                               strict=True)]))

    def take(self, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """(env rewards, truncated), each [n_steps, n_envs], of the rollout just collected (its last
        ``n_steps`` steps: a rollout that a callback stopped leaves steps before it); then empty."""
        if len(self._rewards) < n_steps:
            raise RuntimeError(f"recorded {len(self._rewards)} steps of a rollout of {n_steps}: pass every on_step "
                               "of the rollout to record()")
        out = np.stack(self._rewards[-n_steps:]), np.stack(self._truncated[-n_steps:])
        self._rewards, self._truncated = [], []
        return out


def as_rollout_buffer(model: Any, buffer: RolloutBuffer, round_index: int, episode_offsets: np.ndarray,
                      time_limits: tuple[np.ndarray, np.ndarray] | None = None) -> OurRolloutBuffer:
    """SB3's rollout buffer (after GAE) as rlinfluence's ``RolloutBuffer`` of round ``round_index``:
    the same records in ``[n_steps, n_envs]`` layout; an episode ends where the next step starts one;
    episode ids count from ``episode_offsets`` [n_envs]; ``last_values`` are V of the model's last
    observations. With ``time_limits`` (``TimeLimitEnds.take``: the env's rewards and the time-limit
    ends), a time-limit end is ``truncated`` with its bootstrap V(final observation) in
    ``final_values`` = (SB3's reward - the env's) / gamma, and ``rewards`` are the env's; without
    them, every end is ``terminated`` and the reward carries SB3's bootstrap."""
    n_steps, n_envs = buffer.buffer_size, buffer.n_envs

    def layout(name: str, per_record: bool = False) -> torch.Tensor:
        """``[n_steps, n_envs, ...]`` (``per_record``: one number per record, ``[n_steps, n_envs]``)."""
        flat = _flat(buffer, name)
        out = torch.as_tensor(flat.reshape(n_envs, n_steps, *flat.shape[1:]).swapaxes(0, 1).copy())
        return out.reshape(n_steps, n_envs) if per_record else out

    starts = layout("episode_starts", True).bool()
    ends = torch.cat([starts[1:], torch.as_tensor(np.asarray(model._last_episode_starts), dtype=torch.bool)[None]])
    discrete = isinstance(model.action_space, spaces.Discrete)
    actions = layout("actions", discrete).long() if discrete else layout("actions")
    with torch.no_grad():
        last_obs = obs_as_tensor(model._last_obs, model.policy.device)
        last_values = model.policy.predict_values(last_obs).flatten().cpu().float()
    episode_ids = torch.as_tensor(episode_offsets)[None] + torch.cumsum(starts.long(), dim=0) - starts[0].long()[None]
    rewards, truncated = layout("rewards", True).double(), torch.zeros_like(ends)
    final_values = torch.zeros(n_steps, n_envs, dtype=torch.float64)
    if time_limits is not None:
        env_rewards, truncated = torch.as_tensor(time_limits[0]), torch.as_tensor(time_limits[1]) & ends
        final_values = torch.where(truncated, (rewards - env_rewards) / model.gamma, final_values)
        rewards = env_rewards
    out = OurRolloutBuffer(round=round_index, obs=layout("observations"), actions=actions,
                           rewards=rewards.float(), terminated=ends & ~truncated,
                           truncated=truncated, logp=layout("log_probs", True).float(),
                           values=layout("values", True).float(),
                           final_values=final_values.float(), episode_ids=episode_ids.long(),
                           last_values=last_values)
    out.advantages = layout("advantages", True).float()
    out.returns = layout("returns", True).float()
    return out


class QuarantineCallback(BaseCallback):
    """``--filter quarantine`` for SB3's PPO: before every ``train()``, drop every record of the vec
    envs that the sources test flags over the last ``window`` rollouts (``rlinfluence.filters.
    QuarantineFilter``: the consistency checks and the reward, value and advantage statistics,
    the audit's tests at ``alpha`` across envs x families; the last ``trusted_envs`` envs are never
    tested), on SB3's stored observations. Needs ``PPO(..., rollout_buffer_class=FilteredRolloutBuffer)``.
    Logs ``quarantine/quarantined`` per rollout; ``history`` keeps each rollout's quarantined envs."""

    def __init__(self, window: int = 6, alpha: float = 0.01, trusted_envs: int = 0, verbose: int = 0):
        super().__init__(verbose)
        if window < 1 or not 0 < alpha < 1 or trusted_envs < 0:
            raise ValueError(f"window must be >= 1, alpha in (0, 1), trusted_envs >= 0; got {window}, {alpha}, "
                             f"{trusted_envs}")
        self.filter = QuarantineFilter(window, alpha, False, trusted_envs)
        self.history: list[list[int]] = []
        self._episodes: np.ndarray | None = None
        self._time_limits = TimeLimitEnds()

    def _init_callback(self) -> None:
        if not isinstance(self.model.rollout_buffer, FilteredRolloutBuffer):
            raise TypeError("QuarantineCallback needs the model built with rollout_buffer_class=FilteredRolloutBuffer "
                            f"(from rlinfluence.integrations.sb3), got {type(self.model.rollout_buffer).__name__}")
        if self.model.n_envs - self.filter.trusted_envs < MIN_SOURCES:
            raise ValueError(f"QuarantineCallback compares each env with 2 or more others: it needs at least "
                             f"{MIN_SOURCES} untrusted envs, got {self.model.n_envs} - {self.filter.trusted_envs}")

    def _on_step(self) -> bool:
        self._time_limits.record(self.locals)
        return True

    def _on_rollout_end(self) -> None:
        model, buffer = self.model, self.model.rollout_buffer
        if self._episodes is None:
            self._episodes = np.zeros(buffer.n_envs, dtype=np.int64)
        ours = as_rollout_buffer(model, buffer, len(self.history), self._episodes,
                                 self._time_limits.take(buffer.buffer_size))
        self._episodes = ours.episode_ids[-1].numpy() + 1
        context = FilterContext(SB3PolicyAdapter(model.policy), len(self.history), model.batch_size, model.gamma)
        with _global_rng_untouched(model.policy.device):
            keep = self.filter(ours, context)
        buffer.set_keep_mask(keep.numpy())
        quarantined = [int(s) for s in str(context.stats["quarantined_sources"]).split()]
        self.history.append(quarantined)
        self.logger.record("quarantine/quarantined", float(len(quarantined)))
        if self.verbose >= 1:
            print(f"quarantine: envs {quarantined or 'none'}")


# -- audits ---------------------------------------------------------------------------------------
AUDIT_SCORERS = ("influence", "dtv", "negative-advantage", "abs-advantage", "reward-extremes", "random")
"""The scorers of ``rlinfluence.analysis.audit`` an SB3 rollout can be scored with (tracin needs the
replayed optimiser steps, td-error the next values SB3 does not keep, influence-trusted trusted envs)."""


class AuditCallback(BaseCallback):
    """Writes the harm table ``rlinfluence audit`` reads, once per rollout (after GAE, before
    ``train()``, the policy still the one that collected it): one row per record in SB3's flat
    order with ``round`` (the rollout), ``source`` (the vec env index), ``episode`` (counted per
    env from SB3's ``episode_starts``), ``step``, ``trusted`` (False), ``corrupted`` (only with
    ``corrupted_envs``: the envs a benchmark knows are broken) and one harm column per scorer
    (higher = more harmful, as in ``rlinfluence.analysis.audit``): influence = minus
    ``attribute(model, buffer, advantage_norm="batch")``; dtv = minus the gradient alignment
    g_i . mean_j g_j; negative-advantage, abs-advantage and reward-extremes from the buffer;
    random seeded by the rollout. The files go to ``path/audit/scores/round_K.parquet``.
    NumPy's and torch's global random states are left untouched, so training is unchanged.
    """

    def __init__(self, path: str | Path, scorers: Sequence[str] = AUDIT_SCORERS, corrupted_envs: Sequence[int] = (),
                 verbose: int = 0):
        super().__init__(verbose)
        unknown = [s for s in scorers if s not in AUDIT_SCORERS]
        if unknown or not scorers:
            raise ValueError(f"unknown scorer {unknown[0] if unknown else None!r} for SB3 rollouts "
                             f"(choose from {', '.join(AUDIT_SCORERS)})")
        if not isinstance(path, str | os.PathLike):
            raise ValueError(f"path must be the run folder (a str or Path), got {path!r}")
        self.folder = Path(path) / AUDIT_SCORES
        not_index = [e for e in corrupted_envs if isinstance(e, bool) or not isinstance(e, numbers.Integral)]
        if not_index:
            raise ValueError(f"corrupted_envs holds {not_index[0]!r}: vec env indices are integers")
        self.scorers, self.corrupted_envs = tuple(scorers), tuple(int(e) for e in corrupted_envs)
        self.rounds = 0
        self._episodes: np.ndarray | None = None  # per env: episodes started so far
        self._time_limits = TimeLimitEnds()

    def _init_callback(self) -> None:
        n_envs = self.model.n_envs
        bad = [e for e in self.corrupted_envs if not 0 <= e < n_envs]
        if bad:
            raise ValueError(f"corrupted_envs holds {bad[0]}, not a vec env index of this model (0..{n_envs - 1})")
        for folder in (self.folder.parent, self.folder):  # audit/ and audit/scores/
            if folder.is_symlink():
                raise ValueError(f"{str(folder)!r} is a link (-> {os.readlink(folder)!r}): the score tables go into "
                                 "real folders only")
        # rounds this callback did not write (another training into the same folder) would be audited with its own
        others = sorted(f.name for f in self.folder.glob("round_*.parquet")
                        if not f.stem.removeprefix("round_").isdigit() or int(f.stem.removeprefix("round_")) >= self.rounds)
        if others:
            raise ValueError(f"{str(self.folder)!r} already holds {others[0]} from another training: an audit would mix "
                             "the two; give this training its own path")
        self.folder.mkdir(parents=True, exist_ok=True)

    def _on_step(self) -> bool:
        self._time_limits.record(self.locals)
        return True

    def _harm(self, name: str, buffer: RolloutBuffer, adapter: SB3PolicyAdapter, obs: torch.Tensor,
              actions: torch.Tensor, advantages: torch.Tensor, env_rewards: np.ndarray) -> np.ndarray:
        try:
            if name == "influence":
                return -attribute(self.model, buffer, advantage_norm="batch").double().numpy()
            if name == "dtv":
                return -gradient_alignment(adapter, obs, actions, advantages).detach().cpu().double().numpy()
        except ZeroTargetGradient:
            return np.zeros(len(advantages))
        a = advantages.cpu().double().numpy()
        if name == "negative-advantage":
            return -a
        if name == "abs-advantage":
            return np.abs(a)
        if name == "reward-extremes":  # the env's rewards, without SB3's time-limit bootstrap
            return np.abs(env_rewards - env_rewards.mean())
        checksum = zlib.crc32(_flat(buffer, "actions").tobytes())
        return np.random.default_rng([self.rounds, checksum]).random(len(a))

    def _on_rollout_end(self) -> None:
        import pandas as pd

        buffer = self.model.rollout_buffer
        adapter = SB3PolicyAdapter(self.model.policy)
        n_steps, n_envs = buffer.buffer_size, buffer.n_envs
        starts = np.asarray(buffer.episode_starts, dtype=np.int64)  # [n_steps, n_envs]
        if self._episodes is None:
            self._episodes = np.zeros(n_envs, dtype=np.int64)
            starts[0] = 0  # the first step of training starts episode 0 of every env
        episode = self._episodes[None] + np.cumsum(starts, axis=0)  # [n_steps, n_envs]
        self._episodes = episode[-1]
        table = pd.DataFrame({"round": self.rounds, "source": np.repeat(np.arange(n_envs), n_steps),
                              "episode": episode.T.reshape(-1), "step": np.tile(np.arange(n_steps), n_envs),
                              "trusted": False})
        if self.corrupted_envs:
            table["corrupted"] = table["source"].isin(self.corrupted_envs)
        obs, actions, advantages = _records(buffer, adapter)
        env_rewards = self._time_limits.take(n_steps)[0].T.reshape(-1)  # flat env-major, as the table
        with _global_rng_untouched(adapter.policy.device):
            for name in self.scorers:
                table[name] = self._harm(name, buffer, adapter, obs, actions, advantages, env_rewards)
        atomic_write(self.folder / f"round_{self.rounds:06d}.parquet", lambda p: table.to_parquet(p, index=False))
        self.rounds += 1
