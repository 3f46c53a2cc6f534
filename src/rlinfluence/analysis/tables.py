"""Per-record attribution tables (written as Parquet) and their console view."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from rlinfluence.buffer import RolloutBuffer

_MAX_OBS_VALUES = 64  # larger observations (images) are summarised, not stored in the table


def _obs_summary(obs: np.ndarray) -> str:
    if obs.size <= 8:
        return "[" + ", ".join(f"{v:.3g}" for v in obs.ravel()) + "]"
    return f"{'x'.join(map(str, obs.shape))} mean {obs.mean():.3g}"


def attribution_table(buffer: RolloutBuffer, scores: torch.Tensor) -> pd.DataFrame:
    """One row per record: id (round, env, step), episode, obs, action, reward, advantage,
    return, score and rank (1 = most helpful)."""
    ids = buffer.record_ids().numpy()
    obs = buffer.flat("obs").numpy()
    actions = buffer.flat("actions").numpy()
    score = scores.detach().double().numpy()
    table = pd.DataFrame({
        "round": ids[:, 0], "env": ids[:, 1], "step": ids[:, 2],
        "episode": buffer.flat("episode_ids").numpy(),
        "obs_summary": [_obs_summary(o) for o in obs],
        "action": list(actions) if actions.ndim > 1 else actions,
        "reward": buffer.flat("rewards").numpy(),
        "advantage": buffer.flat("advantages").numpy(),
        "return": buffer.flat("returns").numpy(),
        "score": score,
    })
    if obs[0].size <= _MAX_OBS_VALUES:
        table.insert(5, "obs", list(obs.reshape(len(obs), -1).astype(np.float64)))
    table["rank"] = table["score"].rank(ascending=False, method="first").astype(int)
    return table


def print_records(table: pd.DataFrame, k: int, title: str) -> None:
    """Top-k and bottom-k records of ``attribution_table`` as console tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    columns = ["rank", "round", "env", "step", "obs_summary", "action", "advantage", "score"]
    for name, rows in (("most helpful", table.nsmallest(k, "rank")), ("most harmful", table.nlargest(k, "rank"))):
        view = Table(title=f"{title}: {name}")
        for column in columns:
            view.add_column(column, justify="left" if column == "obs_summary" else "right")
        for _, row in rows.iterrows():
            view.add_row(*[f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in columns])
        console.print(view)
