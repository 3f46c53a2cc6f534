"""Detection of corrupted records: how well each scorer ranks the records a corruption changed.

For a saved round with ground truth (``RolloutBuffer.corrupted``, a run trained with
``--corrupt``), every scorer gives each record a *harm* score (higher = more harmful):

    influence           -<grad l_i, grad f>, f the return target on the whole buffer (IIF's scores)
    influence-trusted   the same with f on the trusted envs' records only (``trusted_envs``)
    dtv                 -g_i . mean_j g_j, g_i = A_i grad log pi(a_i|s_i) (A batch-normalised): the
                        gradient alignment of "Not All Rollouts Are Worth Learning", no target needed
    negative-advantage  -A_i
    abs-advantage       |A_i|
    random              a uniform draw (the chance line), seeded by the round and the buffer

and detection is measured as AUROC (the probability that a corrupted record is ranked more
harmful than a clean one; 0.5 = chance) at three levels: per record, per episode and per source
(a training env), an episode's or a source's harm being the mean harm of its records (and it
counts as corrupted when any of its records, for a source most of them, is). Trusted envs are left out of both
(their records are clean by construction and the trusted target is built from them).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score

from rlinfluence.analysis.report import Section
from rlinfluence.buffer import RolloutBuffer
from rlinfluence.errors import UserError
from rlinfluence.filters import FilterContext, InfluenceScorer
from rlinfluence.influence import ZeroTargetGradient, gradient_alignment

Scorer = Callable[[RolloutBuffer, torch.nn.Module, torch.Tensor | None, int], np.ndarray]


def _influence(trusted_only: bool) -> Scorer:
    def harm(buffer: RolloutBuffer, policy: torch.nn.Module, trusted: torch.Tensor | None, batch_size: int
             ) -> np.ndarray:
        if trusted_only and trusted is None:
            raise ValueError("influence-trusted needs a run with trusted_envs > 0")
        context = FilterContext(policy, buffer.round, batch_size, trusted=trusted if trusted_only else None)
        scores = InfluenceScorer(advantage_norm="batch").scores(buffer, context)
        return -scores.double().numpy() if scores is not None else np.zeros(len(buffer))
    return harm


def _dtv(buffer: RolloutBuffer, policy: torch.nn.Module, *_: object) -> np.ndarray:
    obs, actions, advantages = (buffer.flat(k) for k in ("obs", "actions", "advantages"))
    try:
        return -gradient_alignment(policy, obs, actions, advantages).double().numpy()
    except ZeroTargetGradient:
        return np.zeros(len(buffer))


def _random(buffer: RolloutBuffer, *_: object) -> np.ndarray:
    """Uniform draws, seeded by the round and a checksum of the buffer's actions: reproducible,
    and different for every run and round (a seed of the round alone would repeat across runs)."""
    checksum = zlib.crc32(buffer.flat("actions").numpy().tobytes())
    return np.random.default_rng([buffer.round, checksum]).random(len(buffer))


SCORERS: dict[str, Scorer] = {
    "influence": _influence(False),
    "influence-trusted": _influence(True),
    "dtv": _dtv,
    "negative-advantage": lambda buffer, *_: -buffer.flat("advantages").double().numpy(),
    "abs-advantage": lambda buffer, *_: buffer.flat("advantages").abs().double().numpy(),
    "random": _random,
}


def auroc(harm: np.ndarray, corrupted: np.ndarray) -> float:
    """P(a corrupted item's harm > a clean item's), ties counting 1/2; NaN if one class is empty."""
    corrupted = np.asarray(corrupted, bool)
    if corrupted.all() or not corrupted.any():
        return float("nan")
    return float(roc_auc_score(corrupted, harm))


def detection(buffer: RolloutBuffer, policy: torch.nn.Module, trusted_envs: int, batch_size: int,
              scorers: tuple[str, ...] = tuple(SCORERS)) -> list[dict[str, float | str | int]]:
    """One row per scorer and level (record, episode, source) of one round: its AUROC."""
    n_envs = buffer.n_envs
    env = buffer.record_ids()[:, 1].numpy()
    trusted = torch.from_numpy(env >= n_envs - trusted_envs) if trusted_envs else None
    judged = env < n_envs - trusted_envs
    corrupted = buffer.flat("corrupted").numpy()
    rows: list[dict[str, float | str | int]] = []
    for name in scorers:
        if name == "influence-trusted" and trusted is None:
            continue
        harm = SCORERS[name](buffer, policy, trusted, batch_size)
        sources = np.unique(env[judged])
        source_harm = np.array([harm[env == s].mean() for s in sources])
        source_corrupted = np.array([corrupted[env == s].mean() > 0.5 for s in sources])
        rows.append({"round": buffer.round, "scorer": name, "level": "record",
                     "auroc": auroc(harm[judged], corrupted[judged])})
        episodes = buffer.flat("episode_ids").numpy()[judged]
        _, episode_index = np.unique(episodes, return_inverse=True)
        episode_harm = np.bincount(episode_index, weights=harm[judged]) / np.bincount(episode_index)
        episode_corrupted = np.bincount(episode_index, weights=corrupted[judged].astype(float)) > 0
        rows.append({"round": buffer.round, "scorer": name, "level": "episode",
                     "auroc": auroc(episode_harm, episode_corrupted)})
        rows.append({"round": buffer.round, "scorer": name, "level": "source",
                     "auroc": auroc(source_harm, source_corrupted)})
    return rows


# -- a run's audit: which sources are harmful, and (with ground truth) how well each scorer sees it --
def source_means(harm_by_round: list[np.ndarray], env_by_round: list[np.ndarray], sources: np.ndarray) -> np.ndarray:
    """[rounds, sources]: h_s,k, the mean harm of source s's records in round k."""
    return np.array([[harm[env == s].mean() for s in sources]
                     for harm, env in zip(harm_by_round, env_by_round, strict=True)])


def source_test(harm_by_round: list[np.ndarray], env_by_round: list[np.ndarray], sources: np.ndarray,
                permutations: int = 2000, seed: int = 0) -> list[dict[str, float | int]]:
    """Per source s: its mean harm over rounds and a one-sided permutation p-value of "s is more
    harmful than the other sources".

    The statistic is T_s = mean over rounds k of (h_s,k - mean_j h_j,k), h_s,k the mean harm of
    source s's records in round k. Under the null that the sources are exchangeable (no source is
    broken), the labels of the sources are a random permutation within each round, whatever the
    correlations inside a source (its episodes); so the null draws permute the h_.,k of every
    round independently, and p = (1 + #{T*_s >= T_s}) / (1 + permutations).
    """
    h = source_means(harm_by_round, env_by_round, sources)
    centred = h - h.mean(axis=1, keepdims=True)
    observed = centred.mean(axis=0)
    rng = np.random.default_rng(seed)
    null = np.stack([np.take_along_axis(centred, rng.permuted(np.tile(np.arange(len(sources)), (len(h), 1)), axis=1),
                                        axis=1).mean(axis=0) for _ in range(permutations)])
    p_values = (1 + (null >= observed).sum(axis=0)) / (1 + permutations)
    return [{"source": int(s), "rounds": len(h), "mean_harm": float(h[:, i].mean()), "p_value": float(p_values[i])}
            for i, s in enumerate(sources)]


def holm(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error rate across the sources)."""
    p = np.asarray(p_values, float)
    order = np.argsort(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]))
    out = np.empty_like(p)
    out[order] = adjusted
    return out


def audit_run(run_dir: str | Path, rounds: Sequence[int] | None = None, scorer: str | None = None,
              alpha: float = 0.01, permutations: int = 2000, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(sources, detection) of a run trained with ``--save-buffers``.

    sources: one row per training env but the trusted ones: records, mean harm with a 95%
    bootstrap interval over rounds, the permutation p-value (``source_test``), its Holm-adjusted
    value across sources and ``flagged`` = adjusted p < ``alpha``. ``scorer`` defaults to
    influence-trusted for a run with trusted envs, else influence. detection: the AUROC of every
    scorer at every level per round (``detection``), empty for a run without ground truth."""
    from rlinfluence.experiments.statistics import bootstrap_mean
    from rlinfluence.ppo import load_round
    from rlinfluence.rundir import RunDirectory

    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    config = run.read_config()
    trusted_envs, n_envs = int(config.get("trusted_envs", 0)), int(config["n_envs"])
    scorer = scorer or ("influence-trusted" if trusted_envs else "influence")
    if scorer not in SCORERS or (scorer == "influence-trusted" and not trusted_envs):
        raise UserError(f"unknown scorer {scorer!r} for this run (scorers: "
                        f"{', '.join(s for s in SCORERS if trusted_envs or s != 'influence-trusted')})")
    saved = sorted(int(p.stem.split("_")[1]) for p in (Path(run_dir) / "buffers").glob("round_*.safetensors"))
    rounds = list(rounds) if rounds else saved
    if not rounds:
        raise UserError(f"{str(run_dir)!r} has no saved rounds: train with --save-buffers")
    if n_envs - trusted_envs < 2:
        raise UserError(f"an audit compares sources: {str(run_dir)!r} has {n_envs - trusted_envs} untrusted env(s)")
    if not 0 < alpha < 1:
        raise UserError(f"--alpha must be in (0, 1), got {alpha}")
    if permutations < 1:
        raise UserError(f"--permutations must be >= 1, got {permutations}")
    sources = np.arange(n_envs - trusted_envs)
    harms, envs, rows = [], [], []
    for k in rounds:
        loaded = load_round(run_dir, k)
        buffer, policy = loaded.buffer, loaded.trainer.policy
        env = buffer.record_ids()[:, 1].numpy()
        trusted = torch.from_numpy(env >= n_envs - trusted_envs) if trusted_envs else None
        harms.append(SCORERS[scorer](buffer, policy, trusted, int(config["batch_size"])))
        envs.append(env)
        if config.get("corrupt"):
            rows += detection(buffer, policy, trusted_envs, int(config["batch_size"]))
    table = pd.DataFrame(source_test(harms, envs, sources, permutations, seed))
    per_round = source_means(harms, envs, sources)
    intervals = [bootstrap_mean(per_round[:, i], seed=seed) for i in range(len(sources))]
    table.insert(1, "records", [int(sum((env == s).sum() for env in envs)) for s in sources])
    table.insert(4, "ci_low", [lo for _, lo, _ in intervals])
    table.insert(5, "ci_high", [hi for _, _, hi in intervals])
    table["p_holm"] = holm(table["p_value"].to_numpy())
    table["flagged"] = table["p_holm"] < alpha
    table["scorer"] = scorer
    return table, pd.DataFrame(rows, columns=["round", "scorer", "level", "auroc"])


def plot_sources(sources: pd.DataFrame, alpha: float) -> bytes:
    """PNG: each source's mean harm with its 95% interval, flagged sources in red."""
    from rlinfluence.analysis.report import figure_png, new_figure

    fig, axes = new_figure(max(4.0, 0.6 * len(sources) + 2), 3.2)
    ax = axes[0, 0]
    colors = ["C3" if f else "C0" for f in sources["flagged"]]
    x = np.arange(len(sources))
    mean = sources["mean_harm"].to_numpy()
    ax.bar(x, mean, color=colors)
    ax.errorbar(x, mean, yerr=[mean - sources["ci_low"], sources["ci_high"] - mean], fmt="none", ecolor="k", capsize=3)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x, [f"env {s}" for s in sources["source"]])
    ax.set(ylabel=f"mean harm ({sources['scorer'].iloc[0]})",
           title=f"red: flagged (Holm-adjusted p < {alpha}); bars: 95% interval over rounds")
    return figure_png(fig)


def audit_section(sources: pd.DataFrame, found: pd.DataFrame, alpha: float) -> Section:
    """The audit as a report section: the sources table and plot, and the detection AUROC per
    scorer and level (mean over rounds) where the run has ground truth."""
    from rlinfluence.analysis.report import Table

    flagged = [f"env {s}" for s in sources.loc[sources["flagged"], "source"]]
    section = Section("audit", "Audit: which training envs push the updates the wrong way", paragraphs=[
        f"Harm = minus a record's score by {sources['scorer'].iloc[0]} (higher = more harmful). Each env's mean harm is "
        "tested against the other envs with a permutation test within rounds (the envs' labels shuffled in every "
        f"round), Holm-corrected across envs: a clean run is flagged with probability at most {alpha}.",
        f"Flagged: {', '.join(flagged) or 'none'}."])
    section.tables.append(Table("Sources", ["env", "records", "rounds", "mean harm", "95% interval", "p", "p (Holm)",
                                            "flagged"],
                                [[int(r.source), int(r.records), int(r.rounds), f"{r.mean_harm:.4g}",
                                  f"[{r.ci_low:.4g}, {r.ci_high:.4g}]", f"{r.p_value:.3g}", f"{r.p_holm:.3g}",
                                  "yes" if r.flagged else ""] for r in sources.itertuples()]))
    section.figures["sources"] = (plot_sources(sources, alpha), "Mean harm per env with its 95% interval over rounds.")
    if len(found):
        means = found.groupby(["scorer", "level"], sort=False)["auroc"].mean().unstack()
        section.tables.append(Table("Detection AUROC against the ground truth, mean over rounds (0.5 = chance)",
                                    ["scorer", *means.columns],
                                    [[name, *(f"{v:.2f}" for v in row)] for name, row in means.iterrows()]))
    return section
