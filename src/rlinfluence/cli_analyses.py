"""The per-run analysis commands of ``rlinfluence``: attribute, diagnose, timeline, intervene,
validate and report (``rlinfluence.cli`` lists them with the others; audit and explain, what went
wrong in a run, are in ``rlinfluence.cli_faults``).

Every module imported here is free of torch, pandas and scipy, as in ``rlinfluence.cli``: each
command imports what it runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import tyro

from rlinfluence.config import DEFAULT_ADVANTAGE_NORM
from rlinfluence.errors import UserError
from rlinfluence.helptext import EmptyMeansNone, RunName, RunNames, StatedDefault, shown_as
from rlinfluence.rundir import atomic_write, check_output_dir, check_output_file

if TYPE_CHECKING:
    from rlinfluence.analysis.report import Section


def _round_list(flag: str) -> Any:
    """The type of a flag listing rounds: ``tuple[int, ...]`` of rounds >= 0, sorted, each once;
    written space-separated (``5 10 20``) or, as before, comma-separated (``5,10,20``). tyro
    rejects anything else before the command runs."""

    def parse(texts: list[str]) -> tuple[int, ...]:
        items = [item.strip() for text in texts for item in text.split(",")]
        if not items or not all(item.isdigit() for item in items):
            raise ValueError(f"{flag} must be comma-separated or space-separated round numbers >= 0, "
                             f"got {' '.join(texts)!r}")
        return tuple(sorted({int(item) for item in items}))

    return Annotated[tuple[int, ...], tyro.constructors.PrimitiveConstructorSpec(
        nargs="*", metavar="K [K ...]", instance_from_str=parse,
        is_instance=lambda value: isinstance(value, tuple), str_from_instance=lambda value: [str(k) for k in value],
    ), EmptyMeansNone]


Rounds = _round_list("--rounds")
RoundsOfValidate = _round_list("--round")
AdvantageNorm = Literal["chunk", "batch", "none"]
"""``rlinfluence.influence.ADVANTAGE_NORMS``, as a type tyro checks."""


@dataclass
class AttributeArgs:
    """Score every record of a saved round's buffer by its influence on a target."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory trained with --save-buffers"""
    round: int
    """round k to attribute (its buffer and theta(k) are loaded)"""
    target: Literal["return", "action"] = "return"
    """return: mean A log pi over the buffer; action: log pi(a|s) of the record --state-index"""
    state_index: Annotated[int | None, shown_as("INT")] = None
    """flat buffer index of the (state, action) of the action target"""
    mode: Literal["snapshot", "full"] = "snapshot"
    """snapshot: at theta(k) (ghost dot products); full: TracIn over the round's optimiser steps"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """snapshot mode's training-side advantages: IIF's (chunk: chunks of batch_size records of a
    seeded random permutation), the whole buffer (batch), raw (none)"""
    top: int = 10
    """records shown from each end"""
    out: Annotated[str | None, StatedDefault, shown_as("PATH")] = None
    """Parquet file (default RUN_DIR/attribution_round_K_<target>_<mode>[_<norm>].parquet, see
    attribution_file_name)"""
    html: bool = False
    """also write the top and bottom records (with their frames, if saved) next to it as .html"""


ATTRIBUTION_METADATA = b"rlinfluence"
"""The key of an attribution file's Parquet schema metadata: how it was made, as JSON."""


def attribution_file_name(a: AttributeArgs) -> str:
    """``attribution_round_5_return_snapshot_chunk.parquet``,
    ``attribution_round_5_action17_full.parquet``: the round, the target (with the state index of
    an action target), the mode and the snapshot's normalisation, so that attributions made with
    other settings sit side by side."""
    target = f"action{a.state_index}" if a.target == "action" else a.target
    mode = f"snapshot_{a.advantage_norm}" if a.mode == "snapshot" else a.mode
    return f"attribution_round_{a.round}_{target}_{mode}.parquet"


def _write_attribution(path: Path, table: Any, settings: dict[str, Any]) -> None:
    """``table`` as Parquet at ``path`` (atomically), ``settings`` in its schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = pa.Table.from_pandas(table, preserve_index=False)
    metadata = {**(arrow.schema.metadata or {}), ATTRIBUTION_METADATA: json.dumps(settings).encode()}
    atomic_write(path, lambda p: pq.write_table(arrow.replace_schema_metadata(metadata), p))


def attribute(a: AttributeArgs) -> int:
    """Attribute a saved round; write a Parquet table and print top/bottom records."""
    from rlinfluence.analysis.tables import attribution_table, print_records
    from rlinfluence.checkpoint import load_round
    from rlinfluence.influence import ActionTarget, ReturnTarget, score_buffer

    if a.top < 0:
        raise UserError(f"--top must be >= 0, got {a.top}")
    out = check_output_file(a.out or Path(a.run_dir) / attribution_file_name(a))
    saved = load_round(a.run_dir, a.round)
    buffer, trainer = saved.buffer, saved.trainer
    if a.target == "action":
        if a.state_index is None or not 0 <= a.state_index < len(buffer):
            raise UserError(f"--target action needs --state-index in [0, {len(buffer)}), got {a.state_index}")
        target = ActionTarget(buffer.flat("obs")[a.state_index], buffer.flat("actions")[a.state_index])
    else:
        target = ReturnTarget()
    cfg = trainer.config
    if a.mode == "snapshot":
        scores = score_buffer(trainer.policy, buffer, target=target, advantage_norm=a.advantage_norm,
                              chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef)
    else:
        if not saved.schedule:
            raise UserError(f"round {a.round} has no saved minibatch schedule (train with --save-buffers)")
        scores = score_buffer(
            trainer.policy, buffer, mode="full", schedule=saved.schedule, target=target,
            clip_range=cfg.clip_range, clip_range_vf=cfg.clip_range_vf, vf_coef=cfg.vf_coef,
            ent_coef=cfg.ent_coef, normalize_advantage=cfg.normalize_advantage,
            max_grad_norm=cfg.max_grad_norm, optimizer=trainer.optimizer if cfg.optimizer != "sgd" else None,
        )
    table = attribution_table(buffer, scores)
    table["kept"] = saved.keep.numpy()  # whether the run's update used the record
    if saved.filter_scores is not None:  # the scores the run's filter dropped by, in training
        table["filter_score"] = saved.filter_scores.numpy()
    out.parent.mkdir(parents=True, exist_ok=True)
    trainer_norm = "minibatch" if cfg.normalize_advantage else "none"  # what full mode retraces
    _write_attribution(out, table, {
        "run": Path(a.run_dir).resolve().name, "round": a.round, "target": a.target,
        "state_index": a.state_index, "mode": a.mode,
        "advantage_norm": a.advantage_norm if a.mode == "snapshot" else trainer_norm,
        "chunk_size": cfg.batch_size,
    })
    title = f"round {a.round}, target {a.target}, {a.mode} influence"
    print_records(table, a.top, title=title)
    print(f"wrote {out}")
    if a.html:
        from rlinfluence.analysis.report import write_html
        from rlinfluence.analysis.tables import attribution_section
        from rlinfluence.frames import load_frames

        section = attribution_section(table, f"Attribution of {title}", load_frames(a.run_dir, a.round, len(buffer)),
                                      a.top)
        print(f"wrote {write_html(out.with_suffix('.html'), section.title, [section])}")
        _print_frames_hint(section)
    return 0


def _print_frames_hint(*sections: Section) -> None:
    """Say how to get frames when none of the sections' records has any."""
    from rlinfluence.frames import HOW_TO_SAVE

    if not any(section.galleries for section in sections):
        print(f"no frames of the records: {HOW_TO_SAVE}")


@dataclass
class DiagnoseArgs:
    """Diagnose a saved round: its most harmful records (return target) and, for small discrete
    envs, how their estimated advantages disagree with Monte-Carlo advantages."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory trained with --save-buffers"""
    round: int
    """round k to diagnose"""
    bottom: int = 100
    """bottom records compared with all records (the paper: 100 on FrozenLake)"""
    top: int = 10
    """records printed from each end"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """training-side advantages of the scores: IIF's (chunk: chunks of batch_size records of a
    seeded random permutation), the whole buffer (batch), raw (none)"""
    html: bool = False
    """also write RUN_DIR/analyses/diagnosis_round_K.html"""


def _check_writes_into(run_dir: str, *subfolders: str) -> None:
    """``UserError`` before any work if an analysis could not write its results into ``run_dir``,
    its analyses folder or its own ``subfolders`` (``audit``): one that is not writable, or is a
    file or a link where the folder goes, would otherwise fail after all the computing."""
    from rlinfluence.analysis.report import ANALYSES_DIR

    for folder in (Path(run_dir), *(Path(run_dir) / name for name in (ANALYSES_DIR, *subfolders))):
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise UserError(f"{str(folder)!r} is a {'link' if folder.is_symlink() else 'file'}: the analysis writes "
                            "its results into a real folder there")
        if folder.is_dir() and not os.access(folder, os.W_OK):
            raise UserError(f"{str(folder)!r} is not writable: the analysis writes its results there")


def diagnose(a: DiagnoseArgs) -> int:
    """Diagnose a round; save RUN_DIR/analyses/diagnosis_round_K.{json,parquet,png}."""
    from rlinfluence.analysis.diagnosis import diagnose as run_diagnosis
    from rlinfluence.analysis.diagnosis import diagnosis_section
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.tables import print_records

    if a.top < 1:
        raise UserError(f"--top must be >= 1, got {a.top}")
    _check_writes_into(a.run_dir)
    d = run_diagnosis(a.run_dir, a.round, a.bottom, a.advantage_norm)
    print_records(d.table, a.top, title=f"round {a.round}, target return")
    if d.mc_reason is not None:
        print(f"Monte-Carlo advantage: not available ({d.mc_reason})")
    for key, value in d.stats.items():
        print(f"{key}: {value:.4g}")
    if "A_bar coverage" in d.stats:
        print("(A_hat: the GAE advantage PPO trains on; A_bar: the Monte-Carlo advantage from the buffer's complete "
              "episodes; coverage: the fraction of records that have one; mismatch: A_bar * A_hat < 0; bottom / top: "
              "the most harmful / helpful records)")
    section = diagnosis_section(d)
    folder = Path(a.run_dir) / ANALYSES_DIR
    table = folder / f"{section.key}.parquet"
    save_section(folder, section, beside=[(table, lambda p: d.table.to_parquet(p, index=False))])  # both or neither
    print(f"wrote {folder / (section.key + '.json')} and {table}")
    if a.html:
        print(f"wrote {write_html(folder / (section.key + '.html'), section.title, [section])}")
    _print_frames_hint(section)
    return 0


@dataclass
class TimelineArgs:
    """Behaviour-formation timeline of (s*, a*) over the saved rounds: pi(a*|s*), top records and
    roughness of the action-target scores (docs/method.md, section 8.2)."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory trained with --save-buffers"""
    state_index: Annotated[int | None, shown_as("INT")] = None
    """s* = this record of --state-round's buffer (flat index)"""
    state_round: Annotated[int | None, StatedDefault, shown_as("INT")] = None
    """round whose buffer holds --state-index (default: the last saved round)"""
    state: Annotated[tuple[float, ...] | None, shown_as("FLOAT [FLOAT ...]")] = None
    """s* given explicitly: its observation values, flattened (instead of --state-index)"""
    action: Annotated[tuple[float, ...] | None, shown_as("FLOAT [FLOAT ...]")] = None
    """a* (one integer, or the values of a continuous action); default: the final policy's
    preferred action at s*"""
    rounds: Annotated[Rounds, StatedDefault] = ()
    """rounds to track (default: every saved round)"""
    neighbours: int = 50
    """u: nearest neighbours per record in the roughness graph"""
    top: int = 10
    """top records kept per round"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """training-side advantages of the scores: IIF's (chunk: chunks of batch_size records of a
    seeded random permutation), the whole buffer (batch), raw (none)"""
    html: bool = False
    """also write RUN_DIR/analyses/timeline.html"""


def timeline(a: TimelineArgs) -> int:
    """Track (s*, a*) across rounds; save RUN_DIR/analyses/timeline.{json,parquet,png}."""
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.timeline import select_state_action, timeline_section
    from rlinfluence.analysis.timeline import timeline as run_timeline

    if a.top < 1:
        raise UserError(f"--top must be >= 1, got {a.top}")
    _check_writes_into(a.run_dir)
    target = select_state_action(a.run_dir, state_round=a.state_round, state_index=a.state_index,
                                 state=a.state, action=a.action)
    print(target.description)
    t = run_timeline(a.run_dir, target, list(a.rounds) or None, a.neighbours, a.top, a.advantage_norm)
    print(t.rounds.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"pi(a*|s*) at the final theta({t.final_round}): {t.final_pi:.4g}")
    print(f"estimated phase starts: clustering {t.phases['clustering']}, saturation {t.phases['saturation']}")
    print("(roughness: how unevenly the positive scores vary between neighbouring states, a normalised Dirichlet "
          "energy; high = helpful records scattered, low = clustered; top_same_action: the share of the top records "
          "whose action is a*)")
    section = timeline_section(t)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    top = t.top.drop(columns=[c for c in ("obs",) if c in t.top.columns])
    atomic_write(folder / "timeline_top.parquet", lambda p: top.to_parquet(p, index=False))
    print(f"wrote {folder / 'timeline.json'}")
    if a.html:
        print(f"wrote {write_html(folder / 'timeline.html', section.title, [section])}")
    _print_frames_hint(section)
    return 0


@dataclass
class InterveneArgs:
    """Targeted intervention (docs/method.md, section 5.3): retrain chosen rounds of standard PPO runs from
    theta(k) on (a) the full buffer, (b) without all negatively influential records, (c) without a
    random subset of the same size; compare evaluation returns on the same episode seeds."""

    run_dirs: tyro.conf.Positional[Annotated[tuple[str, ...], StatedDefault, RunNames]]
    """standard PPO run directories trained with --save-buffers (e.g. one per seed)"""
    rounds: Rounds = (5, 10, 20)
    """rounds k to retrain"""
    eval_episodes: int = 100
    """evaluation episodes per variant (the same seeds for a, b, c)"""
    advantage_norm: AdvantageNorm = DEFAULT_ADVANTAGE_NORM
    """IIF scorer's training-side advantages (chunk = IIF's default)"""
    out: Annotated[str | None, StatedDefault, shown_as("PATH")] = None
    """folder for the results across runs (default: RUN_DIR/analyses for one run, else
    <parent of the first run>/intervention)"""
    html: bool = False
    """also write intervention.html in --out"""


def intervene(a: InterveneArgs) -> int:
    """Run the intervention; write intervention.{csv,json,png} per run and across runs."""
    from rlinfluence.analysis.intervention import intervene as run_intervention
    from rlinfluence.analysis.intervention import intervention_section, summarise
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html

    if not a.run_dirs:
        raise UserError("intervene needs at least one RUN_DIR (a standard PPO run with --save-buffers)")
    if a.eval_episodes < 1:
        raise UserError(f"--eval-episodes must be >= 1, got {a.eval_episodes}")
    repeated = next((r for r in a.run_dirs if [Path(x).resolve() for x in a.run_dirs].count(Path(r).resolve()) > 1), None)
    if repeated is not None:
        raise UserError(f"intervene lists {repeated!r} twice: every run would be counted twice")
    names = [Path(r).resolve().name for r in a.run_dirs]
    shared = next((r for r, name in zip(a.run_dirs, names, strict=True) if names.count(name) > 1), None)
    if shared is not None:
        raise UserError(f"two runs share the folder name {Path(shared).resolve().name!r} ({shared!r} and another): "
                        "the results name each run by its folder, so they would be reported as one; rename one")
    if a.out:
        check_output_dir(a.out)
    for run_dir in a.run_dirs:
        _check_writes_into(run_dir)
    rows = run_intervention(list(a.run_dirs), list(a.rounds), a.eval_episodes, a.advantage_norm, progress=True)
    print(summarise(rows).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for run_dir in a.run_dirs:  # each run's report shows its own rows
        own = rows[rows["run"] == Path(run_dir).name]
        save_section(Path(run_dir) / ANALYSES_DIR, intervention_section(own))
    out = Path(a.out) if a.out else (Path(a.run_dirs[0]) / ANALYSES_DIR if len(a.run_dirs) == 1
                                      else Path(a.run_dirs[0]).parent / "intervention")
    section = intervention_section(rows)
    save_section(out, section)
    atomic_write(out / "intervention.csv", lambda p: rows.to_csv(p, index=False))
    print(f"wrote {out / 'intervention.csv'}")
    if a.html:
        print(f"wrote {write_html(out / 'intervention.html', section.title, [section])}")
    return 0


@dataclass
class ReportArgs:
    """One self-contained HTML report of a run: learning curve, per-round influence statistics and
    every analysis saved in RUN_DIR/analyses (diagnose, timeline, intervene)."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory"""
    out: Annotated[str | None, StatedDefault, shown_as("PATH")] = None
    """HTML file (default RUN_DIR/report.html)"""
    score_rounds: int = 6
    """saved rounds scored for the influence histograms (0 = none)"""
    html: bool = True
    """write the HTML file (--no-html: only list what it would contain)"""


def report(a: ReportArgs) -> int:
    """Write the run's HTML report."""
    from rlinfluence.analysis.report import build_report, load_sections
    from rlinfluence.rundir import RunDirectory

    if a.score_rounds < 0:
        raise UserError(f"--score-rounds must be >= 0, got {a.score_rounds}")
    if a.out is not None:
        check_output_file(a.out)
    if not a.html:
        run = RunDirectory.open_existing(a.run_dir, tensorboard=False)
        print("sections: learning curve, influence statistics, "
              + ", ".join(s.title for s in load_sections(run.path / "analyses")))
        return 0
    path, sections = build_report(a.run_dir, a.out, a.score_rounds)
    print(f"wrote {path} ({len(sections)} sections: {', '.join(s.key for s in sections)})")
    _print_frames_hint(*sections)
    return 0


@dataclass
class ValidateArgs:
    """Counterfactual check of the scores of saved rounds: retrain each round from theta(k) on
    --subsets random subsets of --fraction of its records and report the linear datamodeling
    score LDS = Spearman(sum of scores over the subset, real change of the target) with a 95%
    bootstrap interval, and the real change without the lowest-scored 5/10/25% vs a random drop.
    Runs of this library's trainer only (not Stable-Baselines3: it saves no run directory)."""

    run_dir: tyro.conf.Positional[Annotated[str, RunName]]
    """run directory trained with --save-buffers"""
    round: RoundsOfValidate
    """round k, or several (0 5 10: LDS per round as a curve)"""
    subsets: int = 30
    """M random subsets, each retrained (at least 5)"""
    fraction: float = 0.5
    """fraction of the records kept in each subset, in (0, 1)"""
    target: Literal["return", "action"] = "return"
    """return: mean A log pi over the buffer; action: log pi(a|s) of the record --state-index"""
    state_index: Annotated[int | None, shown_as("INT")] = None
    """flat buffer index of the (state, action) of the action target"""
    mode: tuple[Literal["snapshot", "full"], ...] = ("snapshot",)
    """scorers: snapshot (at theta(k)) and/or full (TracIn over the round's optimiser steps)"""
    advantage_norm: tuple[AdvantageNorm, ...] = (DEFAULT_ADVANTAGE_NORM,)
    """snapshot mode's training-side advantages, one scorer each: chunk (IIF's: random chunks of
    batch_size records), batch (whole buffer), none (raw); full mode ignores it"""
    random_draws: int = 5
    """random drops per percentage in the drop test"""
    seed: int = 0
    """seed of the subsets, random drops, chunking and bootstrap"""
    workers: int = 1
    """local worker processes, each validating one round at a time (the same tables as 1)"""
    ray_address: Annotated[str | None, shown_as("ADDRESS")] = None
    """validate the rounds as Ray tasks on this cluster (auto or HOST:PORT) instead"""
    html: bool = False
    """also write RUN_DIR/analyses/validation.html"""


def validate(a: ValidateArgs) -> int:
    """Validate saved rounds; write RUN_DIR/analyses/validation.{json,csv,png} (in the report)."""
    from rlinfluence.analysis.report import ANALYSES_DIR, save_section, write_html
    from rlinfluence.analysis.validation import (
        drop_rows,
        lds_rows,
        scorer_names,
        validate_rounds,
        validation_section,
    )
    from rlinfluence.influence.validation import check_settings

    check_settings(a.subsets, a.fraction)
    if a.seed < 0:
        raise UserError(f"--seed must be >= 0, got {a.seed}")
    _check_writes_into(a.run_dir)
    results = validate_rounds(
        a.run_dir, list(a.round), progress=True, target=a.target, state_index=a.state_index,
        scorers=scorer_names(a.mode, a.advantage_norm), subsets=a.subsets, fraction=a.fraction,
        random_draws=a.random_draws, seed=a.seed, workers=a.workers, ray_address=a.ray_address,
    )
    lds, drops = lds_rows(results), drop_rows(results)
    fmt = {"float_format": lambda v: f"{v:.4g}", "index": False}
    print(lds[["round", "scorer", "lds", "lds_low", "lds_high", "full_change", "retrain_seconds",
               "reproduces_run"]].to_string(**fmt))
    print(drops.drop(columns="run").to_string(**fmt))
    for message in dict.fromkeys(m for m in lds["message"] if m):
        print(f"LDS undefined: {message}")
    section = validation_section(results)
    folder = Path(a.run_dir) / ANALYSES_DIR
    save_section(folder, section)
    atomic_write(folder / "validation.csv", lambda p: lds.to_csv(p, index=False))
    atomic_write(folder / "validation_drops.csv", lambda p: drops.to_csv(p, index=False))
    print(f"wrote {folder / 'validation.json'}, validation.csv, validation_drops.csv")
    if a.html:
        print(f"wrote {write_html(folder / 'validation.html', section.title, [section])}")
    return 0
