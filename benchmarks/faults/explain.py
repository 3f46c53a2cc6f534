"""Does `explain` name the cause of a drop whose cause is known? Drops injected at update K:

- ``step``:   the round's learning rate x ``--spike`` (one round);
- ``data``:   the ``--planted`` records of largest |advantage| (the ones that carried the most
              signal) given an advantage of ``--planted-size`` with the wrong sign (minus the sign
              of their own), after the advantages were computed: a sign bug that hits the largest
              values. (Records chosen at random instead cancel out: half of them push toward
              actions their state's others push away from, and half the seeds showed no drop.)
- ``source``: env 0's rewards multiplied by ``--source-scale`` (negative: a flipped, miswired
              reward worker) in round K, its advantages recomputed.

    python benchmarks/faults/explain.py run --drops 10 --out bench_out/explain
    python benchmarks/faults/explain.py summary --out bench_out/explain --data docs/data
    python benchmarks/faults/explain.py natural --env FrozenLake-v1 --lrs 0.32,0.64 --seeds 5 --out bench_out/explain

Each injection is part of the round's saved buffer and schedule, so the plain re-run reproduces
the injured update. Per (cause, seed): train ``--rounds`` rounds of PPO (8 envs x 256 steps,
``--env``, ``--lr``), inject at round K = ``--at``, then ``explain_round`` of update K (10%
removals, 5 random draws, 100 evaluation episodes). An injection does not always lower the
return (PPO's clipping bounds what one update can do, and a longer step can help a policy still
learning): seeds 1, 2, ... run per cause until ``--drops`` of them gave a drop (the batched plain
re-run below theta(k) beyond noise: the paired interval over the evaluation episodes above 0), at
most ``--max-seeds``; the others are rows too, read *no drop*. One row
per run in ``<out>/runs.csv`` (resumes); ``summary`` prints ``<cause>/right: k/n`` over the
injections that made a drop (the verdict names the cause: ``source 0`` for the source),
``<cause>/no_drop: k/n`` over every seed tried, the confusion table and ``seconds_per_drop: X``,
and writes
``<data>/explain_runs.csv`` and ``<data>/explain_table.txt``.

``plants``: held-out plants, which the verdict's rules were not written on and which no removal
selects by construction, at update K of runs on fresh seeds (every seed counted, drop or not):

- ``inverted-band``:  the ``--planted`` records ranked just below the 10% |advantage| removal's cut
                      (ordinary records, never in it) with their advantage's sign inverted; right: *data*;
- ``stuck-source``:   env 0's logged actions all replaced by action 0 (its log-prob under theta(k)
                      logged with it) and its advantages by their absolute values: a stuck worker
                      whose records all credit one action, at ordinary magnitudes; right: *source 0*;
- ``stale-round``:    ``--share`` of the round's records (random positions) replaced by round 1's at the
                      same positions, with round 1's log-probs, values and advantages: another
                      policy's data; right: *data*.

``natural``: drops nobody planted. Per learning rate and seed, PPO with the env's preset (every
round saved, 100 evaluation episodes a round; ``--trainer sb3``: Stable-Baselines3's PPO, 8 envs x
256 steps, written by ``RunDirectoryCallback``), then ``explain_round`` of each of its
``--drops`` largest drops beyond noise; one row per drop in ``<out>/natural.csv`` (a run that
diverged is a row too), and the summary lines ``natural/<env>/lr_<lr>/verdicts: ...``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402
from hidden_faults import append_row, finished  # noqa: E402

CAUSES = ("step", "data", "source")
PLANTS = {"inverted-band": "data", "stuck-source": "source 0", "stale-round": "data"}
"""Held-out plants (``plants``; not causes the verdict's rules were written on) and the verdict that is right."""


def plant(cause: str, buffer, trainer, planted: int, share: float) -> None:
    """Inject a held-out plant into round ``buffer.round``'s records in place (module docstring of
    ``plants``): no removal of explain selects its records by construction."""
    flat = {name: getattr(buffer, name).view(-1, *getattr(buffer, name).shape[2:])
            for name in ("obs", "actions", "logp", "values", "advantages", "returns", "rewards")}
    if cause == "inverted-band":  # ordinary records just below the |advantage| removal's cut, sign inverted
        adv = flat["advantages"]
        order = adv.abs().argsort(descending=True, stable=True)
        cut = round(0.1 * len(order))
        band = order[cut:cut + planted]
        adv[band] = -adv[band]
        buffer.returns.copy_(buffer.advantages + buffer.values)
    elif cause == "stuck-source":  # source 0 logs action 0 at every step, credited with its own |advantage|
        with torch.no_grad():
            buffer.actions[:, 0] = 0
            buffer.logp[:, 0] = trainer.policy.log_prob(buffer.obs[:, 0], buffer.actions[:, 0]).to(buffer.logp.dtype)
        buffer.advantages[:, 0] = buffer.advantages[:, 0].abs()
        buffer.returns.copy_(buffer.advantages + buffer.values)
    else:  # stale-round: a share of the records replaced by round 1's (another policy's data, its own log-probs)
        stale = trainer.stale_round
        rows = torch.randperm(len(buffer), generator=torch.Generator().manual_seed(buffer.round))
        rows = rows[: round(share * len(buffer))]
        for name, column in flat.items():
            column[rows] = getattr(stale, name).view(-1, *column.shape[1:])[rows]


def injected_trainer(cause: str, at: int, spike: float, planted: int, planted_size: float, source_scale: float,
                     config, share: float = 0.0):
    """A PPO whose update ``at`` is injured by ``cause`` (module docstring, and ``PLANTS``)."""
    from rlinfluence.ppo import PPO

    class Injured(PPO):
        def update(self, buffer, keep, sample_weights=None, lr_scale=1.0, n_epochs=None):
            if buffer.round == 1:
                self.stale_round = copy.deepcopy(buffer)
            if buffer.round == at:
                if cause in PLANTS:
                    plant(cause, buffer, self, planted, share)
                elif cause == "step":
                    lr_scale *= spike
                elif cause == "data":
                    flat = buffer.advantages.view(-1)
                    chosen = flat.abs().argsort(descending=True, stable=True)[:planted]
                    flat[chosen] = -torch.sign(flat[chosen]) * planted_size
                else:
                    buffer.rewards[:, 0] *= source_scale
                    buffer.compute_advantages(self.config.gamma, self.config.gae_lambda)
            return super().update(buffer, keep, sample_weights, lr_scale, n_epochs)

    return Injured(config)


def run_one(cause: str, seed: int, args: argparse.Namespace, out: Path, rows: str = "runs.csv") -> dict:
    """Train to update ``args.at`` injured by ``cause``, explain it; the row appended to ``out/rows``."""
    from rlinfluence.analysis.explain import explain_round
    from rlinfluence.errors import UserError
    from rlinfluence.ppo import PPOConfig

    scratch = out / "scratch" / f"{args.env}_{cause}_{seed}"
    shutil.rmtree(scratch, ignore_errors=True)
    config = PPOConfig.for_env(args.env, update_engine="torch", n_envs=8, n_steps=256, batch_size=64, learning_rate=args.lr, seed=seed,
                               total_timesteps=(args.at + 1) * 2048, eval_episodes=20, save_buffers=True,
                               run_root=str(scratch), progress=False, tensorboard=False)
    try:
        trainer = injected_trainer(cause, args.at, args.spike, args.planted, args.planted_size, args.source_scale,
                                   config, getattr(args, "share", 0.0)).learn()
    except UserError as exc:  # the injured update's loss was not finite: no theta(k+1) to explain
        row = {"cause": cause, "seed": seed, "verdict": f"diverged: {exc}"[:120], "right": False, "drop": np.nan}
        append_row(out / rows, row | ({"env": args.env} if cause in PLANTS else {}))
        return row
    cpu = time.process_time()
    table, _ = explain_round(trainer.run.path, args.at, episodes=args.episodes, draws=args.draws, seed=seed)
    row = {"cause": cause, "seed": seed, "verdict": table["verdict"].iloc[0],
           "right": table["verdict"].iloc[0] == PLANTS.get(cause, "source 0" if cause == "source" else cause),
           "drop": table["drop"].iloc[0], "drop_ci_low": table["drop_ci_low"].iloc[0],
           "return_before": table["return_before"].iloc[0],
           "return_after": table["return_after"].iloc[0],
           "plain_reproduces_run": bool(table["plain_reproduces_run"].iloc[0]),
           "best": table.loc[table["recovered_fraction"].idxmax(), "counterfactual"]
           if table["recovered_fraction"].notna().any() else "",
           "best_recovered": table["recovered_fraction"].max(),
           "beyond_band": ";".join(table.loc[table["beyond_band"], "counterfactual"]),
           "explain_cpu_s": time.process_time() - cpu, "explain_wall_s": table["seconds"].iloc[0],
           "update_s": float(pd.read_csv(trainer.run.path / "metrics.csv")["update_seconds"].iloc[args.at])}
    shutil.rmtree(scratch, ignore_errors=True)
    row = ({"env": args.env} | row) if cause in PLANTS else row
    append_row(out / rows, row)
    return row


def made_drop(rows: pd.DataFrame) -> pd.Series:
    """The injections that lowered the return beyond noise on the explanation's own episodes."""
    from rlinfluence.analysis.explain import NOT_REPRODUCED

    verdict = rows["verdict"].astype(str)
    return (verdict != NOT_REPRODUCED) & ~verdict.str.startswith("diverged")


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.csv"
    for cause in CAUSES:
        for seed in range(1, args.max_seeds + 1):
            rows = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=["cause", "seed", "verdict"])
            mine = rows[rows["cause"] == cause]
            if made_drop(mine).sum() >= args.drops:
                break
            if seed in set(mine["seed"]):
                continue
            row = run_one(cause, seed, args, out)
            print(f"{cause} seed {seed}: verdict {row['verdict']} (drop {row['drop']:.3g}, best {row.get('best')} "
                  f"{row.get('best_recovered', np.nan):.2f}, {row.get('explain_wall_s', np.nan):.0f} s)", flush=True)


def summary(args: argparse.Namespace) -> None:
    every = pd.read_csv(Path(args.out) / "runs.csv")
    rows = every[made_drop(every)]
    diverged = every["verdict"].astype(str).str.startswith("diverged")
    confusion = pd.crosstab(rows["cause"], rows["verdict"])
    lines = [f"{cause}/right: {int(g['right'].sum())}/{len(g)}" for cause, g in rows.groupby("cause")]
    lines += [f"{cause}/no_drop: {int((~made_drop(g) & ~diverged[g.index]).sum())}/{len(g)}"
              + (f" (and {int(diverged[g.index].sum())} diverged)" if diverged[g.index].any() else "")
              for cause, g in every.groupby("cause")]
    trained = every[~diverged]
    lines.append(f"plain_reproduces_run: {int(trained['plain_reproduces_run'].astype(bool).sum())}/{len(trained)}")
    lines.append(f"seconds_per_drop: {rows['explain_wall_s'].median():.1f} (median wall; update "
                 f"{rows['update_s'].median():.2f} s)")
    print(confusion.to_string())
    harness.summary(lines)
    if args.data:
        data = Path(args.data)
        every.to_csv(data / f"{args.name}_runs.csv", index=False)
        (data / f"{args.name}_table.txt").write_text(confusion.to_string() + "\n\n" + "\n".join(lines) + "\n")


def plants(args: argparse.Namespace) -> None:
    """Every plant of ``PLANTS`` on seeds ``--first-seed``.. (``--seeds`` of them, all counted), one
    row each in ``<out>/plants.csv`` (resumes); the summary lines of ``plant_lines``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = finished(out / "plants.csv", ["env", "cause", "seed"])
    for cause in PLANTS:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            if (args.env, cause, seed) not in done:
                row = run_one(cause, seed, args, out, rows="plants.csv")
                print(f"{args.env} {cause} seed {seed}: verdict {row['verdict']} (drop {row['drop']:.3g}, best "
                      f"{row.get('best')} {row.get('best_recovered', np.nan):.2f})", flush=True)
    rows = pd.read_csv(out / "plants.csv")
    lines = plant_lines(rows)
    harness.summary(lines)
    if args.data:
        rows.to_csv(Path(args.data) / "explain_plants_runs.csv", index=False)
        (Path(args.data) / "explain_plants_summary.txt").write_text("\n".join(lines) + "\n")


def plant_lines(rows: pd.DataFrame) -> list[str]:
    """Per env and plant: drops made over every seed tried, the right verdict over the drops and over
    every seed, the verdicts, and which removals made each right *data* verdict (influence on the
    return, on a fresh rollout's, or only |advantage|)."""
    lines = []
    for (env, cause), group in rows.groupby(["env", "cause"], sort=False):
        name, drops = f"plants/{env}/{cause}", group[made_drop(group)]
        right = int(drops["right"].astype(bool).sum())
        lines.append(f"{name}/drop: {len(drops)}/{len(group)}")
        lines.append(f"{name}/right: {right}/{len(drops)} of the drops ({right}/{len(group)} of every seed tried; "
                     f"right: {PLANTS[cause]})")
        lines.append(f"{name}/verdicts: " + ", ".join(f"{k} {v}" for k, v in group["verdict"].value_counts().items()))
        if PLANTS[cause] == "data" and right:
            named = drops.loc[drops["right"].astype(bool), "beyond_band"].fillna("").str.split(";")
            by = {scorer: int(named.apply(lambda n, s=scorer: any(x.endswith(f"% {s}") for x in n)).sum())
                  for scorer in ("influence", "influence-fresh", "tracin", "abs-advantage")}
            lines.append(f"{name}/named_by: " + ", ".join(f"{k} {v}" for k, v in by.items() if v)
                         + f" (of {right} right; a removal may share the credit)")
    drops = rows[made_drop(rows)]
    right = int(drops["right"].astype(bool).sum())
    lines.append(f"plants/all/right: {right}/{len(drops)} of the drops ({right}/{len(rows)} of every seed tried)")
    return lines


EVAL_EPISODES = 100
"""Evaluation episodes after every round of a natural run (what ``find_drops`` reads)."""


def train_ours(args: argparse.Namespace, lr: float, seed: int, scratch: Path) -> Path:
    """rlinfluence's PPO with the env's preset at ``lr``, every round saved; its run directory."""
    from rlinfluence.ppo import PPO, PPOConfig

    preset = PPOConfig.for_env(args.env)
    config = PPOConfig.for_env(args.env, update_engine="torch", learning_rate=lr, seed=seed, save_buffers=True, eval_episodes=EVAL_EPISODES,
                               run_root=str(scratch), progress=False, tensorboard=False,
                               **({"total_timesteps": args.rounds * preset.n_steps * preset.n_envs}
                                  if args.rounds else {}))
    return PPO(config).learn().run.path


def train_sb3(args: argparse.Namespace, lr: float, seed: int, scratch: Path) -> Path:
    """Stable-Baselines3's PPO (8 envs x 256 steps, its defaults otherwise) at ``lr``, written by
    ``RunDirectoryCallback``; its run directory."""
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.env_util import make_vec_env

    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback

    model = SB3PPO("MlpPolicy", make_vec_env(args.env, n_envs=8, seed=seed), n_steps=256, learning_rate=lr,
                   seed=seed, device="cpu")
    model.learn((args.rounds or 20) * 2048, callback=RunDirectoryCallback(scratch / "run", EVAL_EPISODES))
    return scratch / "run"


def natural(args: argparse.Namespace) -> None:
    from rlinfluence.analysis.explain import explain_round, find_drops
    from rlinfluence.errors import UserError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "natural.csv"
    done = finished(path, ["env", "lr", "seed"])
    for seed in range(1, args.seeds + 1):
        for lr in [float(x) for x in args.lrs.split(",")]:
            if (args.env, lr, seed) in done:
                continue
            scratch = out / "scratch" / f"natural_{lr}_{seed}"
            shutil.rmtree(scratch, ignore_errors=True)
            base = {"env": args.env, "trainer": args.trainer, "lr": lr, "seed": seed, "round": -1, "size": np.nan,
                    "se": np.nan, "kl_spike": False, "verdict": "", "reproduces": np.nan, "best": "",
                    "best_recovered": np.nan, "beyond_band": "", "seconds": np.nan, "update_s": np.nan,
                    "drop_ci_low": np.nan}
            try:
                run_dir = (train_sb3 if args.trainer == "sb3" else train_ours)(args, lr, seed, scratch)
            except UserError as exc:
                append_row(path, {**base, "verdict": f"diverged: {exc}"[:120]})
                continue
            metrics = pd.read_csv(run_dir / "metrics.csv")
            drops = find_drops(metrics, EVAL_EPISODES)[: args.drops]
            if not drops:
                append_row(path, {**base, "verdict": "no drop beyond noise"})
            for d in drops:
                table, _ = explain_round(run_dir, d.round, episodes=args.episodes, seed=seed)
                scored = table.dropna(subset=["recovered_fraction"])
                best = scored.loc[scored["recovered_fraction"].idxmax()] if len(scored) else None
                row = {**base, "round": d.round, "size": d.size, "se": d.se, "kl_spike": d.kl_spike,
                       "drop_ci_low": table["drop_ci_low"].iloc[0],
                       "verdict": table["verdict"].iloc[0], "reproduces": bool(table["plain_reproduces_run"].iloc[0]),
                       "best": "" if best is None else best["counterfactual"],
                       "best_recovered": np.nan if best is None else best["recovered_fraction"],
                       "beyond_band": ";".join(table.loc[table["beyond_band"], "counterfactual"]),
                       "seconds": table["seconds"].iloc[0],
                       "update_s": float(metrics.set_index("round")["update_seconds"].get(d.round, np.nan))
                       if "update_seconds" in metrics else np.nan}
                append_row(path, row)
                print(f"{args.trainer} {args.env} lr {lr} seed {seed} update {d.round}: -{d.size:.3g} -> {row['verdict']} "
                      f"(best {row['best']} {row['best_recovered']:.2f})", flush=True)
            shutil.rmtree(scratch, ignore_errors=True)
    harness.summary(natural_lines(pd.read_csv(path)))


SLIDE_FAULT = "action-mismatch:envs=2,mode=actuator,from=10"
"""The slides' broken workers: two envs of 8 whose actuator executes another action from round 10 on."""
SLIDE_EPISODES = 30
"""Evaluation episodes after every round of a slide run (what ``find_drops`` reads)."""


def slide_one(env: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """Train ``args.rounds`` rounds with ``SLIDE_FAULT``; explain the largest slide over ``args.window``
    updates that starts once the workers broke (a window from the break round on), if any."""
    from rlinfluence.analysis.explain import explain_window, find_drops
    from rlinfluence.ppo import PPO, PPOConfig

    scratch = out / "scratch" / f"slide_{env}_{seed}"
    shutil.rmtree(scratch, ignore_errors=True)
    study = harness.STUDIES / f"{env}.json"
    lr = {"learning_rate": json.loads(study.read_text())["chosen"]["ppo"]["learning_rate"]} if study.is_file() else {}
    config = PPOConfig.for_env(env, update_engine="torch", n_envs=8, n_steps=256, batch_size=64, seed=seed, **lr,
                               total_timesteps=args.rounds * 2048, eval_episodes=SLIDE_EPISODES, corrupt=(args.fault,),
                               save_buffers=True, run_root=str(scratch), progress=False, tensorboard=False)
    trainer = PPO(config).learn()
    broken = sorted(np.flatnonzero(trainer.corruptor.broken_envs).tolist())
    start = max(spec.start for spec in trainer.corruptor.specs)
    metrics = pd.read_csv(trainer.run.path / "metrics.csv")
    slides = [d for d in find_drops(metrics, SLIDE_EPISODES, window=args.window) if d.round >= start]
    row = {"env": env, "fault": args.fault, "seed": seed, "window": args.window, "broken": " ".join(map(str, broken)),
           "slide_round": np.nan, "size": np.nan, "se": np.nan, "verdict": "no slide beyond noise",
           "named_broken": False, "named_one_broken": False, "best": "", "best_recovered": np.nan, "beyond_band": "", "reproduces": np.nan,
           "returns": " ".join(f"{r:.1f}" for r in metrics["eval_return_mean"]), "seconds": np.nan}
    if slides:
        d = slides[0]
        table, _ = explain_window(trainer.run.path, d.round, args.window, episodes=args.episodes, draws=args.draws,
                                  seed=seed)
        scored = table.dropna(subset=["recovered_fraction"])
        best = scored.loc[scored["recovered_fraction"].idxmax()] if len(scored) else None
        verdict = table["verdict"].iloc[0]
        named = {int(x) for x in verdict.split(" ")[1].split(",")} if verdict.startswith("source") else set()
        row |= {"slide_round": d.round, "size": d.size, "se": d.se, "verdict": verdict,
                "named_broken": named == set(broken), "named_one_broken": bool(named) and named <= set(broken),
                "best": "" if best is None else best["counterfactual"],
                "best_recovered": np.nan if best is None else best["recovered_fraction"],
                "beyond_band": ";".join(table.loc[table["beyond_band"], "counterfactual"]),
                "reproduces": bool(table["plain_reproduces_run"].iloc[0]), "seconds": table["seconds"].iloc[0]}
    shutil.rmtree(scratch, ignore_errors=True)
    append_row(out / "slides.csv", row)
    return row


def slides(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = finished(out / "slides.csv", ["env", "seed"])
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if (args.env, seed) not in done:
            row = slide_one(args.env, seed, args, out)
            print(f"{args.env} seed {seed}: broken {row['broken']}, slide at {row['slide_round']} (-{row['size']:.3g}): "
                  f"{row['verdict']} (best {row['best']} {row['best_recovered']:.2f})", flush=True)
    rows = pd.read_csv(out / "slides.csv")
    lines = slide_lines(rows)
    harness.summary(lines)
    if args.data:  # the rows and the summary lines the results page includes
        rows.to_csv(Path(args.data) / "explain_slides_runs.csv", index=False)
        (Path(args.data) / "explain_slides_summary.txt").write_text("\n".join(lines) + "\n")


def slide_lines(rows: pd.DataFrame) -> list[str]:
    """Per env and fault, over every seed tried: slides found, the broken sources named, the verdicts."""
    lines = []
    for (env, fault), group in rows.groupby(["env", "fault"]):
        name = f"slides/{env}/{fault}"
        found = group["slide_round"].notna()
        lines.append(f"{name}/slide_found: {int(found.sum())}/{len(group)}")
        for column, what in (("named_broken", "broken_sources_named"), ("named_one_broken", "broken_sources_named_in_part")):
            lines.append(f"{name}/{what}: {int(group[column].astype(bool).sum())}/{len(group)} (every seed tried; "
                         f"{int(group.loc[found, column].astype(bool).sum())}/{int(found.sum())} of the slides)")
        lines.append(f"{name}/verdicts: " + ", ".join(f"{k} {v}" for k, v in group["verdict"].value_counts().items()))
    return lines


ATTRIBUTION = ("influence", "influence-fresh", "tracin")


def natural_lines(rows: pd.DataFrame) -> list[str]:
    """Per trainer, env and learning rate: the verdicts of its drops (runs without one counted
    once), the fraction of each drop the best counterfactual recovered, and which removals made
    the *data* verdicts (an attribution scorer's, or only the |advantage| one)."""
    rows = rows.assign(trainer=rows.get("trainer", pd.Series("rlinfluence", index=rows.index)).fillna("rlinfluence"))
    lines = []
    for (trainer, env, lr), group in rows.groupby(["trainer", "env", "lr"]):
        counts = group["verdict"].str.split(":").str[0].value_counts()
        name = f"natural/{'' if trainer == 'rlinfluence' else trainer + '/'}{env}/lr_{lr:g}"
        lines.append(f"{name}/verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                     + f" ({group['seed'].nunique()} seeds)")
        drops = group[(group["round"] >= 0) & group["best_recovered"].notna()]  # drops the re-run reproduced
        if len(drops):
            lines.append(f"{name}/best_recovered: median {drops['best_recovered'].median():.2f} "
                         f"(range {drops['best_recovered'].min():.2f}-{drops['best_recovered'].max():.2f}, "
                         f"{len(drops)} drops); seconds_per_drop median {drops['seconds'].median():.1f}")
        data = group[group["verdict"] == "data"]
        if len(data):
            by = data["beyond_band"].fillna("").str.split(";")
            attributed = by.apply(lambda names: any(n.split(" ")[-1] in ATTRIBUTION for n in names if "harmful" in n))
            lines.append(f"{name}/data_by_attribution: {int(attributed.sum())}/{len(data)} "
                         f"(the others by |advantage| alone)")
    return lines


def natural_summary(args: argparse.Namespace) -> None:
    rows = pd.concat([pd.read_csv(Path(out) / "natural.csv") for out in args.outs.split(",")], ignore_index=True)
    lines = natural_lines(rows)
    harness.summary(lines)
    if args.data:
        rows.to_csv(Path(args.data) / "explain_natural.csv", index=False)
        (Path(args.data) / "explain_natural_summary.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = harness.parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--env", default="FrozenLake-v1")
    r.add_argument("--lr", type=float, default=0.02)
    r.add_argument("--at", type=int, default=6)
    r.add_argument("--spike", type=float, default=30.0)
    r.add_argument("--planted", type=int, default=200)
    r.add_argument("--planted-size", type=float, default=1000.0)
    r.add_argument("--source-scale", type=float, default=-10.0)
    r.add_argument("--drops", type=int, default=10, help="injections that made a drop, per cause")
    r.add_argument("--max-seeds", type=int, default=30)
    r.add_argument("--episodes", type=int, default=100)
    r.add_argument("--draws", type=int, default=5)
    r.add_argument("--out", default="bench_out/explain")
    n = sub.add_parser("natural")
    n.add_argument("--env", default="FrozenLake-v1")
    n.add_argument("--lrs", default="0.32,0.64")
    n.add_argument("--seeds", type=int, default=5)
    n.add_argument("--rounds", type=int, default=0, help="0: the preset's (SB3: 20)")
    n.add_argument("--trainer", choices=("rlinfluence", "sb3"), default="rlinfluence")
    n.add_argument("--drops", type=int, default=2)
    n.add_argument("--episodes", type=int, default=100)
    n.add_argument("--out", default="bench_out/explain")
    sl = sub.add_parser("slides", help="slides caused by broken workers, explained over a window of updates")
    sl.add_argument("--env", default="CartPole-v1")
    sl.add_argument("--fault", default=SLIDE_FAULT)
    sl.add_argument("--seeds", type=int, default=10)
    sl.add_argument("--first-seed", type=int, default=201)
    sl.add_argument("--rounds", type=int, default=20)
    sl.add_argument("--window", type=int, default=3)
    sl.add_argument("--episodes", type=int, default=50)
    sl.add_argument("--draws", type=int, default=5)
    sl.add_argument("--out", default="bench_out/explain_slides")
    sl.add_argument("--data", default="", help="write <data>/explain_slides_runs.csv and explain_slides_summary.txt")
    pl = sub.add_parser("plants", help="held-out plants (PLANTS) on fresh seeds, every seed counted")
    pl.add_argument("--env", default="CartPole-v1")
    pl.add_argument("--lr", type=float, default=0.001)
    pl.add_argument("--at", type=int, default=6)
    pl.add_argument("--planted", type=int, default=600)
    pl.add_argument("--share", type=float, default=0.5, help="stale-round: the share of the round's records replaced")
    pl.add_argument("--seeds", type=int, default=10)
    pl.add_argument("--first-seed", type=int, default=301)
    pl.add_argument("--episodes", type=int, default=50)
    pl.add_argument("--draws", type=int, default=5)
    pl.add_argument("--out", default="bench_out/explain_plants")
    pl.add_argument("--data", default="", help="write <data>/explain_plants_runs.csv and explain_plants_summary.txt")
    pl.set_defaults(spike=1.0, planted_size=0.0, source_scale=1.0)  # the design causes' sizes; no plant reads them
    s = sub.add_parser("summary")
    s.add_argument("--out", default="bench_out/explain")
    s.add_argument("--data", default="")
    s.add_argument("--name", default="explain", help="writes <data>/<name>_runs.csv and <name>_table.txt")
    ns = sub.add_parser("natural-summary")
    ns.add_argument("--outs", required=True, help="comma-separated natural output folders")
    ns.add_argument("--data", default="")
    args = parser.parse_args()
    np.seterr(all="ignore")
    {"run": run, "natural": natural, "summary": summary, "natural-summary": natural_summary,
     "slides": slides, "plants": plants}[args.command](args)


if __name__ == "__main__":
    main()
