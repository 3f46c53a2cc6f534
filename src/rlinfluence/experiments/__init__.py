"""Experiments: multi-seed comparisons, tuning, statistics (``rlinfluence compare`` / ``aggregate``).

Modules, each importing only those before it:

    specs       method specs FILTER@key=value,... and type-checked PPOConfig overrides
    metrics     curve metrics: the paper's SE/RT reductions, rounds to fractions of a range
    statistics  rliable's IQM / probability of improvement, bootstrap and t intervals (scipy)
    tuning      grids, tuning scores, the choice per method
    execution   running pairs locally or on Ray, resume, refusal of changed settings
    comparison  the comparison: plan -> tune -> evaluate -> summary tables and plots
    aggregate   several compare folders (envs) -> one table, rliable's plots, an HTML page
"""

from rlinfluence.experiments.comparison import (
    CompareConfig,
    compare,
    plan_comparison,
    summarize,
    write_summary,
)
from rlinfluence.experiments.execution import folder_lock, run_pair
from rlinfluence.experiments.metrics import (
    Curve,
    first_reach,
    pair_metrics,
    reduction,
    running_max_levels,
    se_ave,
    smooth,
    time_reduction,
)
from rlinfluence.experiments.specs import MethodSpec, parse_methods, parse_overrides, parse_spec
from rlinfluence.experiments.statistics import ci95, interval_estimates, probability_of_improvement

__all__ = [
    "CompareConfig", "Curve", "MethodSpec", "ci95", "compare", "first_reach", "folder_lock",
    "interval_estimates", "pair_metrics", "parse_methods", "parse_overrides", "parse_spec",
    "plan_comparison", "probability_of_improvement", "reduction", "run_pair", "running_max_levels",
    "se_ave", "smooth", "summarize", "time_reduction", "write_summary",
]
