"""``RUN_DIR/report.html`` of an RLHF run: reward, test reward (or toxicity), KL and kept
fraction per round, where each round's time went, a few sampled responses of every round, and
the kept and dropped completions of a round side by side (one self-contained HTML file, as
``rlinfluence report``).

Every round's completions are saved by the trainer as ``completions/round_XXXX.parquet``, one
row per sequence in rollout order: ``round`` (int64), ``prompt``, ``response`` (str),
``reward`` (the reward model's score, float64), ``score`` (its influence on the IIF target,
float64; null without IIF or in a round IIF skipped) and ``kept`` (bool: the update trained on it);
task ``sentiment-gold`` adds ``gold`` (the gold reward, float64).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from rlinfluence.errors import UserError
from rlinfluence.rundir import RunDirectory, atomic_write, round_name

if TYPE_CHECKING:
    from rlinfluence.analysis.report import Section
    from rlinfluence.rlhf.rollout import Rollout

STAGES = ("generation_seconds", "forward_seconds", "reward_seconds", "influence_seconds", "optimisation_seconds")
COMPLETIONS_DIR = "completions"
COMPLETION_COLUMNS = ("round", "prompt", "response", "reward", "score", "kept")
SHOWN_COMPLETIONS = 8
"""completions shown per side (kept, dropped)"""
SAMPLED_PER_ROUND = 3
"""responses shown per round in the sampled-responses table"""
SAMPLED_ROUNDS = 12
"""rounds shown there at most (evenly spaced, the first and the last included)"""


def _column(rows: list[dict], name: str) -> np.ndarray:
    def number(value: object) -> float:
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return math.nan

    return np.array([number(r.get(name)) for r in rows])


# -- completions ---------------------------------------------------------------------------
def completions_path(run_dir: str | Path, round_index: int) -> Path:
    return Path(run_dir) / COMPLETIONS_DIR / f"{round_name(round_index)}.parquet"


def saved_rounds(run_dir: str | Path) -> list[int]:
    """Indices of the rounds with saved completions, ascending."""
    return sorted(int(p.stem.split("_")[1]) for p in (Path(run_dir) / COMPLETIONS_DIR).glob("round_*.parquet"))


def save_completions(run_dir: str | Path, round_index: int, rollout: Rollout, keep: torch.Tensor,
                     scores: torch.Tensor | None, gold: torch.Tensor | None = None) -> Path:
    """Write round ``round_index``'s sequences as Parquet (columns: the module docstring)."""
    path = completions_path(run_dir, round_index)
    path.parent.mkdir(exist_ok=True)
    completions = pd.DataFrame({
        "round": np.full(len(rollout), round_index, dtype=np.int64),
        "prompt": pd.Series(rollout.prompts, dtype=object), "response": pd.Series(rollout.responses, dtype=object),
        "reward": rollout.scores.double().cpu().numpy(),
        "score": scores.double().cpu().numpy() if scores is not None else np.full(len(rollout), np.nan),
        "kept": keep.cpu().numpy().astype(bool),
    })
    if gold is not None:
        completions["gold"] = gold.double().cpu().numpy()
    atomic_write(path, lambda p: completions.to_parquet(p, engine="pyarrow", index=False))
    return path


def load_completions(run_dir: str | Path, round_index: int) -> pd.DataFrame | None:
    """Round ``round_index``'s completions (None if not saved); ``UserError`` if unreadable."""
    path = completions_path(run_dir, round_index)
    if not path.is_file():
        return None
    try:
        completions = pd.read_parquet(path, engine="pyarrow")
        missing = set(COMPLETION_COLUMNS) - set(completions.columns)
        if missing:
            raise ValueError(f"missing columns {sorted(missing)}")
        columns = list(COMPLETION_COLUMNS) + (["gold"] if "gold" in completions else [])
        return completions[columns].astype({"reward": float, "score": float, "kept": bool})
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not Parquet, a column missing or of the wrong type
        raise UserError(f"cannot read completions {str(path)!r}: {exc}") from None


def _cells(frame: pd.DataFrame, columns: list[str]) -> list[list[object]]:
    """Table rows of ``frame[columns]``, NaN as an empty cell."""
    return [[None if isinstance(v, float) and math.isnan(v) else v for v in row]
            for row in frame[columns].itertuples(index=False)]


def sampled_responses_section(rounds: dict[int, pd.DataFrame]) -> Section:
    """The first ``SAMPLED_PER_ROUND`` responses (in rollout order, one per prompt group) of up to
    ``SAMPLED_ROUNDS`` evenly spaced saved rounds: what the policy writes as training goes on."""
    from rlinfluence.analysis.report import Section, Table

    section = Section("samples", "Sampled responses per round")
    saved = sorted(rounds)
    shown = sorted({saved[round(i)] for i in np.linspace(0, len(saved) - 1, min(SAMPLED_ROUNDS, len(saved)))})
    section.paragraphs.append(
        f"The first {SAMPLED_PER_ROUND} prompts of each shown round (one response per prompt: the first of its group), "
        f"{len(shown)} of the {len(saved)} saved rounds; reward = the reward model's score of the response, "
        "score = its influence on the IIF target (empty without IIF), kept = trained on.")
    columns = ["round", "prompt", "response", "reward", "score", "kept"]
    rows = []
    for k in shown:
        firsts = rounds[k].drop_duplicates("prompt").head(SAMPLED_PER_ROUND)
        rows += _cells(firsts, columns)
    section.tables.append(Table("Sampled responses", columns, rows))
    return section


def completions_section(rounds: dict[int, pd.DataFrame]) -> Section:
    """The kept and dropped completions side by side (text, reward, score) of the last round
    that dropped any (else the last saved round), lowest score first."""
    from rlinfluence.analysis.report import Section, Table

    section = Section("completions", "Kept and dropped completions")
    saved = sorted(rounds)
    filtered = [k for k, c in rounds.items() if not c["kept"].all()]
    k = filtered[-1] if filtered else saved[-1]
    completions = rounds[k].sort_values("score", na_position="last")
    section.paragraphs.append(
        f"Round {k}: the {len(completions)} sampled completions, split by whether the update kept them; "
        "score = the sequence's influence on the IIF target (negative = harmful), lowest first"
        + ("." if filtered else "; no round dropped a completion (training without IIF, or IIF found no "
           "negative sequence)."))
    columns = ["prompt", "response", "reward", "score"] + (["gold"] if "gold" in completions else [])
    for kept, name in ((True, "kept"), (False, "dropped")):
        side = completions[completions["kept"] == kept]
        section.side_by_side.append(Table(f"{name}: {len(side)} of {len(completions)}", columns,
                                          _cells(side.head(SHOWN_COMPLETIONS), columns)))
    return section


def proxy_gold_section(rounds: dict[int, pd.DataFrame]) -> Section | None:
    """Task ``sentiment-gold``: per saved round the mean proxy and gold reward of its completions,
    and the last round's completions the proxy likes most beyond the gold reward (what gaming the
    proxy looks like); None without gold scores."""
    from rlinfluence.analysis.report import Section, Table

    with_gold = {k: c for k, c in sorted(rounds.items()) if "gold" in c}
    if not with_gold:
        return None
    section = Section("proxy-gold", "Proxy against gold")
    section.tables.append(Table("Mean reward of the round's completions", ["round", "proxy (trained on)", "gold", "gap"],
                                [[k, round(float(c["reward"].mean()), 3), round(float(c["gold"].mean()), 3),
                                  round(float((c["reward"] - c["gold"]).mean()), 3)] for k, c in with_gold.items()]))
    k, last = list(with_gold.items())[-1]
    worst = last.assign(gap=last["reward"] - last["gold"]).sort_values("gap", ascending=False)
    columns = ["prompt", "response", "reward", "gold", "gap"]
    section.tables.append(Table(f"Round {k}: the completions the proxy rates most above the gold reward", columns,
                                _cells(worst.head(SHOWN_COMPLETIONS), columns)))
    return section


# -- the report ----------------------------------------------------------------------------
def _curves_png(rows: list[dict], title: str) -> bytes:
    """Stacked panels over rounds: reward, test toxicity (or test reward), KL, approx_kl, kept fraction."""
    from rlinfluence.analysis.report import ROUND_LABEL, figure_png, new_figure, round_axis

    rounds = _column(rows, "round")
    fig, axes = new_figure(8, 9.5, nrows=5, sharex=True)
    reward_ax, tox_ax, kl_ax, approx_ax, kept_ax = axes[:, 0]
    reward_ax.plot(rounds, _column(rows, "reward_mean"), ".-", label="reward of round k's sampled responses (mean)")
    gold = _column(rows, "gold_mean")
    if np.isfinite(gold).any():  # task sentiment-gold: the proxy trained on against the gold check
        reward_ax.plot(rounds, gold, ".-", color="tab:red", label="gold reward of the same responses (mean)")
    reward_ax.set(ylabel="reward")
    # row k's evaluation is of theta(k+1): toxicity with the toxicity reward, else the test reward
    name, what = (("test_toxicity", "mean P(offensive)") if np.isfinite(_column(rows, "test_toxicity")).any()
                  else ("eval_return_mean", "test reward"))
    test = _column(rows, name)
    finite = np.isfinite(test)
    tox_ax.plot(rounds[finite], test[finite], "o-", label=f"{what} of theta(k+1) on the test prompts")
    initial = _column(rows[:1], f"{name}_initial")
    if np.isfinite(initial).any():
        tox_ax.axhline(float(initial[0]), color="k", ls="--", lw=0.8, label="theta(0), before training")
    test_gold = _column(rows, "eval_gold_mean")
    if np.isfinite(test_gold).any():
        shown = np.isfinite(test_gold)
        tox_ax.plot(rounds[shown], test_gold[shown], "o-", color="tab:red", label="gold reward of theta(k+1) on the test prompts")
    tox_ax.set(ylabel=what)
    kl_ax.plot(rounds, _column(rows, "kl"), ".-", color="tab:orange", label="KL to the reference (mean summed per sequence)")
    kl_ax.set(ylabel="KL")
    approx_ax.plot(rounds, _column(rows, "approx_kl"), ".-", color="tab:purple", label="approx_kl of the update")
    approx_ax.set(ylabel="approx_kl")
    kept_ax.plot(rounds, _column(rows, "kept_fraction"), ".-", color="tab:green", label="kept fraction")
    kept_ax.set(ylabel="fraction")
    for ax in axes[:, 0]:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        round_axis(ax, ROUND_LABEL if ax is kept_ax else None)
    fig.suptitle(title)
    return figure_png(fig)


def write_report(run: RunDirectory) -> Path:
    """Write and return ``run.path / "report.html"`` from ``metrics.csv``, ``config.json`` and the
    saved completions."""
    from rlinfluence.analysis.report import Section, Table, write_html

    rows, config = run.rows, run.read_config()
    title = f"RLHF: {config.get('algo')} {config.get('filter')} on {config.get('model')}"
    section = Section("rlhf", title)
    section.summary = {k: config.get(k) for k in ("task", "algo", "filter", "drop_mode", "target", "target_source", "seed",
                                                  "prompts_per_round", "response_length", "learning_rate")}
    sections = [section]
    if not rows:
        section.paragraphs.append("metrics.csv has no completed round yet.")
        return write_html(run.path / "report.html", f"rlinfluence report: {run.path.name}", sections)
    section.figures["curves"] = (_curves_png(rows, f"{config.get('task', 'toxicity')} task: {config.get('model')}"),
                                 "Per round k: training reward, held-out test toxicity (or test reward) of theta(k+1), KL to the "
                                 "reference, approx KL of the update and kept fraction.")
    means = [float(np.nanmean(_column(rows, s))) for s in STAGES]
    section.tables.append(Table("Mean seconds per round (evaluation excluded)", [s.removesuffix("_seconds") for s in STAGES],
                                [[round(m, 3) for m in means]]))
    section.summary.update({"rounds completed": len(rows), "final training reward": float(_column(rows, "reward_mean")[-1])})
    labels = {"eval_return_mean": "final test reward", "test_toxicity": "final test toxicity",
              "eval_gold_mean": "final test gold reward"}
    for name, label in labels.items():
        test = _column(rows, name)
        if np.isfinite(test).any():
            section.summary[label] = float(test[np.isfinite(test)][-1])
    section.summary["train seconds"] = float(_column(rows, "train_seconds")[-1])
    rounds = {k: load_completions(run.path, k) for k in saved_rounds(run.path)}
    if rounds:
        sections += [sampled_responses_section(rounds), completions_section(rounds)]
        if (gold := proxy_gold_section(rounds)) is not None:
            sections.append(gold)
    else:
        section.paragraphs.append("No completions saved for this run (runs before completions were saved).")
    return write_html(run.path / "report.html", f"rlinfluence report: {run.path.name}", sections)
