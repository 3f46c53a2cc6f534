"""benchmarks/harness.py: what every benchmark shares (its arguments, its summary lines)."""

from __future__ import annotations

import pytest


def test_summary_lines_are_name_value(benchmark_script, capsys):
    harness = benchmark_script("harness")
    harness.summary({"CartPole-v1/speedup_vs_sb3": 4.86, "clean/runs_with_a_false_flag": "0/10"})
    harness.summary(["all/faults/flagged_within_5: 36/40"])
    assert capsys.readouterr().out.splitlines() == ["CartPole-v1/speedup_vs_sb3: 4.86", "clean/runs_with_a_false_flag: 0/10",
                                                    "all/faults/flagged_within_5: 36/40"]
    with pytest.raises(ValueError, match="not a `name: value` summary line"):
        harness.summary(["reading   undetermined"])


def test_every_benchmark_folder_is_on_the_path_and_the_parser_shows_the_docstring(benchmark_script):
    import sys

    harness = benchmark_script("harness")
    assert all(str(harness.ROOT / folder) in sys.path for folder in harness.FOLDERS)
    assert all((harness.ROOT / folder).is_dir() for folder in harness.FOLDERS)
    doc = "The question.\n\n    python benchmarks/speed/x.py --flag 1\n"
    assert "The question.\n\n    python benchmarks/speed/x.py --flag 1\n" in harness.parser(doc).format_help()  # as written


def test_same_flags_finds_the_one_column_that_differs_and_takes_two_missing_values_as_equal(benchmark_script):
    import numpy as np
    import pandas as pd

    same_flags = benchmark_script("same_flags")
    columns = [prefix + c for prefix in same_flags.ARMS.values() for c in same_flags.OUTCOME] + ["final_flagged"]
    a = pd.DataFrame({"env": ["CartPole-v1"] * 2, "fault": ["clean", "held-out:frame-skip"], "seed": [231, 231],
                      **{c: [np.nan, "3"] for c in columns}})
    b = a.copy()
    b.loc[1, "seq_verdict_round"] = "4"
    both, same = same_flags.differences(a.sample(frac=1, random_state=0), b)  # joined by run, not by row order
    assert len(both) == 2 and all(same[c].all() for c in columns if c != "seq_verdict_round")
    assert dict(zip(both["fault"], same["seq_verdict_round"], strict=True)) == {"clean": True, "held-out:frame-skip": False}
