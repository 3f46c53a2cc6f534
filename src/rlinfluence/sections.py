"""What every analysis returns: a ``Section`` (title, paragraphs, key figures, tables, PNG figures,
galleries of records with their frames) and its parts, with their JSON form.

The primitives the analyses and tables build on; ``rlinfluence.analysis.report`` saves sections
and renders them into a run's HTML report (one way: report builds on these, never the reverse).
"""

from __future__ import annotations

import base64
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class Table:
    caption: str
    columns: list[str]
    rows: list[list[Any]]


def _base64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


@dataclass
class FrameCard:
    """One record shown by its rendered frame (PNG) and the frames around it in its episode."""

    title: str
    """which record: rank, env, step"""
    label: str
    """what it is: action, advantage, score"""
    frame: bytes
    strip: list[bytes]
    """the frames of its episode's records around it, in step order"""
    strip_steps: list[int]
    """each strip frame's step in the round's buffer (of this env), not in its episode: an episode
    may have begun in an earlier round"""
    current: int
    """the record's position in ``strip``"""

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "label": self.label, "frame": _base64(self.frame),
                "strip": [_base64(png) for png in self.strip], "strip_steps": self.strip_steps,
                "current": self.current}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FrameCard:
        return cls(data["title"], data["label"], base64.b64decode(data["frame"]),
                   [base64.b64decode(png) for png in data["strip"]], list(data["strip_steps"]),
                   int(data["current"]))


@dataclass
class Gallery:
    caption: str
    cards: list[FrameCard]


@dataclass
class Section:
    """One analysis' results. ``figures`` maps a figure name to (PNG bytes, caption); the bytes
    are not serialised (``save_section`` writes them as files next to the JSON). ``galleries``
    (records with their frames) are, base64-encoded: their PNGs are a few KB each."""

    key: str
    title: str
    paragraphs: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    figures: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    galleries: list[Gallery] = field(default_factory=list)
    side_by_side: list[Table] = field(default_factory=list)
    """tables shown next to each other (e.g. kept and dropped completions)"""

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key, "title": self.title, "paragraphs": self.paragraphs,
            "summary": jsonable(self.summary), "tables": [jsonable(asdict(t)) for t in self.tables],
            "figures": {name: caption for name, (_, caption) in self.figures.items()},
            "galleries": [{"caption": g.caption, "cards": [c.to_json() for c in g.cards]} for g in self.galleries],
            "side_by_side": [jsonable(asdict(t)) for t in self.side_by_side],
        }


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    return str(value)
