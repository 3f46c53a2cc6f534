"""Experiments: multi-seed comparisons, tuning, statistics (``rlinfluence compare`` / ``aggregate``).

Modules, each importing only those before it:

    specs       method specs FILTER@key=value,..., type-checked PPOConfig overrides, CompareConfig
    metrics     curve metrics: the paper's SE/RT reductions, rounds to fractions of a range
    tuning      grids, tuning scores, the choice per method
    execution   running pairs (through ``rlinfluence.executor``), resume, refusal of changed settings
    summary     a comparison folder's summary: metrics per method, tables, the reading, plots
    comparison  the comparison: plan -> tune -> evaluate -> summary
    aggregate   several compare folders (envs) -> one table, rliable's plots, an HTML page

The bootstrap and intervals (``rlinfluence.statistics``), the executor (``rlinfluence.executor``)
and the report's building blocks (``rlinfluence.sections``, ``rlinfluence.pages``) sit below this
package and ``rlinfluence.analysis``, which both use them.

The names below are imported from their modules on first use (PEP 562), so that importing one
light module (``specs``, for the command line's parsers) does not import pandas, scipy or torch.
"""

from __future__ import annotations

from rlinfluence.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "comparison": ("compare", "plan_comparison"),
    "summary": ("summarize", "write_summary"),
    "execution": ("folder_lock", "run_pair"),
    "metrics": ("Curve", "first_reach", "pair_metrics", "reduction", "running_max_levels", "se_ave", "smooth",
                "time_reduction"),
    "specs": ("CompareConfig", "MethodSpec", "parse_methods", "parse_overrides", "parse_spec"),
    "rlinfluence.statistics": ("ci95", "interval_estimates", "probability_of_improvement"),
})
