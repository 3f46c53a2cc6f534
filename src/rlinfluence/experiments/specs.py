"""Method specs: ``FILTER[@key=value[,key=value...]]``, optionally named ``NAME=SPEC``.

A spec is a filter (``ppo`` = standard PPO, or any filter of ``rlinfluence.filters``) with
``PPOConfig`` overrides, e.g. ``iif@learning_rate=0.02,drop_pct=25`` or
``fast=ppo@learning_rate=0.04``. A comma-separated list of specs is split so that a
``key=value`` whose key is a ``PPOConfig`` field continues the spec before it:

    ppo,iif,ppo@learning_rate=0.02,iif@learning_rate=0.02,drop_pct=25
    -> ppo | iif | ppo@learning_rate=0.02 | iif@learning_rate=0.02,drop_pct=25

Every key and value is checked against ``PPOConfig``'s field types here, before anything runs.

``CompareConfig``, what ``rlinfluence compare`` runs (its methods, seeds and settings), lives here
too: like ``PPOConfig`` it imports no torch, pandas or scipy, so the command line is built
without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from rlinfluence.config import (
    DROP_FILTERS,
    FIELD_TYPES,
    FILTER_NAMES,
    ROBUST_IIF,
    PPOConfig,
    coerce,
)
from rlinfluence.errors import UserError
from rlinfluence.helptext import EmptyMeansNone, StatedDefault, shown_as
from rlinfluence.statistics import DEFAULT_REPS, MAX_REPS  # noqa: F401  (importable from here)

Clock = Literal["wall", "cpu"]
"""Which seconds the RT figures use: wall time, or process CPU time (robust to other load)."""
TuneMetric = Literal["auc", "final", "rounds80"]
"""A tuning score (``rlinfluence.experiments.tuning``)."""


def check_bootstrap_reps(reps: int) -> None:
    """``UserError`` unless 1 <= ``reps`` <= ``MAX_REPS``."""
    if not 1 <= reps <= MAX_REPS:
        raise UserError(f"--bootstrap-reps must be in [1, {MAX_REPS}], got {reps}")

# keys that define the pair rather than the method: a spec must not change them (eval_seed: every method
# of a seed is evaluated on the same episodes)
PAIR_KEYS = ("env", "seed", "eval_seed", "filter", "method", "run_root", "progress")
# keys that change only how a run is shown or stored, never its numbers
PRESENTATION_KEYS = ("method", "progress", "run_root", "tensorboard", "wandb", "wandb_project", "wandb_group",
                     "wandb_tags", "save_checkpoints")
METHOD_FILTERS = ("ppo", *(name for name in FILTER_NAMES if name != "none"), "iif-robust")


@dataclass(frozen=True)
class MethodSpec:
    """One method of a comparison: a filter and its ``PPOConfig`` overrides."""

    label: str
    """how tables, plots and run directories name it (the spec text, or its NAME)"""
    filter: str
    """``ppo`` (standard PPO) or a filter name"""
    overrides: tuple[tuple[str, Any], ...] = ()
    """(key, value) pairs in the order given"""

    @property
    def override_dict(self) -> dict[str, Any]:
        return dict(self.overrides)

    def with_overrides(self, extra: dict[str, Any]) -> MethodSpec:
        """The same method with more overrides (a tuning candidate); label gets them appended."""
        merged = {**self.override_dict, **extra}
        suffix = ",".join(f"{k}={_format(v)}" for k, v in extra.items())
        sep = "," if "@" in self.label else "@"
        return MethodSpec(f"{self.label}{sep}{suffix}" if extra else self.label, self.filter,
                          tuple(merged.items()))

    @property
    def dirname(self) -> str:
        """A file-system-safe folder prefix for this method's runs."""
        return dirname_of(self.label)

    def config_overrides(self) -> dict[str, Any]:
        return {"filter": "none" if self.filter == "ppo" else self.filter, "method": self.dirname,
                **self.override_dict}


def dirname_of(label: str) -> str:
    """A method label as a file-system-safe folder prefix."""
    return re.sub(r"[^A-Za-z0-9._=@,+-]", "_", label)


def _format(value: Any) -> str:
    if isinstance(value, tuple):
        return json.dumps(list(value), separators=(",", ":"))
    return json.dumps(value) if not isinstance(value, str) else value


def split_top_level(text: str) -> list[str]:
    """``a=1,b=[2,3]`` -> ``["a=1", "b=[2,3]"]``: split at commas outside brackets, drop blanks."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in (p.strip() for p in parts) if p]


def split_specs(text: str) -> list[str]:
    """Split a comma-separated spec list; a ``key=value`` token whose key is a ``PPOConfig``
    field joins the spec before it."""
    specs: list[str] = []
    for token in split_top_level(text):
        key = token.split("=", 1)[0].strip().replace("-", "_")
        if "@" not in token and "=" in token and key in FIELD_TYPES:
            if not specs or "@" not in specs[-1]:
                raise UserError(f"{token!r} has no method before it (write FILTER@{token})")
            specs[-1] += "," + token
        else:
            specs.append(token)
    return specs


def parse_spec(text: str) -> MethodSpec:
    """One spec ``[NAME=]FILTER[@key=value,...]`` -> ``MethodSpec`` (``UserError`` if invalid)."""
    text = text.strip()
    head, at, tail = text.partition("@")
    name = None
    if "=" in head:
        name, _, head = (part.strip() for part in head.partition("="))
        if not re.fullmatch(r"[A-Za-z0-9._+-]+", name or ""):
            raise UserError(f"method name {name!r} in {text!r}: use letters, digits and . _ + -")
        if name in FIELD_TYPES:
            raise UserError(f"method name {name!r} in {text!r} is a PPOConfig key; choose another name")
    filter_name = head.strip()
    if filter_name not in METHOD_FILTERS:
        raise UserError(f"unknown method {filter_name!r} in {text!r} (filters: {', '.join(METHOD_FILTERS)})")
    overrides: dict[str, Any] = {}
    if at:
        for pair in split_top_level(tail):
            key, sep, value = pair.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not key:
                raise UserError(f"bad override {pair!r} in {text!r}: expected key=value")
            if key in PAIR_KEYS:
                raise UserError(f"{key!r} cannot be set per method in {text!r} (it defines the run, not the method)")
            overrides[key] = coerce(key, value.strip())
    fixed = sorted(set(overrides) & set(ROBUST_IIF)) if filter_name == "iif-robust" else []
    if fixed:  # the preset would win over it silently while the label said otherwise
        raise UserError(f"iif-robust sets {fixed[0]}={ROBUST_IIF[fixed[0]]}; {text!r} sets it too: "
                        f"use iif@{fixed[0]}=... to choose it yourself")
    return MethodSpec(name or text, filter_name, tuple(overrides.items()))


def parse_methods(methods: str | Sequence[str]) -> list[MethodSpec]:
    """Specs (each item may itself be a comma-separated spec list) -> specs, with unique labels
    (``UserError`` otherwise)."""
    items = [methods] if isinstance(methods, str) else methods
    specs = [parse_spec(s) for item in items for s in split_specs(item)]
    if not specs:
        raise UserError("--methods is empty")
    labels = [s.label for s in specs]
    dup = next((lab for lab in labels if labels.count(lab) > 1), None)
    if dup is not None:
        raise UserError(f"method {dup!r} is listed twice")
    dirs = [s.dirname for s in specs]
    if len(set(dirs)) < len(dirs):
        raise UserError(f"methods {labels} collide as folder names; name them (NAME=SPEC)")
    return specs


def find_reference(specs: Sequence[MethodSpec], reference: str) -> MethodSpec:
    """The spec ``reference`` names (by label, or by the same filter and overrides)."""
    for spec in specs:
        if spec.label == reference:
            return spec
    wanted = parse_spec(reference)
    for spec in specs:
        if (spec.filter, dict(spec.overrides)) == (wanted.filter, dict(wanted.overrides)):
            return spec
    raise UserError(f"--reference {reference!r} is not among the methods ({', '.join(s.label for s in specs)})")


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings -> type-checked PPOConfig overrides."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UserError(f"bad override {pair!r}: expected key=value with a PPOConfig field as key")
        out[key.strip().replace("-", "_")] = coerce(key, value.strip())
    return out


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``--tune key=v1,v2,...`` (repeatable) -> {key: [values]}; several keys = their product."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise UserError(f"bad --tune {item!r}: expected key=v1,v2,...")
        if key in PAIR_KEYS:
            raise UserError(f"--tune cannot vary {key!r}")
        if key in grid:
            raise UserError(f"--tune lists {key!r} twice")
        parsed = [coerce(key, v) for v in split_top_level(values)]
        if len(set(map(repr, parsed))) < len(parsed):
            raise UserError(f"--tune {key} repeats a value")
        grid[key] = parsed
    return grid


def config_difference(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Keys whose values differ between two config dicts, presentation-only keys excepted, and
    ``drop_pct`` where neither filter drops p % (``PPOConfig.to_dict`` leaves it out there). A key one
    side lacks (a config saved before that option existed) counts as the option's default, which is
    what that run did."""
    defaults = {**json.loads(json.dumps(dataclasses.asdict(PPOConfig()))), "update_engine": "torch"}  # PPOConfig.from_dict
    saved, wanted = ({**defaults, **json.loads(json.dumps(d))} for d in (saved, wanted))  # tuples -> lists
    unused = {"drop_pct"} if saved["filter"] not in DROP_FILTERS and wanted["filter"] not in DROP_FILTERS else set()
    if wanted.get("update_engine") == "auto":  # the run recorded the engine auto chose
        unused.add("update_engine")
    keys = (set(saved) | set(wanted)) - set(PRESENTATION_KEYS) - unused
    return sorted(k for k in keys if saved.get(k) != wanted.get(k))


# Evaluation episode e of seed s is reset with EPISODE_SEED_BASE + s * EPISODE_SEED_STRIDE + e: the
# methods of one seed share their episodes (paired), and no two seeds share any.
EPISODE_SEED_BASE = 100_000
EPISODE_SEED_STRIDE = 10_000


def episode_seed_base(seed: int) -> int:
    """The first evaluation-episode seed of a comparison's runs with training seed ``seed``."""
    return EPISODE_SEED_BASE + seed * EPISODE_SEED_STRIDE


def episode_seeds(config: PPOConfig) -> range:
    """The reset seeds of a run's evaluation episodes."""
    return range(config.eval_seed, config.eval_seed + config.eval_episodes)


@dataclass
class CompareConfig:
    """Multi-seed comparison of methods against a reference (``rlinfluence compare``)."""

    env: str = "FrozenLake-v1"
    """gymnasium env id (a preset gives the paper's hyperparameters, p and round count)"""
    methods: tuple[str, ...] = ("ppo", "iif", "random")
    """method specs FILTER[@key=value,...] or NAME=FILTER@key=value,..., space-separated (or
    comma-separated); filters: ppo (standard), iif, iif-robust, random, advantage, td-error, reward-extremes,
    dtv, advantage-sign, oracle (with --corrupt)"""
    reference: str = "ppo"
    """the method every metric is computed against (a label or spec among --methods)"""
    seeds: int = 5
    """number of evaluation seeds (first_seed, first_seed + 1, ...)"""
    first_seed: int = 1
    """the first evaluation seed"""
    rounds: Annotated[int | None, StatedDefault, shown_as("INT")] = None
    """rounds per run (default: the preset's standard-PPO round count)"""
    drop_pct: Annotated[float | None, StatedDefault, shown_as("FLOAT")] = None
    """p for iif and the baselines (default: the preset's)"""
    eval_episodes: Annotated[int | None, StatedDefault, shown_as("INT")] = None
    """evaluation episodes per round (default: the preset's)"""
    set: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """further PPOConfig overrides for every run, as key=value (e.g. optimizer=adam)"""
    corrupt: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """corruptions of every run's training data, KIND:key=value,... (rlinfluence.corruptions; the
    same envs and episodes for every method of a seed); evaluation stays clean"""
    tune: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """tune every method over key=v1,v2,... (several keys, space-separated: their product) on
    the tuning seeds, then evaluate each with its best value"""
    tune_only: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """with --tune: tune only these methods (labels, the reference among them); every other method
    runs at the reference's chosen values (labelled so), as a protocol that tunes the few methods
    that matter and saves the rest of the grid"""
    tune_seeds: int = 2
    """number of tuning seeds (tune_first_seed, ...), disjoint from the evaluation seeds"""
    tune_first_seed: int = 1001
    """the first tuning seed"""
    tune_metric: TuneMetric = "auc"
    """tuning score: auc (normalised area under the eval curve), final (plateau), rounds80"""
    out: Annotated[str | None, StatedDefault, shown_as("PATH")] = None
    """output folder (default runs/compare__<env>__<time>); re-run with it to resume"""
    workers: int = os.cpu_count() or 1
    """local worker processes"""
    ray_address: Annotated[str | None, shown_as("ADDRESS")] = None
    """run the pairs as Ray tasks on this cluster (auto or HOST:PORT) instead"""
    smooth: int = 1
    """moving-average window (rounds) applied to every curve before the metrics"""
    clock: Clock = "wall"
    """RT figures from wall seconds, or from process CPU seconds (robust to other load on the machine)"""
    bootstrap_reps: int = DEFAULT_REPS
    """bootstrap replications of every interval"""
    bootstrap_seed: int = 0
    """seed of every bootstrap: the same seed gives the same intervals"""
    progress: bool = True
    """show a progress bar of finished pairs"""
    wandb: bool = False
    """log every pair to Weights & Biases, as CleanRL's --track: one W&B run per pair, grouped by
    this comparison's folder name, tagged with its method and env"""
    confirm: Annotated[str | None, shown_as("PATH")] = None
    """confirm an earlier study: its compare.json (or folder); its env, methods, settings and
    chosen values are rerun without tuning on --first-seed/--seeds, which must be seeds (and so
    evaluation episodes) that study never used for tuning or evaluation"""

    def run_config(self, method: MethodSpec | str, seed: int, extra: dict[str, Any] | None = None) -> PPOConfig:
        """The validated ``PPOConfig`` of one run: the env's preset, then drop_pct,
        eval_episodes and --set, then the method's own overrides and ``extra`` (a tuning
        point); rounds are converted to env steps last, with the final n_steps and n_envs."""
        spec = parse_methods(method)[0] if isinstance(method, str) else method
        # a study pins the torch update (its published ones were trained with it; --set or a method's
        # @update_engine=... choose another), so that a seed reproduces them
        overrides: dict[str, Any] = {"seed": seed, "progress": False, "eval_seed": episode_seed_base(seed),
                                     "update_engine": "torch"}
        if self.drop_pct is not None:
            overrides["drop_pct"] = self.drop_pct
        if self.eval_episodes is not None:
            overrides["eval_episodes"] = self.eval_episodes
        overrides.update(parse_overrides(self.set))
        if self.corrupt:
            overrides["corrupt"] = tuple(self.corrupt)
        if self.wandb:
            overrides.update(wandb=True, wandb_group=Path(self.out).name if self.out else f"compare__{self.env}",
                             wandb_tags=(spec.label, self.env))
        overrides.update(spec.config_overrides())
        overrides.update(extra or {})
        try:
            config = PPOConfig.for_env(self.env, **overrides)
        except TypeError as exc:
            raise UserError(f"invalid settings for {spec.label!r}: {exc}") from None
        if self.rounds is not None:
            config.total_timesteps = self.rounds * config.rollout_size
        try:
            config.validate()
        except UserError as exc:
            raise UserError(f"method {spec.label!r}: {exc}") from None
        if config.eval_episodes < 1:  # every metric is computed on the evaluation curve
            raise UserError(f"a comparison needs eval_episodes >= 1, got {config.eval_episodes}")
        if config.eval_every != 1:
            raise UserError(f"a comparison reads every round's evaluation: eval_every must be 1, got {config.eval_every}")
        return config
