"""Which source (training env, worker) is broken, and what kind of fault it is: the per-source tests,
their multiplicity correction, and the verdict that reads a flagged source's signature.

Below both the audit (``rlinfluence.analysis.audit``) and the quarantine filter
(``rlinfluence.filters``), so that training never depends on the analyses. No torch.

A *family* is a per-record score (a harm score, or a consistency check of
``rlinfluence.consistency``). Two tests of "source s differs from the others":

- ``maxt_test``, exact: h_s,k is the mean of s's records (as normal scores within their round)
  whose *episode started in round k* (``group_means`` of ``episode_starts``), and the source labels
  are permuted within rounds, the same permutation for every family. Grouping by the round an
  episode started in keeps the units of different rounds independent when episodes run across
  rounds. Each (source, family) statistic is standardised by its permutation standard deviation,
  and Westfall and Young's step-down maxT adjusts for the sources x families tested: the families'
  correlation (influence, TracIn and DTV move together) costs nothing, where Holm would pay for
  each. Its smallest adjusted p-value is about S^(1-R) (S sources, R rounds): it cannot flag before
  enough rounds have passed (``rounds_needed``), however strong the fault.
- ``outlier_test``, added once every source has ``MIN_EPISODES`` episodes: each record's family score becomes its normal score within its
  round (``normal_scores``), h_s,k the mean over s's records collected in round k, and a source's
  mean over the rounds is compared with the other sources' by a t statistic whose null is that of
  i.i.d. normal means. The spread of the other sources' means carries every correlation inside a
  source (records of one episode, an episode across rounds), so nothing is assumed independent
  but the sources themselves; the size of a departure counts, not only its rank, so a strong
  fault can be flagged in a round or two. Holm over sources x families.
- ``calibration_test``, for the checks whose every record has a known law under the null
  (``action-calibration``: uniform when a worker samples the actions it logs from the policy it
  logs): each source's sum against that law, no other source needed. Holm over sources.

The verdict runs them at shares of alpha (``EXACT_SHARE``, ``CALIBRATION_SHARE``) where they apply.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import special, stats

from rlinfluence.errors import UserError
from rlinfluence.readings import reading
from rlinfluence.statistics import holm

MIN_SOURCES = 3
"""The verdict compares each source with 2 or more others (the outlier test's spread of the others'
means needs two): the audit, quarantine and their SB3 callbacks need this many untrusted sources."""
MAXT_BLOCK = 1 << 18
"""maxT's null is drawn in blocks of at most this many values (2 MiB of float64: memory stays
bounded for any number of sources, and a block that stays in the cache is faster than one draw)."""
STOP_BLOCK = 250
"""With ``stop_above``, maxT looks after every this many draws whether the rest can still flag."""
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


def _permutation_sd(centred: np.ndarray) -> np.ndarray:
    """[..., families] the standard deviation of sum_k c*_s,k when each round k's labels are permuted:
    sqrt(sum_k mean_s c_k,s^2), inf where it is 0 (a family that does not vary tests nothing)."""
    sd = np.sqrt((centred ** 2).mean(axis=1).sum(axis=0))
    return np.where(sd > 1e-12, sd, np.inf)


def _one_sided_scale(t: np.ndarray) -> np.ndarray:
    """|T| of a two-sided family on the scale of a one-sided T: the normal deviate with the same
    tail, Phi^-1(1 - 2 Phi(-|T|)) (T is close to standard normal under the null), so that no
    family dominates the maximum because its statistic is an absolute value."""
    # scipy.special's ndtr and ndtri, what stats.norm's sf and isf compute, without their per-call checks
    return -special.ndtri(np.clip(2 * special.ndtr(-np.abs(t)), 1e-300, 1 - 1e-16))


def maxt_test(means: Mapping[str, np.ndarray], two_sided: Collection[str] = (), permutations: int = 10_000,
              seed: int = 0, stop_above: float | None = None, settled: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, p, p_adjusted), each [sources, families]: for every family f of ``means`` (h [rounds,
    sources], the same rounds for all) and source s, the standardised departure T_s,f = sum_k c_k,s,f
    / sqrt(sum_k mean_j c_k,j,f^2) with c the values centred within their round (for the
    ``two_sided`` families, |T| on a one-sided scale: ``_one_sided_scale``), its permutation p-value,
    and the p-value adjusted for every source x family by Westfall and Young's step-down maxT.

    Under the null that the sources are exchangeable, each round's labels are a random permutation,
    the same for every family, whatever the correlations inside a source or between families. From
    ``permutations`` seeded draws of those permutations: p_s,f = (1 + #{T*_j,f >= T_s,f}) / (1 +
    ``permutations`` x S) over every draw and source j (T*_j,f has one law for every j); with the
    hypotheses ordered by T, largest first, p_adjusted of the i-th = (1 + #{draws whose largest T*
    over the i-th and later hypotheses >= T_i}) / (1 + ``permutations``), made monotone. Flagging
    p_adjusted < alpha keeps the family-wise error rate across all sources x families at most alpha,
    and families that move together (influence, TracIn, DTV) cost nothing, where Holm pays for each.
    A source far out in every round reaches a T that few draws reach, so its adjusted p is near
    the smallest possible, about S^(1-R) (the draws that give one label its values in every round).

    With ``stop_above`` (a caller that needs only which p_adjusted <= ``stop_above``: the quarantine
    filter's flags), the draws stop as soon as the largest T not ``settled`` ([S, F], True where the
    caller needs no answer) has been reached by so many that its p_adjusted, and so the p_adjusted of
    every smaller T (each is at least the larger ones'), is above it whatever the draws left: p and
    p_adjusted are then 1 everywhere. The same draws, so the same answers; a round where no source
    stands out but the settled ones costs a few hundred draws.
    """
    families = list(means)
    centred = np.stack([means[f] - means[f].mean(axis=1, keepdims=True) for f in families], axis=-1)
    n_rounds, n_sources, n_families = centred.shape
    standardised = centred / _permutation_sd(centred)
    sided = np.array([f in two_sided for f in families])

    observed = standardised.sum(axis=0)  # [S, F]
    observed[:, sided] = _one_sided_scale(observed[:, sided])  # the two-sided families' columns only
    rng = np.random.default_rng(seed)
    tolerance = 1e-9
    order = np.argsort(-observed.ravel(), kind="stable")
    threshold = observed.ravel()[order] - tolerance
    exceed = np.zeros((n_sources, n_families), dtype=np.int64)
    reached = np.zeros(len(order), dtype=np.int64)
    # draws in blocks of at most MAXT_BLOCK null values: memory stays bounded for any number of
    # sources, and the blocks consume the generator as one draw of them all would
    block = max(1, MAXT_BLOCK // max(1, n_sources * n_families))
    if stop_above is not None:
        block = min(block, STOP_BLOCK)
        needed = np.flatnonzero(~settled.ravel()[order]) if settled is not None else np.arange(len(order))
        if not len(needed):  # every answer settled
            return observed, np.ones_like(observed), np.ones_like(observed)
        watched = needed[0]  # the largest T whose answer is needed
    for start in range(0, permutations, block):
        size = min(block, permutations - start)
        labels = rng.permuted(np.broadcast_to(np.arange(n_sources), (size, n_rounds, n_sources)), axis=2)
        null = np.zeros((size, n_sources, n_families))
        for k in range(n_rounds):
            null += np.take(standardised[k], labels[:, k], axis=0)
        # [S, F, draws]: each hypothesis (s, f) a contiguous row of draws, in observed.ravel()'s order
        null = np.ascontiguousarray(null.transpose(1, 2, 0))
        null[:, sided] = _one_sided_scale(null[:, sided])
        for s, bar in enumerate(observed - tolerance):  # counted over every source's draws, not sorted
            exceed[s] += (null >= bar[None, :, None]).sum(axis=(0, 2))
        # step-down maxT: the running maximum over the hypotheses from the smallest T up, row by row
        successive = null.reshape(-1, size)[order[::-1]]
        for i in range(1, len(successive)):
            np.maximum(successive[i - 1], successive[i], out=successive[i])
        reached += (successive[::-1] >= threshold[:, None]).sum(axis=1)
        if stop_above is not None and (1 + reached[watched]) / (1 + permutations) > stop_above:
            return observed, np.ones_like(observed), np.ones_like(observed)
    p = (1 + exceed) / (1 + permutations * n_sources)
    ranked = (1 + reached) / (1 + permutations)
    adjusted = np.empty(len(order))
    adjusted[order] = np.maximum.accumulate(ranked)
    return observed, p, adjusted.reshape(n_sources, n_families)


def episode_starts(rounds: np.ndarray, sources: np.ndarray, episodes: np.ndarray,
                   first_seen: dict | None = None) -> np.ndarray:
    """[N] the round each record's episode started in: the first round in which its (source,
    episode) appears, in these records or in ``first_seen`` ((source, episode) -> round, updated)."""
    first_seen = {} if first_seen is None else first_seen
    source_ids, source_code = np.unique(sources, return_inverse=True)
    episode_ids, episode_code = np.unique(episodes, return_inverse=True)
    pairs, pair_of = np.unique(source_code.ravel() * len(episode_ids) + episode_code.ravel(), return_inverse=True)
    earliest = np.full(len(pairs), np.iinfo(np.int64).max)
    np.minimum.at(earliest, pair_of.ravel(), np.asarray(rounds, dtype=np.int64))  # each pair's first round here
    starts, source_ids, episode_ids = [], source_ids.tolist(), episode_ids.tolist()  # the ids as Python values
    for pair, k in zip(pairs.tolist(), earliest.tolist(), strict=True):  # once per (source, episode)
        key = (source_ids[pair // len(episode_ids)], episode_ids[pair % len(episode_ids)])
        first_seen[key] = min(first_seen.get(key, k), k)
        starts.append(first_seen[key])
    return np.array(starts, dtype=np.int64)[pair_of.ravel()]


def group_means(groups: np.ndarray, sources: np.ndarray, values: np.ndarray, columns: Sequence
                ) -> tuple[np.ndarray, np.ndarray]:
    """(groups, h): h [groups, len(columns)] = the mean of ``values`` over the records of each
    (group, source), NaN values left out; a source without a scored record in a group gets that
    group's mean over the other sources (a neutral value: centred, 0). ``values`` [N, F] (several
    families of the same records): h [F, groups, len(columns)], the grouping found once for all."""
    values = np.asarray(values, dtype=float)
    labels, row = np.unique(np.asarray(groups), return_inverse=True)
    columns, sources = np.asarray(list(columns)), np.asarray(sources)
    order = np.argsort(columns, kind="stable")
    at = np.minimum(np.searchsorted(columns, sources, sorter=order), len(columns) - 1)
    col = np.where(columns[order[at]] == sources, order[at], -1)  # -1: a source outside the columns
    size = len(labels) * len(columns)
    inside = col >= 0
    cells = {}  # per pattern of missing values (most families have none): the scored records' cells and counts

    def scored_cells(missing: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = missing.tobytes() if missing.any() else b""
        if key not in cells:
            scored = inside & ~missing
            cell = row.ravel()[scored] * len(columns) + col[scored]
            cells[key] = scored, cell, np.bincount(cell, minlength=size).reshape(len(labels), len(columns))
        return cells[key]

    def means(family: np.ndarray) -> np.ndarray:
        scored, cell, counts = scored_cells(np.isnan(family))
        return cell_means(np.bincount(cell, family[scored], minlength=size).reshape(len(labels), len(columns)), counts)

    if values.ndim == 2:
        return labels, np.stack([means(values[:, f]) for f in range(values.shape[1])])
    return labels, means(values)


def cell_means(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """h [..., groups, sources] = ``sums`` / ``counts`` per (group, source) cell, as ``group_means``
    gives it from records already summed: a cell without a scored record gets its group's mean over
    the other sources (a neutral value: centred, 0), a group without any 0."""
    out = np.divide(sums, counts, out=np.full(np.shape(sums), np.nan), where=np.asarray(counts) > 0)
    row_means = np.nanmean(np.where(np.isnan(out).all(axis=-1, keepdims=True), 0.0, out), axis=-1, keepdims=True)
    return np.where(np.isnan(out), row_means, out)


def normal_scores(rounds: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[N] each value's van der Waerden score within its round, Phi^-1((r - 1/2) / n) with r its
    rank (ties averaged) among the round's n non-NaN values; NaN stays NaN. A record counts by its
    place among the round's records, so no single extreme record (an inf, one huge TD error)
    decides a source's mean, and the means are close to normal. ``values`` [N, F] (several
    families of the same records): [N, F], each column ranked on its own."""
    values = np.asarray(values, float)
    out = np.full(values.shape, np.nan)
    for k in np.unique(rounds):
        at = np.asarray(rounds) == k
        block = values[at]
        ranks = stats.rankdata(block, axis=0, nan_policy="omit")  # NaN where the value is
        counts = np.maximum((~np.isnan(block)).sum(axis=0), 1)
        out[at] = special.ndtri((ranks - 0.5) / counts)  # stats.norm.ppf's values, without its per-call checks
    return out


def episode_floor(sources: np.ndarray, episodes: np.ndarray, z: np.ndarray, columns: Sequence) -> np.ndarray:
    """[len(columns)] per source s, the standard error a source's mean of ``z`` would have if its
    episodes were independent draws from the *other* sources' episodes: sqrt(s_e^2 * mean_j 1/n_j),
    s_e^2 the variance of the other sources' episodes' mean z and n_j each source's episodes. The
    floor of ``outlier_test``'s spread: where the sources' means happen to cluster (a rare event,
    say a goal reached, in a few episodes: most sources have none and the same mean), the spread
    between sources alone would make any source with the event look far out. ``z`` [N, F] (several
    families of the same records): [F, len(columns)], the episodes found once for all."""
    z = np.asarray(z, dtype=float)
    source, episode = np.asarray(sources), np.asarray(episodes)
    _, source_code = np.unique(source, return_inverse=True)
    episode_ids, episode_code = np.unique(episode, return_inverse=True)
    # every (source, episode) pair in (source, episode) order; a family's pairs are those with a scored record
    pairs, first, pair_of = np.unique(source_code.ravel() * len(episode_ids) + episode_code.ravel(),
                                      return_index=True, return_inverse=True)
    pair_of, pair_source = pair_of.ravel(), source[first]
    present_pairs = {}  # per pattern of missing values (most families have none): the pairs it scores

    def scored_pairs(missing: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = missing.tobytes() if missing.any() else b""
        if key not in present_pairs:
            counts_per_pair = np.bincount(pair_of[~missing], minlength=len(pairs))
            present_pairs[key] = ~missing, counts_per_pair, counts_per_pair > 0
        return present_pairs[key]

    def floors(family: np.ndarray) -> np.ndarray:
        scored, counts_per_pair, present = scored_pairs(np.isnan(family))
        means = np.bincount(pair_of[scored], family[scored], minlength=len(pairs))[present] / counts_per_pair[present]
        return pair_floors(means, pair_source[present], columns)

    if z.ndim == 2:
        return np.stack([floors(z[:, f]) for f in range(z.shape[1])])
    return floors(z)


def pair_floors(pair_means: np.ndarray, pair_sources: np.ndarray, columns: Sequence) -> np.ndarray:
    """[len(columns)] ``episode_floor`` from each scored (source, episode)'s mean of z
    (``pair_means``) and its source (``pair_sources``), for callers that sum episodes as they go;
    ``pair_means`` [pairs, F] (families scored on the same pairs): [len(columns), F]."""
    counts = np.array([np.sum(pair_sources == c) for c in columns], dtype=float)
    harmonic = np.mean(1 / np.maximum(counts, 1))
    out = np.zeros((len(columns),) + pair_means.shape[1:])
    for i, c in enumerate(columns):
        others = pair_means[pair_sources != c]
        if len(others) > 1:
            out[i] = np.sqrt(others.var(axis=0, ddof=1) * harmonic)
    return out


def outlier_test(h: np.ndarray, two_sided: bool = False, floor: np.ndarray | float = 0.0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(t, p): per source s of ``h [rounds, sources]``, how far its mean over the rounds lies above
    the other sources' (``two_sided``: on either side), and the p-value.

    With m_s = mean_k h_s,k and R the other sources, t_s = (m_s - mean_R m) /
    (max(sd_R m, ``floor``_s) sqrt(1 + 1/|R|)) and p = P(T >= t_s) for T ~ Student t with |R| - 1
    degrees of freedom (two-sided: 2 P(T >= |t_s|)): exact when the sources' means are i.i.d.
    normal under the null and the floor does not bind, which their being means of many bounded
    scores (``normal_scores``) over ``MIN_EPISODES`` or more episodes makes close; the floor
    (``episode_floor``) keeps a spread that clusters by chance from making a yardstick too short. A
    common shift of a round (the policy changed) moves every source alike and cancels. Needs 3 or
    more sources; a spread of 0 is no yardstick, and p = 1.
    """
    means = h.mean(axis=0)
    n_sources = len(means)
    if n_sources < 3:
        raise ValueError(f"the outlier test compares each source with 2 or more others, got {n_sources} sources")
    floors = np.broadcast_to(np.asarray(floor, float), (n_sources,))
    # row s: the other sources' means, in order (each row reduced as the 1-d array of them would be)
    others = np.broadcast_to(means, (n_sources, n_sources))[~np.eye(n_sources, dtype=bool)].reshape(n_sources, -1)
    spread = np.maximum(others.std(axis=1, ddof=1), floors) * np.sqrt(1 + 1 / (n_sources - 1))
    tested = spread > 1e-12 * (1 + np.abs(others).max(axis=1))
    t = np.where(tested, (means - others.mean(axis=1)) / np.where(tested, spread, 1.0), 0.0)
    tail = special.stdtr(n_sources - 2, -(np.abs(t) if two_sided else t))  # stats.t.sf, without its per-call checks
    p = np.where(tested, np.minimum(1.0, 2 * tail) if two_sided else tail, 1.0)
    return t, p


def calibration_test(sums: np.ndarray, counts: np.ndarray, variance: float) -> np.ndarray:
    """[sources] two-sided p-values of z_s = ``sums``_s / sqrt(``counts``_s ``variance``): per source,
    the sum of its records' scores against a null in which every record scores independently with
    mean 0 and ``variance`` (``rlinfluence.consistency.CALIBRATED``: a worker that samples the
    actions it logs from the policy it logs). The null is each record's own, so no other source is
    needed as a yardstick and no round sets a floor: a source whose records are off by a tenth of
    their spread stands out after a few hundred records. p = 2 Phi(-|z_s|) (the scores are bounded:
    the normal law of their sum is close from a few dozen records); a source without records: 1."""
    sums, counts = np.asarray(sums, float), np.asarray(counts, float)
    z = np.divide(sums, np.sqrt(counts * variance), out=np.zeros_like(sums), where=counts > 0)
    return np.minimum(1.0, 2 * stats.norm.sf(np.abs(z)))


def calibration_p_values(sources: np.ndarray, scores: np.ndarray, columns: Sequence, variance: float) -> np.ndarray:
    """[len(columns)] ``calibration_test`` of each source's records (``sources`` [N] their source ids,
    ``scores`` [N], NaN left out); a source of ``columns`` without a scored record gets p = 1."""
    per_source = pd.Series(np.asarray(scores, float)).groupby(np.asarray(sources)).agg(["sum", "count"])
    per_source = per_source.reindex(list(columns)).fillna(0.0)
    return calibration_test(per_source["sum"].to_numpy(), per_source["count"].to_numpy(), variance)


VERDICT_VERSION = 4
"""What the verdict is: its families, its tests and their shares of alpha, and the reading of a
signature. Every figure records the version that produced it (``verdict_version`` in an audit's
sources.csv, its printed lines and a benchmark's rows); any change to a family, a test, a share or a
reading rule bumps it. 1: the verdict of the design measurements (docs/results/hidden-faults.md,
published before the held-out protocol); 2: the same families and tests, with a reading that names a
class only where the evidence separates it from the others that fit (``reading``); 3, after version
2's held-out results: a signature of gradient and advantage families only is "undetermined" among
every class (version 2 read it "unexplained", a claim of self-consistent data that a scaled reward
or a flaky actuator contradicted), the rule that took ``action-fit`` without ``lag-fit`` as evidence
against an observation fault is gone (rounded observations move ``action-fit`` too), and a family
whose per-source values leave fewer than ``OUTLIER_MIN_SPREAD`` sources apart from the rest gets no
outlier test (``verdict``); 4: the gradient families (influence, influence-trusted, influence-chunk,
tracin, dtv) are scored and tested only where asked (``audit --gradient-families``, which tests version
3's families), the tests and the reading unchanged."""

MIN_EPISODES = 5
"""Episodes (whole or in part) each source needs in the audited rounds for the outlier test: a
source's mean over fewer episodes is far from normal (one episode reaching the goal, or not,
decides it), and the exact test is used alone (``verdict``)."""


EXACT_SHARE = 0.8
"""The exact test's share of alpha where both tests run (a weighted Bonferroni over the two
procedures): with 7 sources its smallest adjusted p-value after 4 rounds (about 7^-3) passes 0.01."""
CALIBRATION_SHARE = 0.1
"""The calibration test's share of alpha where it runs; the exact and outlier tests share the rest as above."""


GUARANTEES = ("audit", "run")


def audit_level(alpha: float, rounds: int, guarantee: str = "audit") -> float:
    """The level an audit of ``rounds`` rounds flags at: ``alpha`` (``guarantee`` "audit": the chance
    of a false flag in this one audit is at most alpha), or alpha / (R (R + 1)) with R = ``rounds``
    ("run": a run audited after each of its rounds, every audit over all its rounds so far, has at
    most alpha chance of any false flag in all of them, since the levels sum to alpha over R = 1, 2,
    ...). The price, measured on held-out runs (docs/results/hidden-faults.md): early audits are so
    strict that few faults are flagged within 5 rounds; most are by round 8."""
    if guarantee not in GUARANTEES:
        raise UserError(f"guarantee must be one of {', '.join(GUARANTEES)}, got {guarantee!r}")
    return alpha if guarantee == "audit" else alpha / (max(rounds, 1) * (max(rounds, 1) + 1))


def rounds_needed(n_sources: int, alpha: float, share: float = 1.0) -> int:
    """The fewest rounds R at which the exact test's smallest adjusted p-value, about n_sources^(1-R)
    (a draw that gives one label the broken source's values in every round), divided by its
    ``share`` of alpha, is below alpha: before that, the exact test alone cannot flag any source,
    however broken."""
    return math.floor(math.log(1 / (alpha * share)) / math.log(n_sources)) + 2


OUTLIER_MIN_SPREAD = 3
"""Sources a family's values must set apart from the rest for its outlier test (``spread_enough``)."""


def spread_enough(means: np.ndarray) -> bool:
    """Whether a family's per-source values (``means`` [rounds, sources], averaged over the rounds) set
    at least ``OUTLIER_MIN_SPREAD`` sources apart from the most common value. The outlier test scales
    a source's departure by the others' spread: in a rare 0/1 family (one source's episode reached a
    time limit, the others' none) that spread is near zero and t is unbounded, a flag from one event."""
    per_source = np.nanmean(np.asarray(means, float), axis=0)
    per_source = per_source[np.isfinite(per_source)]
    if not len(per_source):
        return False
    values, counts = np.unique(np.round(per_source, 12), return_counts=True)
    return len(per_source) - int(counts.max()) >= OUTLIER_MIN_SPREAD


def verdict_p_values(means: Mapping[str, np.ndarray], two_sided: Sequence[str] = (),
                     outlier_means: Mapping[str, np.ndarray] | None = None,
                     floors: Mapping[str, np.ndarray] | None = None, permutations: int = 10_000,
                     calibrated: Mapping[str, np.ndarray] | None = None, flags_at: float | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(p, p_adjusted), each [sources, families of ``means``, one or more]: the tests of ``verdict``
    combined, before and after the adjustment across sources x families (a source is flagged where
    some p_adjusted < alpha); what a caller that needs only the flags (the quarantine filter, every
    round) computes without the table. With ``flags_at`` = alpha, only which sources are flagged is
    kept exact: the outlier and calibration tests run first, and maxT (``maxt_test``'s
    ``stop_above``, its ``settled`` the sources they flag already) stops once it can flag no other
    source (each route through it to p_adjusted < alpha needs its own p_adjusted below alpha)."""
    families = list(means)
    n_sources = next(iter(means.values())).shape[1]
    outlier = None
    if outlier_means is not None:
        outlier = np.column_stack([outlier_test(outlier_means[f], f in two_sided, (floors or {}).get(f, 0.0))[1]
                                   if spread_enough(outlier_means[f]) else np.ones(n_sources) for f in families])

    def combined(raw: np.ndarray, adjusted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # maxT's with the others
        if outlier is not None:
            raw = np.minimum(1.0, np.minimum(raw / EXACT_SHARE, outlier / (1 - EXACT_SHARE)))
            adjusted = np.minimum(1.0, np.minimum(adjusted / EXACT_SHARE, holm(outlier) / (1 - EXACT_SHARE)))
        if calibrated:
            rest = 1 - CALIBRATION_SHARE
            raw, adjusted = np.minimum(1.0, raw / rest), np.minimum(1.0, adjusted / rest)
            for family, p in calibrated.items():
                j = families.index(family)
                raw[:, j] = np.minimum(raw[:, j], np.minimum(1.0, np.asarray(p) / CALIBRATION_SHARE))
                adjusted[:, j] = np.minimum(adjusted[:, j], np.minimum(1.0, holm(p) / CALIBRATION_SHARE))
        return raw, adjusted

    settled = None
    if flags_at is not None:  # the sources the other tests flag whatever maxT finds
        ones = np.ones((n_sources, len(families)))
        flagged = (combined(ones, ones)[1] < flags_at).any(axis=1)
        settled = np.repeat(flagged[:, None], len(families), axis=1)
    _, raw, adjusted = maxt_test(means, two_sided, permutations, stop_above=flags_at, settled=settled)
    return combined(raw, adjusted)


def verdict(means: Mapping[str, np.ndarray], sources: Sequence, two_sided: Sequence[str] = (),
            alpha: float = 0.01, outlier_means: Mapping[str, np.ndarray] | None = None,
            floors: Mapping[str, np.ndarray] | None = None, permutations: int = 10_000,
            calibrated: Mapping[str, np.ndarray] | None = None) -> pd.DataFrame:
    """One row per source: the p-value of every family, adjusted across sources x families,
    ``flagged`` (some adjusted p < ``alpha``), its ``signature`` (the flagging families,
    ``;``-joined, with their adjusted p in ``signature_p``), and the ``fault_class`` and ``reading``
    of that signature (``reading``).

    The exact test is ``maxt_test`` of ``means`` (h [rounds, sources] per family, per episode start
    round), its p-values adjusted by step-down maxT. With ``outlier_means`` (normal-score means per
    collection round, which callers give once every source has ``MIN_EPISODES`` episodes, with each
    family's ``episode_floor`` in ``floors``), the outlier test runs beside it, Holm-adjusted, and a
    source x family's adjusted p is min(p_maxT / w, p_Holm / (1 - w)) with w = ``EXACT_SHARE`` (each
    procedure at its share of alpha, so the family-wise error rate is at most alpha whatever their
    dependence; a family whose values set fewer than ``OUTLIER_MIN_SPREAD`` sources apart gets p = 1
    from it, ``spread_enough``); the unadjusted ``p_<family>`` columns combine alike. The exact test finds a modest
    departure that holds round after round, the outlier test a large one in a round or two. With
    ``calibrated`` (per family of ``CALIBRATED``, the p-values of ``calibration_test`` per source),
    that test runs at ``CALIBRATION_SHARE`` of alpha for its family, Holm over sources, and the
    other two at the rest. ``verdict_version`` is ``VERDICT_VERSION``."""
    families = list(means)
    n_sources = len(sources)
    if families:
        raw, adjusted = verdict_p_values(means, two_sided, outlier_means, floors, permutations, calibrated)
    else:
        raw = adjusted = np.ones((n_sources, 0))
    flags = adjusted < alpha
    signatures = [[families[j] for j in np.argsort(adjusted[i]) if flags[i, j]] for i in range(n_sources)]
    # each source's side of the others per family (mean over rounds of its centred means): the
    # reading's truncations rule needs it, the two-sided p-values do not keep it
    sides = (np.column_stack([(means[f] - means[f].mean(axis=1, keepdims=True)).mean(axis=0) for f in families])
             if families else np.zeros((n_sources, 0)))
    readings = [reading(s, dict(zip(families, raw[i], strict=True)), dict(zip(families, sides[i], strict=True)))
                for i, s in enumerate(signatures)]
    out = pd.DataFrame({  # built at once: pandas takes milliseconds per column added one by one
        "source": list(sources), **{f"p_{family}": raw[:, j] for j, family in enumerate(families)},
        "flagged": flags.any(axis=1), "p_adjusted_min": adjusted.min(axis=1) if families else 1.0,
        "signature": [";".join(s) for s in signatures],
        "signature_p": [";".join(f"{adjusted[i, families.index(f)]:.2g}" for f in s) for i, s in enumerate(signatures)],
        "fault_class": [r[0] for r in readings], "reading": [r[1] for r in readings], "candidates": [r[2] for r in readings],
        "rounds": len(next(iter(means.values()))) if families else 0,
        "test": "+".join(["exact"] + ["outlier"] * (outlier_means is not None) + ["calibration"] * bool(calibrated)),
        "verdict_version": VERDICT_VERSION})
    first = ["source", "rounds", "flagged", "signature", "signature_p", "fault_class", "candidates", "reading",
             "p_adjusted_min", "test", "verdict_version"]
    return out[first + [c for c in out.columns if c not in first]]
