"""Faults that hide from the reward: does the audit's verdict find the broken worker, how soon, by
which families, and does its reading name the fault?

    python benchmarks/faults/hidden_faults.py detect --seeds 5 --clean-seeds 10 --rounds 8 --out bench_out/hidden_faults
    python benchmarks/faults/hidden_faults.py summary --out bench_out/hidden_faults --data docs/data

Per env, fault and seed, one run of plain PPO (8 envs x 256 steps a round, the last env trusted,
PPO's learning rate tuned on clean data where ``studies/<env>.json`` has it, every round saved,
TracIn recorded) with ``--corrupt <fault>``; and clean runs. After each round r the verdict
(``rlinfluence.analysis.audit.verdict_table``: every family but the gradient ones, version 4's; the
exact, outlier and calibration tests at alpha 0.01 across sources x families; and in the ``grad_``
columns the same with the gradient families too, ``audit --gradient-families``) is computed on rounds 0..r (with ``--window W``,
on the last W rounds, as a monitor would). Per run, one row: the first round count at which the
broken source is flagged by the verdict and by each family, the fault class read at that point,
and every false flag (a clean source flagged at any check). A fault given ``from=R`` (``--faults``)
breaks its env at round R: ``summary`` counts its rounds to flag from R (``start``).

    python benchmarks/faults/hidden_faults.py detect --faults 'logp-mismatch:envs=1,temperature=2,from=10' --clean-seeds 0 --rounds 16 --window 6 --out bench_out/hf_late
Rows are appended to ``<out>/runs.csv`` as runs finish; a re-run skips finished runs, and jobs
run in ``--workers`` processes, seed by seed, so a cut-off run still covers every env and fault.

``summary`` writes ``<data>/<name>_runs.csv`` (the per-run rows), ``<data>/<name>_table.txt``
(the results page's table) and ``figures/<name>_rounds.png`` beside the data folder (``--name``, default ``hidden_faults``), and prints one line per
figure: ``<env>/<fault>/flagged_within_5: k/n``, ``.../reading_right: k/m``,
``<env>/clean/runs_with_a_false_flag: k/n [Clopper-Pearson 95%]``, and per fault the families
that flag it within 5 rounds on most seeds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from filelock import FileLock  # noqa: E402

from rlinfluence.analysis.harm import ATTRIBUTION_FAMILIES  # noqa: E402
from rlinfluence.experiments.tuning import widen_past_edge  # noqa: E402
from rlinfluence.statistics import clopper_pearson  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402
import held_out_faults  # noqa: E402

STUDIES = harness.STUDIES
ENVS = ("CartPole-v1", "Acrobot-v1", "LunarLander-v3", "MiniGrid-Empty-8x8-v0")
FAULTS = ("action-mismatch:envs=1,mode=actuator", "action-mismatch:envs=1,mode=log", "reward-delay:envs=1,lag=10",
          "done-flag:envs=1,mode=truncation-as-termination", "done-flag:envs=1,mode=termination-as-truncation",
          "obs-bug:envs=1,mode=scale", "obs-bug:envs=1,mode=swap", "obs-bug:envs=1,mode=lag",
          "logp-mismatch:envs=1,temperature=2", "action-mismatch:envs=2,mode=actuator", "obs-bug:envs=2,mode=lag")
ALPHA = 0.01
WITHIN = 5


def _config(env: str, fault: str | None, seed: int, rounds: int, scratch: Path, **overrides):
    from rlinfluence.ppo import PPOConfig

    study = STUDIES / f"{env}.json"
    lr = {"learning_rate": json.loads(study.read_text())["chosen"]["ppo"]["learning_rate"]} if study.is_file() else {}
    settings = {"n_envs": 8, "n_steps": 256, "batch_size": 64, **lr, "seed": seed, "total_timesteps": rounds * 2048,
                "eval_episodes": 0, "corrupt": (fault,) if fault else (), "trusted_envs": 1, "save_buffers": True,
                "tracin": True, "run_root": str(scratch), "method": f"s{seed}", "progress": False,
                "tensorboard": False}
    return PPOConfig.for_env(env, **{"update_engine": "torch", **settings, **overrides})  # the engine of its published runs


def append_row(path: Path, row: dict) -> None:
    """Append one result row to ``path`` under a file lock (workers share it; a re-run resumes from
    it), its values under the file's own header (a key the header lacks is an error; a column the
    row lacks is left empty)."""
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            pd.DataFrame([row]).to_csv(path, index=False)
            return
        header = list(pd.read_csv(path, nrows=0).columns)
        unknown = set(row) - set(header)
        if unknown:
            raise ValueError(f"{path} has no column for {sorted(unknown)}")
        pd.DataFrame([row]).reindex(columns=header).to_csv(path, mode="a", header=False, index=False)


def finished(path: Path, keys: list[str]) -> set[tuple]:
    """The ``keys`` of the rows already in ``path`` (none if it does not exist)."""
    if not path.is_file():
        return set()
    prior = pd.read_csv(path)
    return set(zip(*(prior[k] for k in keys), strict=True))


HELD_OUT = "held-out:"
"""A fault given as ``held-out:<kind>`` is one of ``held_out_faults.KINDS``, put around one env by a wrapper."""
N_ENVS = 8


def truth_class(fault: str) -> str:
    """The fault class a right reading names: the held-out kind's, or the ``--corrupt`` kind's."""
    from rlinfluence.readings import KIND_CLASS

    if fault.startswith(HELD_OUT):
        return held_out_faults.ALL_KINDS[fault.removeprefix(HELD_OUT)][0]
    return KIND_CLASS[fault.split(":")[0]]


def reading_outcome(fault_class: str, candidates: str, truth: str) -> str:
    """right (the true class named), undetermined (not named, but among the candidates) or wrong."""
    if fault_class == truth:
        return "right"
    return "undetermined" if fault_class == "undetermined" and truth in candidates.split(";") else "wrong"


def _train_native(env: str, fault: str | None, seed: int, rounds: int, scratch: Path) -> tuple[Path, set, int]:
    """(run directory, broken envs, the round the fault starts) of one run of rlinfluence's PPO."""
    from rlinfluence.ppo import PPO

    held_out = fault is not None and fault.startswith(HELD_OUT)
    trainer = PPO(_config(env, None if held_out else fault, seed, rounds, scratch))
    if held_out:
        broken = held_out_faults.broken_env(seed, N_ENVS - 1)
        held_out_faults.break_env(trainer.stream.env, fault.removeprefix(HELD_OUT), broken, seed)
        trainer.stream.reset(trainer.config.seed)  # the trainer reset its envs when built: again, the broken one wrapped
        return trainer.learn().run.path, {broken}, 0
    trainer.learn()
    if not fault:
        return trainer.run.path, set(), 0
    return (trainer.run.path, set(np.flatnonzero(trainer.corruptor.broken_envs).tolist()),
            max(spec.start for spec in trainer.corruptor.specs))


def _train_sb3(env: str, fault: str | None, seed: int, rounds: int, scratch: Path) -> tuple[Path, set, int]:
    """The same with Stable-Baselines3's PPO (its defaults but 8 envs x 256 steps and minibatches of
    64), written by ``RunDirectoryCallback``; faults are held-out kinds only (``--corrupt`` is rlinfluence's)."""
    import torch
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.env_util import make_vec_env

    from rlinfluence.envs import make_env
    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback

    if fault is not None and not fault.startswith(HELD_OUT):
        raise SystemExit(f"--trainer sb3 takes held-out faults only, got {fault!r}")
    torch.set_num_threads(1)
    vec_env = make_vec_env(lambda: make_env(env), n_envs=N_ENVS, seed=seed)
    broken: set = set()
    if fault:
        broken = {held_out_faults.broken_env(seed, N_ENVS)}
        held_out_faults.break_env(vec_env, fault.removeprefix(HELD_OUT), next(iter(broken)), seed)
    model = SB3PPO("MlpPolicy", vec_env, n_steps=256, batch_size=64, seed=seed, device="cpu")
    model.learn(rounds * 256 * N_ENVS, callback=RunDirectoryCallback(scratch / "run", eval_episodes=0))
    return scratch / "run", broken, 0


RLLIB_RUNNERS, RLLIB_SUB_ENVS = 2, 4
"""RLlib's layout: 2 env runners x 4 sub-envs, the 8 sources of the project's own runs."""


def _train_rllib(env: str, fault: str | None, seed: int, rounds: int, scratch: Path,
                 quarantine: bool = False) -> tuple[Path, set, int]:
    """The same with RLlib's PPO (its defaults but 2 env runners x 4 sub-envs and 2048 steps an
    iteration), written by ``rlinfluence.integrations.rllib`` (with ``quarantine``, quarantining
    too): the held-out kind wraps one sub-env of one runner, chosen by the seed among the 8, when the
    runner builds its envs."""
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig as RLlibPPOConfig

    from rlinfluence.integrations.rllib import run_callback

    if fault is not None and not fault.startswith(HELD_OUT):
        raise SystemExit(f"--trainer rllib takes held-out faults only, got {fault!r}")
    if not ray.is_initialized():  # the workers import held_out_faults from here
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    broken = held_out_faults.broken_env(seed, N_ENVS) if fault else None
    recorder = run_callback(scratch / "run", quarantine=quarantine)
    if fault:
        runner, sub_env = divmod(broken, RLLIB_SUB_ENVS)
        kind = fault.removeprefix(HELD_OUT)

        def on_environment_created(self, *, env_runner, env, **kwargs):
            if env_runner.worker_index == runner + 1:
                held_out_faults.break_env(env, kind, sub_env, seed)

        recorder = type("FaultyRunCallback", (recorder,), {"on_environment_created": on_environment_created,
                                                            "__qualname__": "_train_rllib.<locals>.FaultyRunCallback"})
    config = (RLlibPPOConfig().environment(env)
              .env_runners(num_env_runners=RLLIB_RUNNERS, num_envs_per_env_runner=RLLIB_SUB_ENVS)
              .training(train_batch_size_per_learner=2048).debugging(seed=seed).callbacks(recorder))
    algorithm = config.build_algo()
    try:
        for _ in range(rounds):
            algorithm.train()
    finally:
        algorithm.stop()
    return scratch / "run", set() if broken is None else {broken}, 0


def run_one(env: str, fault: str | None, seed: int, rounds: int, out: Path, window: int = 0,
            trainer: str = "native") -> dict:
    """Train, score every round, and check the verdict after each round (module docstring)."""
    from rlinfluence.analysis.audit import verdict_families, verdict_table
    from rlinfluence.analysis.harm import harm_table, scorers_of
    from rlinfluence.checkpoint import load_round
    from rlinfluence.sources import VERDICT_VERSION

    scratch = out / "scratch" / f"{trainer}__{env}__{fault or 'clean'}__{seed}".replace(":", "_").replace(",", "_")
    shutil.rmtree(scratch, ignore_errors=True)
    cpu0 = time.process_time()
    train = {"native": _train_native, "sb3": _train_sb3, "rllib": _train_rllib}[trainer]
    path, broken, start = train(env, fault, seed, rounds, scratch)
    train_cpu = time.process_time() - cpu0
    # another trainer's run has no trusted env, and no TracIn recorded in its rounds (a replay per round would dominate)
    native = trainer == "native"
    scored = [f for f in scorers_of(1 if native else 0) if f != "random" and (native or f != "tracin")]
    families = verdict_families(scored)  # the verdict's own (version 4: no gradient families)
    asked = verdict_families(scored, gradient_families=True)  # with --gradient-families: the comparison arm
    tables = []
    row: dict = {"env": env, "fault": fault or "clean", "seed": seed, "trainer": trainer, "rounds": rounds,
                 "start": start, "window": window, "verdict_version": VERDICT_VERSION,
                 "broken": " ".join(map(str, sorted(broken)))}
    for prefix in ("", "seq_", "looks_", "grad_"):
        row |= {f"{prefix}verdict_round": np.nan, f"{prefix}reading": "", f"{prefix}candidates": "",
                f"{prefix}reading_outcome": "", f"{prefix}reading_right": np.nan, f"{prefix}false_flags": "",
                f"{prefix}false_signatures": "", f"{prefix}signature": ""}
    row |= {"final_flagged": "", "p_at_flag": ""}
    row |= {f"round_{f}": np.nan for f in scorers_of(1) if f != "random"}
    truth = truth_class(fault) if fault else ""
    cpu1 = time.process_time()
    for k in range(rounds):
        tables.append(harm_table(load_round(path, k), scored))
        audited = pd.concat(tables[max(0, k + 1 - window):] if window else tables, ignore_index=True)
        verdict = verdict_table(audited, families, ALPHA)
        active = broken if k >= start else set()  # before a from=R fault begins, every flag is a false one
        found = _note(row, "", verdict, k, active, truth)
        if len(found) and not row["p_at_flag"]:
            row["p_at_flag"] = json.dumps({c[2:]: round(float(found[c].iloc[0]), 6) for c in found.columns
                                           if c.startswith("p_") and c != "p_adjusted_min"})
        # alpha 0.01 per audit with the gradient families asked (audit --gradient-families: version 3's families)
        with_gradients = _note(row, "grad_", verdict_table(audited, asked, ALPHA), k, active, truth)
        for family in asked:  # each family's first flag: the gradient families' in the arm that tests them
            signatures = (found if family in families else with_gradients)["signature"]
            if np.isnan(row[f"round_{family}"]) and any(family in str(s).split(";") for s in signatures):
                row[f"round_{family}"] = k + 1
        # the per-run guarantee: the (k+1)-th audit of a run at alpha / ((k+1)(k+2)), which sum to alpha
        sequential = verdict if verdict["p_adjusted_min"].min() >= ALPHA else \
            verdict_table(audited, families, sequential_alpha(ALPHA, k + 1))
        _note(row, "seq_", sequential, k, active, truth)
        level = looks_alpha(ALPHA, k + 1)  # the per-run guarantee at looks 1, 2, 4, 8, ... only
        if level is not None:
            _note(row, "looks_", verdict if verdict["p_adjusted_min"].min() >= ALPHA else
                  verdict_table(audited, families, level), k, active, truth)
        if k == rounds - 1:
            row["final_flagged"] = " ".join(map(str, verdict.loc[verdict["flagged"], "source"].astype(int)))
    row["train_cpu_s"], row["audit_cpu_s"] = train_cpu, time.process_time() - cpu1
    shutil.rmtree(scratch, ignore_errors=True)
    append_row(out / "runs.csv", row)
    return row


def sequential_alpha(alpha: float, look: int) -> float:
    """The level of a run's ``look``-th audit (1, 2, ...) that keeps its chance of any false flag, over
    every audit, at most ``alpha``: alpha / (look (look + 1)), whose sum over all looks is alpha
    (fixed in the held-out protocol before it was measured; the library's ``audit --guarantee run``)."""
    from rlinfluence.sources import audit_level

    return audit_level(alpha, look, "run")


def looks_alpha(alpha: float, audit: int) -> float | None:
    """The level of a run's ``audit``-th audit (1, 2, ...) in the looks arm of the second held-out
    protocol: only audits 1, 2, 4, 8, ... (the i-th look, at audit 2^(i-1)) may flag, the i-th at
    alpha / (i (i + 1)), which sum to alpha over all looks; None at the other audits. It spends alpha
    on fewer, more informative audits than ``sequential_alpha``: its look at audit 4 is at alpha / 12
    where that arm's is at alpha / 20."""
    if audit & (audit - 1):
        return None
    look = audit.bit_length()
    return alpha / (look * (look + 1))


def _note(row: dict, prefix: str, verdict: pd.DataFrame, k: int, active: set, truth: str) -> pd.DataFrame:
    """Record the audit after round k in ``row``'s ``prefix`` columns: its false flags, and the first
    flag of a broken source with its reading; returns the flagged broken sources' rows."""
    flagged = verdict[verdict["flagged"]]
    found = flagged[flagged["source"].isin(active)]
    false = sorted(set(flagged["source"].astype(int)) - active)
    if false:
        row[f"{prefix}false_flags"] += f"{k + 1}:{','.join(map(str, false))} "
        # which families flagged each: what a false flag's cause is read from, without re-running the run
        signatures = flagged.set_index(flagged["source"].astype(int))["signature"]
        row[f"{prefix}false_signatures"] += "".join(f"{k + 1}:{s}:{signatures[s]} " for s in false)
    if len(found) and np.isnan(row[f"{prefix}verdict_round"]):
        first = found.iloc[0]
        row[f"{prefix}verdict_round"] = k + 1
        row[f"{prefix}reading"], row[f"{prefix}candidates"] = first["fault_class"], first["candidates"]
        row[f"{prefix}reading_outcome"] = reading_outcome(first["fault_class"], first["candidates"], truth)
        row[f"{prefix}reading_right"] = float(row[f"{prefix}reading_outcome"] == "right")
        row[f"{prefix}signature"] = first["signature"]
    return found


def held_out_jobs(envs: list[str], out: Path, trainer: str, clean_seeds: int, protocol: int = 2) -> list[tuple]:
    """The held-out protocol's runs (``held_out_faults.PROTOCOLS[protocol]``): each kind that applies on
    each env on the fault seeds, ``ROUNDS`` rounds; clean runs on the first ``clean_seeds`` seeds,
    ``CLEAN_ROUNDS`` rounds."""
    from rlinfluence.sources import VERDICT_VERSION

    if protocol != VERDICT_VERSION:
        raise SystemExit(f"--protocol {protocol} measures verdict version {protocol}; this code's is {VERDICT_VERSION}")
    kinds, seeds, fault_seeds = held_out_faults.PROTOCOLS[protocol]
    jobs = []
    for seed in seeds[:max(clean_seeds, len(fault_seeds))]:
        for env in envs:
            if seed in fault_seeds:
                jobs += [(env, f"{HELD_OUT}{kind}", seed, held_out_faults.ROUNDS, out, 0, trainer)
                         for kind in kinds if held_out_faults.applies(kind, env)]
            if seed < seeds[0] + clean_seeds:
                jobs.append((env, None, seed, held_out_faults.CLEAN_ROUNDS, out, 0, trainer))
    return jobs


def detect(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    envs = args.envs.split(",")
    if args.held_out:
        jobs = held_out_jobs(envs, out, args.trainer, args.clean_seeds, args.protocol)
    else:
        chosen = args.faults.split(";") if args.faults else list(FAULTS)
        jobs = []
        for seed in range(1, max(args.seeds, args.clean_seeds) + 1):
            for env in envs:
                faults = (chosen if seed <= args.seeds else []) + ([None] if seed <= args.clean_seeds else [])
                jobs += [(env, fault, seed, args.rounds, out, args.window, args.trainer) for fault in faults
                         if not (fault == "obs-bug:envs=1,mode=swap" and env == "FrozenLake-v1")]
    done = finished(out / "runs.csv", ["env", "fault", "seed"])
    jobs = [job for job in jobs if (job[0], job[1] or "clean", job[2]) not in done]
    print(f"{len(jobs)} runs to go", flush=True)
    with ProcessPoolExecutor(args.workers) as pool:
        for row in pool.map(run_one, *zip(*jobs, strict=True)) if jobs else []:
            print(f"{row['env']} {row['fault']} seed {row['seed']}: verdict round {row['verdict_round']} "
                  f"({row['reading']}) false {row['false_flags'].strip() or '-'}", flush=True)


LEARN_ARMS = {"ppo": {"filter": "none"}, "oracle": {"filter": "oracle"}, "quarantine": {"filter": "quarantine"},
              "iif": {"filter": "iif"}, "random": {"filter": "random", "drop_pct": 12.5, "random_match": "pct"},
              "iif-robust": {"filter": "iif-robust"}, "iif-trusted": {"filter": "iif", "scoring_target": "trusted"},
              "dtv": {"filter": "dtv"}, "advantage-sign": {"filter": "advantage-sign"}}


class Recording:
    """Wraps a filter and keeps, per round, how many records it dropped and how many of those were
    corrupted, and how many records the round had and how many of those were corrupted."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.dropped, self.dropped_corrupted, self.records, self.corrupted = [], [], [], []

    def __call__(self, buffer, context):
        keep = self.inner(buffer, context)
        corrupted = buffer.flat("corrupted")
        self.dropped.append(int((~keep).sum()))
        self.dropped_corrupted.append(int((~keep & corrupted).sum()))
        self.records.append(len(keep))
        self.corrupted.append(int(corrupted.sum()))
        return keep

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def learn_one(env: str, fault: str, arm: str, seed: int, rounds: int, out: Path, learning_rate: float | None = None,
              table: str = "learn.csv") -> dict:
    """One training run of ``arm`` under ``fault`` (at ``learning_rate``, else PPO's clean-tuned one): the
    evaluation return per round, CPU and what it dropped, appended to ``<out>/<table>``."""
    from rlinfluence.errors import UserError
    from rlinfluence.ppo import PPO

    config = _config(env, None if fault == "clean" else fault, seed, rounds, out / "scratch", save_buffers=False, tracin=False, eval_episodes=20,
                     eval_envs=10, **LEARN_ARMS[arm],
                     **({"learning_rate": learning_rate} if learning_rate else {}))
    trainer = PPO(config, run_dir=False)  # the filter the config names, with every option it sets
    trainer.filter = recording = Recording(trainer.filter)
    returns: list[float] = []
    try:
        trainer.learn(callback=lambda _, metrics: returns.append(metrics["eval_return_mean"]))
        diverged = np.nan
    except UserError:  # a non-finite loss or weights: the run counts, padded (``with_divergence_padded``)
        diverged = len(returns)
    dropped = sum(recording.dropped)
    row = {"env": env, "fault": fault, "arm": arm, "seed": seed, "rounds": rounds,
           "learning_rate": config.learning_rate,
           "auc": float(np.mean(returns)) if np.isnan(diverged) else np.nan,
           "final": float(np.mean(returns[-3:])) if np.isnan(diverged) else np.nan, "diverged": diverged,
           "train_cpu_s": trainer.train_cpu_seconds, "dropped": dropped,
           "rounds_dropping": sum(d > 0 for d in recording.dropped),
           "selectivity": sum(recording.dropped_corrupted) / dropped if dropped else np.nan,
           # the share of corrupted records: K/8 for a fault of K whole envs, measured for one that
           # corrupts a fraction of the episodes (reward noise, a trigger)
           "base_rate": sum(recording.corrupted) / max(sum(recording.records), 1), "returns": " ".join(f"{r:.4g}" for r in returns)}
    append_row(out / table, row)
    return row


def learn(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = finished(out / "learn.csv", ["env", "fault", "arm", "seed"])
    settings = [tuple(s.split("/")) for s in args.settings.split(";")]
    arms = args.arms.split(",") if args.arms else list(LEARN_ARMS)
    jobs = [(env, fault, arm, seed, args.rounds, out) for seed in range(args.first_seed, args.seeds + 1)
            for env, fault in settings for arm in arms if (env, fault, arm, seed) not in done
            and not (fault == "clean" and arm == "oracle")]  # on clean data the oracle is PPO
    print(f"{len(jobs)} runs to go", flush=True)
    with ProcessPoolExecutor(args.workers) as pool:
        for row in pool.map(learn_one, *zip(*jobs, strict=True)) if jobs else []:
            print(f"{row['env']} {row['fault']} {row['arm']} seed {row['seed']}: auc {row['auc']:.4g} "
                  f"selectivity {row['selectivity']:.3f}", flush=True)


def with_divergence_padded(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with every diverged run (``diverged`` = the round its training stopped at) counted:
    its returns after that round set to the worst evaluation return of any run of its env and fault
    in ``runs``, and its auc and final computed from them (as ``compare`` counts a diverged pair), so
    a learning rate or a method that diverges is not judged on the runs that survived."""
    runs = runs.copy()
    if "diverged" not in runs:
        return runs
    curves = runs["returns"].fillna("").astype(str).str.split().apply(lambda r: [float(x) for x in r])
    for _, group in runs.groupby(["env", "fault"]):
        worst = min((min(c) for c in curves[group.index] if c), default=np.nan)
        for i in group.index[group["diverged"].notna()]:
            padded = curves[i] + [worst] * (int(runs.at[i, "rounds"]) - len(curves[i]))
            runs.at[i, "auc"], runs.at[i, "final"] = float(np.mean(padded)), float(np.mean(padded[-3:]))
    return runs


TUNE_FACTORS = (0.5, 1.0, 2.0)
MAX_GRID = 8


def tuned_learning_rates(pool, env: str, fault: str, arms: list[str], args: argparse.Namespace, out: Path) -> dict:
    """Each arm's learning rate for ``fault`` on ``env``: the grid PPO's clean-tuned rate x ``TUNE_FACTORS``,
    widened by a factor 2 past an edge while the best mean auc over the tuning seeds sits on it (at most
    ``MAX_GRID`` points), so that every choice is interior to the grid it was chosen from."""
    base = _config(env, None, 1, 1, out / "scratch").learning_rate
    grids = {arm: sorted(float(f"{base * f:.6g}") for f in TUNE_FACTORS) for arm in arms}
    tuning_seeds = range(args.tuning_first_seed, args.tuning_first_seed + args.tuning_seeds)
    while True:
        done = finished(out / "tune.csv", ["env", "fault", "arm", "seed", "learning_rate"])
        jobs = [(env, fault, arm, seed, args.rounds, out, lr, "tune.csv") for arm in arms for lr in grids[arm]
                for seed in tuning_seeds if (env, fault, arm, seed, lr) not in done]
        for row in pool.map(learn_one, *zip(*jobs, strict=True)) if jobs else []:
            print(f"tune {env} {fault} {row['arm']} lr {row['learning_rate']:.3g} seed {row['seed']}: "
                  f"auc {row['auc']:.4g}" + (f" (diverged at round {row['diverged']})" if row["diverged"] >= 0 else ""),
                  flush=True)
        runs = pd.read_csv(out / "tune.csv")
        runs = with_divergence_padded(runs[(runs["env"] == env) & (runs["fault"] == fault)
                                           & runs["seed"].isin(tuning_seeds)])
        chosen, widened = {}, False
        for arm in arms:
            means = runs[runs["arm"] == arm].groupby("learning_rate")["auc"].mean().reindex(grids[arm])
            best = float(means.idxmax())
            chosen[arm] = best
            wider = widen_past_edge(grids[arm], best, MAX_GRID)
            if wider:
                grids[arm], widened = wider, True
        if not widened:
            return {arm: {"learning_rate": chosen[arm], "grid": grids[arm],
                          "interior": chosen[arm] not in (grids[arm][0], grids[arm][-1])} for arm in arms}


def tune(args: argparse.Namespace) -> None:
    """Per setting: every arm's learning rate tuned on the tuning seeds (``tuned_learning_rates``), written to
    ``<out>/chosen.json``, then every arm trained at its own rate on the evaluation seeds (``learn.csv``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen_path = out / "chosen.json"
    arms = args.arms.split(",") if args.arms else list(LEARN_ARMS)
    with ProcessPoolExecutor(args.workers) as pool:
        for env, fault in (tuple(s.split("/")) for s in args.settings.split(";")):
            setting_arms = [a for a in arms if not (fault == "clean" and a == "oracle")]  # on clean data it is PPO
            chosen = json.loads(chosen_path.read_text()) if chosen_path.is_file() else {}
            key = f"{env}/{fault}"
            if key not in chosen or set(chosen[key]) != set(setting_arms):
                chosen[key] = tuned_learning_rates(pool, env, fault, setting_arms, args, out)
                chosen_path.write_text(json.dumps(chosen, indent=1))
            print(f"{key}: " + ", ".join(f"{a} {c['learning_rate']:.3g}" for a, c in chosen[key].items()), flush=True)
            done = finished(out / "learn.csv", ["env", "fault", "arm", "seed"])
            jobs = [(env, fault, arm, seed, args.rounds, out, chosen[key][arm]["learning_rate"])
                    for seed in range(args.first_seed, args.seeds + 1) for arm in setting_arms
                    if (env, fault, arm, seed) not in done]
            for row in pool.map(learn_one, *zip(*jobs, strict=True)) if jobs else []:
                print(f"{env} {fault} {row['arm']} seed {row['seed']}: auc {row['auc']:.4g} "
                      f"selectivity {row['selectivity']:.3f}", flush=True)


def learn_table(runs: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(the results table's lines, the summary lines) of per-run learning rows (``learn.csv``, or the
    committed ``docs/data/<name>.csv``, from which ``publish_results.py --check`` rebuilds the table):
    paired differences of auc to PPO and to the oracle (t intervals), the share of the oracle's gain
    (Fieller's interval), each arm's learning rate, selectivity and CPU per arm, and the clean runs'
    false quarantines (Clopper-Pearson)."""
    from rlinfluence.statistics import ci95, ratio_ci95

    runs = with_divergence_padded(runs.drop_duplicates(["env", "fault", "arm", "seed"], keep="last"))
    summary: list[str] = []
    lines = ["| env | fault | arm | lr | seeds | auc | auc - ppo's, paired [95% t] | auc - oracle's, paired [95% t] | "
             "share of the oracle's gain [95% Fieller] | selectivity (base rate) | CPU / PPO's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (env, fault), group in runs.groupby(["env", "fault"], sort=False):
        by_arm = {arm: g.set_index("seed") for arm, g in group.groupby("arm")}
        # decimals for about three significant digits of the setting's auc (CartPole's hundreds, MiniGrid's 0.5)
        scale = float(group["auc"].abs().max())
        digits = max(1, 2 - math.floor(math.log10(scale))) if scale > 0 else 1
        for arm, g in by_arm.items():
            cells = []
            for reference in ("ppo", "oracle"):
                seeds = g.index.intersection(by_arm[reference].index) if reference in by_arm else []
                diff = (g.loc[seeds, "auc"] - by_arm[reference].loc[seeds, "auc"]).to_numpy() if len(seeds) else []
                if len(diff) >= 2 and arm != reference:
                    mean, low, high = ci95(diff)
                    cells.append(f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]")
                    summary.append(f"{env}/{fault}/{arm}/auc_minus_{reference}: {mean:+.{digits + 1}f} "
                                   f"[{low:+.{digits + 1}f}, {high:+.{digits + 1}f}] (n={len(diff)})")
                else:
                    cells.append("-")
            share = "-"
            if arm not in ("ppo", "oracle") and {"ppo", "oracle"} <= set(by_arm):
                seeds = g.index.intersection(by_arm["ppo"].index).intersection(by_arm["oracle"].index)
                if len(seeds) >= 2:
                    ppo = by_arm["ppo"].loc[seeds, "auc"]
                    ratio, low, high = ratio_ci95(g.loc[seeds, "auc"] - ppo, by_arm["oracle"].loc[seeds, "auc"] - ppo)
                    share = f"{ratio:.2f} [{low:.2f}, {high:.2f}]"
                    summary.append(f"{env}/{fault}/{arm}/share_of_oracle_gain: {share} (n={len(seeds)})")
            lr = f"{g['learning_rate'].iloc[0]:.3g}" if "learning_rate" in g else "-"
            cpu = g["train_cpu_s"].mean() / by_arm["ppo"]["train_cpu_s"].mean() if "ppo" in by_arm else np.nan
            selectivity = g["selectivity"].mean()
            failed = g.index[g["diverged"].notna()].tolist() if "diverged" in g else []
            arm_cell = f"{arm} (diverged: seeds {' '.join(map(str, failed))})" if failed else arm
            lines.append(f"| {env} | {fault} | {arm_cell} | {lr} | {len(g)} | {g['auc'].mean():.{digits}f} | {cells[0]} | "
                         f"{cells[1]} | {share} | {'-' if np.isnan(selectivity) else f'{selectivity:.2f}'} "
                         f"({g['base_rate'].iloc[0]:.3f}) | {cpu:.2f} |")
    clean = runs[(runs["fault"] == "clean") & (runs["arm"] == "quarantine")]
    for env, group in clean.groupby("env"):
        rounds, k = int(group["rounds"].sum()), int(group["rounds_dropping"].sum())
        low, high = clopper_pearson(k, rounds)
        summary.append(f"{env}/clean/quarantine_false_rounds: {k}/{rounds} [{low:.3f}, {high:.3f}] "
                       f"(runs with any: {int((group['rounds_dropping'] > 0).sum())}/{len(group)})")
    return lines, summary


def learn_summary(args: argparse.Namespace) -> None:
    """``learn_table`` of ``<out>/learn.csv``, printed; with ``--data``, the rows, the table, the
    tuning runs and choices written as ``<data>/<name>*``."""
    runs = pd.read_csv(Path(args.out) / "learn.csv")
    if args.data:
        runs.to_csv(Path(args.data) / f"{args.name}.csv", index=False)
    lines, summary = learn_table(runs)
    harness.summary(summary)
    chosen_path = Path(args.out) / "chosen.json"
    if chosen_path.is_file():  # written by ``tune``: each arm's grid and whether its choice is interior
        chosen = json.loads(chosen_path.read_text())
        choices = [(key, arm, c) for key, arms in chosen.items() for arm, c in arms.items()]
        print(f"all/tuned_choices_interior: {sum(c['interior'] for *_, c in choices)}/{len(choices)}"
              + "".join(f"; edge: {key} {arm} {c['learning_rate']:.3g} of {c['grid']}"
                        for key, arm, c in choices if not c["interior"]))
        if args.data:
            tuning = pd.read_csv(Path(args.out) / "tune.csv")
            tuning.to_csv(Path(args.data) / f"{args.name}_tuning.csv", index=False)
            (Path(args.data) / f"{args.name}_chosen.json").write_text(json.dumps(chosen, indent=1) + "\n")
    if args.data:
        (Path(args.data) / f"{args.name}_table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _has_false_flag(group: pd.DataFrame, prefix: str = "") -> pd.Series:
    return group[f"{prefix}false_flags"].fillna("").astype(str).str.strip().ne("")


def _outcomes(group: pd.DataFrame, prefix: str = "") -> pd.Series:
    """Each flagged run's reading outcome (right, undetermined, wrong); rows of verdict version 1
    have no ``reading_outcome``: right or wrong by ``reading_right``."""
    flagged = group[group[f"{prefix}verdict_round"].notna()]
    if f"{prefix}reading_outcome" in flagged:
        return flagged[f"{prefix}reading_outcome"].fillna("").astype(str)
    return flagged[f"{prefix}reading_right"].map({1.0: "right", 0.0: "wrong"})


def _reading_cell(outcomes: pd.Series) -> str:
    return "/".join(str(int((outcomes == o).sum())) for o in ("right", "undetermined", "wrong"))


def markdown_table(runs: pd.DataFrame, families: list[str]) -> str:
    """One row per env and fault: seeds, flagged within WITHIN rounds and within the runs' rounds, the
    rounds it took, the reading of the first flag (right / undetermined / wrong), runs with a false
    flag, the same for the per-run arm where the rows have it, and the families that flag it within WITHIN."""
    sequential, paired = "seq_verdict_round" in runs, "grad_verdict_round" in runs
    last = int((runs.loc[runs["fault"] != "clean", "rounds"] - runs.get("start", 0)).max()) \
        if (runs["fault"] != "clean").any() else int(runs["rounds"].max())
    header = (f"| env | fault | seeds | flagged within {WITHIN} rounds | within {last} | rounds to flag (each seed; - = not "
              f"in {last}) | reading right/undetermined/wrong | runs with a false flag |"
              + (f" per-run alpha: within {WITHIN} / {last}, false flags |" if sequential else "")
              + (f" with the gradient families: within {WITHIN} / {last}, false flags |" if paired else "")
              + f" families flagging it within {WITHIN} (seeds) |")
    lines = [header, "|" + "---|" * header.count(" |")]
    for (env, fault), group in runs.groupby(["env", "fault"], sort=False):
        n = len(group)
        false = int(_has_false_flag(group).sum())
        seq_false = int(_has_false_flag(group, "seq_").sum()) if sequential else 0
        if fault == "clean":
            low, high = clopper_pearson(false, n)
            cells = ["-", "-", "-", "-", f"{false}/{n} [{low:.2f}, {high:.2f}]"]
            if sequential:
                low, high = clopper_pearson(seq_false, n)
                cells.append(f"{seq_false}/{n} [{low:.2f}, {high:.2f}]")
            if paired:
                grad_false = int(_has_false_flag(group, "grad_").sum())
                low, high = clopper_pearson(grad_false, n)
                cells.append(f"{grad_false}/{n} [{low:.2f}, {high:.2f}]")
            lines.append(f"| {env} | clean | {n} | " + " | ".join(cells) + " | - |")
            continue
        rounds = " ".join("-" if np.isnan(r) else str(int(r)) for r in group["verdict_round"])
        finders = ", ".join(f"{f} {int((group[f'round_{f}'] <= WITHIN).sum())}" for f in families
                            if (group[f"round_{f}"] <= WITHIN).sum() > 0) or "none"
        cells = [f"{int((group['verdict_round'] <= WITHIN).sum())}/{n}", f"{int(group['verdict_round'].notna().sum())}/{n}",
                 rounds, _reading_cell(_outcomes(group)), f"{false}/{n}"]
        for arm, shown in (("seq_", sequential), ("grad_", paired)):
            if shown:
                cells.append(f"{int((group[f'{arm}verdict_round'] <= WITHIN).sum())}/{n} / "
                             f"{int(group[f'{arm}verdict_round'].notna().sum())}/{n}, "
                             f"{int(_has_false_flag(group, arm).sum())}/{n}")
        lines.append(f"| {env} | {fault} | {n} | " + " | ".join(cells) + f" | {finders} |")
    return "\n".join(lines) + "\n"


HELD_OUT_DATA = ("hidden_faults_held_out", "hidden_faults_held_out_sb3", "hidden_faults_held_out_acrobot")
"""The held-out protocol's per-run rows in docs/data (``<name>_runs.csv``): native on the three target
envs, SB3, and Acrobot apart."""
HELD_OUT_PROTOCOLS = ((HELD_OUT_DATA, "held-out-answer"),
                      (("hidden_faults_held_out_v3", "hidden_faults_held_out_v3_sb3"), "held-out-answer-v3"),
                      (("hidden_faults_held_out_v4", "hidden_faults_held_out_v4_sb3"), "held-out-answer-v4"))
"""Each held-out protocol's rows (native, SB3, Acrobot apart where measured) and the marker of its
answer on the results page: version 2's, version 3's second held-out set, version 4's third."""


def _count(flags: pd.Series) -> str:
    return f"{int(flags.sum())}/{len(flags)}"


def held_out_answer(native: pd.DataFrame, sb3: pd.DataFrame | None = None, acrobot: pd.DataFrame | None = None
                    ) -> list[str]:
    """The held-out results' short answer as markdown list items, every figure computed from the per-run rows: what was
    flagged within ``WITHIN`` rounds per env, the kinds that meet the target (>= 9 of 10 on each
    target env where they apply), the readings right / undetermined / wrong, and the clean runs with
    a false flag under both arms (alpha per audit, and the per-run alpha)."""
    lines = []
    faulty, clean = native[native["fault"] != "clean"], native[native["fault"] == "clean"]
    version = int(native["verdict_version"].iloc[0])
    per_env = ", ".join(f"{env.split('-')[0]} {_count(g['verdict_round'] <= WITHIN)}" for env, g in faulty.groupby("env"))
    kinds = faulty.assign(kind=faulty["fault"].str.removeprefix(HELD_OUT))
    met = [k for k, g in kinds.groupby("kind") if all((e["verdict_round"] <= WITHIN).sum() >= 9 for _, e in g.groupby("env"))]
    outcomes = _outcomes(faulty)
    wrong = outcomes == "wrong"
    lines.append(f"On {kinds['kind'].nunique()} fault kinds and seeds its rules never saw (verdict version {version}, "
                 f"one broken env of 8, 10 seeds per env and kind), the audit flags the broken env within {WITHIN} "
                 f"rounds in {per_env} runs; {len(met)} of {kinds['kind'].nunique()} kinds meet the target (>= 9 of 10 on "
                 f"every target env where they apply){': ' + ', '.join(met) if met else ''}.")
    lines.append("By kind, flagged within 5 rounds: " + "; ".join(
        f"{kind} " + ", ".join(f"{env.split('-')[0]} {_count(e['verdict_round'] <= WITHIN)}" for env, e in g.groupby("env"))
        for kind, g in kinds.groupby("kind", sort=False)) + " (a kind missing on an env does not apply there).")
    families = [c[6:] for c in faulty.columns if c.startswith("round_")]
    gradient = faulty[[f"round_{f}" for f in families if f in ATTRIBUTION_FAMILIES]].min(axis=1)
    other = faulty[[f"round_{f}" for f in families if f not in ATTRIBUTION_FAMILIES]].min(axis=1)
    lines.append(f"Of the {int(faulty['verdict_round'].notna().sum())} flagged runs, "
                 f"{int((gradient.notna() & other.isna()).sum())} were flagged only by the gradient families "
                 "(influence, TracIn, dtv and their variants), never by another family in the run's rounds.")
    lines.append(f"Its readings of {len(outcomes)} first flags: {int((outcomes == 'right').sum())} right, "
                 f"{int((outcomes == 'undetermined').sum())} undetermined (the truth among the candidates), "
                 f"{int(wrong.sum())} wrong: right or undetermined {100 * (1 - wrong.mean()):.0f}% (target >= 90%), "
                 f"wrong {100 * wrong.mean():.0f}% (target <= 5%).")
    k, seq_k = int(_has_false_flag(clean).sum()), int(_has_false_flag(clean, "seq_").sum())
    rounds = int(clean["rounds"].max()) if len(clean) else 0
    lines.append(f"Clean runs audited after each of {rounds} rounds: {k} of {len(clean)} have a false flag at alpha "
                 f"0.01 per audit (target: 0); with the per-run alpha (audit j at 0.01 / (j (j + 1))) {seq_k} of {len(clean)}, "
                 f"at the cost of flagging {_count(faulty['seq_verdict_round'] <= WITHIN)} faulty runs within "
                 f"{WITHIN} rounds instead of {_count(faulty['verdict_round'] <= WITHIN)}.")
    if "looks_verdict_round" in native:  # the second protocol's third arm
        lines.append(f"With the per-run alpha at looks 1, 2, 4, 8, 16 only (look i at 0.01 / (i (i + 1))): "
                     f"{int(_has_false_flag(clean, 'looks_').sum())} of {len(clean)} clean runs with a false flag; "
                     f"faulty runs flagged within {WITHIN} rounds {_count(faulty['looks_verdict_round'] <= WITHIN)}, "
                     f"within {int(faulty['rounds'].max())} {_count(faulty['looks_verdict_round'].notna())}.")
    if "grad_verdict_round" in native:  # the third protocol's paired arm
        lines.append(paired_line(native))
    for name, rows in (("Stable-Baselines3 runs (RunDirectoryCallback)", sb3),
                       ("Acrobot (500-step episodes, reported apart)", acrobot)):
        if rows is not None and len(rows):
            f, c = rows[rows["fault"] != "clean"], rows[rows["fault"] == "clean"]
            lines.append(f"{name}: faulty runs flagged within {WITHIN} rounds {_count(f['verdict_round'] <= WITHIN)}, "
                         f"within {int(f['rounds'].max())} {_count(f['verdict_round'].notna())}; readings wrong "
                         f"{int((_outcomes(f) == 'wrong').sum())} of {len(_outcomes(f))}; clean runs with a false flag "
                         f"{int(_has_false_flag(c).sum())} of {len(c)} per audit, {int(_has_false_flag(c, 'seq_').sum())} "
                         "with the per-run alpha" + (f", {int(_has_false_flag(c, 'looks_').sum())} with it at looks only"
                                                     if "looks_verdict_round" in rows else "") + ".")
            if "grad_verdict_round" in rows:
                paired = paired_line(rows)
                lines.append(f"{name}, {paired[0].lower()}{paired[1:]}")
    return [f"- {line}" for line in lines]  # a list: each figure's sentence on its own line of the page


def paired_line(rows: pd.DataFrame) -> str:
    """The paired arm's sentence: the same runs audited with the gradient families too (``grad_``, alpha
    0.01 per audit) against the verdict without them (alpha 0.01 per audit)."""
    faulty, clean = rows[rows["fault"] != "clean"], rows[rows["fault"] == "clean"]
    without, with_them = faulty["verdict_round"] <= WITHIN, faulty["grad_verdict_round"] <= WITHIN
    return (f"Paired, the same runs with the gradient families asked (version 3's families, alpha 0.01 per audit): "
            f"faulty runs flagged within {WITHIN} rounds {_count(with_them)} (without them {_count(without)}; "
            f"{int((without & ~with_them).sum())} flagged only without them, {int((with_them & ~without).sum())} only "
            f"with them); readings wrong {int((_outcomes(faulty, 'grad_') == 'wrong').sum())} of "
            f"{len(_outcomes(faulty, 'grad_'))}; clean runs with a false flag {int(_has_false_flag(clean, 'grad_').sum())} "
            f"of {len(clean)} (without them {int(_has_false_flag(clean).sum())}).")


def rounds_figure(runs: pd.DataFrame, path: Path) -> None:
    """PNG: per fault (rows) and env (colours), each seed's rounds until the verdict flags the
    broken source (past the last round: not flagged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faulty = runs[runs["fault"] != "clean"]
    faults, envs = list(dict.fromkeys(faulty["fault"])), list(dict.fromkeys(faulty["env"]))
    never = int(faulty["rounds"].max()) + 1  # the faulty runs' last round (clean runs may run longer)
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(faults) + 1.4))
    for j, env in enumerate(envs):
        for i, fault in enumerate(faults):
            values = faulty.loc[(faulty["env"] == env) & (faulty["fault"] == fault), "verdict_round"].fillna(never)
            jitter = (np.arange(len(values)) - len(values) / 2) * 0.04
            ax.scatter(values.to_numpy() + jitter, np.full(len(values), i) + (j - len(envs) / 2) * 0.18,
                       s=14, color=f"C{j}", label=env if i == 0 else None)
    ax.axvline(WITHIN + 0.5, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(faults)), faults, fontsize=7)
    ax.set_xticks(range(1, never + 1), [*map(str, range(1, never)), "not\nflagged"])
    ax.set(xlabel="rounds until the verdict flags the broken source (each dot a seed)")
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prepared(runs: pd.DataFrame, source: str = "the rows") -> pd.DataFrame:
    """A detection run's rows as the summary reads them: the last row of each (env, fault, seed), one
    verdict version (rows of several are refused), rounds to flag counted from a fault's start,
    sorted. A runs file the summary wrote (``<name>_runs.csv``) comes back unchanged."""
    runs = runs.drop_duplicates(["env", "fault", "seed"], keep="last")
    runs = runs.drop(columns=["corrupted_within_5"], errors="ignore")  # every record of a broken env: not what changed
    versions = sorted(set(runs["verdict_version"].astype(int))) if "verdict_version" in runs else [1]
    if len(versions) > 1:
        raise SystemExit(f"{source} holds rows of verdict versions {versions}: summarise each version's rows apart")
    if "start" in runs and runs["start"].any():  # a fault that breaks its env at round R: rounds count from R
        counted = [c for c in runs.columns if c.endswith("verdict_round") or c.startswith("round_")]
        runs[counted] = runs[counted].sub(runs["start"], axis=0)
        runs["fault_start"], runs["start"] = runs["start"], 0  # counted from it once; kept, not counted again
    return runs.sort_values(["env", "fault", "seed"], kind="stable")


def summary(args: argparse.Namespace) -> None:
    """Tables, figure and summary lines of a detection run's rows, each reading as recorded when its
    run was made (never re-read by later rules); rows of more than one verdict version are refused."""
    source = Path(args.runs) if args.runs else Path(args.out) / "runs.csv"
    runs = prepared(pd.read_csv(source), str(source))
    flagged = runs[(runs["fault"] != "clean") & runs["verdict_round"].notna()]
    if len(flagged):  # the fault class each flag read, by fault
        print(pd.crosstab(flagged["fault"], flagged["reading"]).to_string())
    lines = summary_lines(runs)
    harness.summary(lines)
    if args.data:
        Path(args.data).mkdir(parents=True, exist_ok=True)
        if not args.runs:
            runs.to_csv(Path(args.data) / f"{args.name}_runs.csv", index=False)
        families = [c[6:] for c in runs.columns if c.startswith("round_")]
        (Path(args.data) / f"{args.name}_table.txt").write_text(markdown_table(runs, families))
        (Path(args.data) / f"{args.name}_summary.txt").write_text("\n".join(lines) + "\n")
        figures = Path(args.data).parent / "figures"
        figures.mkdir(exist_ok=True)
        rounds_figure(runs, figures / f"{args.name}_rounds.png")


ARM_NAMES = {"": "", "seq_": "per_run_alpha/", "looks_": "per_run_looks/", "grad_": "with_gradient_families/"}
"""The summary lines' name of each arm: alpha per audit, the per-run alpha at every audit, at looks 1, 2, 4, 8,
..., and alpha per audit with the gradient families asked (the third protocol's paired arm)."""


def summary_lines(runs: pd.DataFrame) -> list[str]:
    """The summary lines of a detection run's rows (``prepared``): per env and fault, what was flagged
    within ``WITHIN`` rounds and by the end, the readings, the false flags; then over all runs."""
    lines = [f"verdict_version: {int(runs['verdict_version'].iloc[0]) if 'verdict_version' in runs else 1}"]
    families = [c[6:] for c in runs.columns if c.startswith("round_")]
    arms = [arm for arm in ARM_NAMES if f"{arm}verdict_round" in runs]
    for (env, fault), group in runs.groupby(["env", "fault"], sort=False):
        n = len(group)
        for arm in arms:
            name = f"{env}/{fault}/{ARM_NAMES[arm]}"
            if fault == "clean":
                k = int(_has_false_flag(group, arm).sum())
                low, high = clopper_pearson(k, n)
                lines.append(f"{name}runs_with_a_false_flag: {k}/{n} [{low:.2f}, {high:.2f}]")
                if not arm:
                    for look in sorted({WITHIN, 8, int(group["rounds"].max())}):  # one audit of each run
                        k = int(group["false_flags"].fillna("").astype(str).str.split().apply(
                            lambda flags, look=look: any(f.split(":")[0] == str(look) for f in flags)).sum())
                        low, high = clopper_pearson(k, n)
                        lines.append(f"{name}false_flag_in_the_audit_of_round_{look}: {k}/{n} [{low:.2f}, {high:.2f}]")
                continue
            lines.append(f"{name}flagged_within_{WITHIN}: {int((group[f'{arm}verdict_round'] <= WITHIN).sum())}/{n}")
            last = int((group["rounds"] - group["start"]).max()) if "start" in group else int(group["rounds"].max())
            lines.append(f"{name}flagged_within_{last}: "
                  f"{int(group[f'{arm}verdict_round'].notna().sum())}/{n}")
            lines.append(f"{name}reading_right_undetermined_wrong: {_reading_cell(_outcomes(group, arm))}")
            lines.append(f"{name}runs_with_a_false_flag: {int(_has_false_flag(group, arm).sum())}/{n}")
        finders = [f"{f} {int((group[f'round_{f}'] <= WITHIN).sum())}/{n}" for f in families
                   if (group[f"round_{f}"] <= WITHIN).sum() > 0]
        if fault != "clean":
            lines.append(f"{env}/{fault}/families_within_{WITHIN}: {', '.join(finders) or 'none'}")
    faulty, clean = runs[runs["fault"] != "clean"], runs[runs["fault"] == "clean"]
    for arm in arms:
        name = f"all/{ARM_NAMES[arm]}"
        if len(faulty):
            within = faulty[f"{arm}verdict_round"] <= WITHIN
            lines.append(f"{name}faults/flagged_within_{WITHIN}: {int(within.sum())}/{len(faulty)}")
            lines.append(f"{name}faults/flagged_within_{int(faulty['rounds'].max())}: "
                  f"{int(faulty[f'{arm}verdict_round'].notna().sum())}/{len(faulty)}")
            outcomes = _outcomes(faulty, arm)
            lines.append(f"{name}faults/reading_right_undetermined_wrong: {_reading_cell(outcomes)} of {len(outcomes)}")
        if len(clean):
            k = int(_has_false_flag(clean, arm).sum())
            low, high = clopper_pearson(k, len(clean))
            lines.append(f"{name}clean/runs_with_a_false_flag: {k}/{len(clean)} [{low:.2f}, {high:.2f}]")
    if len(faulty):
        gradient = faulty[[f"round_{f}" for f in families if f in ATTRIBUTION_FAMILIES]].min(axis=1)
        other = faulty[[f"round_{f}" for f in families if f not in ATTRIBUTION_FAMILIES]].min(axis=1)
        lines.append(f"all/faults/found_only_by_gradient_families: {int((gradient.notna() & other.isna()).sum())}/"
              f"{int(faulty['verdict_round'].notna().sum())}")
        lines.append(f"all/faults/gradient_families_first: {int((gradient < other).sum())}, other_families_first: "
              f"{int((other < gradient).sum())}, same_round: {int((other == gradient).sum())}")
    return lines


def main() -> None:
    parser = harness.parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("detect")
    d.add_argument("--envs", default=",".join(ENVS))
    d.add_argument("--seeds", type=int, default=10)
    d.add_argument("--clean-seeds", type=int, default=30)
    d.add_argument("--rounds", type=int, default=8)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--out", default="bench_out/hidden_faults")
    d.add_argument("--faults", default="", help="';'-separated fault specs (default: the module's FAULTS)")
    d.add_argument("--window", type=int, default=0, help="audit the last W rounds (0: every round so far)")
    d.add_argument("--held-out", action="store_true",
                   help="the held-out protocol's runs (benchmarks/faults/held_out_faults.py: kinds, seeds, rounds)")
    d.add_argument("--protocol", type=int, choices=sorted(held_out_faults.PROTOCOLS), default=2,
                   help="with --held-out: the held-out set that measures this verdict version (its kinds and seeds)")
    d.add_argument("--trainer", choices=("native", "sb3", "rllib"), default="native",
                   help="rlinfluence's PPO, Stable-Baselines3's written by RunDirectoryCallback, or RLlib's written by integrations.rllib")
    s = sub.add_parser("summary")
    s.add_argument("--out", default="bench_out/hidden_faults")
    s.add_argument("--data", default="")
    s.add_argument("--name", default="hidden_faults", help="the written files' prefix")
    s.add_argument("--runs", default="", help="summarise this rows file (e.g. docs/data/<name>_runs.csv) instead of "
                   "<out>/runs.csv; it is not rewritten")
    lr = sub.add_parser("learn")
    lr.add_argument("--settings", default="CartPole-v1/action-mismatch:envs=1,mode=actuator;"
                    "CartPole-v1/obs-bug:envs=1,mode=scale;CartPole-v1/reward-delay:envs=1,lag=10;"
                    "Acrobot-v1/obs-bug:envs=1,mode=swap;CartPole-v1/clean;Acrobot-v1/clean")
    lr.add_argument("--seeds", type=int, default=5, help="the last seed")
    lr.add_argument("--first-seed", type=int, default=1)
    lr.add_argument("--arms", default="", help="comma-separated subset of the arms (default: all)")
    lr.add_argument("--rounds", type=int, default=20)
    lr.add_argument("--workers", type=int, default=1)
    lr.add_argument("--out", default="bench_out/hidden_faults")
    t = sub.add_parser("tune", help="every arm's lr tuned per setting on tuning seeds, then evaluation seeds")
    t.add_argument("--settings", required=True, help="';'-separated env/fault (or env/clean)")
    t.add_argument("--arms", default="ppo,oracle,quarantine,random")
    t.add_argument("--tuning-seeds", type=int, default=3)
    t.add_argument("--tuning-first-seed", type=int, default=101, help="disjoint from the evaluation seeds")
    t.add_argument("--seeds", type=int, default=10, help="the last evaluation seed")
    t.add_argument("--first-seed", type=int, default=1)
    t.add_argument("--rounds", type=int, default=20)
    t.add_argument("--workers", type=int, default=2)
    t.add_argument("--out", default="bench_out/hf_tuned")
    ls = sub.add_parser("learn-summary")
    ls.add_argument("--out", default="bench_out/hidden_faults")
    ls.add_argument("--data", default="")
    ls.add_argument("--name", default="hidden_faults_learn", help="the written files' prefix")
    args = parser.parse_args()
    {"detect": detect, "summary": summary, "learn": learn, "tune": tune,
     "learn-summary": learn_summary}[args.command](args)


if __name__ == "__main__":
    main()
