"""Numbers a reviewer would sign: censoring, pairing, reproducible intervals, held-out episodes."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlinfluence import cli
from rlinfluence.errors import UserError
from rlinfluence.experiments import (
    CompareConfig,
    compare,
    plan_comparison,
    summarize,
    write_summary,
)
from rlinfluence.experiments.metrics import paired_speed, time_to_level
from rlinfluence.experiments.published import collect, fill, headline_table
from rlinfluence.experiments.specs import episode_seeds
from rlinfluence.experiments.summary import speed_verdict
from rlinfluence.statistics import (
    clopper_pearson,
    interval_estimates,
    probability_of_improvement,
)

from .test_comparisons import _tiny

ROUNDS = 20


def _write_run(folder, returns):
    folder.mkdir(parents=True)
    n = len(returns)
    pd.DataFrame({"eval_return_mean": returns, "train_seconds": np.arange(1, n + 1, dtype=float),
                  "train_cpu_seconds": np.arange(1, n + 1, dtype=float), "approx_kl": np.full(n, 0.01)}
                 ).to_csv(folder / "metrics.csv", index=False)


def _step_curve(reach_round: int | None) -> np.ndarray:
    """0 until ``reach_round`` (1-based), 1 from then on; never 1 when None."""
    curve = np.zeros(ROUNDS)
    if reach_round is not None:
        curve[reach_round - 1:] = 1.0
    return curve


def test_a_method_that_fails_on_two_seeds_is_not_reported_faster_than_one_that_is_late_on_all(tmp_path):
    for seed in range(1, 6):
        _write_run(tmp_path / f"ppo__seed{seed}", _step_curve(15))  # late, on every seed
        _write_run(tmp_path / f"flaky__seed{seed}", _step_curve(13 if seed <= 3 else None))
    rows = {r["method"]: r for r in summarize(tmp_path, ["ppo", "flaky"], range(1, 6), reps=300)}
    flaky = rows["flaky"]
    # the paper's metric, over the seeds that reached: what used to be reported (+13%)
    assert flaky["se_80pct_n"] == 3 and flaky["se_80pct_mean"] == pytest.approx(100 * (1 - 13 / 15))
    # every seed counted: 2 of 5 never got there, counted as 21 rounds (censored)
    assert flaky["reached80_n"] == 3 and rows["ppo"]["reached80_n"] == 5
    assert flaky["rounds80_mean"] == pytest.approx((3 * 13 + 2 * 21) / 5)
    assert flaky["rounds80_mean"] > rows["ppo"]["rounds80_mean"] == 15
    assert flaky["log_ratio80"] < 0
    assert flaky["verdict80"] == "reaches it on fewer seeds"


def test_fast_where_it_works_is_still_not_called_faster_when_it_fails_elsewhere():
    row = {"reached80_n": 3, "reference_reached80_n": 5, "log_ratio80_lo": 0.5, "log_ratio80_hi": 1.0}
    assert speed_verdict(row) == "reaches it on fewer seeds"
    assert speed_verdict({**row, "reached80_n": 5}) == "faster"
    assert speed_verdict({**row, "reached80_n": 5, "log_ratio80_lo": -0.1}) == "no clear difference"


def test_an_unreached_level_is_right_censored_at_rounds_plus_one():
    assert time_to_level([0, 0, 1], 0.8) == (3, True)
    assert time_to_level([0, 0, 0], 0.8) == (4, False)
    speed = paired_speed([0, 1, 1, 1], [0, 0, 0, 1], 0.8)  # the reference twice as fast as... 2 vs 4
    assert speed["log_ratio"] == pytest.approx(np.log(2 / 4))  # symmetric: -ln 2, as a 2x gain is +ln 2


def test_pairing_changes_the_answer_where_seeds_differ_more_than_methods():
    seed_effect = np.linspace(-5, 5, 10)[:, None]  # seeds differ a lot, the method adds a little everywhere
    x, y = seed_effect + 0.1, seed_effect
    paired = probability_of_improvement(x, y, reps=500, seed=0, paired=True)
    unpaired = probability_of_improvement(x, y, reps=500, seed=0, paired=False)
    assert paired == pytest.approx((1.0, 0.6915, 1.0), abs=1e-4)  # better on all 10 seeds: exact [0.69, 1]
    assert 0.5 < unpaired[0] < 0.6 and unpaired[1] < 0.5  # run against run, the seed spread swamps it


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(7, 2)), rng.normal(size=(7, 2))
    assert interval_estimates({"x": x}, 300, seed=5) == interval_estimates({"x": x}, 300, seed=5)
    assert interval_estimates({"x": x}, 300, seed=5) != interval_estimates({"x": x}, 300, seed=6)
    for paired in (True, False):
        assert probability_of_improvement(x, y, 300, 5, paired) == probability_of_improvement(x, y, 300, 5, paired)


def test_a_failed_runs_penalty_does_not_depend_on_the_other_methods_in_the_folder(tmp_path):
    def folder(name, methods):
        out = tmp_path / name
        for m, curve in methods.items():
            _write_run(out / f"{m}__seed1", curve)
        (out / "bad__seed1" / "failed.json").write_text(json.dumps({"error": "non-finite", "round": 3}))
        return {r["method"]: r for r in summarize(out, list(methods), [1], reps=50)}

    ref, bad = np.linspace(0, 1, ROUNDS), np.linspace(0, 1, ROUNDS)[:3]
    alone = folder("alone", {"ppo": ref, "bad": bad})
    beside_a_disaster = folder("crowd", {"ppo": ref, "bad": bad, "awful": np.full(ROUNDS, -1000.0)})
    assert alone["bad"]["mean_auc_norm"] == pytest.approx(beside_a_disaster["bad"]["mean_auc_norm"])
    assert alone["bad"]["mean_final_norm"] == pytest.approx(0.0)  # after it stops: the reference's start


def test_tuning_and_evaluation_runs_never_share_an_evaluation_episode():
    cfg = _tiny("unused", seeds=3, tune=("learning_rate=0.001,0.002",), tune_seeds=2)
    plan = plan_comparison(cfg)
    episodes = {role: {e for s in seeds for e in episode_seeds(cfg.run_config("ppo", s))}
                for role, seeds in (("tune", plan.tune_seeds), ("eval", plan.seeds))}
    assert episodes["tune"] and episodes["eval"] and not episodes["tune"] & episodes["eval"]
    # the methods of one seed share their episodes: the pair is paired
    assert episode_seeds(cfg.run_config("ppo", 1)) == episode_seeds(cfg.run_config("iif", 1))


@pytest.mark.parametrize("key", ["seed", "eval_seed"])
def test_a_comparison_refuses_to_fix_what_the_seed_defines(tmp_path, capsys, key):
    out = tmp_path / "out"
    assert cli.main(["compare", "--env", "CartPole-v1", "--set", f"{key}=99", "--out", str(out)]) == 2
    assert f"--set {key}=... is not allowed" in capsys.readouterr().err and not out.exists()


def test_confirm_reruns_the_studys_choices_on_seeds_it_never_used(tmp_path):
    study = compare(_tiny(tmp_path / "study", seeds=1, tune=("learning_rate=0.001,0.003",), tune_seeds=1))
    chosen = json.loads((study / "compare.json").read_text())["chosen"]
    with pytest.raises(UserError, match="seed 1 was used by the study"):
        compare(CompareConfig(confirm=str(study), first_seed=1, seeds=1, out=str(tmp_path / "c0"), progress=False))
    with pytest.raises(UserError, match="seed 1001 was used by the study"):
        compare(CompareConfig(confirm=str(study), first_seed=1000, seeds=2, out=str(tmp_path / "c1"), progress=False))
    with pytest.raises(UserError, match="cannot --tune"):
        compare(CompareConfig(confirm=str(study), first_seed=7, seeds=1, tune=("learning_rate=0.1,0.2",)))
    out = compare(CompareConfig(confirm=str(study / "compare.json"), first_seed=101, seeds=1, workers=1,
                                out=str(tmp_path / "confirm"), progress=False, bootstrap_reps=50))
    record = json.loads((out / "compare.json").read_text())
    assert record["chosen"] == chosen and record["tune"] == [] and record["confirms"]["study_seeds"] == [1]
    assert not (out / "tune").exists()  # nothing tuned again
    for method, point in chosen.items():
        ran = json.loads((out / f"{method}__seed101" / "config.json").read_text())
        assert ran["learning_rate"] == point["learning_rate"] and ran["seed"] == 101
        assert ran["n_steps"] == 128  # the study's --set came along


# -- tables generated from data ------------------------------------------------------------
FIXTURE_TABLE = Path(__file__).parent / "fixtures" / "published_table.md"


def _fixture_folder(out):
    """A compare folder of hand-made curves: a reference and a method twice as fast on 4 of 5 seeds."""
    for seed in range(1, 6):
        _write_run(out / f"ppo__seed{seed}", _step_curve(10))
        _write_run(out / f"fast__seed{seed}", _step_curve(5 if seed <= 4 else 10))
    (out / "compare.json").write_text(json.dumps({"env": "FrozenLake-v1", "first_seed": 1,
                                                  "chosen": {"ppo": {"learning_rate": 0.32}, "fast": {}}}))
    write_summary(out, ["ppo", "fast"], range(1, 6), reference="ppo", reps=200)
    return out


def test_a_table_regenerated_from_a_fixture_folder_equals_the_committed_one(tmp_path):
    folder = _fixture_folder(tmp_path / "FrozenLake-v1")
    first = (folder / "summary.csv").read_bytes()
    write_summary(folder, ["ppo", "fast"], range(1, 6), reference="ppo", reps=200)
    assert (folder / "summary.csv").read_bytes() == first  # the same data, the same file, digit for digit
    lines = headline_table(collect([folder]))
    assert "\n".join(lines) + "\n" == FIXTURE_TABLE.read_text()
    page = "intro\n<!-- table:confirmation -->\nstale\n<!-- /table:confirmation -->\nend\n"
    filled = fill(page, "confirmation", lines)
    assert "stale" not in filled and filled.startswith("intro\n") and filled.endswith("end\n")
    assert fill(filled, "confirmation", lines) == filled
    with pytest.raises(UserError, match="no <!-- table:other -->"):
        fill(page, "other", lines)


def test_a_folders_summary_is_recomputed_from_its_per_seed_curves_alone(tmp_path):
    from rlinfluence.experiments.published import (
        PUBLISHED_COLUMNS,
        curves_frame,
        summary_from_curves,
    )

    out = tmp_path / "FrozenLake-v1"
    for seed in range(1, 6):
        _write_run(out / f"ppo__seed{seed}", _step_curve(10) + 0.01 * seed)
        _write_run(out / f"slow__seed{seed}", _step_curve(12 if seed != 3 else None))
        _write_run(out / f"bad__seed{seed}", _step_curve(6)[: 20 if seed != 2 else 4])
    (out / "bad__seed2" / "failed.json").write_text(json.dumps({"error": "non-finite", "round": 4}))
    (out / "compare.json").write_text(json.dumps({"env": "FrozenLake-v1", "first_seed": 1, "seeds": 5, "smooth": 1,
                                                  "clock": "cpu", "reference": "ppo"}))
    write_summary(out, ["ppo", "slow", "bad"], range(1, 6), clock="cpu", reference="ppo", reps=200)
    frame = curves_frame([out])
    assert len(frame) == 3 * 5 * ROUNDS and frame.loc[frame["method"] == "bad", "failed"].sum() == ROUNDS  # padded
    recomputed = summary_from_curves(frame, reps=200)
    expected = pd.read_csv(out / "summary.csv")
    numeric = [c for c in PUBLISHED_COLUMNS if c in expected and c != "failed_seeds"
               and pd.api.types.is_numeric_dtype(expected[c])]
    assert len(numeric) > 20
    pd.testing.assert_frame_equal(recomputed[numeric], expected[numeric], check_exact=False, rtol=1e-12,
                                  check_dtype=False)
    assert list(recomputed["verdict80"]) == list(expected["verdict80"])
    assert list(recomputed["failed_seeds"]) == ["", "", "2"]


def test_the_docs_tables_are_the_ones_their_committed_data_gives():
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "publish_results.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr



def test_a_reference_that_did_not_improve_leaves_80_percent_undefined_everywhere_and_few_seeds_are_named():
    from rlinfluence.experiments.summary import few_seeds_note, robust_cells

    row = {"method": "iif", "seeds": 2, "reached80_n": 2, "rounds80_mean": 1.0, "rounds80_lo": 1.0, "rounds80_hi": 1.0,
           "log_ratio80": float("nan"), "log_ratio80_lo": float("nan"), "log_ratio80_hi": float("nan"),
           "verdict80": "undefined: the reference did not improve", "poi_auc": 1.0, "poi_auc_lo": 1.0,
           "poi_auc_hi": 1.0, "diff_auc": float("nan"), "diff_auc_lo": float("nan"), "diff_auc_hi": float("nan"),
           "iqm_auc_norm": float("nan"), "iqm_auc_norm_lo": float("nan"), "iqm_auc_norm_hi": float("nan"),
           "iqm_final_norm": float("nan"), "iqm_final_norm_lo": float("nan"), "iqm_final_norm_hi": float("nan"),
           "approx_kl_mean": 0.01}
    cells = robust_cells(row, "ppo")
    assert cells[1:3] == ["undefined", "undefined"] and cells[5].endswith("(raw returns)") and cells[6] == "undefined"
    assert "2/2" not in " ".join(cells)
    defined = robust_cells({**row, "verdict80": "faster", "reached80_n": 1}, "ppo")
    assert defined[1] == "1/2" and defined[2].startswith(">= ") and "raw" not in defined[5]
    assert "2 seed pairs" in few_seeds_note(2) and few_seeds_note(5) == ""


def test_a_censored_ratio_of_rounds_reads_as_a_bound():
    """A method that never reached 80% on some seeds counts rounds + 1 there: its ratio is a lower
    bound, and the reading says "at least"; a censored reference makes it "at most"."""
    from rlinfluence.experiments.summary import censoring_bound, reading_lines

    assert [censoring_bound(*x) for x in ((2, 2, 2), (0, 2, 2), (2, 1, 2), (1, 1, 2))] == \
        ["", "at least ", "at most ", "roughly "]
    common = {"seeds": 2, "log_ratio80": math.log(1 / 1.8), "log_ratio80_lo": float("nan"),
              "log_ratio80_hi": float("nan"), "poi_auc": 0.0}
    rows = [{"method": "ppo", "reached80_n": 2, "verdict80": "reference", **common},
            {"method": "iif", "reached80_n": 0, "verdict80": "reaches it on fewer seeds", **common}]
    assert "needs at least 1.80x ppo's rounds" in reading_lines(rows, "ppo")[0]


def test_rows_summarised_with_a_percentile_bootstrap_get_the_exact_interval_of_their_p_improvement():
    from rlinfluence.experiments.published import _row

    record = {"method": "iif", "seeds": 5, "poi_auc": 1.0, "poi_auc_lo": 1.0, "poi_auc_hi": 1.0,
              "failed_seeds": float("nan"), "chosen": "{}"}
    assert _row({**record, "interval": "percentile"})["poi_auc_lo"] == pytest.approx(0.478, abs=1e-3)
    assert _row(record)["poi_auc_lo"] == 1.0  # a row without the note is the library's own (already exact)
    tie = _row({**record, "poi_auc": 0.7, "interval": "percentile"})  # 3.5 of 5: a tie counts half
    assert (tie["poi_auc_lo"], tie["poi_auc_hi"]) == pytest.approx((clopper_pearson(3, 5)[0], clopper_pearson(4, 5)[1]))


def test_the_summary_opens_with_the_answer_and_names_a_collapsed_reference(tmp_path):
    for seed in range(1, 4):
        returns = _step_curve(5)
        if seed == 3:  # learns, then falls back to its start in the last rounds
            returns[-3:] = 0.0
        _write_run(tmp_path / f"ppo__seed{seed}", returns)
        _write_run(tmp_path / f"fast__seed{seed}", _step_curve(4))
    write_summary(tmp_path, ["ppo", "fast"], range(1, 4), reference="ppo", reps=50)
    text = (tmp_path / "summary.md").read_text()
    assert text.index("## Against the reference") < text.index("## Paper metrics")
    assert "ppo collapsed on seed 3: its evaluation return fell from 1 (round 4) to 0" in text
    assert "collapsed on seed 1" not in text and "fast collapsed" not in text
