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
