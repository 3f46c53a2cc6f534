"""Controls for the headline table: is iif-robust faster than tuned PPO because it selects records,
or because it takes a longer step (and drops records at all)?

    python benchmarks/learning/headline_controls.py tune --env FrozenLake-v1 --out bench_out/controls
    python benchmarks/learning/headline_controls.py confirm --env FrozenLake-v1 --out bench_out/controls --data docs/data

Each env starts from its study in ``benchmarks/studies/<env>.json`` (rounds, evaluation episodes,
settings, the learning-rate grid, and the chosen rates of ppo and iif-robust); ``--env
LunarLander-v3-150`` starts from LunarLander's 150-round study instead. Two arms the study
lacked:

- **step-matched PPO**: PPO with a different step length per round, ``STEP_VARIANTS``
  (target_kl early stopping at three levels, a KL-adaptive learning rate at two, 5, 20 and 30
  epochs instead of 10). Each variant's
  learning rate is tuned over the study's grid (``--grid`` gives another, for variants whose
  rate that grid does not reach) on 3 tuning seeds (1001-1003), each is then
  evaluated on the study's seeds 1-5, and the best by mean normalised auc is kept: the protocol
  that picked iif-robust among its ~8 variants, with as many variants and one more tuning seed;
- **random drops at iif-robust's kept fraction**: ``random@drop_pct=P`` with P = 100 x (1 - the
  mean kept fraction of iif-robust at its chosen rate on the tuning seeds), its rate tuned the same
  way: iif-robust's fewer records without its choice of which.

``tune`` runs that study (``<out>/<env>/tune``); ``confirm`` reruns ppo and iif-robust at the
study's chosen rates and the two new arms at theirs on seeds 101-110 (which no choice saw) with
``rlinfluence compare`` (``<out>/<env>/confirm``; plus PPO at the rate this study's three tuning
seeds chose, where it differs from the study's), prints its summary and a ``name: value`` line per
figure (``figure_lines``), and with ``--data``
writes ``<data>/controls_<env>_scores.csv`` (per seed), ``controls_<env>_curves.csv`` (every run's
evaluation return per round) and ``controls_<env>_summary.csv``, and the
choices' evidence: ``controls_<env>_tuning.csv`` (each arm's grid) and ``controls_<env>_pick_scores.csv``
(the variants on seeds 1-5).
Re-running resumes.

Where runs are slow (LunarLander at 150 rounds), ``tune --keep-study-ppo`` leaves PPO at the
study's rate (tuned on the same seeds and grid) instead of tuning it again, and ``confirm
--study-curves <data>/<study's>_curves.csv`` reads the study's ppo and iif-robust runs of seeds
101-110 from its committed per-seed curves instead of rerunning them: only the two new arms run,
and the summary against ppo is computed from the curves of all four (``with_study``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

STUDIES = harness.STUDIES
STEP_VARIANTS = ("ppo-kl01=ppo@target_kl=0.01", "ppo-kl03=ppo@target_kl=0.03", "ppo-kl10=ppo@target_kl=0.1",
                 "ppo-akl01=ppo@adaptive_kl=0.01", "ppo-akl03=ppo@adaptive_kl=0.03",
                 "ppo-e5=ppo@n_epochs=5", "ppo-e20=ppo@n_epochs=20", "ppo-e30=ppo@n_epochs=30")
TUNE_SEEDS = (1001, 1002, 1003)


def study(name: str) -> dict:
    """``benchmarks/studies/<name>.json``: an env's study (``--env``: the env id, or another study of it)."""
    return json.loads((STUDIES / f"{name}.json").read_text())


def kept_fraction(name: str, scratch: Path, seeds: tuple[int, ...], workers: int) -> float:
    """iif-robust's mean kept fraction over every round of the tuning ``seeds``, at its chosen rate
    (the seeds in ``workers`` processes)."""
    from rlinfluence.executor import run_calls
    from rlinfluence.ppo import PPOConfig

    s = study(name)
    env = s["env"]
    preset = PPOConfig.for_env(env)
    configs = [PPOConfig.for_env(env, update_engine="torch", filter="iif", drop_pct="auto", seed=seed, eval_episodes=0,
                                 learning_rate=s["chosen"]["iif-robust"]["learning_rate"],
                                 total_timesteps=s["rounds"] * preset.n_steps * preset.n_envs,
                                 run_root=str(scratch), progress=False, tensorboard=False).to_dict()
               for seed in seeds]
    fractions = run_calls(mean_kept_fraction, [(c,) for c in configs], workers, None)
    shutil.rmtree(scratch, ignore_errors=True)
    return sum(fractions) / len(fractions)


def mean_kept_fraction(config: dict) -> float:
    """One run's kept fraction, averaged over its rounds."""
    from rlinfluence.ppo import PPO, PPOConfig

    trainer = PPO(PPOConfig.from_dict(config)).learn()
    return float(pd.read_csv(trainer.run.path / "metrics.csv")["kept_fraction"].mean())


def common(name: str) -> dict:
    s = study(name)
    return {"env": s["env"], "rounds": s["rounds"], "eval_episodes": s["eval_episodes"], "set": tuple(s["set"]),
            "drop_pct": s["drop_pct"], "clock": "cpu", "progress": False}


def tune(args: argparse.Namespace) -> None:
    from rlinfluence.experiments import CompareConfig, compare

    folder = Path(args.out) / args.study
    folder.mkdir(parents=True, exist_ok=True)
    tune_seeds = TUNE_SEEDS[: args.tune_seeds]
    variants = [v for v in STEP_VARIANTS if v.split("=", 1)[0] in args.variants.split(",")] \
        if args.variants else list(STEP_VARIANTS)
    kept_file = folder / "iif_robust_kept.json"
    if not kept_file.is_file():
        kept_file.write_text(json.dumps({"kept_fraction": kept_fraction(args.study, folder / "scratch", tune_seeds, args.workers)}))
    drop = round(100 * (1 - json.loads(kept_file.read_text())["kept_fraction"]), 1)
    print(f"{args.study}: iif-robust keeps {100 - drop:.1f}% of records on the tuning seeds; random drops {drop}%",
          flush=True)
    methods = ((() if args.keep_study_ppo else ("ppo",)) + tuple(variants) + (f"random-kept=random@drop_pct={drop}",))
    compare(CompareConfig(**common(args.study), methods=methods, reference=methods[0].split("=", 1)[0],
                          tune=(args.grid,) if args.grid else tuple(study(args.study)["tune"]), tune_seeds=len(tune_seeds),
                          tune_first_seed=tune_seeds[0], first_seed=1, seeds=args.pick_seeds, out=str(folder / "tune"),
                          workers=args.workers))


def confirm(args: argparse.Namespace) -> None:
    from rlinfluence.experiments import CompareConfig, compare

    folder = Path(args.out) / args.study
    tuning = json.loads((folder / "tune" / "compare.json").read_text())
    tuned, tried = tuning["chosen"], tuning["methods"]
    scores = pd.read_csv(folder / "tune" / "scores.csv")  # normalised auc per (method, seed 1-5)
    labels = [v.split("=", 1)[0] for v in STEP_VARIANTS if v in tried]
    step = scores[scores["method"].isin(labels)].groupby("method")["auc"].mean().sort_values(kind="stable").index[-1]
    spec = dict(v.split("=", 1) for v in STEP_VARIANTS)[step]
    random_spec = next(m for m in tried if m.startswith("random-kept="))
    chosen = study(args.study)["chosen"]
    methods = (f"ppo=ppo@learning_rate={chosen['ppo']['learning_rate']}",
               f"iif-robust=iif@drop_pct=auto,learning_rate={chosen['iif-robust']['learning_rate']}",
               f"{step}={spec},learning_rate={tuned[step]['learning_rate']}",
               f"{random_spec},learning_rate={tuned['random-kept']['learning_rate']}")
    if "ppo" in tuned and tuned["ppo"]["learning_rate"] != chosen["ppo"]["learning_rate"]:  # three seeds chose another
        methods += (f"ppo-retuned=ppo@learning_rate={tuned['ppo']['learning_rate']}",)
    if args.study_curves:  # ppo's and iif-robust's runs are the study's: only the new arms run
        methods = methods[2:]
    print(f"{args.study}: the step-matched PPO kept is {step} (best mean auc on seeds "
          f"{sorted(scores['seed'].unique().tolist())}); confirming "
          + " ".join(methods), flush=True)
    out = compare(CompareConfig(**common(args.study), methods=methods, reference=methods[0].split("=", 1)[0],
                                first_seed=101, seeds=10, out=str(folder / "confirm"), workers=args.workers))
    if args.study_curves:
        summary = with_study(args, out)
    else:
        print((out / "summary.md").read_text())
        summary = pd.read_csv(out / "summary.csv")
    harness.summary(figure_lines(args.study, summary))
    if not args.data:
        return
    data = Path(args.data)
    # the choices' evidence: each arm's tuning grid (3 seeds) and the variants' scores on the pick seeds
    pd.read_csv(folder / "tune" / "tuning.csv").to_csv(data / f"controls_{args.study}_tuning.csv", index=False)
    scores.to_csv(data / f"controls_{args.study}_pick_scores.csv", index=False)
    if not args.study_curves:  # (with_study wrote its summary and curves)
        pd.read_csv(out / "scores.csv").to_csv(data / f"controls_{args.study}_scores.csv", index=False)
        pd.read_csv(out / "summary.csv").to_csv(data / f"controls_{args.study}_summary.csv", index=False)
        curves = pd.concat([pd.read_csv(run / "metrics.csv", usecols=["round", "eval_return_mean", "approx_kl"])
                            .assign(method=run.name.split("__seed")[0], seed=int(run.name.split("__seed")[1]))
                            for run in sorted(out.glob("*__seed*"))], ignore_index=True)
        curves.to_csv(data / f"controls_{args.study}_curves.csv", index=False)


def figure_lines(name: str, summary: pd.DataFrame) -> list[str]:
    """``name: value`` per arm against the reference (the summary's first row): seeds reaching 80%
    of its range, the log ratio of rounds to 80% (> 0: sooner), the paired differences of
    normalised auc and plateau, and the failed seeds."""
    reference, lines = summary.iloc[0], []
    for row in summary.iloc[1:].itertuples():
        prefix = f"{name}_{row.method}"
        lines += [f"{prefix}_reached80: {row.reached80_n}/{row.seeds} ({reference.method} "
                  f"{reference.reached80_n}/{reference.seeds})",
                  f"{prefix}_log_ratio80: {row.log_ratio80:+.2f} [{row.log_ratio80_lo:+.2f}, {row.log_ratio80_hi:+.2f}]",
                  *(f"{prefix}_{column}_minus_{reference.method}: {getattr(row, column):+.2f} "
                    f"[{getattr(row, column + '_lo'):+.2f}, {getattr(row, column + '_hi'):+.2f}]"
                    for column in ("diff_auc", "diff_final")),
                  f"{prefix}_failed_seeds: {row.failed_seeds if isinstance(row.failed_seeds, str) and row.failed_seeds else 'none'}"]
    return lines


def with_study(args: argparse.Namespace, out: Path) -> pd.DataFrame:
    """The new arms' runs on seeds 101-110 (``out``) beside the study's ppo and iif-robust runs of
    the same seeds, read from its per-seed curves (``--study-curves``, ``curves_frame``'s columns):
    one summary against ppo (``summary_from_curves``), printed, and with ``--data`` written as
    ``controls_<study>.csv`` and ``controls_<study>_curves.csv``, which ``publish_results.py
    --check`` recomputes one from the other. A pair shares its seed's initial policy and
    evaluation episodes whichever session ran it. Returns the summary."""
    from rlinfluence.experiments.published import curves_frame, summary_from_curves

    runs = curves_frame([out]).assign(reference="ppo")
    reused = pd.read_csv(args.study_curves)
    reused = reused[reused["method"].isin(["ppo", "iif-robust"]) & reused["seed"].isin(runs["seed"].unique())
                    & (reused["env"] == runs["env"].iloc[0])]
    held = set(reused[["method", "seed"]].itertuples(index=False, name=None))
    missing = [(m, s) for m in ("ppo", "iif-robust") for s in sorted(map(int, runs["seed"].unique())) if (m, s) not in held]
    if missing:
        raise SystemExit(f"error: {args.study_curves} lacks the study's {runs['env'].iloc[0]} runs {missing}")
    frame = pd.concat([reused, runs], ignore_index=True)
    summary = summary_from_curves(frame)
    print(summary[["method", "reached80_n", "rounds80_mean", "log_ratio80", "log_ratio80_lo", "log_ratio80_hi",
                   "diff_auc", "diff_auc_lo", "diff_auc_hi", "approx_kl_mean", "failed_seeds"]].to_string(index=False))
    if args.data:
        summary.to_csv(Path(args.data) / f"controls_{args.study}.csv", index=False)
        frame.to_csv(Path(args.data) / f"controls_{args.study}_curves.csv", index=False)
    return summary


def main() -> None:
    parser = harness.parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("tune", "confirm"):
        p = sub.add_parser(name)
        p.add_argument("--env", dest="study", default="FrozenLake-v1",
                       help="the study to start from, benchmarks/studies/<name>.json: an env id, or another study of "
                            "one (LunarLander-v3-150); it names the output folder and the data files")
        p.add_argument("--out", default="bench_out/controls")
        p.add_argument("--workers", type=int, default=2)
        if name == "confirm":
            p.add_argument("--data", default="")
            p.add_argument("--study-curves", default="", help="the study's per-seed curves on seeds 101-110 (e.g. "
                           "docs/data/lunar150_curves.csv): its ppo and iif-robust runs are read, not rerun")
        else:  # a smaller protocol where runs are slow (say which in the results)
            p.add_argument("--variants", default="", help="comma-separated labels of STEP_VARIANTS (default: all)")
            p.add_argument("--tune-seeds", type=int, default=len(TUNE_SEEDS), choices=range(1, len(TUNE_SEEDS) + 1))
            p.add_argument("--pick-seeds", type=int, default=5, help="seeds 1.. that pick the step variant")
            p.add_argument("--keep-study-ppo", action="store_true", help="PPO keeps the study's rate (tuned on "
                           "the same seeds and grid): not tuned again")
            p.add_argument("--grid", default="", help="the tuning grid instead of the study's, e.g. "
                           "learning_rate=0.005,0.01,0.02 (for variants whose rate the study's grid does not reach)")
    args = parser.parse_args()
    {"tune": tune, "confirm": confirm}[args.command](args)


if __name__ == "__main__":
    main()
