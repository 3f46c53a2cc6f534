"""The check that ties every figure quoted in prose (README, docs/index.md, results pages) to the committed data it comes from."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from figures import check_pages, check_text, figure_mismatch  # noqa: E402

ORACLE = "reward_flip_tuned_summary:Acrobot-v1/reward-flip:envs=1/oracle/auc_minus_ppo"  # +133.07 [+20.52, +245.62]


def test_a_figure_matches_its_data_at_the_precision_written_and_an_edited_one_does_not():
    assert figure_mismatch(ORACLE, "+133 [+21, +246]") is None
    assert figure_mismatch(ORACLE, "+133.1 [+20.5, +245.6]") is None
    assert figure_mismatch(ORACLE, "+133") is None  # a part of the value, in order
    assert "is not" in figure_mismatch(ORACLE, "+143 [+21, +246]")
    assert "is not" in figure_mismatch(ORACLE, "+133 [+22, +246]")
    assert "is not" in figure_mismatch(ORACLE, "[+21, +246] +133")  # out of order
    assert "no line" in figure_mismatch("reward_flip_tuned_summary:no/such/figure", "1")
    assert "docs/data" in figure_mismatch("no_such_file:x", "1")


def test_a_key_quotes_its_own_numbers_and_a_csv_figure_its_interval():
    key = "hidden_faults_held_out_summary:all/faults/flagged_within_5"  # 86/140
    assert figure_mismatch(key, "within 5 rounds in 86/140") is None
    assert figure_mismatch(key, "within 6 rounds in 86/140") is not None
    assert figure_mismatch("confirmation:LunarLander-v3/iif-robust/diff_auc", "-0.13 [-0.23, -0.03]") is None
    assert figure_mismatch("confirmation:LunarLander-v3/iif-robust/diff_auc", "-0.12 [-0.23, -0.03]") is not None


def test_a_number_outside_the_markers_is_refused_where_the_page_is_checked():
    figure = f"<!-- fig:{ORACLE} -->+133 [+21, +246]<!-- /fig -->"
    assert check_text(f"the oracle gains {figure} auc in `--rounds 20` on CartPole-v1", "p", whole=True) == []
    loose = check_text(f"the oracle gains {figure} auc, 15% of it", "p", whole=True)
    assert len(loose) == 1 and "15" in loose[0]
    short = f"<!-- short-answer -->{figure} and 7 more<!-- /short-answer -->\n\n12 seeds below"
    assert "7" in check_text(short, "p", whole=False)[0] and "12" not in check_text(short, "p", whole=False)[0]
    edited = check_text(f"<!-- fig:{ORACLE} -->+134 [+21, +246]<!-- /fig -->", "p", whole=True)
    assert len(edited) == 1 and "+134" in edited[0]


def test_every_quoted_figure_of_the_readme_and_the_results_pages_is_its_data():
    assert check_pages() == []
