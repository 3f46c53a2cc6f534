"""Consistency checks of a round's records: what a practitioner checks when one worker seems broken.

Each check gives every record of a round a score, higher = less consistent with the rest of the
data or with the policy theta(k) that collected it; an audit averages a score per source and
round and tests the sources against each other (``rlinfluence.sources``). None reads the reward's
sign or size as such; they ask whether the records agree with themselves:

    logp-gap         |log pi_old(a|s) - log pi_theta(k)(a|s)|: the logged log-prob against the
                     policy's own (0 for a worker that acts with theta(k) and logs what it did;
                     gaps below GAP_TOLERANCE, float rounding between the rollout and the
                     trainer, count as 0)
    value-gap        |V_old(s) - V_theta(k)(s)|, the logged value against a recomputed one (the same
                     tolerance, relative to 1 + |V|)
    action-surprise  -log pi(a|s) - H(pi(.|s)): how much less likely the logged action is than a
                     sample of pi(.|s) would be on average (mean 0 for actions sampled from pi;
                     two-sided: a worker sampling colder than it logs scores below 0)
    action-calibration
                     U - 1/2, U the randomised probability integral transform of the logged action
                     under pi(.|s): for Discrete, U = P(a' ranks before a) + V pi(a|s), the actions
                     ranked by probability (most likely first, ties by index), V ~ U(0, 1) seeded by
                     the round and the observations; for a diagonal Gaussian, U = F_chi2(d)(sum_d z_d^2), where
                     sum_d z_d^2 = 2 (action-surprise) + d. When the worker sampled the action it logged
                     from the policy it logged, every record's U is uniform on (0, 1) and independent
                     of the others (``rlinfluence.sources.calibration_test`` needs nothing else);
                     a worker that samples hotter than it logs, or logs another action than it
                     sampled, scores above 0 (two-sided)
    obs-shift        mean_d log(1 + z_d^2), z_d = (o_d - median_d) / scale_d, scale_d = 1.4826 MAD_d
                     (the standard deviation where the MAD is 0), both over the pooled records of
                     the round (the log keeps a clean source's rare extreme states from
                     outweighing a broken source's steady shift)
    truncations      at a record that ends an episode, 1 if the end is reported as a time-limit
                     truncation and 0 if as a termination (NaN elsewhere): a source's mean is the
                     share of its episode ends that it bootstraps through. Under the null the
                     sources share one time limit and one task, so one share out of line (two-sided)
                     points at its done flags: terminal states reported as truncations (a share above
                     the others', which may be 0 before any episode reaches the limit), or time limits
                     reported as terminal (a share below)
    dynamics         a one-step model o' - o ~ ridge(phi(o, a)), phi = [o, a, o (x) a] (a one-hot
                     for Discrete), fit on the pooled records and cross-fitted over two folds of
                     episodes: each record's mean squared standardised error on the fold it was
                     not fit on (records whose next observation is in the buffer)
    action-fit       the dynamics error with the logged action minus its mean over the other
                     actions the record could have carried (every action of a Discrete space; for
                     Box, the actions of four seeded shuffles of the round's records): how much the
                     logged action fails to explain the transition, within the same state (a state
                     that is hard to predict raises both terms alike)
    lag-fit          action-fit's mean error over the actions the record could carry minus the error
                     with the action of the record before it in the episode (NaN at an episode's
                     first record): high when the previous action explains the transition, as it
                     does for every record of a worker whose observations run one step behind its
                     actions (the logged o_t is o_(t-1), so the logged transition is the one a_(t-1)
                     caused); for a clean worker or a miswired actuator the previous action explains
                     it only where it happens to equal the action that did
    reward-model     the same cross-fitted ridge for the reward r ~ phi(o, a): squared standardised error
    termination      cross-fitted logistic regression of the terminated flag on phi(o, a) (L2
                     penalty 1/2 |w|^2, the intercept free; fitted to its optimum): the
                     calibration residual terminated - P(terminated | o, a), mean 0 for a source
                     whose flags follow the pooled ones (two-sided: flags missing or added)

A record a check cannot score (no next observation in the buffer) is NaN; per-source means skip
it. The fits are deterministic.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cached_property

import gymnasium as gym
import numpy as np
import torch
from scipy import linalg, special, stats
from scipy.linalg import lapack
from sklearn.linear_model import LogisticRegression

from rlinfluence.buffer import RolloutBuffer

MODEL_CHECKS = ("dynamics", "action-fit", "lag-fit", "reward-model", "termination")
POLICY_CHECKS = ("logp-gap", "value-gap", "action-surprise", "action-calibration")
CHECKS = (*POLICY_CHECKS, "obs-shift", "truncations", *MODEL_CHECKS)
STATISTICS = ("negative-advantage", "abs-advantage", "td-error", "reward-extremes")
TWO_SIDED = frozenset({"action-surprise", "action-calibration", "truncations", "termination"})
"""Checks whose per-source mean departs from the others' in either direction when a source is broken."""
RAW_SCALE = frozenset({"action-calibration", "truncations"})
"""Checks that the tests take as they are, not as normal scores within the round: bounded scores whose
size carries the signal, which ranks would flatten (a uniform U, or a 0/1 end type whose ties would
all share one rank). Unbounded checks stay normal scores: one huge value (a termination the model did
not expect, an action the policy almost never takes) would decide a source's mean."""
CALIBRATED = {"action-calibration": 1 / 12}
"""Checks whose every record has a known null law: mean 0 and this variance, independently of the
others (``rlinfluence.sources.calibration_test``)."""
GAP_TOLERANCE = 1e-3


@torch.no_grad()
def policy_checks(policy: torch.nn.Module, buffer: RolloutBuffer, n_actions: int | None) -> dict[str, np.ndarray]:
    """``logp-gap``, ``value-gap``, ``action-surprise`` and ``action-calibration`` of every record
    (flat order) at ``policy``; ``n_actions``: the size of a Discrete action space (None otherwise:
    ``action-calibration`` is then scored for a diagonal Gaussian policy and NaN for any other).
    Every action's log-prob comes from the policy's ``evaluate_every_action(obs)`` where it has one
    (``ActorCritic``: with the entropy and the value, one pass), else its ``action_log_probs(obs)``
    (the SB3 adapter), else ``evaluate_actions`` once per action."""
    obs, actions = buffer.flat("obs"), buffer.flat("actions")
    every = None  # every action's log-prob, [N, n_actions]
    if n_actions is not None and callable(getattr(policy, "evaluate_every_action", None)):  # one actor pass
        every, entropy, values = policy.evaluate_every_action(obs)
        logp = every.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    else:
        logp, entropy, values = policy.evaluate_actions(obs, actions)
    logp, entropy, values = (x.double().numpy() for x in (logp, entropy, values))
    logp_gap = np.abs(buffer.flat("logp").double().numpy() - logp)
    value_gap = np.abs(buffer.flat("values").double().numpy() - values)
    surprise = -logp - entropy
    if n_actions is not None:
        if every is None and callable(getattr(policy, "action_log_probs", None)):  # one forward for every action
            every = policy.action_log_probs(obs)
        elif every is None:  # a policy with only evaluate_actions: one forward per action
            every = torch.stack([policy.evaluate_actions(obs, torch.full_like(actions, a))[0] for a in range(n_actions)], 1)
        probs = torch.softmax(every.double(), dim=1).numpy()  # renormalised: float rounding of the log-probs
        taken = actions.reshape(len(actions)).long().numpy()
        p_taken = probs[np.arange(len(taken)), taken][:, None]
        index = np.arange(n_actions)[None, :]
        before = (probs > p_taken) | ((probs == p_taken) & (index < taken[:, None]))
        # V seeded by the round and a checksum of the observations: reproducible, independent of the
        # sampling noise, and different in every run (one V for every run would tie their audits)
        v = np.random.default_rng([int(buffer.round), zlib.crc32(obs.numpy().tobytes())]).random(len(taken))
        pit = (probs * before).sum(axis=1) + v * p_taken[:, 0]
    elif gaussian_actions(policy):
        dims = int(np.prod(actions.shape[1:])) if actions.dim() > 1 else 1
        pit = stats.chi2.cdf(np.maximum(2 * surprise + dims, 0.0), dims)
    else:  # a joint action (MultiDiscrete, MultiBinary): no law implemented, so no score
        pit = np.full(len(surprise), np.nan)
    return {"logp-gap": np.where(logp_gap > GAP_TOLERANCE, logp_gap, 0.0),
            "value-gap": np.where(value_gap > GAP_TOLERANCE * (1 + np.abs(values)), value_gap, 0.0),
            "action-surprise": surprise, "action-calibration": pit - 0.5}


def obs_shift(buffer: RolloutBuffer) -> np.ndarray:
    """``obs-shift`` of every record: log(1 + its squared robust z-score), averaged over the features."""
    x = buffer.flat("obs").reshape(len(buffer), -1).double().numpy()
    centre = np.median(x, axis=0)
    scale = 1.4826 * np.median(np.abs(x - centre), axis=0)
    scale = np.where(scale > 0, scale, x.std(axis=0))
    varying = scale > 0
    if not varying.any():
        return np.zeros(len(buffer))
    return np.log1p(((x[:, varying] - centre[varying]) / scale[varying]) ** 2).mean(axis=1)


def truncations(buffer: RolloutBuffer) -> np.ndarray:
    """``truncations`` of every record (flat order): 1.0 for a reported truncation, 0.0 for a reported
    termination, NaN for a record that does not end its episode."""
    terminated, truncated = buffer.flat("terminated").numpy(), buffer.flat("truncated").numpy()
    return np.where(terminated | truncated, truncated.astype(np.float64), np.nan)


def _features(obs: np.ndarray, actions: np.ndarray, n_actions: int | None) -> np.ndarray:
    """phi(o, a) = [o, a, o (x) a], a one-hot for Discrete."""
    a = np.eye(n_actions)[actions.astype(np.int64)] if n_actions is not None else actions.reshape(len(actions), -1)
    return np.concatenate([obs, a, (obs[:, :, None] * a[:, None, :]).reshape(len(obs), -1)], axis=1)


def _folds(buffer: RolloutBuffer) -> np.ndarray:
    """[N] 0/1: two folds of whole episodes, as near halves of the round's (source, episode) pairs as
    their count allows, the pairs shuffled with a seed of the round. (A parity of the ids would put
    every episode in one fold where ids advance in step with the sources, as when every worker's
    episode hits the time limit at once.)"""
    source = buffer.record_ids()[:, 1].numpy().astype(np.int64)
    episode = buffer.flat("episode_ids").numpy().astype(np.int64)
    episode_ids, episode_code = np.unique(episode, return_inverse=True)
    # the (source, episode) pairs in their sorted order, from one code per pair (np.unique(axis=0) is slow)
    pairs, pair_of = np.unique(source * len(episode_ids) + episode_code.ravel(), return_inverse=True)
    order = np.random.default_rng([int(buffer.round), 17]).permutation(len(pairs))
    return (np.argsort(order) % 2)[pair_of.ravel()]


class _Phi:
    """phi(o, a) of a round's records (``_features``), built only where a model reads it. Wider than
    ``MOMENT_RIDGE_FEATURES`` with a Discrete action (an image observation's products with the
    action), a fold's column means and standard deviations are taken block by block, without phi:
    the observation's columns, the one-hot's, then o (x) e_a for one action a at a time, equal to
    phi's own to the bit (each column's sum runs over the same rows in the same order, and o (x) e_a
    holds the same products). Only the termination model's fits on folds with both classes build it."""

    def __init__(self, obs: np.ndarray, actions: np.ndarray, n_actions: int | None):
        self.obs, self.actions, self.n_actions = obs, actions, n_actions
        width = actions.reshape(len(actions), -1).shape[1] if n_actions is None else n_actions
        self.width = obs.shape[1] * (1 + width) + width
        self.blockwise = n_actions is not None and self.width > MOMENT_RIDGE_FEATURES

    @cached_property
    def matrix(self) -> np.ndarray:
        return _features(self.obs, self.actions, self.n_actions)

    def column_moments(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) of phi's columns over ``rows`` ([N] bool)."""
        if not self.blockwise:
            matrix = self.matrix[rows]
            return matrix.mean(axis=0), matrix.std(axis=0)
        o, taken = self.obs[rows], self.actions[rows].astype(np.int64)
        d, n_actions = o.shape[1], self.n_actions
        mean, std = np.empty(self.width), np.empty(self.width)
        one_hot = np.eye(n_actions)[taken]
        mean[:d], std[:d] = o.mean(axis=0), o.std(axis=0)
        mean[d:d + n_actions], std[d:d + n_actions] = one_hot.mean(axis=0), one_hot.std(axis=0)
        for a in range(n_actions):  # phi's o (x) e_a columns: j * n_actions + a
            block = o * one_hot[:, a:a + 1]
            mean[d + n_actions + a::n_actions], std[d + n_actions + a::n_actions] = block.mean(axis=0), block.std(axis=0)
        return mean, std


class _Split:
    """One fold of the cross-fitting over ``rows``: train rows (``rows`` outside fold k), test rows
    (``rows`` in k), the train features' mean and scale (a constant feature's scale 1, as
    StandardScaler's), and phi standardised by them on each side, made once for every model fitted
    on the same rows (the reward and termination models share theirs)."""

    def __init__(self, phi: _Phi, train: np.ndarray, test: np.ndarray):
        self.phi, self.train, self.test = phi, train, test
        self.mean, self.scale = phi.column_moments(train)
        self.scale[self.scale < 10 * np.finfo(np.float64).eps] = 1.0

    @cached_property
    def x_train(self) -> np.ndarray:
        return (self.phi.matrix[self.train] - self.mean) / self.scale

    @cached_property
    def x_test(self) -> np.ndarray:
        return self.standardised(self.phi.matrix)

    def standardised(self, features: np.ndarray) -> np.ndarray:
        """The test rows of ``features`` ([N, F], phi's columns) on the train rows' scale."""
        return (features[self.test] - self.mean) / self.scale


def _fold_splits(phi: _Phi, fold: np.ndarray, rows: np.ndarray) -> list[_Split]:
    """The ``_Split`` of each fold k with records on both sides."""
    sides = [(rows & (fold != k), rows & (fold == k)) for k in (0, 1)]
    return [_Split(phi, train, test) for train, test in sides if train.any() and test.any()]


def _cross_fit(fit: Callable[[np.ndarray, np.ndarray], Callable[[np.ndarray], np.ndarray]],
               splits: list[_Split], y: np.ndarray, predict_on: list[np.ndarray | None]) -> list[np.ndarray]:
    """For each matrix of ``predict_on`` ([N, F] features; None: phi itself), the prediction of every
    row from the model fit on the other fold's rows (NaN outside the splits' rows)."""
    out = [np.full(y.shape, np.nan) for _ in predict_on]
    for split in splits:
        model = fit(split.x_train, y[split.train])
        for target, features in zip(out, predict_on, strict=True):
            target[split.test] = model(split.x_test if features is None else split.standardised(features))
    return out


def _ridge_weights(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(w, intercept) of ridge regression with an unpenalised intercept, in closed form (sklearn's
    ``Ridge(alpha)`` without its per-call overhead, which was most of the model checks' time on
    small observations): w = (Xc'Xc + alpha I)^-1 Xc'yc, or Xc'(XcXc' + alpha I)^-1 yc where
    records are fewer than features; Xc, yc centred; intercept mean(y) - mean(X)'w. A constant
    column of X is 0 in Xc, so its weight is 0 in either form: such columns are left out of the
    products (the one-hot interactions of an image's unused channels are most of them)."""
    x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
    varying = np.ptp(x, axis=0) > 0
    xc, yc = x[:, varying] - x_mean[varying], y - y_mean
    w = np.zeros((x.shape[1],) + y.shape[1:])
    if len(x) < xc.shape[1]:
        gram = xc @ xc.T
        gram[np.diag_indices_from(gram)] += alpha
        w[varying] = xc.T @ linalg.solve(gram, yc, assume_a="pos", check_finite=False)
    else:
        gram = xc.T @ xc
        gram[np.diag_indices_from(gram)] += alpha
        w[varying] = linalg.solve(gram, xc.T @ yc, assume_a="pos", check_finite=False)
    return w, y_mean - x_mean @ w


def _ridge(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> Callable[[np.ndarray], np.ndarray]:
    """The fitted ridge of ``_ridge_weights`` as a predictor."""
    w, intercept = _ridge_weights(x, y, alpha)
    return lambda z: z @ w + intercept


MOMENT_RIDGE_FEATURES = 256
"""Beyond this many features (an image observation's products with a Discrete action) the ridge is
solved from each action's moments (``_moment_ridge_weights``), without building phi, and predicts
from its weights on the raw features: the direct fit to float rounding. Fewer features keep the
direct fit, and every figure computed with it to the bit."""


def _moment_ridge_weights(obs: np.ndarray, actions: np.ndarray, n_actions: int, split: _Split, y: np.ndarray,
                          alpha: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(w, intercept) of ``_ridge_weights(split.x_train, y[split.train], alpha)`` for phi(o, a) =
    [o, e_a, o (x) e_a], without phi. With z = phi / scale, ridge on the standardised features with an
    unpenalised intercept has the same w as ridge on z with one (the centring goes into the
    intercept: c = b + (mean / scale) . w); [z, 1]'[z, 1] needs only each action's n_a, sum_a o and
    G_a = sum_a o o' (the rows taking a), and is block-arrow: the o (x) e_a columns of action a meet
    only their own and the border's (o, e, 1). Each block is eliminated by its Cholesky factor, the
    border solved from its Schur complement. Columns constant on the train rows get w = 0, as there."""
    train = split.train
    o, taken, targets = obs[train], actions[train].astype(np.int64), y[train].reshape(int(train.sum()), -1)
    n, d = o.shape
    scale = split.scale
    scale_o, scale_e, scale_oa = scale[:d], scale[d:d + n_actions], scale[d + n_actions:].reshape(d, n_actions)
    counts = np.bincount(taken, minlength=n_actions)
    moments = []  # per action: G_a, sum o, sum o y', sum y
    varying_oa = np.zeros((d, n_actions), dtype=bool)  # o (x) e_a: o on a's rows, 0 on the others
    for a in range(n_actions):
        rows_a, y_a = o[taken == a], targets[taken == a]
        moments.append((rows_a.T @ rows_a, rows_a.sum(axis=0), rows_a.T @ y_a, y_a.sum(axis=0)))
        if counts[a]:
            low, high = rows_a.min(axis=0), rows_a.max(axis=0)
            if counts[a] < n:
                low, high = np.minimum(low, 0.0), np.maximum(high, 0.0)
            varying_oa[:, a] = high > low
    vo, ve = np.flatnonzero(np.ptp(o, axis=0) > 0), np.flatnonzero((counts > 0) & (counts < n))
    # the border's rows: the varying o columns, the varying e columns, the intercept
    n_o, n_border = len(vo), len(vo) + len(ve) + 1
    so = scale_o[vo]
    border, rhs = np.zeros((n_border, n_border)), np.zeros((n_border, targets.shape[1]))
    border[:n_o, :n_o] = sum(m[0] for m in moments)[np.ix_(vo, vo)] / np.outer(so, so)
    border[:n_o, -1] = sum(m[1] for m in moments)[vo] / so
    for j, a in enumerate(ve, start=n_o):
        border[:n_o, j] = moments[a][1][vo] / (so * scale_e[a])
        border[j, j], border[j, -1] = counts[a] / scale_e[a] ** 2, counts[a] / scale_e[a]
        rhs[j] = moments[a][3] / scale_e[a]
    border = np.triu(border) + np.triu(border, 1).T
    border[-1, -1] = n
    border.flat[:-1:n_border + 1] += alpha  # every column but the intercept's
    rhs[:n_o] = sum(m[2] for m in moments)[vo] / so[:, None]
    rhs[-1] = targets.sum(axis=0)
    schur, reduced = border.copy(), rhs.copy()
    eliminated = []
    for a in range(n_actions):
        v = np.flatnonzero(varying_oa[:, a])
        if not len(v):
            continue
        gram, sums, cross, _ = moments[a]
        sv = scale_oa[v, a]
        block = gram[np.ix_(v, v)] / np.outer(sv, sv)
        block.flat[::len(v) + 1] += alpha
        coupling = np.zeros((n_border, len(v)))  # the border's rows x the block's columns
        coupling[:n_o] = gram[np.ix_(vo, v)] / np.outer(so, sv)
        coupling[n_o:-1][ve == a] = sums[v] / (scale_e[a] * sv)
        coupling[-1] = sums[v] / sv
        factor = linalg.cho_factor(block, check_finite=False)
        solved_coupling = linalg.cho_solve(factor, coupling.T, check_finite=False)
        solved_rhs = linalg.cho_solve(factor, cross[v] / sv[:, None], check_finite=False)
        schur -= coupling @ solved_coupling
        reduced -= coupling @ solved_rhs
        eliminated.append((a, v, solved_coupling, solved_rhs))
    solution = linalg.solve(schur, reduced, assume_a="pos", check_finite=False)
    w = np.zeros((len(scale), targets.shape[1]))
    w[vo], w[d + ve] = solution[:n_o], solution[n_o:-1]
    for a, v, solved_coupling, solved_rhs in eliminated:
        w[d + n_actions + v * n_actions + a] = solved_rhs - solved_coupling @ solution
    intercept = solution[-1] + (split.mean / scale) @ w
    return (w, intercept) if y.ndim > 1 else (w[:, 0], float(intercept[0]))


def _ridge_every_action(obs: np.ndarray, actions: np.ndarray, splits: list[_Split], y: np.ndarray,
                        n_actions: int) -> np.ndarray:
    """[N, n_actions, targets]: the cross-fitted ridge's prediction of every row with each action of
    a Discrete space (NaN outside the splits' rows; ``y`` [N, targets]), from its weights on the raw
    features: with phi(o, a) = [o, e_a, o (x) e_a] and W = w / scale split alike, f(o, a) = o W_o +
    W_a[a] + o W_oa[:, a] + b, every action's at the cost of one prediction (``_cross_fit`` with
    ``_features(obs, a)`` for each a, without building them). Fitted by ``_moment_ridge_weights``
    beyond ``MOMENT_RIDGE_FEATURES`` features, else by ``_ridge_weights``."""
    n, d = obs.shape
    out = np.full((n, n_actions) + y.shape[1:], np.nan)
    for split in splits:
        if len(split.scale) > MOMENT_RIDGE_FEATURES:
            w, intercept = _moment_ridge_weights(obs, actions, n_actions, split, y)
        else:
            w, intercept = _ridge_weights(split.x_train, y[split.train])
        w = w / split.scale[:, None]
        bias = intercept - split.mean @ w
        w_o, w_a, w_oa = w[:d], w[d:d + n_actions], w[d + n_actions:].reshape(d, n_actions, -1)
        o = obs[split.test]
        out[split.test] = (o @ w_oa.reshape(d, -1)).reshape(len(o), n_actions, -1) + (o @ w_o + bias)[:, None, :] + w_a[None]
    return out


NEWTON_FEATURES = 256
"""Up to this many features the termination model is fitted by Newton's method (its Hessian is
small: a few milliseconds to the optimum), beyond by sklearn's lbfgs (no Hessian)."""


def _logistic_newton(x: np.ndarray, y: np.ndarray, tol: float = 1e-10, max_steps: int = 100
                     ) -> tuple[np.ndarray, float]:
    """(w, b) minimising sum_i [log(1 + e^z_i) - y_i z_i] + |w|^2 / 2, z = x w + b (sklearn's
    ``LogisticRegression(C=1)`` objective, the intercept unpenalised), by Newton's method with
    step halving, to a gradient below ``tol`` times the records (lbfgs stops at 1e-4)."""
    design = np.column_stack([x, np.ones(len(x))])
    penalty = np.ones(design.shape[1])
    penalty[-1] = 0.0
    theta = np.zeros(design.shape[1])
    theta[-1] = np.log(y.mean() / (1 - y.mean()))  # the intercept of the rate: the optimum with w = 0

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = design @ theta
        return float((np.logaddexp(0.0, z) - y * z).sum() + 0.5 * (penalty * theta**2).sum()), z

    value, z = objective(theta)
    for _ in range(max_steps):
        p = special.expit(z)
        gradient = design.T @ (p - y) + penalty * theta
        if np.abs(gradient).max() < tol * len(y):
            break
        hessian = design.T @ (design * (p * (1 - p))[:, None])
        hessian.flat[::len(hessian) + 1] += penalty
        # LAPACK's Cholesky solve as linalg.solve(assume_a="pos") makes it, without its per-call checks
        _, step, info = lapack.dposv(hessian, gradient)
        if info != 0:
            raise linalg.LinAlgError(f"the Hessian is not numerically positive definite (dposv info {info})")
        size = 1.0
        while True:  # halve the step until the objective does not rise
            candidate = theta - size * step
            candidate_value, candidate_z = objective(candidate)
            if candidate_value <= value or size < 1e-10:
                break
            size /= 2
        theta, value, z = candidate, candidate_value, candidate_z
    return theta[:-1], float(theta[-1])


def _logistic(x: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The fitted probability of ``y`` = 1 given the features; ``y`` of two classes (a fold of one
    needs no model: ``_termination``)."""
    if x.shape[1] <= NEWTON_FEATURES:
        try:
            w, b = _logistic_newton(x, y)
            return lambda z: special.expit(z @ w + b)
        except linalg.LinAlgError:  # a Hessian not numerically positive definite: lbfgs needs none
            pass
    model = LogisticRegression(C=1.0, max_iter=500).fit(x, y)
    return lambda z: model.predict_proba(z)[:, 1]


def _termination(splits: list[_Split], terminated: np.ndarray) -> np.ndarray:
    """The cross-fitted probability of each record's terminated flag (NaN outside the splits' rows):
    ``_logistic`` on phi, or where the train rows hold one class, their smoothed rate (y.sum() + 1/2)
    / (n + 1), for which phi is not built."""
    p = np.full(len(terminated), np.nan)
    for split in splits:
        y = terminated[split.train]
        if y.min() == y.max():
            p[split.test] = (y.sum() + 0.5) / (len(y) + 1.0)
        else:
            p[split.test] = _logistic(split.x_train, y)(split.x_test)
    return p


def model_checks(buffer: RolloutBuffer, n_actions: int | None) -> dict[str, np.ndarray]:
    """``dynamics``, ``action-fit``, ``lag-fit``, ``reward-model`` and ``termination`` of every record (flat order).
    ``n_actions``: the size of a Discrete action space (None for Box)."""
    n, n_steps = len(buffer), buffer.n_steps
    obs = buffer.flat("obs").reshape(n, -1).double().numpy()
    actions = buffer.flat("actions").double().numpy()
    step = buffer.record_ids()[:, 2].numpy()
    done = buffer.flatten(buffer.dones).numpy()
    has_next = (step < n_steps - 1) & ~done
    nxt = np.roll(obs, -1, axis=0)  # flat order is env-major: i + 1 is the same env's next step
    phi = _Phi(obs, actions, n_actions)
    fold = _folds(buffer)

    delta = nxt - obs
    spread = delta[has_next].std(axis=0) if has_next.any() else np.zeros(obs.shape[1])
    varying = spread > 1e-8
    episode = buffer.flat("episode_ids").numpy()
    # the record before in the same env and episode (flat order is env-major)
    has_previous = (step > 0) & (episode == np.roll(episode, 1))
    previous_actions = np.roll(actions, 1, axis=0)
    dynamics, action_fit, lag_fit = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    if varying.any() and has_next.sum() > 10:
        y = (delta[:, varying] - delta[has_next][:, varying].mean(axis=0)) / spread[varying]
        next_splits = _fold_splits(phi, fold, has_next)  # the dynamics is fitted on the records with a next one
        if n_actions is not None:
            every = _ridge_every_action(obs, actions, next_splits, y, n_actions)
            errors = ((every - y[:, None, :]) ** 2).mean(axis=2)  # [N, n_actions]
            rows = np.arange(n)
            dynamics = errors[rows, actions.astype(np.int64)]
            previous_error = errors[rows, previous_actions.astype(np.int64)]
            alternative = errors.mean(axis=1)
        else:
            shuffle = np.random.default_rng([int(buffer.round), 23])
            alternatives = [actions[shuffle.permutation(n)] for _ in range(4)]
            fitted, previous, *others = _cross_fit(
                _ridge, next_splits, y,
                [None, _features(obs, previous_actions, n_actions)] + [_features(obs, a, n_actions) for a in alternatives])
            dynamics = ((fitted - y) ** 2).mean(axis=1)
            previous_error = ((previous - y) ** 2).mean(axis=1)
            alternative = np.mean([((other - y) ** 2).mean(axis=1) for other in others], axis=0)
        action_fit = dynamics - alternative
        lag_fit = np.where(has_previous, alternative - previous_error, np.nan)

    splits = _fold_splits(phi, fold, np.ones(n, bool))  # the reward's and the termination's
    rewards = buffer.flat("rewards").double().numpy()
    reward_spread = rewards.std()
    reward_model = np.zeros(n)
    if reward_spread > 0:
        y = (rewards - rewards.mean()) / reward_spread
        if phi.blockwise:  # the taken action's of every action's
            fitted = _ridge_every_action(obs, actions, splits, y[:, None], n_actions)[np.arange(n), actions.astype(np.int64), 0]
        else:
            (fitted,) = _cross_fit(_ridge, splits, y, [None])
        reward_model = np.where(np.isnan(fitted), np.nan, (fitted - y) ** 2)

    terminated = buffer.flat("terminated").numpy().astype(np.float64)
    p = _termination(splits, terminated)
    return {"dynamics": dynamics, "action-fit": action_fit, "lag-fit": lag_fit, "reward-model": reward_model,
            "termination": terminated - p}


def statistic_scores(buffer: RolloutBuffer, gamma: float) -> dict[str, np.ndarray]:
    """The reward, value and advantage statistics of every record (flat order), higher = more
    suspect: ``negative-advantage`` -A, ``abs-advantage`` |A|, ``td-error`` |delta| (delta = r +
    gamma V(s') (1 - done) - V(s)) and ``reward-extremes`` |r - mean r|."""
    advantages = buffer.flat("advantages").double().numpy()
    rewards = buffer.flat("rewards").double().numpy()
    return {"negative-advantage": -advantages, "abs-advantage": np.abs(advantages),
            "td-error": np.abs(buffer.flatten(buffer.td_errors(gamma)).double().numpy()),
            "reward-extremes": np.abs(rewards - rewards.mean())}


def consistency_scores(policy: torch.nn.Module, buffer: RolloutBuffer, n_actions: int | None) -> dict[str, np.ndarray]:
    """Every check of the module docstring for every record of ``buffer`` (flat order), at ``policy``
    = theta(k), the policy that collected it."""
    return {**policy_checks(policy, buffer, n_actions), "obs-shift": obs_shift(buffer), "truncations": truncations(buffer),
            **model_checks(buffer, n_actions)}


def gaussian_actions(policy: torch.nn.Module) -> bool:
    """Whether ``policy`` samples its actions from a diagonal Gaussian: an ``ActorCritic`` with a Box
    head, or an SB3 adapter of a policy whose action space is a Box."""
    if hasattr(policy, "continuous"):
        return bool(policy.continuous)
    return isinstance(getattr(getattr(policy, "policy", None), "action_space", None), gym.spaces.Box)


def action_count(policy: torch.nn.Module) -> int | None:
    """The number of Discrete actions of a policy (None for a continuous one): its ``n_actions``
    where it has one (the SB3 adapter), else an ``ActorCritic``'s action head."""
    if hasattr(policy, "n_actions"):
        return policy.n_actions
    return None if getattr(policy, "continuous", False) else int(policy.action_head.out_features)
