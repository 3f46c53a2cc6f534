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

The audit and the quarantine of SB3's vec envs (``AuditCallback``, ``QuarantineCallback``) are in
``rlinfluence.integrations.sb3_audit``; the run writer (``RunDirectoryCallback``) in ``sb3_rundir``.

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

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
    drop_lowest,
    guard_minibatch,
    iif_drop_count,
)
from rlinfluence.influence import (
    DEFAULT_ADVANTAGE_NORM,
    ReturnTarget,
    Target,
    ZeroTargetGradient,
    snapshot_influence,
)

__all__ = ["FilteredRolloutBuffer", "InfluenceFilterCallback", "SB3PolicyAdapter", "TimeLimitEnds", "as_rollout_buffer",
           "attribute", "flat_field", "global_rng_untouched", "next_permutation", "records_of"]

ADVANTAGE_NORMS = ("auto", "chunk", "batch", "none")
JOINT_ACTION_SPACES = (spaces.MultiDiscrete, spaces.MultiBinary)
"""Action spaces where one record is a joint action over several dimensions (IIF warns)."""


# -- the policy adapter ---------------------------------------------------------------------------
class SB3PolicyAdapter(nn.Module):
    """SB3's ``ActorCriticPolicy`` behind the interface our scorers use.

    - ``log_prob(obs, actions) -> [N]``: ``policy.get_distribution(obs).log_prob(actions)`` (the
      actor path only; SB3's own observation preprocessing, e.g. images / 255);
    - ``evaluate_actions(obs, actions) -> (log_prob, entropy, value)`` (our order, not SB3's);
    - ``action_log_probs(obs) -> [N, n_actions]`` (Discrete only): every action's log-prob;
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

    def action_log_probs(self, obs: torch.Tensor) -> torch.Tensor:
        """log pi(a|s) of every action of a Discrete space, [N, n_actions] (column a equals ``log_prob(obs, a)``)."""
        if not self.discrete:
            raise ValueError(f"action_log_probs needs a Discrete action space, not {self.policy.action_space}")
        return self.policy.get_distribution(obs).distribution.logits

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
def flat_field(buffer: RolloutBuffer, name: str) -> np.ndarray:
    """A buffer field in flat env-major order (SB3's ``get()`` order), whichever state it is in."""
    array = getattr(buffer, name)
    return array if buffer.generator_ready else buffer.swap_and_flatten(array)


def records_of(buffer: RolloutBuffer, adapter: SB3PolicyAdapter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(obs, actions, raw advantages) of every record, flat env-major, on the policy's device."""
    if not isinstance(buffer, RolloutBuffer) or isinstance(buffer.observations, dict):
        raise ValueError(f"expected an SB3 RolloutBuffer with array observations, got {type(buffer).__name__}")
    if not buffer.full:
        raise ValueError("the rollout buffer is not full: collect a rollout (and compute GAE) first")
    device = adapter.policy.device
    n = buffer.buffer_size * buffer.n_envs
    obs = torch.as_tensor(flat_field(buffer, "observations"), device=device)
    actions = torch.as_tensor(flat_field(buffer, "actions").astype(np.float32, copy=False), device=device)
    if adapter.discrete:
        actions = actions.reshape(n).long()
    advantages = torch.as_tensor(flat_field(buffer, "advantages").reshape(n), device=device)
    return obs, actions, advantages


POLICY_TOLERANCE = 1e-4
"""The largest |logged log-prob - the policy's log-prob| of a record that ``attribute`` takes as the
same policy (float32 rounding between SB3's rollout and a recomputation is ~1e-6)."""


def _check_collected_by(adapter: SB3PolicyAdapter, buffer: RolloutBuffer, obs: torch.Tensor,
                        actions: torch.Tensor) -> None:
    """``ValueError`` unless the adapter's policy gives the buffer's logged log-probs: it collected it."""
    logged = torch.as_tensor(flat_field(buffer, "log_probs").reshape(len(obs)), device=obs.device)
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
def global_rng_untouched(device: torch.device) -> Iterator[None]:
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
    obs, actions, advantages = records_of(buffer, adapter)
    n = len(advantages)
    if check_policy:
        _check_collected_by(adapter, buffer, obs, actions)
    norm = _resolve_norm(model, advantage_norm)
    chunk = chunk_size or getattr(model, "batch_size", None) or n
    if norm == "chunk" and order is None:
        order = next_permutation(n)
    coef = float(getattr(model, "ent_coef", 0.0)) if ent_coef is None else float(ent_coef)
    with global_rng_untouched(adapter.policy.device):
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
        dones, infos = step_locals["dones"], list(step_locals["infos"])
        infos += [{}] * (len(dones) - len(infos))  # a VecEnv may give fewer infos than envs: no time limit known
        self._truncated.append(np.array([bool(done) and info.get("terminal_observation") is not None
                                         and bool(info.get("TimeLimit.truncated", False))
                                         for done, info in zip(dones, infos, strict=False)]))

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
                      time_limits: tuple[np.ndarray, np.ndarray] | None = None, obs: torch.Tensor | None = None
                      ) -> OurRolloutBuffer:
    """SB3's rollout buffer (after GAE) as rlinfluence's ``RolloutBuffer`` of round ``round_index``:
    the same records in ``[n_steps, n_envs]`` layout; an episode ends where the next step starts one;
    episode ids count from ``episode_offsets`` [n_envs]; ``last_values`` are V of the model's last
    observations. With ``time_limits`` (``TimeLimitEnds.take``: the env's rewards and the time-limit
    ends), a time-limit end is ``truncated`` with its bootstrap V(final observation) in
    ``final_values`` = (SB3's reward - the env's) / gamma, and ``rewards`` are the env's; without
    them, every end is ``terminated`` and the reward carries SB3's bootstrap. ``obs``: the records'
    observations as rlinfluence's policy takes them, ``[n_steps, n_envs, ...]`` (default: the buffer's)."""
    n_steps, n_envs = buffer.buffer_size, buffer.n_envs

    def layout(name: str, per_record: bool = False) -> torch.Tensor:
        """``[n_steps, n_envs, ...]`` (``per_record``: one number per record, ``[n_steps, n_envs]``)."""
        flat = flat_field(buffer, name)
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
    out = OurRolloutBuffer(round=round_index, obs=layout("observations") if obs is None else obs, actions=actions,
                           rewards=rewards.float(), terminated=ends & ~truncated,
                           truncated=truncated, logp=layout("log_probs", True).float(),
                           values=layout("values", True).float(),
                           final_values=final_values.float(), episode_ids=episode_ids.long(),
                           last_values=last_values)
    out.advantages = layout("advantages", True).float()
    out.returns = layout("returns", True).float()
    return out
