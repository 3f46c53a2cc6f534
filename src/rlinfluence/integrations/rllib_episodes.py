"""RLlib's episodes as rlinfluence's records, without Ray: each source's steps of an iteration in
order (``trajectories``), and its first records with the critic's values and GAE
(``source_records``); the parameter names of RLlib's default PPO module mapped onto rlinfluence's
``ActorCritic`` (``rllib_names``). ``rlinfluence.integrations.rllib`` calls them from RLlib's
Learner; an episode here is anything with RLlib's ``SingleAgentEpisode`` reads (``len``,
``get_observations``, ``get_actions``, ``get_rewards``, ``get_extra_model_outputs``,
``is_terminated``, ``is_truncated``, ``custom_data``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlinfluence.errors import UserError

__all__ = ["SOURCE_KEY", "SourceTrajectory", "rllib_names", "source_of", "source_records", "trajectories"]

SOURCE_KEY = "rlinfluence_source"
"""The key of an episode's ``custom_data`` that holds its (runner, sub-env)."""
_PARTS = (
    (re.compile(r"encoder\.actor_encoder\.net\.mlp\.(\d+)\.(weight|bias)"), r"actor.\1.\2"),
    (re.compile(r"encoder\.critic_encoder\.net\.mlp\.(\d+)\.(weight|bias)"), r"critic.\1.\2"),
    (re.compile(r"pi\.net\.mlp\.0\.(weight|bias)"), r"action_head.\1"),
    (re.compile(r"vf\.net\.mlp\.0\.(weight|bias)"), r"value_head.\1"),
)


def rllib_names(name: str) -> str | None:
    """RLlib's default PPO module's parameter name -> rlinfluence's ``ActorCritic`` name
    (``encoder.actor_encoder.net.mlp.2.weight`` -> ``actor.2.weight``, ``pi.net.mlp.0.bias`` ->
    ``action_head.bias``, ...); None for a name that does not map."""
    for pattern, ours in _PARTS:
        if pattern.fullmatch(name):
            return pattern.sub(ours, name)
    return None


def source_of(worker_index: int, env_index: int, envs_per_runner: int) -> int:
    """The run's source of sub-env ``env_index`` of env runner ``worker_index`` (1, 2, ... remote;
    0 the local runner, which samples only where there are no remote ones)."""
    return (max(worker_index, 1) - 1) * envs_per_runner + env_index


class SourceTrajectory:
    """One source's steps of an iteration, in order, across its episode chunks: ``obs`` [n, ...],
    ``actions``, ``logp``, ``rewards``, ``terminated``, ``truncated`` [n], and ``ends``: per chunk,
    (its last step's index, the observation after it: the final one of an episode or of the
    iteration's unfinished chunk)."""

    def __init__(self, chunks: Sequence[Any]):
        def cat(key: str) -> np.ndarray:
            return np.concatenate([np.asarray(_field(chunk, key)) for chunk in chunks])

        lengths = [len(chunk) for chunk in chunks]
        last = np.cumsum(lengths) - 1
        self.obs, self.actions, self.rewards = cat("obs"), cat("actions"), cat("rewards").astype(np.float64)
        self.logp = cat("logp")
        n = len(self.obs)
        self.terminated, self.truncated = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        self.terminated[last] = [bool(chunk.is_terminated) for chunk in chunks]
        self.truncated[last] = [bool(chunk.is_truncated) and not chunk.is_terminated for chunk in chunks]
        self.ends = [(int(i), np.asarray(chunk.get_observations(-1))) for i, chunk in zip(last, chunks, strict=True)]

    def __len__(self) -> int:
        return len(self.obs)


def _field(chunk: Any, key: str) -> Any:
    if key == "obs":
        return np.asarray(chunk.get_observations())[:-1]
    if key == "logp":
        return chunk.get_extra_model_outputs("action_logp")
    return getattr(chunk, f"get_{key}")()


def trajectories(episodes: Sequence[Any], n_sources: int, envs_per_runner: int) -> list[SourceTrajectory]:
    """Each source's ``SourceTrajectory`` of an iteration's episode chunks (in the order RLlib gives
    them, which is each sub-env's order in time); a source without steps is an error."""
    chunks: list[list[Any]] = [[] for _ in range(n_sources)]
    for episode in episodes:
        tag = episode.custom_data.get(SOURCE_KEY)
        if tag is None:
            raise UserError("an RLlib episode has no source tag: the env runners do not run rlinfluence's RunCallback "
                            "(build the algorithm with .callbacks(run_callback(...)))")
        source = source_of(*tag, envs_per_runner)
        if not 0 <= source < n_sources:
            raise UserError(f"an RLlib episode comes from runner {tag[0]}, sub-env {tag[1]}: outside the "
                            f"{n_sources} sources the run was built with")
        if len(episode):
            chunks[source].append(episode)
    empty = [s for s, c in enumerate(chunks) if not c]
    if empty:
        raise UserError(f"source {empty[0]} sent no steps this iteration: every env runner's sub-env must sample "
                        "in every iteration (a runner lost?)")
    return [SourceTrajectory(c) for c in chunks]




def source_records(run: SourceTrajectory, policy: torch.nn.Module, gamma: float, gae_lambda: float,
                   kept: int) -> dict[str, Any]:
    """One source's first ``kept`` records with the critic's values at theta(k) and GAE over its
    whole iteration (A_t = delta_t + gamma lambda A_{t+1} within a chunk, delta_t = r_t + gamma
    V(s_{t+1}) - V(s_t); a chunk's end bootstraps V(final observation) unless terminated)."""
    ends, finals = zip(*run.ends, strict=True)
    with torch.no_grad():
        values = policy.value(torch.as_tensor(run.obs, dtype=torch.float32)).double().numpy()
        final_values = policy.value(torch.as_tensor(np.stack(finals), dtype=torch.float32)).double().numpy()
    n = len(run)
    next_values = np.append(values[1:], 0.0)
    chunk_end = np.zeros(n, dtype=bool)
    chunk_end[list(ends)] = True
    bootstrap = np.where(run.terminated[list(ends)], 0.0, final_values)
    next_values[list(ends)] = bootstrap
    deltas = run.rewards + gamma * next_values - values
    advantages = np.zeros(n)
    running = 0.0
    for t in range(n - 1, -1, -1):
        running = deltas[t] + (0.0 if chunk_end[t] else gamma * gae_lambda * running)
        advantages[t] = running
    record_final = np.zeros(n)
    record_final[list(ends)] = np.where(run.truncated[list(ends)], final_values, 0.0)
    # V of the observation after the last kept record: the next record's (a new episode's first where
    # one ended), or the final observation of the iteration's unfinished chunk
    last_value = values[kept] if kept < n else final_values[-1]
    return {"obs": run.obs[:kept], "actions": run.actions[:kept], "logp": run.logp[:kept], "values": values[:kept],
            "rewards": run.rewards[:kept], "terminated": run.terminated[:kept], "truncated": run.truncated[:kept],
            "final_values": record_final[:kept], "advantages": advantages[:kept],
            "returns": (advantages + values)[:kept], "last_value": float(last_value)}
