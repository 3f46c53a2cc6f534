"""Which source (training env, worker) is broken, and what kind of fault it is: the permutation test
of per-source scores, Holm's correction, and the verdict that reads a flagged source's signature.

Below both the audit (``rlinfluence.analysis.audit``) and the quarantine filter
(``rlinfluence.filters``), so that training never depends on the analyses. No torch.

A *family* is a per-record score (a harm score, or a consistency check of
``rlinfluence.consistency``); h_s,k is the mean of source s's records whose *episode started in
round k* (``unit_means``). Grouping by the round an episode started in, not the round a record
was collected in, keeps the units of different rounds independent when episodes run across
rounds: an episode longer than a round would otherwise put the same trajectory into several
rounds' units of one source, which the within-round permutation treats as independent draws, and
the test would flag clean sources more often than alpha.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

EXACT_LIMIT = 1 << 21
"""The exact null is enumerated when each half of the rounds has at most this many label draws."""


def _half_sums(centred: np.ndarray) -> np.ndarray:
    sums = np.zeros(1)
    for row in centred:
        sums = (sums[:, None] + row[None, :]).ravel()
    return sums


def source_test(h: np.ndarray, permutations: int = 2000, seed: int = 0, two_sided: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """(T, p): per source s of ``h [rounds, sources]``, its statistic and the permutation p-value of
    "s is more harmful than the other sources" (``two_sided``: "s departs from them").

    T_s = mean over rounds k of (h_s,k - mean_j h_j,k). Under the null that the sources are
    exchangeable (no source is broken) the labels are a random permutation within each round,
    whatever the correlations inside a source; source s then draws, independently per round, one
    of the round's S centred values, so T*_s has the same law for every s. p = P(T* >= T_s) (or
    P(|T*| >= |T_s|)), computed exactly over all S^R draws (meet in the middle: the sums of each half
    of the rounds, one sorted and searched) when S^ceil(R/2) <= ``EXACT_LIMIT``, else estimated from
    ``permutations`` seeded draws as (1 + #{T* >= T_s}) / (1 + permutations). The smallest exact p
    is S^-R: with 7 sources, 6e-5 after 5 rounds.
    """
    centred = h - h.mean(axis=1, keepdims=True)
    observed = centred.mean(axis=0)
    n_rounds, n_sources = centred.shape
    tolerance = 1e-9 * (1 + np.abs(centred).max())
    half = (n_rounds + 1) // 2
    if float(n_sources) ** half <= EXACT_LIMIT:
        first, second = _half_sums(centred[:half]), np.sort(_half_sums(centred[half:]))
        total = float(n_sources) ** n_rounds

        def at_least(t: float) -> float:  # draws with a + b >= t
            return float((len(second) - np.searchsorted(second, t - first - tolerance, side="left")).sum())

        def at_most(t: float) -> float:  # draws with a + b <= t
            return float(np.searchsorted(second, t - first + tolerance, side="right").sum())

        p = []
        for t in observed * n_rounds:
            if not two_sided:
                count = at_least(t)
            elif abs(t) <= tolerance:  # |a + b| >= 0: every draw
                count = total
            else:
                count = at_least(abs(t)) + at_most(-abs(t))
            p.append(min(1.0, count / total))
        return observed, np.array(p)
    rng = np.random.default_rng(seed)
    index = np.tile(np.arange(n_sources), (n_rounds, 1))
    null = np.stack([np.take_along_axis(centred, rng.permuted(index, axis=1), axis=1).mean(axis=0)
                     for _ in range(permutations)])
    compared, reference = (np.abs(null), np.abs(observed)) if two_sided else (null, observed)
    return observed, (1 + (compared >= reference - tolerance / n_rounds).sum(axis=0)) / (1 + permutations)


def episode_starts(rounds: np.ndarray, sources: np.ndarray, episodes: np.ndarray,
                   first_seen: dict | None = None) -> np.ndarray:
    """[N] the round each record's episode started in: the first round in which its (source,
    episode) appears, in these records or in ``first_seen`` ((source, episode) -> round, updated)."""
    first_seen = {} if first_seen is None else first_seen
    keys = list(zip(sources.tolist(), episodes.tolist(), strict=True))
    for key, k in zip(keys, rounds.tolist(), strict=True):
        if key not in first_seen or k < first_seen[key]:
            first_seen[key] = k
    return np.array([first_seen[key] for key in keys], dtype=np.int64)


def unit_means(starts: np.ndarray, sources: np.ndarray, values: np.ndarray, columns: Sequence
               ) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, h): h [rounds, len(columns)] = the mean of ``values`` over the records of each
    (start round, source); a source without a scored record in a start round gets that round's mean
    over the other sources (a neutral value: centred, 0)."""
    frame = pd.DataFrame({"start": starts, "source": sources, "value": values})
    h = frame.groupby(["start", "source"])["value"].mean().unstack("source").reindex(columns=list(columns))
    out = h.to_numpy(dtype=float)
    row_means = np.nanmean(np.where(np.isnan(out).all(axis=1, keepdims=True), 0.0, out), axis=1, keepdims=True)
    return h.index.to_numpy(), np.where(np.isnan(out), row_means, out)


def holm(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error rate across the tests), any shape."""
    p = np.asarray(p_values, float)
    flat = p.ravel()
    order = np.argsort(flat, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((len(flat) - np.arange(len(flat))) * flat[order]))
    out = np.empty_like(flat)
    out[order] = adjusted
    return out.reshape(p.shape)


# -- the reading of a signature -----------------------------------------------------------------------
FAULT_CLASSES = ("stale-policy", "observation", "action", "sampling", "done-flags", "reward", "unexplained")
KIND_CLASS = {"stale": "stale-policy", "obs-bug": "observation", "action-mismatch": "action",
              "logp-mismatch": "sampling", "done-flag": "done-flags", "reward-delay": "reward",
              "reward-flip": "reward", "reward-noise": "reward", "trigger": "reward"}
"""The fault class each corruption kind belongs to (``rlinfluence.corruptions``): the truth a reading is judged by."""

SUPPORT = 0.05
"""A family supports a reading without flagging the source when its unadjusted p-value is below this."""


def reading(signature: Sequence[str], p_values: Mapping[str, float] | None = None) -> tuple[str, str]:
    """(fault class, a plain-language reading) of the families that flag a source.

    ``p_values`` (family -> the source's unadjusted p-value) lets a family that does not flag the
    source on its own still decide between two readings of the families that do (p < ``SUPPORT``):
    a model-family signature with observation statistics that lean away from the others' reads as
    an observation bug, with unlikely actions as a logged-action bug.

    The rules go from the most specific evidence to the least: a logged log-prob or value that
    theta(k) does not give (the worker's policy is not the trainer's), observations distributed
    unlike the others', transitions that the logged (state, action) do not explain (with actions
    unlikely under the policy: logged actions that are not the executed ones; with likely ones: an
    actuator that executes another action, or observations out of step), actions unlikely under the
    policy that explains the transitions (a sampler that differs from the logged policy), episode
    ends that disagree with their states, rewards that disagree with their (state, action); and
    updates that oppose the others' with self-consistent data.
    """
    flagged = set(signature)
    if not flagged:
        return "", ""
    supported = flagged | {f for f, p in (p_values or {}).items() if p < SUPPORT}
    model_family = bool(flagged & {"dynamics", "action-fit"})
    if flagged & {"logp-gap", "value-gap"}:
        return "stale-policy", ("its logged log-probs or values are not the current policy's: a stale or lagging "
                                "worker, or one that logs another policy's numbers")
    if "obs-shift" in flagged or (model_family and "obs-shift" in supported):
        return "observation", ("its observations are distributed unlike the other workers': check its observation "
                               "preprocessing (scaling, feature order)")
    if model_family:
        if "action-surprise" in supported:
            return "action", ("its transitions do not follow from its logged actions, and those actions are unlikely "
                              "under the policy: the logged actions are not the executed ones (an action-mapping or "
                              "logging bug)")
        return "action", ("its transitions do not follow from its logged (state, action) though its actions look "
                          "like the policy's: the env executes another action than the logged one (an actuator or "
                          "clipping bug), or its observations are out of step (a lag)")
    if "action-surprise" in flagged:
        return "sampling", ("its actions are not samples of the policy it logs, though its transitions are consistent: "
                            "it samples from another distribution (temperature, an inference engine)")
    if "termination" in flagged:
        return "done-flags", ("its episode ends disagree with the states they happen in: check its terminated / "
                              "truncated flags")
    if flagged & {"reward-model", "reward-extremes", "td-error"}:
        return "reward", ("its rewards disagree with its (state, action) while its transitions are consistent: check "
                          "its reward's timing, sign and assignment")
    return "unexplained", ("its data is self-consistent but its updates oppose the other workers': most often a "
                           "reward or objective they do not share")


def verdict(means: Mapping[str, np.ndarray], sources: Sequence, two_sided: Sequence[str] = (),
            alpha: float = 0.01, permutations: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One row per source: the p-value of every family (``means[family]`` = h [rounds, sources]),
    Holm-adjusted across sources x families, ``flagged`` (some adjusted p < ``alpha``), its
    ``signature`` (the flagging families, ``;``-joined, with their adjusted p in ``signature_p``),
    and the ``fault_class`` and ``reading`` of that signature (``reading``)."""
    families = list(means)
    raw = np.column_stack([source_test(means[f], permutations, seed, f in two_sided)[1] for f in families]) \
        if families else np.ones((len(sources), 0))
    adjusted = holm(raw)
    out = pd.DataFrame({"source": list(sources)})
    for j, family in enumerate(families):
        out[f"p_{family}"] = raw[:, j]
    flags = adjusted < alpha
    out["flagged"] = flags.any(axis=1)
    out["p_holm_min"] = adjusted.min(axis=1) if families else 1.0
    signatures = [[families[j] for j in np.argsort(adjusted[i]) if flags[i, j]] for i in range(len(sources))]
    out["signature"] = [";".join(s) for s in signatures]
    out["signature_p"] = [";".join(f"{adjusted[i, families.index(f)]:.2g}" for f in s) for i, s in enumerate(signatures)]
    readings = [reading(s, dict(zip(families, raw[i], strict=True))) for i, s in enumerate(signatures)]
    out["fault_class"] = [r[0] for r in readings]
    out["reading"] = [r[1] for r in readings]
    out["rounds"] = len(next(iter(means.values()))) if families else 0
    first = ["source", "rounds", "flagged", "signature", "signature_p", "fault_class", "reading", "p_holm_min"]
    return out[first + [c for c in out.columns if c not in first]]
