"""Analysis results as sections, and one self-contained HTML report per run.

Every analysis (diagnosis, timeline, intervention) returns a ``Section``: a title, paragraphs,
key figures (``summary``), tables and PNG figures. ``save_section`` writes it to
``RUN_DIR/analyses/<key>.json`` plus ``<key>__<figure>.png``; ``build_report`` gathers the run's
learning curve, its per-round influence statistics and every saved section into one HTML file
with the images embedded as base64 PNG (no external file, script or style sheet).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlinfluence.errors import UserError
from rlinfluence.rundir import RunDirectory, atomic_write

ANALYSES_DIR = "analyses"


@dataclass
class Table:
    caption: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    """One analysis' results. ``figures`` maps a figure name to (PNG bytes, caption); the bytes
    are not serialised (``save_section`` writes them as files next to the JSON)."""

    key: str
    title: str
    paragraphs: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    figures: dict[str, tuple[bytes, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key, "title": self.title, "paragraphs": self.paragraphs,
            "summary": _jsonable(self.summary), "tables": [_jsonable(asdict(t)) for t in self.tables],
            "figures": {name: caption for name, (_, caption) in self.figures.items()},
        }


def figure_png(fig: Any, dpi: int = 100) -> bytes:
    """A matplotlib ``Figure`` rendered to PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def new_figure(width: float, height: float, ncols: int = 1, nrows: int = 1) -> tuple[Any, Any]:
    """A matplotlib ``Figure`` (object API, no pyplot state) and its axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    return str(value)


_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


def save_section(folder: str | Path, section: Section) -> Path:
    """Write ``section`` to ``folder/<key>.json`` and its figures to ``folder/<key>__<name>.png``."""
    if not _SAFE_KEY.match(section.key):
        raise ValueError(f"section key {section.key!r} must be letters, digits, '_', '.', '-'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, (png, _) in section.figures.items():
        atomic_write(folder / f"{section.key}__{name}.png", lambda p, png=png: p.write_bytes(png))
    text = json.dumps(section.to_json(), indent=1)
    path = folder / f"{section.key}.json"
    atomic_write(path, lambda p: p.write_text(text))
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
                png = folder / f"{data['key']}__{name}.png"
                if png.is_file():
                    figures[name] = (png.read_bytes(), caption)
            sections.append(Section(
                data["key"], data["title"], data.get("paragraphs", []), data.get("summary", {}),
                [Table(**t) for t in data.get("tables", [])], figures,
            ))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"cannot read analysis {str(path)!r}: {exc}") from None
    return sections


# -- HTML ----------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .85em; }
th, td { border: 1px solid #ccc; padding: .2em .5em; text-align: right; }
th { background: #f3f3f3; } caption { text-align: left; font-weight: bold; padding: .3em 0; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: .85em; color: #555; } dl.summary { display: grid; grid-template-columns: max-content auto; gap: .1em 1em; }
dl.summary dt { font-weight: bold; } dl.summary dd { margin: 0; }
"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.4g}"
    if value is None:
        return ""
    return str(value)


def _section_html(section: Section) -> str:
    out = [f'<section id="{html.escape(section.key)}">', f"<h2>{html.escape(section.title)}</h2>"]
    out += [f"<p>{html.escape(p)}</p>" for p in section.paragraphs]
    if section.summary:
        out.append('<dl class="summary">')
        for key, value in section.summary.items():
            out.append(f"<dt>{html.escape(str(key))}</dt><dd>{html.escape(_fmt(value))}</dd>")
        out.append("</dl>")
    for table in section.tables:
        out.append(f"<table><caption>{html.escape(table.caption)}</caption><thead><tr>")
        out += [f"<th>{html.escape(str(c))}</th>" for c in table.columns]
        out.append("</tr></thead><tbody>")
        for row in table.rows:
            out.append("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>")
        out.append("</tbody></table>")
    for name, (png, caption) in section.figures.items():
        data = base64.b64encode(png).decode("ascii")
        alt = html.escape(caption or name)
        out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{alt}">'
                   f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    out.append("</section>")
    return "\n".join(out)


def render_html(title: str, sections: Sequence[Section]) -> str:
    """A complete, self-contained HTML5 document of ``sections``."""
    body = "\n".join(_section_html(s) for s in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1>\n{body}\n</body>\n</html>\n"
    )


def write_html(path: str | Path, title: str, sections: Sequence[Section]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = render_html(title, sections)
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    return path


# -- the run report ------------------------------------------------------------------------
def learning_section(run: RunDirectory, config: dict[str, Any]) -> Section:
    """Learning curve and per-round training statistics from ``metrics.csv``."""
    rows = run.rows
    section = Section("learning", "Learning curve")
    section.summary = {
        "env": config.get("env"), "method": config.get("method") or config.get("filter"),
        "seed": config.get("seed"), "rounds completed": len(rows),
        "optimizer": f"{config.get('optimizer')} lr {config.get('learning_rate')}",
        "eval episodes per round": config.get("eval_episodes"),
    }
    if not rows:
        section.paragraphs.append("metrics.csv has no completed round yet.")
        return section
    if not any("eval_return_mean" in r for r in rows):
        raise UserError(f"{str(run.path / 'metrics.csv')!r} has no eval_return_mean column "
                        "(not written by rlinfluence train?)")
    rounds = np.array([r["round"] for r in rows], dtype=float)

    def column(name: str) -> np.ndarray:
        return np.array([float(r.get(name, math.nan)) if r.get(name, "") != "" else math.nan for r in rows])

    mean, std = column("eval_return_mean"), column("eval_return_std")
    fig, axes = new_figure(10, 3.6, ncols=2)
    ax = axes[0, 0]
    # eval after round k's update is the return of theta(k+1)
    ax.plot(rounds + 1, mean, label="evaluation (stochastic policy)")
    ax.fill_between(rounds + 1, mean - std, mean + std, alpha=0.2)
    train = column("train_return_mean")
    if np.isfinite(train).any():
        ax.plot(rounds + 1, train, alpha=0.7, label="training episodes")
    ax.set(xlabel="theta(k): rounds completed", ylabel="return", title="return")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[0, 1]
    ax.plot(rounds, column("kept_fraction"), label="kept fraction")
    for name in ("clip_fraction", "approx_kl"):
        if np.isfinite(column(name)).any():
            ax.plot(rounds, column(name), label=name)
    ax.set(xlabel="round k", title="update statistics")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    section.figures["curve"] = (figure_png(fig), "Left: mean evaluation return (+/- 1 std over "
                                "episodes) after each round; right: kept fraction, clip fraction, approx KL.")
    best = int(np.nanargmax(mean)) if np.isfinite(mean).any() else None
    section.summary.update({
        "final eval return": float(mean[-1]),
        "best eval return": float(mean[best]) if best is not None else math.nan,
        "best after round": int(rounds[best]) if best is not None else None,
        "train seconds": float(column("train_seconds")[-1]),
    })
    return section


def influence_section(run_dir: str | Path, n_rounds: int = 6, advantage_norm: str = "batch") -> Section | None:
    """Return-target snapshot scores of up to ``n_rounds`` evenly spaced saved rounds: histograms
    and a table (fraction negative, spread), plus the kept fraction the run actually used."""
    from rlinfluence.influence import ReturnTarget, score_buffer
    from rlinfluence.ppo import load_round

    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    saved = saved_rounds(run)
    if not saved:
        return None
    picks = sorted({saved[int(round(i))] for i in np.linspace(0, len(saved) - 1, min(n_rounds, len(saved)))})
    section = Section("influence", "Per-round influence statistics (return target)")
    section.paragraphs.append(
        f"Snapshot influence of every record on the return target at theta(k) (advantage "
        f"normalisation: {advantage_norm}) for {len(picks)} of the {len(saved)} saved rounds. "
        "Positive = the record pushes the round's update towards a higher return.")
    rows, all_scores = [], {}
    kept = {int(r["round"]): r.get("kept_fraction") for r in run.rows}
    for k in picks:
        s = load_round(run_dir, k)
        cfg = s.trainer.config
        scores = score_buffer(s.trainer.policy, s.buffer, target=ReturnTarget(), advantage_norm=advantage_norm,
                              chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef).double().numpy()
        all_scores[k] = scores
        rows.append([k, len(scores), float((scores < 0).mean()), float(scores.mean()), float(scores.std()),
                     float(scores.min()), float(scores.max()), kept.get(k)])
    section.tables.append(Table("Return-target scores per round (kept fraction = what the run trained on)",
                                ["round", "records", "fraction negative", "mean", "std", "min", "max",
                                 "kept fraction"], rows))
    ncols = min(3, len(picks))
    nrows = math.ceil(len(picks) / ncols)
    fig, axes = new_figure(3.4 * ncols, 2.6 * nrows, ncols=ncols, nrows=nrows)
    for ax in axes.ravel()[len(picks):]:
        ax.set_visible(False)
    for ax, k in zip(axes.ravel(), picks, strict=False):
        scores = all_scores[k]
        ax.hist(scores, bins=60, color="tab:blue")
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set(title=f"round {k}: {np.mean(scores < 0):.0%} negative", xlabel="score")
    section.figures["histograms"] = (figure_png(fig), "Histograms of return-target scores (log count).")
    return section


def saved_rounds(run: RunDirectory) -> list[int]:
    """Rounds k whose buffer and theta(k) checkpoint are both saved."""
    found = []
    for path in sorted((run.path / "buffers").glob("round_*.safetensors")):
        k = int(path.stem.split("_")[1])
        if run.checkpoint_path(k).is_file():
            found.append(k)
    return found


def build_report(run_dir: str | Path, out: str | Path | None = None, score_rounds: int = 6) -> tuple[Path, list[Section]]:
    """Write the run's report (default ``RUN_DIR/report.html``); returns its path and sections."""
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    config = run.read_config()
    sections = [learning_section(run, config)]
    if score_rounds > 0:
        influence = influence_section(run_dir, score_rounds)
        if influence is not None:
            sections.append(influence)
    sections += load_sections(run.path / ANALYSES_DIR)
    path = write_html(Path(out) if out else run.path / "report.html",
                      f"rlinfluence report: {run.path.name}", sections)
    return path, sections
