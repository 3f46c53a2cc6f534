"""Local data attribution for a PPO round (docs/method.md, sections 2-4).

Scorers (what is computed) and targets (what influence is measured on) are independent:

- ``snapshot_influence``: score_i = A_norm_i <grad log pi(a_i|s_i), grad f> at theta(k) (IIF's
  fast scores, ghost dot products);
- ``gradient_alignment``: g_i . mean_j g_j, no target (DTV); ``return_and_alignment_scores``: the
  return target's scores (batch and chunk advantages) and the alignment from one pass;
- ``tracin_influence``: full local TracIn over the round's recorded optimiser steps (a replay);
  ``TracInRecorder``, the same sum recorded by a training loop as it takes the steps;
- targets ``ActionTarget`` (mean log pi(a*|s*)) and ``ReturnTarget`` ((1/n) sum_j A_j log pi(a_j|s_j));
- ``score_buffer`` scores a ``RolloutBuffer``; ``top_records`` picks proponents / opponents;
- the engine, for new scorers: ``plan_ghost``, ``per_record_dots`` (d_i = <grad u_i, v> for any
  row-separable u), ``self_target_dots`` (v = grad of a weighted sum of the same u;
  ``shared_self_target_dots`` several such v from one pass);
- ``unchanged(policy)``: every scoring pass runs in eval mode and leaves the policy exactly as it
  found it (checked after every pass when ``state.CHECK_MODULE_STATE``, as in the tests);
- ``ZeroTargetGradient``: raised when a target has no signal (grad f = 0, e.g. all advantages 0).

Positive scores are helpful (training on the record increases f), negative harmful.
"""

from rlinfluence.influence.api import TopRecords, score_buffer, top_records
from rlinfluence.influence.ghost import (
    GhostPlan,
    per_record_dots,
    plan_ghost,
    self_target_dots,
    shared_self_target_dots,
)
from rlinfluence.influence.snapshot import (
    ADVANTAGE_NORMS,
    DEFAULT_ADVANTAGE_NORM,
    adam_inverse_preconditioner,
    chunk_permutation,
    gradient_alignment,
    normalize_for_attribution,
    return_and_alignment_scores,
    snapshot_influence,
)
from rlinfluence.influence.state import unchanged
from rlinfluence.influence.targets import (
    ActionTarget,
    LogProbTarget,
    Records,
    ReturnTarget,
    Target,
    ZeroTargetGradient,
    target_gradient,
)
from rlinfluence.influence.tracin import TracInRecorder, tracin_influence
from rlinfluence.influence.validation import validate

__all__ = [
    "ADVANTAGE_NORMS",
    "DEFAULT_ADVANTAGE_NORM",
    "ActionTarget",
    "GhostPlan",
    "LogProbTarget",
    "Records",
    "ReturnTarget",
    "Target",
    "TopRecords",
    "TracInRecorder",
    "ZeroTargetGradient",
    "adam_inverse_preconditioner",
    "chunk_permutation",
    "gradient_alignment",
    "normalize_for_attribution",
    "per_record_dots",
    "plan_ghost",
    "return_and_alignment_scores",
    "score_buffer",
    "self_target_dots",
    "shared_self_target_dots",
    "snapshot_influence",
    "target_gradient",
    "top_records",
    "tracin_influence",
    "unchanged",
    "validate",
]
