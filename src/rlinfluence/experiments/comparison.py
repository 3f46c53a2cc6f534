"""Multi-seed comparisons of methods against a reference, optionally each tuned first.

``compare(CompareConfig(...))``:

    1. plan      parse every method spec (``specs``), the reference, the tuning grid; build and
                 validate every run's ``PPOConfig``; nothing is written if anything is invalid
    2. tune      (with ``tune``) every method x grid point on the tuning seeds, disjoint from the
                 evaluation seeds; the best point by the tuning metric is each method's choice
    3. evaluate  every method (with its choice) on the evaluation seeds; each seed starts every
                 method from the same initial policy and evaluates on the same episode seeds,
                 which come from the seed (``episode_seed_base``): a tuning seed's evaluation
                 episodes are never an evaluation seed's
    (``confirm``) an earlier study's choices rerun, untuned, on seeds and evaluation episodes
                 that study never used
    4. summarise (``summary``) the paper's SE/RT metrics per seed pair against the reference, rliable's IQM,
                 mean and probability of improvement with bootstrap intervals, tables and plots

Pairs run in a process pool or as Ray tasks; a re-run with the same folder skips finished pairs,
trains unfinished ones again from their start, and refuses pairs started with other settings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.executor import check_executor
from rlinfluence.experiments.execution import (
    Job,
    check_existing,
    failure,
    finished,
    folder_lock,
    run_jobs,
)
from rlinfluence.experiments.metrics import Curve
from rlinfluence.experiments.specs import (  # noqa: F401  (CompareConfig, episode_seeds importable from here)
    DEFAULT_REPS,
    EPISODE_SEED_STRIDE,
    Clock,
    CompareConfig,
    MethodSpec,
    TuneMetric,
    check_bootstrap_reps,
    dirname_of,
    episode_seed_base,
    episode_seeds,
    find_reference,
    parse_grid,
    parse_methods,
    parse_overrides,
    split_specs,
)
from rlinfluence.experiments.summary import write_summary
from rlinfluence.experiments.tuning import at_edge, choose, grid_points, tuning_scores
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import atomic_write


@dataclass
class Plan:
    """Every run of a comparison, resolved and validated before anything trains."""

    specs: list[MethodSpec]
    reference: MethodSpec
    seeds: list[int]
    tune_seeds: list[int]
    grid: dict[str, list[Any]]
    points: list[dict[str, Any]] = field(default_factory=list)
    tuned: list[MethodSpec] = field(default_factory=list)
    """the methods tuned (every one unless ``tune_only``); the others take the reference's choice"""

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.specs]


MAX_SEEDS = 10_000
"""The most evaluation (or tuning) seeds a comparison takes: each is a training run per method."""


def plan_comparison(cfg: CompareConfig) -> Plan:
    """Parse and validate everything (``UserError`` naming the first bad value)."""
    for name in ("seeds", "rounds", "smooth"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if cfg.seeds > MAX_SEEDS or cfg.tune_seeds > MAX_SEEDS:  # each is a training run per method
        raise UserError(f"--seeds {cfg.seeds} / --tune-seeds {cfg.tune_seeds}: at most {MAX_SEEDS} seeds")
    check_executor(cfg.workers, cfg.ray_address)  # before any folder exists
    check_bootstrap_reps(cfg.bootstrap_reps)
    fixed_by_seed = sorted(set(parse_overrides(cfg.set)) & {"seed", "eval_seed"})
    if fixed_by_seed:
        raise UserError(f"--set {fixed_by_seed[0]}=... is not allowed: a comparison derives each run's seed and "
                        "evaluation episodes from --first-seed/--seeds (and --tune-first-seed/--tune-seeds)")
    specs = parse_methods(cfg.methods)
    reference = find_reference(specs, cfg.reference)
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    grid = parse_grid(cfg.tune)
    tune_seeds = list(range(cfg.tune_first_seed, cfg.tune_first_seed + cfg.tune_seeds)) if grid else []
    if grid and cfg.tune_seeds < 1:
        raise UserError(f"--tune-seeds must be >= 1, got {cfg.tune_seeds}")
    overlap = sorted(set(seeds) & set(tune_seeds))
    if overlap:
        raise UserError(f"tuning seeds {tune_seeds} overlap the evaluation seeds at {overlap}: "
                        "choose --tune-first-seed past them")
    for spec in specs:
        fixed = sorted(set(spec.override_dict) & set(grid))
        if fixed:
            raise UserError(f"method {spec.label!r} fixes {', '.join(fixed)}, which --tune varies")
    labels = [spec.label for spec in specs]
    unknown = [label for label in cfg.tune_only if label not in labels]
    if unknown:
        raise UserError(f"--tune-only names {unknown[0]!r}, which is not among --methods ({', '.join(labels)})")
    if cfg.tune_only and not grid:
        raise UserError("--tune-only needs --tune")
    if cfg.tune_only and reference.label not in cfg.tune_only:
        raise UserError(f"--tune-only must include the reference {reference.label!r}: the other methods run at its "
                        "chosen values")
    tuned = [spec for spec in specs if not cfg.tune_only or spec.label in cfg.tune_only] if grid else []
    plan = Plan(specs, reference, seeds, tune_seeds, grid, grid_points(grid) if grid else [{}], tuned)
    for spec in specs:  # every run that can happen is valid
        for point in plan.points:
            config = cfg.run_config(spec, seeds[0], point)
            if config.eval_episodes > EPISODE_SEED_STRIDE:
                raise UserError(f"a comparison evaluates at most {EPISODE_SEED_STRIDE} episodes per round "
                                f"(each seed's episodes are its own), got eval_episodes={config.eval_episodes}")
    return plan


def episodes_used(cfg: CompareConfig, seeds: Sequence[int]) -> set[int]:
    """Every evaluation-episode seed the runs of ``seeds`` reset with."""
    reference = find_reference(parse_methods(cfg.methods), cfg.reference)
    return {e for s in seeds for e in episode_seeds(cfg.run_config(reference, s))}


def confirmation_config(cfg: CompareConfig) -> tuple[CompareConfig, dict[str, dict[str, Any]], dict[str, Any]]:
    """For ``--confirm STUDY``: the study's comparison, untuned, on ``cfg``'s seeds, with the
    study's chosen values; (config, chosen, what is recorded of the study). ``UserError`` if a
    seed or an evaluation episode of the confirmation was used by the study."""
    path = Path(cfg.confirm)
    path = path / "compare.json" if path.is_dir() else path
    try:
        study = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"--confirm {str(path)!r}: cannot read it ({exc})") from None
    fields = _study_fields(study, path)
    if cfg.tune:
        raise UserError("--confirm reruns the study's choices; it cannot --tune")
    given = [f"--{name}" for name in ("set", "corrupt") if getattr(cfg, name)]
    if given:
        raise UserError(f"--confirm reruns the study's own settings; {given[0]} cannot change them")
    chosen = fields.pop("chosen")
    fields["corrupt"] = study.get("corrupt", [])  # a study from before corruptions had none
    listed = {k: (fields[k],) if isinstance(fields[k], str) else tuple(fields[k]) for k in ("methods", "set", "corrupt")}
    study_cfg = CompareConfig(**{**fields, **listed})
    confirm_cfg = dataclasses.replace(
        cfg, env=study_cfg.env, methods=study_cfg.methods, reference=study_cfg.reference, rounds=study_cfg.rounds,
        drop_pct=study_cfg.drop_pct, eval_episodes=study_cfg.eval_episodes, set=study_cfg.set,
        corrupt=study_cfg.corrupt)
    specs = parse_methods(confirm_cfg.methods)
    if sorted(chosen) != sorted(s.label for s in specs):
        raise UserError(f"--confirm {str(path)!r}: its chosen values name {sorted(chosen)}, "
                        f"its methods {[s.label for s in specs]}")
    for spec in specs:
        confirm_cfg.run_config(spec, cfg.first_seed, chosen[spec.label])
    study_seeds = list(range(study_cfg.first_seed, study_cfg.first_seed + study_cfg.seeds))
    study_tune = list(range(study_cfg.tune_first_seed, study_cfg.tune_first_seed + study_cfg.tune_seeds)) \
        if study.get("tune") else []
    # a confirmation of a confirmation: the seeds and episodes of every study before it are used too
    earlier_seeds, earlier_episodes = _earlier_use(study, path)
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    used = sorted(set(seeds) & set(study_seeds + study_tune + earlier_seeds))
    if used:
        raise UserError(f"--confirm: seed {used[0]} was used by the study or a study it confirms (evaluation seeds "
                        f"{study_seeds}, tuning seeds {study_tune}, earlier {sorted(earlier_seeds)}); choose "
                        "--first-seed past them")
    study_episodes = episodes_used(study_cfg, study_seeds + study_tune + earlier_seeds) | set(earlier_episodes)
    shared = episodes_used(confirm_cfg, seeds) & study_episodes
    if shared:
        raise UserError(f"--confirm: evaluation episode seed {min(shared)} was used by the study")
    record = {"study": str(path), "study_seeds": study_seeds, "study_tune_seeds": study_tune,
              "seeds_used": sorted(set(study_seeds + study_tune + earlier_seeds)),
              "episode_seeds_used": sorted(study_episodes)}
    return confirm_cfg, chosen, record


def _earlier_use(study: dict[str, Any], path: Path) -> tuple[list[int], list[int]]:
    """(seeds, evaluation episode seeds) the studies that ``study`` confirms used, from its
    ``confirms`` record (a study that confirms none: nothing)."""
    prior = study.get("confirms", {})
    if not isinstance(prior, dict):
        raise UserError(f"--confirm {str(path)!r}: its 'confirms' record is not a JSON object")
    seeds = prior.get("seeds_used", [*prior.get("study_seeds", []), *prior.get("study_tune_seeds", [])])
    episodes = prior.get("episode_seeds_used", study.get("episode_seeds_used", []))
    for name, values in (("seeds_used", seeds), ("episode_seeds_used", episodes)):
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise UserError(f"--confirm {str(path)!r}: its 'confirms' record's {name} is not a list of integers")
    return seeds, episodes


_STUDY_TYPES: dict[str, tuple[type, ...]] = {
    "env": (str,), "methods": (str, list), "reference": (str,), "rounds": (int, type(None)),
    "drop_pct": (int, float, str, type(None)), "eval_episodes": (int, type(None)), "set": (list,),
    "first_seed": (int,), "seeds": (int,), "tune_first_seed": (int,), "tune_seeds": (int,), "chosen": (dict,)}


def _study_fields(study: Any, path: Path) -> dict[str, Any]:
    """The fields of a study's compare.json that a confirmation reruns, type-checked (``UserError``
    naming the first that is missing or of another type)."""
    if not isinstance(study, dict):
        raise UserError(f"--confirm {str(path)!r} is not a compare.json: it holds a {type(study).__name__}, "
                        "not a JSON object")
    fields = {}
    for key, types_ in _STUDY_TYPES.items():
        if key not in study:
            raise UserError(f"--confirm {str(path)!r} is not a compare.json: it has no {key!r}")
        value = study[key]
        if isinstance(value, bool) or not isinstance(value, types_):
            raise UserError(f"--confirm {str(path)!r}: {key!r} is {value!r}, not of the type a compare.json gives it")
        fields[key] = value
    listed = [("methods", fields["methods"]), ("set", fields["set"]), ("corrupt", study.get("corrupt", []))]
    for key, value in listed:
        if not isinstance(value, list | str) or (isinstance(value, list) and not all(isinstance(v, str) for v in value)):
            raise UserError(f"--confirm {str(path)!r}: {key!r} is {value!r}, not a list of strings")
    if not all(isinstance(v, dict) for v in fields["chosen"].values()):
        raise UserError(f"--confirm {str(path)!r}: 'chosen' must map each method to its chosen values")
    return fields


# what defines a study's results: a folder re-run with another value of one of these would mix
# two studies (its tuning.csv, chosen values and pairs); --seeds may grow, the rest is display
STUDY_KEYS = ("env", "methods", "reference", "first_seed", "rounds", "drop_pct", "eval_episodes", "set", "corrupt",
              "tune", "tune_only", "tune_seeds", "tune_first_seed", "tune_metric", "smooth")


def check_same_study(out: Path, cfg: CompareConfig) -> None:
    """``UserError`` naming the first key of ``STUDY_KEYS`` whose value differs from the one the
    folder's compare.json was run with, before anything is trained or written."""
    path = out / "compare.json"
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"cannot read {str(path)!r} ({exc}); use another --out") from None
    asked = json.loads(json.dumps(asdict(cfg)))  # tuples as lists, as the file has them
    for key in STUDY_KEYS:
        if key in saved and saved[key] != asked[key]:
            raise UserError(f"{out} holds a comparison run with {key}={saved[key]!r}, not {asked[key]!r}: "
                            "use another --out (nothing was run)")


def _tuning_jobs(cfg: CompareConfig, plan: Plan, out: Path) -> dict[tuple[str, int], list[Job]]:
    jobs: dict[tuple[str, int], list[Job]] = {}
    for spec in plan.tuned:
        for i, point in enumerate(plan.points):
            candidate = spec.with_overrides(point)
            jobs[spec.label, i] = [(cfg.run_config(spec, s, point).to_dict(),
                                    str(out / "tune" / f"{candidate.dirname}__seed{s}")) for s in plan.tune_seeds]
    return jobs


def _run(cfg: CompareConfig, jobs: list[Job], label: str, may_fail: bool = False) -> None:
    done = sum(finished(run_dir) for _, run_dir in jobs)
    with progress_bar(cfg.progress, label, len(jobs), done) as advance:
        run_jobs(jobs, cfg.workers, cfg.ray_address, lambda run_dir: advance(Path(run_dir).name), may_fail)


def compare(cfg: CompareConfig) -> Path:
    """Plan, (tune,) run or resume every pair, then write the summary; returns the folder."""
    confirmed: dict[str, Any] | None = None
    study_chosen: dict[str, dict[str, Any]] | None = None
    if cfg.confirm:
        cfg, study_chosen, confirmed = confirmation_config(cfg)
    plan = plan_comparison(cfg)
    check_envs(cfg, plan)
    out = Path(cfg.out or f"runs/compare__{cfg.env}__{time.strftime('%Y%m%d-%H%M%S')}")
    if (out / "config.json").is_file():  # the pairs' folders and tables would land among a run's files
        raise UserError(f"--out {str(out)!r} is a run directory: give the comparison a folder of its own")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {str(out)!r}: {exc.strerror}") from None
    done: dict[str, bool] = {"locked": False, "wrote": False}  # what this call did, for the undo
    try:
        _compare(cfg, plan, out, confirmed, study_chosen, done)
    except UserError:
        if done["locked"]:
            _undo_refused(out, created, done["wrote"])
        raise
    return out


def check_envs(cfg: CompareConfig, plan: Plan) -> None:
    """The checks a run makes against its env (a corruption's trigger region, ``obs-bug:swap``'s
    two features), made for every method before any folder is written: a pair refused by them
    would leave a study folder that the corrected rerun is then refused on."""
    import gymnasium as gym

    from rlinfluence.corruptions import check_corruptions
    from rlinfluence.envs import base_observation_space, make_env

    if not cfg.corrupt:
        return
    env = make_env(cfg.env)
    try:
        features = env.observation_space.shape[-1] if env.observation_space.shape else None
    finally:
        env.close()
    discrete = isinstance(base_observation_space(cfg.env), gym.spaces.Discrete)
    for spec in plan.specs:
        for point in plan.points:
            config = cfg.run_config(spec, plan.seeds[0], point)
            try:
                check_corruptions(config.corrupt, config.n_envs, config.trusted_envs, config.env, discrete, features)
            except UserError as exc:
                raise UserError(f"method {spec.label!r}: {exc}") from None


def _undo_refused(out: Path, created: bool, wrote: bool) -> None:
    """After a refusal in a folder this call held the lock of: a compare.json it wrote that no
    finished pair stands on is removed (the corrected rerun into the folder would be refused by
    it), and a folder it created with no finished pair is removed, lock file and all."""
    if any(p.name in ("done.json", "failed.json") for p in out.rglob("*")):
        return
    if created:
        shutil.rmtree(out, ignore_errors=True)
    elif wrote:
        (out / "compare.json").unlink(missing_ok=True)


def _compare(cfg: CompareConfig, plan: Plan, out: Path, confirmed: dict[str, Any] | None,
             study_chosen: dict[str, dict[str, Any]] | None, done: dict[str, bool]) -> None:
    with folder_lock(out):
        done["locked"] = True
        check_same_study(out, cfg)
        chosen: dict[str, dict[str, Any]] = study_chosen if study_chosen is not None else \
            {spec.label: {} for spec in plan.specs}
        tuning_table = None
        if plan.grid:
            tune_jobs = _tuning_jobs(cfg, plan, out)
            check_existing([job for jobs in tune_jobs.values() for job in jobs])
            _run(cfg, [job for jobs in tune_jobs.values() for job in jobs], "tuning pairs", may_fail=True)
            tuning_table, chosen = write_tuning(out, cfg, plan, tune_jobs)
        eval_jobs = [(cfg.run_config(spec, s, chosen[spec.label]).to_dict(), str(out / f"{spec.dirname}__seed{s}"))
                     for s in plan.seeds for spec in plan.specs]
        check_existing(eval_jobs)
        done["wrote"] = not (out / "compare.json").exists()
        atomic_write(out / "compare.json", lambda p: p.write_text(json.dumps(
            {**asdict(cfg), "chosen": chosen, **({"confirms": confirmed} if confirmed else {})}, indent=2)))
        _run(cfg, eval_jobs, "pairs", may_fail=True)
        write_summary(out, plan.labels, plan.seeds, cfg.smooth, cfg.clock, plan.reference.label,
                      chosen=chosen, tuning=tuning_table, reps=cfg.bootstrap_reps, seed=cfg.bootstrap_seed, progress=cfg.progress)


# -- tuning output ---------------------------------------------------------------------


def write_tuning(out: Path, cfg: CompareConfig, plan: Plan, jobs: dict[tuple[str, int], list[Job]]
                 ) -> tuple[pd.DataFrame, dict[str, dict[str, Any]]]:
    """tuning.csv (score per tuned method per grid point) and each method's choice (an untuned
    method's is the reference's). A candidate with a failed tuning run (it diverged) scores -inf
    and is never chosen."""
    failed = {key: [f"seed {Path(d).name.rsplit('seed', 1)[1]} failed: {f['error']}"
                    for _, d in runs if (f := failure(d)) is not None] for key, runs in jobs.items()}
    curves = {key: [Curve.from_run(Path(run_dir), cfg.smooth, cfg.clock) for _, run_dir in runs]
              for key, runs in jobs.items() if not failed[key]}
    if not curves:
        raise UserError("every tuning candidate failed; narrow the --tune grid")
    scores = {key: -math.inf for key in jobs} | tuning_scores(curves, cfg.tune_metric)
    rows = []
    chosen: dict[str, dict[str, Any]] = {}
    for spec in plan.tuned:
        best = choose(scores, spec.label)
        chosen[spec.label] = plan.points[best]
        if scores[spec.label, best] == -math.inf:
            raise UserError(f"every tuning candidate of {spec.label!r} failed; narrow the --tune grid")
        for i, point in enumerate(plan.points):
            kl = [float(np.nanmean(c.approx_kl)) for c in curves.get((spec.label, i), []) if c.approx_kl is not None]
            note = ",".join(at_edge(best, plan.grid)) if i == best else ""
            rows.append({"method": spec.label, **{k: _plain(v) for k, v in point.items()},
                         cfg.tune_metric: scores[spec.label, i], "approx_kl": float(np.mean(kl)) if kl else math.nan,
                         "chosen": i == best, "at_edge": note, "failed": "; ".join(failed[spec.label, i])})
    table = pd.DataFrame(rows)
    atomic_write(out / "tuning.csv", lambda p: table.to_csv(p, index=False))
    return table, {spec.label: chosen.get(spec.label, chosen[plan.reference.label]) for spec in plan.specs}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# -- summary ----------------------------------------------------------------------------
