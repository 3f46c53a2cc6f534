"""Per-record attribution tables (written as Parquet), their console view and their HTML view.

In HTML, records of a run trained with ``--save-buffers --save-frames`` are shown as cards: the
record's rendered frame with its action, advantage and score, and the strip of frames around it
in its episode (``STRIP_WIDTH`` steps either side); for a round without frames the section says
how to get them (``rlinfluence.frames.HOW_TO_SAVE``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.frames import HOW_TO_SAVE, png, record_strip
from rlinfluence.sections import FrameCard, Gallery, Section, Table

_MAX_OBS_VALUES = 64  # larger observations (images) are summarised, not stored in the table


# MiniGrid's object codes (minigrid.core.constants.OBJECT_TO_IDX, a fixed part of its observation
# format; the tests compare them with minigrid's): the ones a record's view is described by.
_MINIGRID_EMPTY, _MINIGRID_GOAL, _MINIGRID_MAX = 1, 8, 10
_MINIGRID_NAMES = {0: "unseen", 2: "wall", 3: "floor", 4: "door", 5: "key", 6: "ball", 7: "box", 8: "goal",
                   9: "lava", 10: "agent"}


def _minigrid_view(image: np.ndarray) -> str | None:
    """A MiniGrid egocentric view (width x height x (object, colour, state), the agent at the
    bottom row's centre facing up) in words: where the goal is from the agent, and what is
    straight ahead; ``None`` for an image that is not such a view. The agent's cell in the grid
    is not part of the observation, so the view is what a record can show."""
    if not (image.shape[0] == image.shape[1] and image.shape[0] % 2 == 1 and image.shape[2] == 3):
        return None
    objects = image[..., 0]
    if not np.issubdtype(objects.dtype, np.integer) or objects.min() < 0 or objects.max() > _MINIGRID_MAX:
        return None
    size, centre = image.shape[0], image.shape[0] // 2
    places = []
    for x, y in zip(*np.nonzero(objects == _MINIGRID_GOAL), strict=True):
        ahead, side = size - 1 - int(y), int(x) - centre
        sideways = f", {abs(side)} {'right' if side > 0 else 'left'}" if side else ""
        places.append(f"goal {ahead} ahead{sideways}")
    column = objects[centre, size - 2::-1]  # the cells straight ahead, nearest first
    blocked = np.flatnonzero(column != _MINIGRID_EMPTY)
    front = (f"{_MINIGRID_NAMES.get(int(column[blocked[0]]), 'object')} {int(blocked[0]) + 1} ahead"
             if len(blocked) else f"open {size - 1} ahead")
    parts = places or ["no goal in view"]
    if not front.startswith("goal"):  # a goal straight ahead is said once
        parts.append(front)
    return f"view {size}x{size}: {'; '.join(parts)}"


def _obs_summary(obs: np.ndarray) -> str:
    """An observation in words: a one-hot state as its index (and its cell, for a square grid such
    as FrozenLake's), a MiniGrid view by where the goal is and what is ahead, another image by its
    shape, a short vector by its values."""
    flat = obs.ravel()
    if flat.size > 1 and obs.ndim == 1 and np.count_nonzero(flat) == 1 and flat.max() == 1:
        state, width = int(np.flatnonzero(flat)[0]), int(round(flat.size ** 0.5))
        cell = f" (row {state // width}, col {state % width} of {width}x{width})" if width * width == flat.size else ""
        return f"state {state}{cell}"
    if obs.ndim == 3:
        return _minigrid_view(obs) or f"image {'x'.join(map(str, obs.shape))}"
    if obs.size <= 8:
        return "[" + ", ".join(f"{v:.3g}" for v in flat) + "]"
    return f"{'x'.join(map(str, obs.shape))} mean {obs.mean():.3g}"


def attribution_table(buffer: RolloutBuffer, scores: torch.Tensor) -> pd.DataFrame:
    """One row per record: id (round, env, step), episode, obs, action, reward, advantage,
    return, corrupted (the ground truth of a run trained with ``--corrupt``), score and rank
    (1 = most helpful)."""
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
        "corrupted": buffer.flat("corrupted").numpy() if buffer.corrupted.numel() else np.zeros(len(score), bool),
        "score": score,
    })
    if obs[0].size <= _MAX_OBS_VALUES:
        table.insert(5, "obs", list(obs.reshape(len(obs), -1).astype(np.float64)))
    table["rank"] = table["score"].rank(ascending=False, method="first").astype(int)
    return table


def print_records(table: pd.DataFrame, k: int, title: str) -> None:
    """Top-k and bottom-k records of ``attribution_table`` as console tables."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console()
    columns = ["rank", "round", "env", "step", "obs_summary", "action", "advantage", "score"]
    # proponents push the target up the most (score > 0 = training on them raises it), opponents down
    for name, rows in (("proponents (most helpful)", table.nsmallest(k, "rank")),
                       ("opponents (most harmful)", table.nlargest(k, "rank"))):
        view = RichTable(title=f"{title}: {name}")
        for column in columns:
            view.add_column(column, justify="left" if column == "obs_summary" else "right")
        for _, row in rows.iterrows():
            view.add_row(*[f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in columns])
        console.print(view)


# -- HTML: records with their frames ---------------------------------------------------------
FRAME_RECORDS = 8
"""records shown with their frames per group (top, bottom)"""
STRIP_WIDTH = 3


def action_text(action: object) -> str:
    """A discrete action as its integer, a continuous one as its values (3 significant digits)."""
    values = np.atleast_1d(np.asarray(action)).ravel()
    if values.dtype.kind in "iub":
        return ", ".join(str(int(v)) for v in values)
    return ", ".join(f"{float(v):.3g}" for v in values)


def record_cards(table: pd.DataFrame, indices: Sequence[int], frames: np.ndarray) -> list[FrameCard]:
    """Cards of the records ``indices`` (flat buffer indices = rows of ``attribution_table``)."""
    env_ids, episodes, steps = (table[column].to_numpy() for column in ("env", "episode", "step"))
    cards = []
    for i in (int(i) for i in indices):
        row = table.iloc[i]
        strip = record_strip(i, env_ids, episodes, steps, STRIP_WIDTH)
        cards.append(FrameCard(
            title=f"record {i} (env {row['env']}, step {row['step']}), rank {row['rank']} of {len(table)}",
            label=f"action {action_text(row['action'])}, advantage {row['advantage']:.3g}, "
                  f"score {row['score']:.3g}",
            frame=png(frames[i]), strip=[png(frames[j]) for j in strip],
            strip_steps=[int(steps[j]) for j in strip], current=int(np.flatnonzero(strip == i)[0]),
        ))
    return cards


def add_record_frames(section: Section, table: pd.DataFrame, frames: np.ndarray | None,
                      groups: Mapping[str, Sequence[int]]) -> None:
    """Append to ``section`` one gallery per group (caption -> flat indices, best shown first;
    the first ``FRAME_RECORDS`` are shown) or, if ``frames`` is None, how to get frames."""
    if frames is None:
        section.paragraphs.append(f"No frames of this round's records: {HOW_TO_SAVE}.")
        return
    for caption, indices in groups.items():
        shown = list(indices)[:FRAME_RECORDS]
        section.galleries.append(Gallery(f"{caption}: {len(shown)} records with their frames (red: the "
                                         f"record, around it its episode's steps)",
                                         record_cards(table, shown, frames)))


def attribution_section(table: pd.DataFrame, title: str, frames: np.ndarray | None, rows: int = 10) -> Section:
    """The ``attribute --html`` page of an ``attribution_table``: its top and bottom ``rows``
    records as tables and, with ``frames`` (flat order), as frames with their episode strips."""
    k = int(table["round"].iloc[0])
    section = Section(f"attribution_round_{k}", title)
    section.paragraphs.append("Every record of the round's buffer scored by its influence on the target; "
                              "positive = the record pushes the round's update towards the target.")
    order = table.sort_values("rank").index.to_numpy()
    top, bottom = order[:rows], order[::-1][:rows]
    add_record_frames(section, table, frames, {"Top (most helpful)": top, "Bottom (most harmful)": bottom})
    columns = ["rank", "env", "step", "episode", "obs_summary", "action", "advantage", "score"]
    for name, idx in (("Top", top), ("Bottom", bottom)):
        section.tables.append(Table(f"{name} {len(idx)} records", columns, [
            [action_text(v) if c == "action" else v.item() if isinstance(v, np.generic) else v
             for c, v in zip(columns, row, strict=True)] for row in table.iloc[idx][columns].itertuples(index=False)]))
    return section
