"""The report's building blocks: figures rendered to PNG, sections saved to and loaded from a
folder as JSON plus PNGs, and self-contained HTML pages rendered from the package's Jinja2
templates (``rlinfluence/templates/page.html.j2``). Below both ``rlinfluence.analysis`` (a run's
report) and ``rlinfluence.experiments`` (the compare and aggregate pages)."""

from __future__ import annotations

import base64
import functools
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlinfluence.atomic import atomic_write, atomic_write_all
from rlinfluence.errors import UserError
from rlinfluence.sections import FrameCard, Gallery, Section, Table

ANALYSES_DIR = "analyses"


def figure_png(fig: Any, dpi: int = 100) -> bytes:
    """A matplotlib ``Figure`` rendered to PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def new_figure(width: float, height: float, ncols: int = 1, nrows: int = 1, sharex: bool = False) -> tuple[Any, Any]:
    """A matplotlib ``Figure`` (object API, no pyplot state) and its axes ``[nrows, ncols]``;
    ``sharex``: stacked panels share their x axis (ticks labelled on the bottom row only)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False, sharex=sharex)


ROUND_LABEL = "round k: the update theta(k) -> theta(k+1)"
"""the x label of every plot over rounds: round k is the update from theta(k) to theta(k+1)"""


def round_axis(ax: Any, label: str | None = ROUND_LABEL) -> None:
    """Integer ticks on ``ax``'s x axis of rounds, labelled ``label`` (None: no label, e.g. the
    upper panels of a stack)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one round: one tick
    if label:
        ax.set_xlabel(label)


def evenly_spaced(values: Sequence[int], n: int) -> list[int]:
    """At most ``n`` of ``values``, evenly spaced from the first to the last."""
    if not values:
        return []
    return sorted({values[int(round(i))] for i in np.linspace(0, len(values) - 1, min(n, len(values)))})


_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


def save_section(folder: str | Path, section: Section,
                 beside: Sequence[tuple[Path, Callable[[Path], None]]] = ()) -> Path:
    """Write ``section`` to ``folder/<key>.json`` and its figures to ``folder/<key>__<name>.png``,
    with the files ``beside`` it (``(path, write)``: the table it describes) all or none
    (``atomic_write_all``)."""
    if not _SAFE_KEY.match(section.key):
        raise ValueError(f"section key {section.key!r} must be letters, digits, '_', '.', '-'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    writes = list(beside)
    for name, (png, _) in section.figures.items():
        writes.append((folder / f"{section.key}__{name}.png", lambda p, png=png: p.write_bytes(png)))
    text = json.dumps(section.to_json(), indent=1)
    path = folder / f"{section.key}.json"
    writes.append((path, lambda p: p.write_text(text)))
    atomic_write_all(writes)
    return path


def load_sections(folder: str | Path) -> list[Section]:
    """Every section saved in ``folder`` (in natural order of their keys), figures read back from
    their PNGs."""
    folder = Path(folder)
    sections = []
    def natural(path: Path) -> list[object]:  # diagnosis_round_5 before diagnosis_round_10
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.stem)]

    for path in sorted(folder.glob("*.json"), key=natural):
        try:
            data = json.loads(path.read_text())
            figures = {}
            for name, caption in data.get("figures", {}).items():
                # an edited JSON must not make the report embed a file outside the run's folder
                if not (_SAFE_KEY.match(str(data["key"])) and _SAFE_KEY.match(str(name))):
                    raise UserError(f"analysis {str(path)!r} names a figure file outside {str(folder)!r}: "
                                    f"{data['key']!r}, {name!r}")
                png = folder / f"{data['key']}__{name}.png"
                if png.is_file():
                    figures[name] = (png.read_bytes(), caption)
            galleries = [Gallery(g["caption"], [FrameCard.from_json(c) for c in g["cards"]])
                         for g in data.get("galleries", [])]
            sections.append(Section(
                data["key"], data["title"], data.get("paragraphs", []), data.get("summary", {}),
                [Table(**t) for t in data.get("tables", [])], figures, galleries,
                [Table(**t) for t in data.get("side_by_side", [])],
            ))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a bad base64 frame is a ValueError
            raise UserError(f"cannot read analysis {str(path)!r}: {exc}") from None
    return sections


# -- HTML ----------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.4g}"
    if value is None:
        return ""
    return str(value)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


@functools.cache
def _templates() -> Any:
    """The Jinja2 environment of the package's ``templates/`` (autoescaped HTML)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("rlinfluence", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(fmt=_fmt, data_uri=_data_uri)
    return env


def render_html(title: str, sections: Sequence[Section]) -> str:
    """A complete, self-contained HTML5 document of ``sections`` (``templates/page.html.j2``); a
    section titled as the page gets no heading of its own."""
    return _templates().get_template("page.html.j2").render(title=title, sections=sections)


def write_html(path: str | Path, title: str, sections: Sequence[Section]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = render_html(title, sections)
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    return path
