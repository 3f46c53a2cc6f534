"""Targeted intervention (docs/method.md, section 5.3): retrain one round without its harmful records.

At round k of a standard PPO run (``--save-buffers``), starting from theta(k) with its optimiser
state, the trainer's own ``update`` runs on

    (a) the full buffer,
    (b) the buffer without every negatively influential record (return target, IIF's scorer,
        ``drop_mode="neg"``: p = 100% of the negatives),
    (c) the buffer without a uniformly random subset of the same size,
    (d) the full buffer with the learning rate scaled by s, s chosen by bisection (at most
        ``D_RETRAINS`` retrains, geometric in s) so that approx_kl(d) = approx_kl(b): the same
        step length as (b) with every record, so R(b) - R(d) is what the choice of records adds
        beyond how far the update goes,

each from a deep copy of the same trainer state, so the minibatch generator starts from the same
state in all four. Before updating, the generator is advanced past the round's collection
draw, exactly as in training, so (a) reproduces the run's own update: its parameters are
compared with the saved theta(k+1) (``a_matches_run``). The four policies are then evaluated
on the same episode seeds with the same action-sampling generator (``PPO.evaluate``), and

    delta_b = R(b) - R(a),   delta_c = R(c) - R(a),   delta_d = R(d) - R(a),   b_minus_d = R(b) - R(d).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from rlinfluence.analysis.report import ROUND_LABEL, Section, Table, figure_png, new_figure
from rlinfluence.errors import UserError
from rlinfluence.filters import FilterContext, IIFFilter, drop_lowest
from rlinfluence.influence import DEFAULT_ADVANTAGE_NORM
from rlinfluence.rundir import RunDirectory

if TYPE_CHECKING:
    from rlinfluence.checkpoint import SavedRound

VARIANTS = ("a", "b", "c", "d")
D_RETRAINS = 8


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
                    advantage_norm: str = DEFAULT_ADVANTAGE_NORM) -> dict[str, object]:
    """Retrain round ``round_index`` of a run as (a), (b), (c); one result row."""
    from rlinfluence.checkpoint import load_round

    if eval_episodes < 1:
        raise UserError(f"--eval-episodes must be >= 1, got {eval_episodes}")
    saved = load_round(run_dir, round_index)
    trainer, buffer = saved.trainer, saved.buffer
    cfg = trainer.config
    if cfg.filter != "none":
        raise UserError(f"{str(run_dir)!r} is a {cfg.filter!r} run; the intervention needs a standard PPO run "
                        "(filter none), whose round-k update trained on the whole buffer")

    # (b): IIF's scorer with its own seed for the chunk permutation, dropping every negative record
    context = FilterContext(trainer.policy, round_index, cfg.batch_size, cfg.gamma, ent_coef=cfg.ent_coef)
    iif = IIFFilter(100.0, drop_mode="neg", advantage_norm=advantage_norm, seed=_seed(cfg.seed, round_index, 11))
    keep_b = iif(buffer, context)
    n_drop = int((~keep_b).sum())
    # (c): as many records, uniformly at random
    generator = torch.Generator().manual_seed(_seed(cfg.seed, round_index, 12))
    keep_c = drop_lowest(torch.rand(len(buffer), generator=generator), n_drop)
    keeps = {"a": torch.ones(len(buffer), dtype=torch.bool), "b": keep_b, "c": keep_c}

    returns, kl, a_matches = {}, {}, None
    for variant in ("a", "b", "c"):
        kl[variant] = saved.retrain(keeps[variant])["approx_kl"]
        if variant == "a":
            a_matches = matches_checkpoint(trainer, run_dir, round_index + 1)
        returns[variant] = trainer.evaluate(eval_episodes)
    scale, kl["d"], retrains = match_kl(saved, kl["b"], kl["a"])
    saved.retrain(lr_scale=scale)
    returns["d"] = trainer.evaluate(eval_episodes)
    r = {v: float(returns[v].mean()) for v in VARIANTS}
    return {
        "run": Path(run_dir).name, "env": cfg.env, "seed": cfg.seed, "round": round_index,
        "records": len(buffer), "dropped": n_drop, "guarded": bool(context.stats.get("minibatch_guard", 0.0)),
        "R_a": r["a"], "R_b": r["b"], "R_c": r["c"],
        "R_d": r["d"], "delta_b": r["b"] - r["a"], "delta_c": r["c"] - r["a"], "delta_d": r["d"] - r["a"],
        **d_comparison(kl["b"], kl["d"], returns["b"], returns["d"]),
        "se_delta_b": _paired_se(returns["b"], returns["a"]), "se_delta_c": _paired_se(returns["c"], returns["a"]),
        "se_delta_d": _paired_se(returns["d"], returns["a"]),
        **{f"kl_{v}": kl[v] for v in VARIANTS}, "d_lr_scale": scale, "d_retrains": retrains,
        "eval_episodes": eval_episodes, "a_matches_run": a_matches,
    }


D_MATCH = 0.1
"""(d) counts as matched to (b)'s step when its approx_kl is within this fraction of (b)'s."""


def d_comparison(kl_b: float, kl_d: float, returns_b: np.ndarray, returns_d: np.ndarray) -> dict[str, object]:
    """``d_matched`` (approx_kl(d) within ``D_MATCH`` of approx_kl(b)), and b_minus_d = R(b) - R(d)
    with its paired s.e., NaN where (d) is unmatched: the bisection gave up, and (b) - (d) would
    not compare the records at one step length."""
    matched = bool(kl_b > 0 and abs(kl_d / kl_b - 1) <= D_MATCH)
    if not matched:
        return {"d_matched": False, "b_minus_d": math.nan, "se_b_minus_d": math.nan}
    return {"d_matched": True, "b_minus_d": float(returns_b.mean() - returns_d.mean()),
            "se_b_minus_d": _paired_se(returns_b, returns_d)}


def match_kl(saved: SavedRound, target_kl: float, kl_at_one: float, max_retrains: int = D_RETRAINS) -> tuple[float, float, int]:
    """(s, approx_kl at s, retrains): the learning-rate scale s of a full-buffer retrain whose
    approx_kl is closest to ``target_kl`` among the scales tried (kl(1) = ``kl_at_one`` is known).

    approx_kl grows with s, so: double (or halve) s until the target is bracketed, then bisect
    geometrically, stopping within 2% of the target or after ``max_retrains`` retrains. A scale
    whose update diverges counts as too large.
    """
    tried = {1.0: kl_at_one}
    if not (target_kl > 0 and kl_at_one > 0):
        return 1.0, kl_at_one, 0
    lo, hi = (1.0, None) if target_kl > kl_at_one else (None, 1.0)
    for _ in range(max_retrains):
        if lo is not None and hi is not None:
            scale = math.sqrt(lo * hi)
        else:
            scale = 2.0 * lo if lo is not None else 0.5 * hi
        try:
            tried[scale] = saved.retrain(lr_scale=scale)["approx_kl"]
        except UserError:  # the update diverged (non-finite loss): this scale is too large
            tried[scale] = math.inf
        if abs(tried[scale] / target_kl - 1) < 0.02:
            break
        if tried[scale] < target_kl:
            lo = scale
        else:
            hi = scale
    best = min(tried, key=lambda s: abs(math.log(max(tried[s], 1e-12) / target_kl)))
    return best, tried[best], len(tried) - 1


def _paired_se(x: np.ndarray, y: np.ndarray) -> float:
    """Standard error of mean(x - y) over episodes with shared seeds."""
    d = np.asarray(x) - np.asarray(y)
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan


def matches_checkpoint(trainer, run_dir: str | Path, n_rounds: int) -> bool | None:
    """Whether the trainer's policy equals the run's saved theta(n_rounds) (None if not saved)."""
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    if not run.checkpoint_path(n_rounds).is_file():
        return None
    saved = run.read_checkpoint(run.checkpoint_path(n_rounds))["policy"]
    return all(torch.equal(v, saved[k]) for k, v in trainer.policy.state_dict().items())


def intervene(run_dirs: list[str | Path], rounds: list[int], eval_episodes: int = 100,
              advantage_norm: str = DEFAULT_ADVANTAGE_NORM, progress: bool = False) -> pd.DataFrame:
    """One row per (run, round); runs are typically the seeds of one env."""
    rows = []
    if progress:
        print("R(a): evaluation return after round k's update on every record; dB, dC, dD: the return of (b) "
              "without the negatively scored records, (c) without as many random records, (d) on every record "
              "with the lr scaled to (b)'s KL step, minus R(a)", flush=True)
    for run_dir in run_dirs:
        for k in rounds:
            rows.append(intervene_round(run_dir, k, eval_episodes, advantage_norm))
            if progress:
                row = rows[-1]
                print(f"{row['run']} round {k}: R(a) {row['R_a']:.4g}  dB {row['delta_b']:+.4g}  "
                      f"dC {row['delta_c']:+.4g}  dD {row['delta_d']:+.4g} (lr x{row['d_lr_scale']:.3g}, "
                      f"kl {row['kl_d']:.3g} vs b {row['kl_b']:.3g}{'' if row['d_matched'] else ', unmatched'})  "
                      f"dropped {row['dropped']}/{row['records']}",
                      flush=True)
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
            "delta_d": float(g["delta_d"].mean()), "se_d": se(g["delta_d"]),
            "d_matched": int(g["d_matched"].sum()),
            "b_minus_d": float(g["b_minus_d"].mean()), "se_b_minus_d": se(g["b_minus_d"].dropna()),
            "b_beats_d": int((g["b_minus_d"] > 0).sum()),
            "kl_a": float(g["kl_a"].mean()), "kl_b": float(g["kl_b"].mean()), "kl_d": float(g["kl_d"].mean()),
            "d_lr_scale": float(g["d_lr_scale"].mean()),
        })
    return pd.DataFrame(out)


def bar_png(rows: pd.DataFrame) -> bytes:
    summary = summarise(rows)
    envs = list(dict.fromkeys(summary["env"]))
    fig, axes = new_figure(4.2 * len(envs), 3.6, ncols=len(envs))
    for ax, env in zip(axes[0], envs, strict=True):
        s = summary[summary["env"] == env]
        x = np.arange(len(s))
        arms = [("b", "tab:green", "(b) drop negatives"), ("c", "tab:gray", "(c) drop random, same size"),
                ("d", "tab:orange", "(d) full buffer, lr scaled to (b)'s approx_kl")]
        for j, (arm, color, label) in enumerate(arms):
            offset = (j - 1) * 0.27
            ax.bar(x + offset, s[f"delta_{arm}"], 0.27, yerr=s[f"se_{arm}"].fillna(0), capsize=3, color=color,
                   label=label)
            for _, g in rows[rows["env"] == env].groupby("round"):
                i = int(np.flatnonzero(s["round"].to_numpy() == g["round"].iloc[0])[0])
                ax.scatter(np.full(len(g), i + offset), g[f"delta_{arm}"], s=10, color="k", zorder=3)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(x, [str(k) for k in s["round"]])
        runs = int(s["runs"].max())
        plural = "run" if runs == 1 else "runs"
        ax.set(xlabel=ROUND_LABEL, ylabel="return change vs (a)", title=f"{env} ({runs} {plural})")
        ax.grid(alpha=0.3, axis="y")
    # one legend under the panels, so that it covers no bar
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8,
               title=f"bars: mean +/- s.e. over {plural} (seeds); dots: single runs", title_fontsize=8)
    return figure_png(fig)


def intervention_section(rows: pd.DataFrame) -> Section:
    section = Section("intervention", "Targeted intervention (single round)")
    n_eval = sorted(set(rows["eval_episodes"]))
    section.paragraphs.append(
        "Round k retrained from theta(k) on (a) the full buffer, (b) without all negatively influential "
        "records (return target), (c) without a random subset of the same size, (d) the full buffer with the "
        "learning rate scaled so that its approx_kl equals (b)'s; evaluated on the same "
        f"{', '.join(map(str, n_eval))} episode seeds. Bars: mean over runs (+/- s.e. across runs), dots: runs. "
        "The paper finds (b) consistently improves and (c) does not; (b) - (d) is what the choice of records "
        "adds beyond the longer step, reported only where (d)'s approx_kl came within "
        f"{D_MATCH:.0%} of (b)'s (d_matched; elsewhere the bisection gave up and b_minus_d is empty).")
    matches = rows["a_matches_run"].dropna()
    if len(matches):
        section.paragraphs.append(f"(a) reproduced the run's own theta(k+1) exactly in {int(matches.sum())} of "
                                  f"{len(matches)} retrained rounds.")
    summary = summarise(rows)
    section.tables.append(Table("Across runs", list(summary.columns),
                                [list(r) for r in summary.itertuples(index=False)]))
    columns = ["run", "seed", "round", "dropped", "R_a", "R_b", "R_c", "R_d", "delta_b", "se_delta_b", "delta_c",
               "se_delta_c", "delta_d", "d_matched", "b_minus_d", "se_b_minus_d", "kl_a", "kl_b", "kl_d",
               "d_lr_scale", "a_matches_run"]
    section.tables.append(Table("Per run (se_delta: paired s.e. over evaluation episodes)", columns,
                                [[v.item() if isinstance(v, np.generic) else v for v in r]
                                 for r in rows[columns].itertuples(index=False)]))
    section.figures["bars"] = (bar_png(rows), "Return change of (b) and (c) relative to (a), per round.")
    return section
