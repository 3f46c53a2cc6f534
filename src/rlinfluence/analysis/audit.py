"""Audits of a run's training data: which sources push its updates the wrong way, and (where the
truth is known) how well each scorer finds the corrupted records.

Every record of a round gets a *harm* score from each scorer and consistency check
(``rlinfluence.analysis.harm``: the scorers, and the harm table a round is scored into; higher =
more harmful).

With no scorer named, an audit gives the *verdict* (``rlinfluence.sources.verdict``): every family
(every scorer but random) tested per source, adjusted across sources x families, and for each
flagged source its signature (the families that flag it) read as a likely fault class.

Detection (``detection``) is measured at three levels: per record, per episode and per source, an
episode's or a source's harm being the mean harm of its records (an episode counts as corrupted
when any of its records is, a source when most of them are), as the AUROC (the probability that a
corrupted item is ranked more harmful than a clean one; 0.5 = chance) and the precision at the
corrupted fraction (of the m most harmful items, m the number of corrupted ones, the fraction
corrupted; the base rate m / n is chance). Trusted records are left out of both (they are clean
by construction, and the trusted target is built from them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score

from rlinfluence.analysis.harm import ATTRIBUTION_FAMILIES, harm_table, scorers_of
from rlinfluence.analysis.report import Section
from rlinfluence.consistency import (
    CALIBRATED,
    RAW_SCALE,
    TWO_SIDED,
)
from rlinfluence.errors import UserError
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import AUDIT_SCORES as SCORES_DIR
from rlinfluence.rundir import saved_round_numbers
from rlinfluence.sources import (  # noqa: F401
    MIN_EPISODES,
    MIN_SOURCES,
    audit_level,
    calibration_p_values,
    episode_floor,
    episode_starts,
    group_means,
    normal_scores,
    rounds_needed,
    source_test,
    verdict,
)
from rlinfluence.statistics import holm

if TYPE_CHECKING:
    pass

Level = Literal["record", "episode", "source"]
LEVELS: tuple[Level, ...] = ("record", "episode", "source")
PLOTTED_SOURCES = 40
"""The sources plot shows at most this many bars (the lowest p-values); the table keeps every source."""
MAX_PERMUTATIONS = 1_000_000
"""The most permutations ``--permutations`` takes (a bound, so that a typo does not hang the audit)."""


def auroc(harm: np.ndarray, corrupted: np.ndarray) -> float:
    """P(a corrupted item's harm > a clean item's), ties counting 1/2; NaN if one class is empty."""
    corrupted = np.asarray(corrupted, bool)
    if corrupted.all() or not corrupted.any():
        return float("nan")
    return float(roc_auc_score(corrupted, harm))


def precision_at_fraction(harm: np.ndarray, corrupted: np.ndarray) -> float:
    """Of the m most harmful items (m = the number corrupted), the fraction that is corrupted;
    NaN if one class is empty. Items tied at the m-th harm share the slots left: each counts with
    the chance a random tie-break would pick it (so no order of the items, e.g. corrupted envs
    first, favours a scorer with many ties)."""
    corrupted, harm = np.asarray(corrupted, bool), np.asarray(harm, float)
    m = int(corrupted.sum())
    if m in (0, len(corrupted)):
        return float("nan")
    threshold = np.sort(harm)[::-1][m - 1]
    above, tied = harm > threshold, harm == threshold
    slots = m - int(above.sum())
    return float((corrupted[above].sum() + slots * corrupted[tied].mean()) / m)


def items(table: pd.DataFrame, level: Level, scorers: Sequence[str]) -> pd.DataFrame:
    """The table's untrusted records grouped to ``level``: per round, the mean harm of each scorer,
    ``records`` and ``corrupted`` (episode: any record; source: most records; where known)."""
    judged = table[~table["trusted"]]
    if level == "record":
        return judged.assign(records=1)
    keys = ["round", "source"] + (["episode"] if level == "episode" else [])
    aggregations = {name: (name, "mean") for name in scorers} | {"records": ("step", "size")}
    if "corrupted" in judged:
        aggregations["corrupted"] = ("corrupted", "any" if level == "episode" else lambda c: c.mean() > 0.5)
    return judged.groupby(keys, sort=True).agg(**aggregations).reset_index()


def detection(table: pd.DataFrame, scorers: Sequence[str]) -> pd.DataFrame:
    """One row per round, scorer and level: its AUROC and precision at the corrupted fraction (a
    two-sided check judged by its distance from the round's median; an unscored record at the median)."""
    rows = []
    for level in LEVELS:
        grouped = items(table, level, scorers)
        for k, in_round in grouped.groupby("round", sort=True):
            truth = in_round["corrupted"].to_numpy(bool)
            for name in scorers:
                harm = in_round[name].to_numpy(dtype=float)
                centre = np.nanmedian(harm) if np.isfinite(harm).any() else 0.0
                harm = np.where(np.isnan(harm), centre, harm)  # a record a check cannot score is neutral
                if name in TWO_SIDED:  # a departure either way is the signal
                    harm = np.abs(harm - centre)
                rows.append({"scorer": name, "level": level, "round": int(k), "auroc": auroc(harm, truth),
                             "precision": precision_at_fraction(harm, truth)})
    return pd.DataFrame(rows, columns=["scorer", "level", "round", "auroc", "precision"])


# -- the sources test -------------------------------------------------------------------------------
def _judged(table: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """(the untrusted records, the sources): every source must have records in every round audited."""
    judged = table[~table["trusted"]]
    counts = judged.pivot_table(index="round", columns="source", values="step", aggfunc="size")
    missing = counts.isna()
    if missing.to_numpy().any():
        k, s = next((k, s) for k in counts.index for s in counts.columns if missing.loc[k, s])
        raise UserError(f"source {s!r} has no records in round {k}: the test compares every source in every "
                        "round (audit the rounds where all sources are present with --rounds)")
    return judged, counts.columns.to_numpy()


def source_means(table: pd.DataFrame, scorer: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sources, rounds, h) with h [rounds, sources] = h_s,k, the mean harm of source s's untrusted
    records whose episode started in round k (``rlinfluence.sources.group_means`` of
    ``episode_starts``: independent units for the exact test when episodes run across rounds); a
    source with no scored record of an episode started in round k gets the round's mean, a neutral
    value."""
    judged, sources = _judged(table)
    source, episode = judged["source"].to_numpy(), judged["episode"].to_numpy()
    starts = episode_starts(judged["round"].to_numpy(), source, episode)
    rounds, h = group_means(starts, source, judged[scorer].to_numpy(dtype=float), sources)
    return sources, rounds, h


FAMILY_EXCLUDED = ("random",)
"""Scorers that are not families of the verdict (random is the chance line of detection)."""


def verdict_families(scorers: Sequence[str], gradient_families: bool = False) -> list[str]:
    """The families of ``scorers`` the verdict tests: all but ``FAMILY_EXCLUDED``, and but the
    ``ATTRIBUTION_FAMILIES`` unless ``gradient_families`` (version 3's families then)."""
    return [s for s in scorers if s not in FAMILY_EXCLUDED and (gradient_families or s not in ATTRIBUTION_FAMILIES)]


def verdict_table(table: pd.DataFrame, families: Sequence[str], alpha: float = 0.01) -> pd.DataFrame:
    """``rlinfluence.sources.verdict`` of a harm table over ``families``, with each source's records
    as normal scores within their round (``normal_scores``; the ``RAW_SCALE`` checks as they are):
    the exact test on each source's means per episode start round (``episode_starts``), once every
    source has ``MIN_EPISODES`` episodes in the table the outlier test on its means per collection
    round (floored by ``episode_floor``) beside it, and for the ``CALIBRATED`` checks the
    calibration test of each source's records against their known null."""
    families = [f for f in families if f not in FAMILY_EXCLUDED]
    judged, sources = _judged(table)
    if len(sources) < MIN_SOURCES:
        raise UserError(f"the verdict compares each source with 2 or more others: this run has {len(sources)} "
                        "untrusted source(s) (test them with one --scorer, which needs 2)")
    rounds, source, episode = (judged[c].to_numpy() for c in ("round", "source", "episode"))
    starts = episode_starts(rounds, source, episode)  # the exact test's units, once for all families
    enough = judged.groupby("source")["episode"].nunique().min() >= MIN_EPISODES
    means, outlier_means, floors = {}, {}, {}
    if families:  # every family's units at once: [records, families]
        values = judged[families].to_numpy(dtype=float)
        z = np.where(np.isin(families, list(RAW_SCALE)), values, normal_scores(rounds, values))
        means = dict(zip(families, group_means(starts, source, z, sources)[1], strict=True))
        if enough:  # the outlier test's units: means per collection round, and their floor
            outlier_means = dict(zip(families, group_means(rounds, source, z, sources)[1], strict=True))
            floors = dict(zip(families, episode_floor(source, episode, z, sources), strict=True))
    calibrated = {family: calibration_p_values(source, judged[family].to_numpy(dtype=float), sources, CALIBRATED[family])
                  for family in families if family in CALIBRATED}
    out = verdict(means, sources, TWO_SIDED, alpha, outlier_means if enough else None, floors, calibrated=calibrated)
    counts = table[~table["trusted"]].groupby("source").size()
    out.insert(1, "records", [int(counts[s]) for s in sources])  # source, records, rounds, flagged, ...
    return out


def sources_table(table: pd.DataFrame, scorer: str, alpha: float = 0.01, permutations: int = 2000, seed: int = 0
                  ) -> pd.DataFrame:
    """One row per untrusted source: records, rounds, mean harm with a 95% t interval
    over rounds, the permutation p-value (``source_test``), its Holm-adjusted value across the
    sources and ``flagged`` = adjusted p < ``alpha``."""
    from rlinfluence.statistics import ci95

    sources, rounds, h = source_means(table, scorer)
    if len(sources) < 2:
        raise UserError(f"an audit compares sources: this run has {len(sources)} untrusted source(s)")
    _, p_values = source_test(h, permutations, seed, scorer in TWO_SIDED)
    intervals = [ci95(h[:, i]) for i in range(len(sources))]
    counts = table[~table["trusted"]].groupby("source").size()
    out = pd.DataFrame({"source": sources, "records": [int(counts[s]) for s in sources], "rounds": len(rounds),
                        "mean_score": h.mean(axis=0), "ci_low": [lo for _, lo, _ in intervals],
                        "ci_high": [hi for _, _, hi in intervals], "p_value": p_values})
    out["p_holm"] = holm(p_values)
    out["flagged"] = out["p_holm"] < alpha
    out["scorer"] = scorer
    return out


def ranked(table: pd.DataFrame, level: Level, scorer: str) -> pd.DataFrame:
    """The items of ``level`` (records, episodes, sources per round) by harm, most harmful first."""
    grouped = items(table, level, [scorer])
    columns = [c for c in ("round", "source", "episode", "step", "records", scorer, "corrupted") if c in grouped]
    return grouped[columns].rename(columns={scorer: "harm"}).sort_values("harm", ascending=False, kind="stable")


# -- a run's audit ----------------------------------------------------------------------------------
HARM_TABLE_COLUMNS = ("round", "source", "episode", "step", "trusted")


def _saved_rounds(run_dir: Path) -> list[int]:
    return saved_round_numbers(run_dir / "buffers", ".safetensors")


def round_harm_table(run_dir: str | Path, round_index: int, scorers: Sequence[str]) -> pd.DataFrame:
    """``harm_table`` of saved round ``round_index`` of a run, loaded at theta(k): one job of an
    audit (a top-level function, so that another process can run it)."""
    from rlinfluence.checkpoint import load_round

    return harm_table(load_round(run_dir, round_index), scorers)


def _scored_rounds(run_dir: Path, rounds: Sequence[int], scorer: str | None, workers: int,
                   ray_address: str | None, progress: bool = False, gradient_families: bool = False
                   ) -> tuple[pd.DataFrame, list[str], str | None]:
    """A run trained with ``--save-buffers``: its saved rounds scored now, by every scorer and check
    for the verdict (``scorer`` None; the ``ATTRIBUTION_FAMILIES`` only with ``gradient_families``) or
    by all of them where the run has ground truth (for the detection table), else by the test's
    alone; one round per
    job, in ``workers`` local processes or as Ray tasks (``rlinfluence.executor.run_calls``), concatenated
    in round order whichever ran them."""
    from rlinfluence.executor import run_calls
    from rlinfluence.rundir import RunDirectory

    config = RunDirectory.open_existing(run_dir, tensorboard=False).read_config()
    available = scorers_of(int(config.get("trusted_envs", 0)))
    if scorer is not None and scorer not in available:
        raise UserError(f"unknown scorer {scorer!r} for this run (scorers: {', '.join(available)})")
    saved = _saved_rounds(run_dir)
    absent = sorted(set(rounds) - set(saved))
    if absent:
        raise UserError(f"round {absent[0]} of {str(run_dir)!r} is not saved (saved: {saved[0]}..{saved[-1]})")
    first = RunDirectory.open_existing(run_dir, tensorboard=False).load_buffer(saved[0])
    if "schedule_indices" not in first:
        available.remove("tracin")  # a round saved without its minibatches (an SB3 run's): nothing to replay
    elif "tracin" not in first and scorer != "tracin":
        # not recorded in training: replaying every record's full TracIn costs about two rounds of training a
        # round (docs/benchmarks.md), so only where asked (--scorer tracin) or recorded (train --tracin)
        available.remove("tracin")
    if not (gradient_families or config.get("corrupt")):
        available = [s for s in available if s not in ATTRIBUTION_FAMILIES or s == scorer]
    scorers = available if config.get("corrupt") or scorer is None else [scorer]
    todo = list(rounds or saved)
    with progress_bar(progress, f"audit: scoring {len(todo)} saved rounds", len(todo)) as advance:
        tables = run_calls(round_harm_table, [(run_dir, k, scorers) for k in todo], workers, ray_address,
                           on_done=lambda table: advance(f"round {int(table['round'].iloc[0])}"))
    return pd.concat(tables, ignore_index=True), scorers, scorer


def _check_written(table: pd.DataFrame, path: Path, owner: dict[int, Path]) -> None:
    """``UserError`` for a written harm table the test would misread: a missing source id, a record
    given twice, a score that is not a finite number, or a round another file holds too (``owner``:
    round -> the file that held it first, updated)."""
    if table["source"].isna().any():
        raise UserError(f"{path} has {int(table['source'].isna().sum())} row(s) without a source id")
    keys = list(HARM_TABLE_COLUMNS[:4])
    duplicated = table.duplicated(keys)
    if duplicated.any():
        row = table.loc[duplicated, keys].iloc[0].to_dict()
        raise UserError(f"{path} holds the record {row} {int(duplicated.sum()) + 1} times or more: each record once")
    for column in table.columns.difference([*HARM_TABLE_COLUMNS, "corrupted"]):
        values = pd.to_numeric(table[column], errors="coerce")
        bad = values.isna() | ~np.isfinite(values.to_numpy(dtype=float, na_value=np.nan))
        if bad.any():
            raise UserError(f"{path}: score column {column!r} has {int(bad.sum())} value(s) that are not finite "
                            f"numbers (first: {table.loc[bad, column].iloc[0]})")
    for k in pd.unique(table["round"]):
        if int(k) in owner:
            raise UserError(f"round {int(k)} is held by both {owner[int(k)]} and {path}: one file per round")
        owner[int(k)] = path


def _written_rounds(run_dir: Path, rounds: Sequence[int], scorer: str | None
                    ) -> tuple[pd.DataFrame, list[str], str | None]:
    """Harm tables written during training (``SCORES_DIR``: the SB3 ``AuditCallback``, or a user's)."""
    files = sorted((run_dir / SCORES_DIR).glob("round_*.parquet"))
    if not files:
        raise UserError(f"{str(run_dir)!r} has no saved rounds: train with --save-buffers (or, with "
                        "Stable-Baselines3, rlinfluence.integrations.sb3_audit.AuditCallback)")
    tables, owner = [], {}
    for path in files:
        try:
            tables.append(pd.read_parquet(path))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {str(path)!r} as Parquet: {exc}") from None
        missing = sorted(set(HARM_TABLE_COLUMNS) - set(tables[-1].columns))
        if missing:
            raise UserError(f"{path} has no column {missing[0]!r} (a harm table has {', '.join(HARM_TABLE_COLUMNS)})")
        _check_written(tables[-1], path, owner)
        scores = set(tables[-1].columns) - {*HARM_TABLE_COLUMNS, "corrupted"}
        first = set(tables[0].columns) - {*HARM_TABLE_COLUMNS, "corrupted"}
        if scores != first:
            odd = sorted(scores ^ first)[0]
            raise UserError(f"{path} and {files[0]} hold different score columns ({odd!r} is in one only): "
                            "every round's table scores with the same scorers")
    table = pd.concat(tables, ignore_index=True)
    for column in ("trusted", "corrupted"):
        if column in table and table[column].dtype != bool:
            raise UserError(f"the {column!r} column of {str(run_dir / SCORES_DIR)!r} must be bool, got {table[column].dtype}")
    absent = sorted(set(rounds) - set(table["round"]))
    if absent:
        raise UserError(f"round {absent[0]} is not among the score tables of {str(run_dir)!r}")
    if rounds:
        table = table[table["round"].isin(list(rounds))]
    held = [c for c in table.columns if c not in (*HARM_TABLE_COLUMNS, "corrupted")]
    if not held:
        raise UserError(f"the score tables of {str(run_dir)!r} hold no harm column (only {', '.join(table.columns)}): "
                        "add one score column per scorer, higher = more harmful")
    if scorer is not None and scorer not in held:
        raise UserError(f"unknown scorer {scorer!r}: the score tables of {str(run_dir)!r} hold {', '.join(held)}")
    return table, held, scorer


def audit_run(run_dir: str | Path, rounds: Sequence[int] = (), scorer: str | None = None,
              alpha: float = 0.01, permutations: int = 2000, seed: int = 0, workers: int = 1,
              ray_address: str | None = None, progress: bool = False, guarantee: str = "audit",
              gradient_families: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(sources, detection, harm table) of a run's rounds (default: all). Harm table: the saved rounds
    (``--save-buffers``) scored a round per job here (``workers`` 1), in local processes or as Ray
    tasks on ``ray_address`` (the same table), or the tables written in training (``SCORES_DIR``).
    sources: the verdict over every family but the ``ATTRIBUTION_FAMILIES`` (with
    ``gradient_families``, over those too: version 3's families; ``verdict_table``), or ``scorer``'s
    ``sources_table``, at the ``level`` of ``rlinfluence.sources.audit_level`` for ``guarantee``.
    detection: every scorer at every level per round (``detection``) where the run has ground truth,
    else empty."""
    from rlinfluence.executor import check_executor

    if not 0 < alpha < 1:
        raise UserError(f"--alpha must be in (0, 1), got {alpha}")
    if not 1 <= permutations <= MAX_PERMUTATIONS:
        raise UserError(f"--permutations must be in [1, {MAX_PERMUTATIONS}], got {permutations} (p-values are "
                        f"resolved to 1/(1 + permutations); more take minutes and change no flag at alpha >= 1e-4)")
    check_executor(workers, ray_address)
    run_dir = Path(run_dir)
    if _saved_rounds(run_dir):
        table, scorers, scorer = _scored_rounds(run_dir, list(rounds), scorer, workers, ray_address, progress,
                                                gradient_families)
    else:  # read, not scored: nothing to distribute
        table, scorers, scorer = _written_rounds(run_dir, list(rounds), scorer)
    found = detection(table, scorers) if "corrupted" in table else \
        pd.DataFrame(columns=["scorer", "level", "round", "auroc", "precision"])
    level = audit_level(alpha, int(table["round"].nunique()), guarantee)
    if scorer is None:
        families = verdict_families(scorers, gradient_families)
        if not families:
            raise UserError(f"the score tables of {str(run_dir)!r} hold only gradient families ({', '.join(scorers)}): "
                            "test them with --gradient-families, or one with --scorer")
        sources = verdict_table(table, families, level)
    else:
        sources = sources_table(table, scorer, level, permutations, seed)
    return sources.assign(level=level), found, table


def unreachable_note(sources: pd.DataFrame, alpha: float) -> str:
    """A verdict that flagged nothing: whether any flag was reachable ("" when it was)."""
    n_sources, rounds = len(sources), int(sources["rounds"].iloc[0])
    needed = rounds_needed(n_sources, alpha)
    if sources["test"].iloc[0] != "exact" or rounds >= needed:
        return ""
    return (f"no flag was reachable: with {n_sources} sources the exact test needs {needed} rounds (this audit has "
            f"{rounds}), and the outlier test needs {MIN_EPISODES} episodes per source\n")


def is_verdict(sources: pd.DataFrame) -> bool:
    """Whether an audit's sources table is the verdict over families (else one scorer's test)."""
    return "signature" in sources


def ranking_scorer(sources: pd.DataFrame) -> str:
    """The scorer an audit ranks episodes or records by: the single scorer, or in a verdict the
    family that flags a source most strongly (the first of the verdict's families if none does)."""
    if not is_verdict(sources):
        return str(sources["scorer"].iloc[0])
    flagged = sources[sources["flagged"]].sort_values("p_adjusted_min", kind="stable")
    if len(flagged):
        return str(flagged["signature"].iloc[0]).split(";")[0]
    return next(c[2:] for c in sources.columns if c.startswith("p_") and c != "p_adjusted_min")


def plot_sources(sources: pd.DataFrame, alpha: float) -> bytes:
    """PNG: each source's mean harm with its 95% interval (or, for a verdict, -log10 of its smallest
    adjusted p over the families against -log10 alpha), flagged sources in red."""
    from rlinfluence.analysis.report import figure_png, new_figure

    shown = ""
    if len(sources) > PLOTTED_SOURCES:  # the most suspect ones: a bar per source would be unreadable
        key = sources["p_adjusted_min" if is_verdict(sources) else "p_value"]
        sources = sources.loc[key.sort_values(kind="stable").index[:PLOTTED_SOURCES]].sort_index()
        shown = f" ({PLOTTED_SOURCES} of {len(key)} sources: the lowest p)"
    fig, axes = new_figure(max(4.0, 0.6 * len(sources) + 2), 3.2)
    ax = axes[0, 0]
    colors = ["C3" if f else "C0" for f in sources["flagged"]]
    x = np.arange(len(sources))
    if is_verdict(sources):
        ax.bar(x, -np.log10(sources["p_adjusted_min"].clip(lower=1e-300)), color=colors)
        ax.axhline(-np.log10(alpha), color="k", lw=0.8, ls="--")
        ax.set_xticks(x, [str(s) for s in sources["source"]])
        ax.set(xlabel="source (training env)" + shown, ylabel="-log10 smallest adjusted p",
               title=f"red: flagged by some family; dashed: alpha {alpha}")
        return figure_png(fig)
    mean = sources["mean_score"].to_numpy()
    ax.bar(x, mean, color=colors)
    ax.errorbar(x, mean, yerr=[mean - sources["ci_low"], sources["ci_high"] - mean], fmt="none", ecolor="k", capsize=3)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x, [str(s) for s in sources["source"]])
    ax.set(xlabel="source (training env)" + shown, ylabel=f"mean harm ({sources['scorer'].iloc[0]})",
           title=f"red: flagged (Holm-adjusted p < {alpha}); bars: 95% interval over rounds")
    return figure_png(fig)


def detection_summary(found: pd.DataFrame) -> pd.DataFrame:
    """Per scorer and level: the mean AUROC and precision over rounds, each with a 95% t interval
    over rounds clipped to [0, 1]."""
    from rlinfluence.statistics import ci95

    rows = []
    for (name, level), group in found.groupby(["scorer", "level"], sort=False):
        row = {"scorer": name, "level": level, "rounds": int(group["auroc"].notna().sum())}
        for stat in ("auroc", "precision"):
            values = group[stat].dropna().to_numpy()
            mean, lo, hi = ci95(values, bounds=(0.0, 1.0)) if len(values) else (np.nan,) * 3
            row |= {stat: mean, f"{stat}_lo": lo, f"{stat}_hi": hi}
        rows.append(row)
    return pd.DataFrame(rows)


def audit_section(sources: pd.DataFrame, found: pd.DataFrame, alpha: float) -> Section:
    """The audit as a report section: the sources table and plot, and the detection AUROC and
    precision per scorer and level (means over rounds, 95% intervals) where the run has ground truth."""
    from rlinfluence.analysis.report import Table

    flagged = [str(s) for s in sources.loc[sources["flagged"], "source"]]
    if is_verdict(sources):
        families = [c[2:] for c in sources.columns if c.startswith("p_") and c != "p_adjusted_min"]
        section = Section("audit", "Audit: which worker is broken, and what kind of fault it is", paragraphs=[
            f"Each family ({', '.join(families)}) scores every record; each source's mean per round (over its episodes "
            "that started in the round, as normal scores within their round) is tested against the other sources' by "
            "an exact permutation test within rounds (step-down maxT across sources x families), and once every "
            "source has 5 episodes its mean normal score by a t test beside it (Holm), and its logged actions' "
            "calibration against the law they have when sampled from the logged policy (Holm; tests run: "
            f"{sources['test'].iloc[0]}): a run with no broken source has a flag with probability at most {alpha}. "
            "A flagged source's signature (the families that flag it) is read as a fault class where the evidence "
            "separates that class from the others that fit it, else as undetermined between the candidates "
            f"(verdict version {sources['verdict_version'].iloc[0]}).",
            f"Flagged sources: {', '.join(flagged) or 'none'}."])
        section.tables.append(Table("Sources", ["source", "records", "rounds", "flagged", "signature (adjusted p)",
                                                "fault class", "reading"],
                                    [[str(r.source), int(r.records), int(r.rounds), "yes" if r.flagged else "",
                                      " ".join(f"{f} ({q})" for f, q in zip(str(r.signature).split(";"),
                                                                             str(r.signature_p).split(";"),
                                                                             strict=True)) if r.flagged else "",
                                      r.fault_class if r.flagged else "", r.reading if r.flagged else ""]
                                     for r in sources.itertuples()]))
        section.figures["sources"] = (plot_sources(sources, alpha), "Smallest adjusted p per source.")
        _detection_tables(section, found)
        return section
    section = Section("audit", "Audit: which training envs push the updates the wrong way", paragraphs=[
        f"Harm = a record's score by {sources['scorer'].iloc[0]}, signed so that higher = more harmful (for "
        "influence: minus its influence on the return target). Each source's mean harm is tested against the "
        "other sources with a permutation test within rounds (the sources' labels shuffled in every round), "
        f"Holm-corrected across sources: a run with no broken source has a flag with probability at most {alpha}.",
        f"Flagged sources: {', '.join(flagged) or 'none'}."])
    section.tables.append(Table("Sources", ["source", "records", "rounds", "mean harm", "95% interval", "p",
                                            "p (Holm)", "flagged"],
                                [[str(r.source), int(r.records), int(r.rounds), f"{r.mean_score:.4g}",
                                  f"[{r.ci_low:.4g}, {r.ci_high:.4g}]", f"{r.p_value:.3g}", f"{r.p_holm:.3g}",
                                  "yes" if r.flagged else ""] for r in sources.itertuples()]))
    section.figures["sources"] = (plot_sources(sources, alpha), "Mean harm per source with its 95% interval over rounds.")
    _detection_tables(section, found)
    return section


def _detection_tables(section: Section, found: pd.DataFrame) -> None:
    from rlinfluence.analysis.report import Table

    if len(found):
        summary = detection_summary(found)
        section.tables.append(Table(
            "Detection against the ground truth: AUROC (0.5 = chance) and precision at the corrupted fraction, "
            "means over rounds with 95% intervals",
            ["scorer", "level", "rounds", "AUROC", "precision"],
            [[r.scorer, r.level, int(r.rounds), f"{r.auroc:.2f} [{r.auroc_lo:.2f}, {r.auroc_hi:.2f}]",
              f"{r.precision:.2f} [{r.precision_lo:.2f}, {r.precision_hi:.2f}]"] for r in summary.itertuples()]))
