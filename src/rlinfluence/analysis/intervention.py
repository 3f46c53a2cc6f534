"""Targeted intervention (method-spec 5.3): retrain one round without its harmful records.

At round k of a standard PPO run (``--save-buffers``), starting from theta(k) with its optimiser
state, the trainer's own ``update`` runs on

    (a) the full buffer,
    (b) the buffer without every negatively influential record (return target, IIF's scorer,
        ``drop_mode="neg"``: p = 100% of the negatives),
    (c) the buffer without a uniformly random subset of the same size,

each from a deep copy of the same trainer state, so the minibatch generator starts from the same
state in all three. Before updating, the generator is advanced past the round's collection
draw, exactly as in training, so (a) reproduces the run's own update: its parameters are
compared with the saved theta(k+1) (``a_matches_run``). The three policies are then evaluated
on the same episode seeds with the same action-sampling generator (``PPO.evaluate``), and

    delta_b = R(b) - R(a),   delta_c = R(c) - R(a).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rlinfluence.analysis.report import Section, Table, figure_png, new_figure
from rlinfluence.errors import UserError
from rlinfluence.filters import FilterContext, IIFFilter, drop_lowest
from rlinfluence.rundir import RunDirectory, load_checkpoint

VARIANTS = ("a", "b", "c")


def parse_rounds(text: str) -> list[int]:
    """"5,10,20" -> [5, 10, 20] (UserError on anything else)."""
    try:
        rounds = [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise UserError(f"--rounds must be comma-separated round numbers, got {text!r}") from None
    if not rounds or min(rounds) < 0:
        raise UserError(f"--rounds must list rounds >= 0, got {text!r}")
    return sorted(set(rounds))


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def intervene_round(run_dir: str | Path, round_index: int, eval_episodes: int = 100,
                    advantage_norm: str = "chunk") -> dict[str, object]:
    """Retrain round ``round_index`` of a run as (a), (b), (c); one result row."""
    from rlinfluence.ppo import load_round

    if eval_episodes < 1:
        raise UserError(f"--eval-episodes must be >= 1, got {eval_episodes}")
    saved = load_round(run_dir, round_index)
    trainer, buffer = saved.trainer, saved.buffer
    cfg = trainer.config
    if cfg.filter != "none":
        raise UserError(f"{str(run_dir)!r} is a {cfg.filter!r} run; the intervention needs a standard PPO run "
                        "(filter none), whose round-k update trained on the whole buffer")
    start = copy.deepcopy(trainer.state_dict())

    # (b): IIF's scorer with its own seed for the chunk permutation, dropping every negative record
    context = FilterContext(trainer.policy, round_index, cfg.batch_size, cfg.gamma)
    iif = IIFFilter(100.0, drop_mode="neg", advantage_norm=advantage_norm, seed=_seed(cfg.seed, round_index, 11))
    keep_b = iif(buffer, context)
    n_drop = int((~keep_b).sum())
    # (c): as many records, uniformly at random
    generator = torch.Generator().manual_seed(_seed(cfg.seed, round_index, 12))
    keep_c = drop_lowest(torch.rand(len(buffer), generator=generator), n_drop)
    keeps = {"a": torch.ones(len(buffer), dtype=torch.bool), "b": keep_b, "c": keep_c}

    returns, a_matches = {}, None
    for variant in VARIANTS:
        trainer.load_state_dict(copy.deepcopy(start))
        # training drew the round's sampling noise from this generator before updating
        trainer.policy.noise((cfg.n_steps, cfg.n_envs), trainer.generator)
        trainer.update(buffer, keeps[variant])
        if variant == "a":
            a_matches = _matches_checkpoint(trainer, run_dir, round_index + 1)
        returns[variant] = trainer.evaluate(eval_episodes)
    r = {v: float(returns[v].mean()) for v in VARIANTS}
    return {
        "run": Path(run_dir).name, "env": cfg.env, "seed": cfg.seed, "round": round_index,
        "records": len(buffer), "dropped": n_drop, "guarded": bool(context.stats.get("minibatch_guard", 0.0)),
        "R_a": r["a"], "R_b": r["b"], "R_c": r["c"],
        "delta_b": r["b"] - r["a"], "delta_c": r["c"] - r["a"],
        "se_delta_b": _paired_se(returns["b"], returns["a"]), "se_delta_c": _paired_se(returns["c"], returns["a"]),
        "eval_episodes": eval_episodes, "a_matches_run": a_matches,
    }


def _paired_se(x: np.ndarray, y: np.ndarray) -> float:
    """Standard error of mean(x - y) over episodes with shared seeds."""
    d = np.asarray(x) - np.asarray(y)
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan


def _matches_checkpoint(trainer, run_dir: str | Path, n_rounds: int) -> bool | None:
    """Whether the trainer's policy equals the run's saved theta(n_rounds) (None if not saved)."""
    path = RunDirectory.open_existing(run_dir, tensorboard=False).checkpoint_path(n_rounds)
    if not path.is_file():
        return None
    saved = load_checkpoint(path)["policy"]
    return all(torch.equal(v, saved[k]) for k, v in trainer.policy.state_dict().items())


def intervene(run_dirs: list[str | Path], rounds: list[int], eval_episodes: int = 100,
              advantage_norm: str = "chunk", progress: bool = False) -> pd.DataFrame:
    """One row per (run, round); runs are typically the seeds of one env."""
    rows = []
    for run_dir in run_dirs:
        for k in rounds:
            rows.append(intervene_round(run_dir, k, eval_episodes, advantage_norm))
            if progress:
                row = rows[-1]
                print(f"{row['run']} round {k}: R(a) {row['R_a']:.4g}  dB {row['delta_b']:+.4g}  "
                      f"dC {row['delta_c']:+.4g}  dropped {row['dropped']}/{row['records']}", flush=True)
    return pd.DataFrame(rows)


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (env, round) across runs: mean and s.e. of delta_b and delta_c, and how many runs improved."""
    def se(x: pd.Series) -> float:
        return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan

    out = []
    for (env, k), g in rows.groupby(["env", "round"], sort=True):
        out.append({
            "env": env, "round": k, "runs": len(g), "dropped_fraction": float((g["dropped"] / g["records"]).mean()),
            "R_a": float(g["R_a"].mean()),
            "delta_b": float(g["delta_b"].mean()), "se_b": se(g["delta_b"]), "b_better": int((g["delta_b"] > 0).sum()),
            "delta_c": float(g["delta_c"].mean()), "se_c": se(g["delta_c"]), "c_better": int((g["delta_c"] > 0).sum()),
        })
    return pd.DataFrame(out)


def bar_png(rows: pd.DataFrame) -> bytes:
    summary = summarise(rows)
    envs = list(dict.fromkeys(summary["env"]))
    fig, axes = new_figure(4.2 * len(envs), 3.6, ncols=len(envs))
    for ax, env in zip(axes[0], envs, strict=True):
        s = summary[summary["env"] == env]
        x = np.arange(len(s))
        ax.bar(x - 0.2, s["delta_b"], 0.4, yerr=s["se_b"].fillna(0), capsize=3, color="tab:green",
               label="(b) drop negatives")
        ax.bar(x + 0.2, s["delta_c"], 0.4, yerr=s["se_c"].fillna(0), capsize=3, color="tab:gray",
               label="(c) drop random, same size")
        for _, g in rows[rows["env"] == env].groupby("round"):
            i = int(np.flatnonzero(s["round"].to_numpy() == g["round"].iloc[0])[0])
            ax.scatter(np.full(len(g), i - 0.2), g["delta_b"], s=10, color="k", zorder=3)
            ax.scatter(np.full(len(g), i + 0.2), g["delta_c"], s=10, color="k", zorder=3)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(x, [str(k) for k in s["round"]])
        ax.set(xlabel="round k", ylabel="return change vs (a)", title=f"{env} ({int(s['runs'].max())} runs)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    return figure_png(fig)


def intervention_section(rows: pd.DataFrame) -> Section:
    section = Section("intervention", "Targeted intervention (single round)")
    n_eval = sorted(set(rows["eval_episodes"]))
    section.paragraphs.append(
        "Round k retrained from theta(k) on (a) the full buffer, (b) without all negatively influential "
        "records (return target), (c) without a random subset of the same size; evaluated on the same "
        f"{', '.join(map(str, n_eval))} episode seeds. Bars: mean over runs (+/- s.e. across runs), dots: runs. "
        "The paper finds (b) consistently improves and (c) does not.")
    matches = rows["a_matches_run"].dropna()
    if len(matches):
        section.paragraphs.append(f"(a) reproduced the run's own theta(k+1) exactly in {int(matches.sum())} of "
                                  f"{len(matches)} retrained rounds.")
    summary = summarise(rows)
    section.tables.append(Table("Across runs", list(summary.columns),
                                [list(r) for r in summary.itertuples(index=False)]))
    columns = ["run", "seed", "round", "dropped", "R_a", "R_b", "R_c", "delta_b", "se_delta_b", "delta_c",
               "se_delta_c", "a_matches_run"]
    section.tables.append(Table("Per run (se_delta: paired s.e. over evaluation episodes)", columns,
                                [[v.item() if isinstance(v, np.generic) else v for v in r]
                                 for r in rows[columns].itertuples(index=False)]))
    section.figures["bars"] = (bar_png(rows), "Return change of (b) and (c) relative to (a), per round.")
    return section
