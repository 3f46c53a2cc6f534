"""Fair comparisons: method specs, tuning on held-out seeds, rliable statistics, aggregate."""

import csv
import json
import math
import re

import numpy as np
import pytest

from rlinfluence import cli
from rlinfluence.errors import UserError
from rlinfluence.experiments import CompareConfig, Curve, compare, parse_methods, summarize
from rlinfluence.experiments import comparison as compare_module
from rlinfluence.experiments.specs import find_reference, parse_grid, split_specs
from rlinfluence.experiments.tuning import (
    at_edge,
    choose,
    grid_points,
    tuning_scores,
    widen_past_edge,
)
from rlinfluence.statistics import (
    ci95,
    interval_estimates,
    iqm,
    probability_of_improvement,
)

TINY_SET = ("n_steps=128", "batch_size=32", "n_epochs=2", "eval_envs=2", "tensorboard=false")


def _tiny(out, **kw):
    settings = dict(env="CartPole-v1", methods="ppo,iif", seeds=2, rounds=2, eval_episodes=2, set=TINY_SET,
                    out=str(out), progress=False, workers=1, bootstrap_reps=200)
    return CompareConfig(**{**settings, **kw})


# -- specs ---------------------------------------------------------------------------------
def test_the_issue_example_parses_into_five_methods():
    text = "ppo,iif,ppo@learning_rate=0.02,iif@learning_rate=0.02,drop_pct=25"
    assert split_specs(text) == ["ppo", "iif", "ppo@learning_rate=0.02", "iif@learning_rate=0.02,drop_pct=25"]
    specs = parse_methods(text + ",big=ppo@hidden_sizes=[128,128],max_grad_norm=none")
    assert [s.label for s in specs] == ["ppo", "iif", "ppo@learning_rate=0.02",
                                        "iif@learning_rate=0.02,drop_pct=25", "big"]
    assert specs[3].override_dict == {"learning_rate": 0.02, "drop_pct": 25.0}
    assert specs[4].override_dict == {"hidden_sizes": (128, 128), "max_grad_norm": None}
    assert specs[3].config_overrides()["filter"] == "iif" and specs[0].config_overrides()["filter"] == "none"
    assert find_reference(specs, "ppo@learning_rate=2e-2").label == "ppo@learning_rate=0.02"


@pytest.mark.parametrize(("methods", "message"), [
    ("ppo,bogus", "unknown method 'bogus'"),
    ("ppo,iif@colour=red", "unknown PPOConfig key 'colour'"),
    ("ppo,iif@drop_pct=lots", "drop_pct=lots: expected float"),
    ("ppo,iif@drop_pct=0", "drop_pct"),  # PPOConfig.validate's range check, before any run
    ("ppo,iif@seed=4", "'seed' cannot be set per method"),
    ("ppo,ppo", "listed twice"),
    ("learning_rate=0.1,ppo", "has no method before it"),
    ("ppo,iif@eval_episodes=0", "a comparison needs eval_episodes >= 1, got 0"),
])
def test_a_bad_spec_is_one_error_line_and_writes_nothing(tmp_path, capsys, methods, message):
    out = tmp_path / "out"
    assert cli.main(["compare", "--env", "CartPole-v1", "--methods", methods, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
    assert not out.exists()


def test_reference_must_be_among_the_methods_and_need_not_be_ppo(tmp_path):
    with pytest.raises(UserError, match="--reference 'ppo' is not among the methods"):
        compare(_tiny(tmp_path / "x", methods="iif,random"))
    assert not (tmp_path / "x").exists()
    out = compare(_tiny(tmp_path / "y", methods="iif,random", reference="iif", seeds=1))
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert rows[0]["method"] == "iif" and float(rows[0]["se_peak_mean"]) == 0.0


def test_rounds_are_counted_after_the_overrides():
    cfg = CompareConfig(env="FrozenLake-v1", rounds=3, set=("n_steps=512",))
    assert cfg.run_config("ppo", 1).total_timesteps == 3 * 512
    assert cfg.run_config("ppo@n_steps=256", 1).total_timesteps == 3 * 256


def test_rerunning_with_changed_settings_is_refused_before_training(tmp_path):
    compare(_tiny(tmp_path, seeds=1))
    before = (tmp_path / "ppo__seed1" / "metrics.csv").read_text()
    with pytest.raises(UserError, match=r"holds a comparison run with set=.*nothing was run"):
        compare(_tiny(tmp_path, seeds=1, set=(*TINY_SET, "learning_rate=0.01")))
    (tmp_path / "compare.json").unlink()  # without the study's record, each pair still knows its settings
    with pytest.raises(UserError, match=r"ppo__seed1 was run with other settings \(learning_rate"):
        compare(_tiny(tmp_path, seeds=1, set=(*TINY_SET, "learning_rate=0.01")))
    assert (tmp_path / "ppo__seed1" / "metrics.csv").read_text() == before
    assert (tmp_path / "iif__seed1" / "done.json").is_file()  # the finished pair is kept


# -- tuning --------------------------------------------------------------------------------
def _curve(values):
    return Curve(np.asarray(values, float), np.arange(1.0, len(values) + 1))


def test_tuning_picks_the_best_candidate_of_each_method_on_hand_made_curves():
    slow, fast, unstable = [0, 0, .2, .4, .6, .8, .9, 1], [0, .5, .9, 1, 1, 1, 1, 1], [0, .1, .2, .9, .1, .9, .1, .2]
    curves = {("ppo", 0): [_curve(slow)] * 2, ("ppo", 1): [_curve(fast), _curve(fast)],
              ("ppo", 2): [_curve(unstable)] * 2, ("iif", 0): [_curve(fast)] * 2, ("iif", 1): [_curve(slow)] * 2,
              ("iif", 2): [_curve(slow)] * 2}
    for metric in ("auc", "final", "rounds80"):
        scores = tuning_scores(curves, metric)
        assert choose(scores, "ppo") == 1 and choose(scores, "iif") == 0, metric
    assert choose({("m", 0): 1.0, ("m", 1): 1.0}, "m") == 0  # ties: the first in grid order
    grid = parse_grid(["learning_rate=0.01,0.02,0.04", "n_epochs=4,10"])
    assert grid_points(grid)[1] == {"learning_rate": 0.01, "n_epochs": 10} and len(grid_points(grid)) == 6
    assert at_edge(0, grid) == ["learning_rate", "n_epochs"] and at_edge(2, grid) == ["n_epochs"]
    assert at_edge(1, {"learning_rate": [0.01, 0.02, 0.04]}) == [] and at_edge(0, {"seed_offset": [3]}) == []
    assert at_edge(1, {"learning_rate": [0.01, 0.02]}) == ["learning_rate"]  # two values: only edges
    assert widen_past_edge([0.04, 0.02, 0.08], 0.08, 6) == [0.02, 0.04, 0.08, 0.16]
    assert widen_past_edge([0.02, 0.04, 0.08], 0.02, 6) == [0.01, 0.02, 0.04, 0.08]
    assert widen_past_edge([0.02, 0.04, 0.08], 0.04, 6) is None and widen_past_edge([0.02, 0.04, 0.08], 0.08, 3) is None


def test_tuning_uses_only_tuning_seeds_and_evaluation_never_enters_the_choice(tmp_path, monkeypatch):
    seen = {}
    original = compare_module.write_tuning

    def spy(out, cfg, plan, jobs):
        seen["eval_dirs_at_choice"] = sorted(p.name for p in out.iterdir() if "__seed" in p.name)
        seen["tuning_runs"] = sorted(run_dir for runs in jobs.values() for _, run_dir in runs)
        return original(out, cfg, plan, jobs)

    monkeypatch.setattr(compare_module, "write_tuning", spy)
    out = compare(_tiny(tmp_path, tune=("learning_rate=0.0003,0.003",), tune_seeds=1))
    assert seen["eval_dirs_at_choice"] == []  # no evaluation pair existed when the choice was made
    assert all(r.endswith("__seed1001") for r in seen["tuning_runs"]) and len(seen["tuning_runs"]) == 4
    chosen = json.loads((out / "compare.json").read_text())["chosen"]
    for method in ("ppo", "iif"):
        config = json.loads((out / f"{method}__seed1" / "config.json").read_text())
        assert config["learning_rate"] == chosen[method]["learning_rate"]
    tuning = list(csv.DictReader((out / "tuning.csv").open()))
    assert len(tuning) == 4 and sum(r["chosen"] == "True" for r in tuning) == 2
    assert "## Tuning" in (out / "summary.md").read_text()
    with pytest.raises(UserError, match="overlap the evaluation seeds"):
        compare(_tiny(tmp_path / "z", tune=("learning_rate=0.001,0.002",), tune_first_seed=2))
    with pytest.raises(UserError, match="fixes learning_rate, which --tune varies"):
        compare(_tiny(tmp_path / "z", methods="ppo,iif@learning_rate=0.1", tune=("learning_rate=0.001,0.002",)))


def test_tune_only_tunes_the_named_methods_and_runs_the_rest_at_the_references_choice(tmp_path):
    out = compare(_tiny(tmp_path, methods="ppo,iif,random", tune=("learning_rate=0.0003,0.003",), tune_only=("ppo",),
                        tune_seeds=1))
    assert sorted(p.name for p in (out / "tune").iterdir()) == ["ppo@learning_rate=0.0003__seed1001",
                                                               "ppo@learning_rate=0.003__seed1001"]
    chosen = json.loads((out / "compare.json").read_text())["chosen"]
    assert chosen["iif"] == chosen["random"] == chosen["ppo"]
    assert json.loads((out / "random__seed1" / "config.json").read_text())["learning_rate"] == \
        chosen["ppo"]["learning_rate"]
    summary = (out / "summary.md").read_text()
    assert "Not tuned (run at ppo's chosen values): iif, random." in summary and "ppo's: learning_rate=" in summary
    import io

    from rich.console import Console

    from rlinfluence.experiments.summary import summary_table

    console = Console(file=io.StringIO(), width=200)  # what compare draws on a terminal
    console.print(summary_table(out))
    drawn = console.file.getvalue()
    assert "against ppo, every seed counted" in drawn and all(m in drawn for m in ("ppo", "iif", "random"))
    for kwargs, message in (({"tune_only": ("iif",)}, "must include the reference 'ppo'"),
                            ({"tune_only": ("ppo", "dqn")}, "--tune-only names 'dqn'")):
        with pytest.raises(UserError, match=message):
            compare(_tiny(tmp_path / "z", tune=("learning_rate=0.001,0.002",), **kwargs))
    with pytest.raises(UserError, match="--tune-only needs --tune"):
        compare(_tiny(tmp_path / "z", tune_only=("ppo",)))


# -- statistics ----------------------------------------------------------------------------
def _fake_run(folder, returns):
    folder.mkdir(parents=True)
    with (folder / "metrics.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "eval_return_mean", "train_seconds", "approx_kl"])
        for i, r in enumerate(returns):
            writer.writerow([i, r, i + 1.0, 0.01])


def test_a_method_identical_to_its_reference_has_poi_one_half_and_equal_iqm(tmp_path):
    rng = np.random.default_rng(0)
    for seed in range(1, 6):
        curve = np.cumsum(rng.random(12))
        _fake_run(tmp_path / f"ppo__seed{seed}", curve)
        _fake_run(tmp_path / f"twin__seed{seed}", curve)
        _fake_run(tmp_path / f"better__seed{seed}", curve + 100)
    rows = {r["method"]: r for r in summarize(tmp_path, ["ppo", "twin", "better"], range(1, 6), reps=300)}
    assert rows["twin"]["poi_auc"] == 0.5 and rows["twin"]["poi_final"] == 0.5
    assert rows["twin"]["iqm_auc_norm"] - rows["ppo"]["iqm_auc_norm"] == 0.0
    assert rows["ppo"]["mean_final_norm"] == pytest.approx(1.0)  # 1 = the reference's plateau
    assert rows["better"]["poi_auc"] == 1.0  # 5 of 5 seeds: the exact interval, not [1, 1]
    assert rows["better"]["poi_auc_lo"] == pytest.approx(0.478, abs=1e-3) and rows["better"]["poi_auc_hi"] == 1.0


def test_the_iqm_is_scipys_trimmed_mean_to_the_last_bit():
    from scipy import stats

    rng = np.random.default_rng(0)
    for shape in [(1,), (2,), (3, 1), (4, 3), (5, 7), (10, 1), (33, 2)]:
        scores = rng.normal(size=shape) * 10.0 ** rng.integers(-3, 4)
        assert iqm(scores) == float(stats.trim_mean(scores, 0.25, axis=None)), shape
    assert math.isnan(iqm(np.array([1.0, 2.0, 3.0, np.nan])))  # where trimming would hide the NaN
    assert math.isnan(iqm(np.empty((0, 2))))


def test_bootstrap_intervals_cover_the_truth_on_a_synthetic_case():
    rng = np.random.default_rng(1)
    trials, covered_mean, covered_iqm, covered_poi = 40, 0, 0, 0
    for t in range(trials):
        x = rng.normal(0.3, 1.0, size=(20, 1))
        y = rng.normal(0.0, 1.0, size=(20, 1))
        est = interval_estimates({"x": x}, reps=400, seed=t)["x"]
        covered_mean += est["mean"][1] <= 0.3 <= est["mean"][2]
        covered_iqm += est["iqm"][1] <= 0.3 <= est["iqm"][2]  # symmetric: the IQM's truth is the mean
        _, lo, hi = probability_of_improvement(x, y, reps=400, seed=t)
        true_poi = 0.5 + 0.5 * __import__("math").erf(0.3 / 2)  # P(N(0.3,1) > N(0,1)) = Phi(0.3 / sqrt 2)
        covered_poi += lo <= true_poi <= hi
        m, blo, bhi = ci95(x[:, 0])
        assert blo <= m <= bhi
    for covered in (covered_mean, covered_iqm, covered_poi):
        assert covered / trials >= 0.8  # nominal 0.95; a broken interval covers far less


# -- aggregate -----------------------------------------------------------------------------
def test_aggregate_end_to_end_on_two_tiny_compare_folders(tmp_path, capsys):
    a = compare(_tiny(tmp_path / "cartpole"))
    b = compare(_tiny(tmp_path / "cartpole_v0", env="CartPole-v0"))
    out = tmp_path / "agg"
    assert cli.main(["aggregate", str(a), str(b), "--out", str(out), "--bootstrap-reps", "200"]) == 0
    printed = capsys.readouterr().out
    assert "Aggregate over 2 envs against ppo" in printed and "| iif |" in printed
    for name in ("aggregate.md", "aggregate.csv", "intervals.png", "performance_profile.png",
                 "probability_of_improvement.png", "aggregate.html"):
        assert (out / name).stat().st_size > 0
    html = (out / "aggregate.html").read_text()
    assert html.count("<img") == 3 and "data:image/png;base64," in html
    rows = list(csv.DictReader((out / "aggregate.csv").open()))
    assert [r["method"] for r in rows] == ["ppo", "iif"] and rows[0]["poi_auc"] == "0.5"
    assert cli.main(["aggregate", str(a), str(tmp_path / "missing")]) == 2
    assert "is not a finished compare folder" in capsys.readouterr().err


def test_a_diverging_tuning_candidate_is_recorded_and_never_chosen(tmp_path):
    sgd = (*TINY_SET, "optimizer=sgd", "max_grad_norm=null")
    out = compare(_tiny(tmp_path, methods="ppo", seeds=1, set=sgd, tune=("learning_rate=0.001,1e12",), tune_seeds=1))
    failed = json.loads((out / "tune" / "ppo@learning_rate=1000000000000.0__seed1001" / "failed.json").read_text())
    assert "non-finite" in failed["error"]
    assert json.loads((out / "compare.json").read_text())["chosen"] == {"ppo": {"learning_rate": 0.001}}
    assert re.search(r"seed 1001 failed: round \d+: non-finite", (out / "summary.md").read_text())
    with pytest.raises(UserError, match="every tuning candidate failed"):
        compare(_tiny(tmp_path / "all", methods="ppo", seeds=1, set=sgd, tune=("learning_rate=1e12,1e13",),
                      tune_seeds=1))


def test_a_diverging_evaluation_pair_is_kept_at_the_worst_return(tmp_path):
    sgd = (*TINY_SET, "optimizer=sgd", "max_grad_norm=null", "learning_rate=0.001")
    out = compare(_tiny(tmp_path, methods="ppo,wild=ppo@learning_rate=1e12", rounds=3, set=sgd))
    assert "non-finite" in json.loads((out / "wild__seed1" / "failed.json").read_text())["error"]
    rows = {r["method"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert rows["wild"]["failed_seeds"] == "1 2" and str(rows["ppo"]["failed_seeds"]) in ("", "nan")
    scores = list(csv.DictReader((out / "scores.csv").open()))
    assert len(scores) == 4  # the failed pairs are in the statistics, not dropped
    assert "**Failed pairs** (training diverged): wild (seeds 1 2)" in (out / "summary.md").read_text()


def test_an_interrupted_pair_is_trained_again_from_its_start(tmp_path):
    from rlinfluence.experiments import run_pair

    config = _tiny(tmp_path, rounds=3).run_config("ppo", 1)
    run_pair(config.to_dict(), str(tmp_path / "whole"))
    run_pair(config.to_dict(), str(tmp_path / "cut"))
    cut = tmp_path / "cut"  # as if killed during the last round: no done.json, no last checkpoint
    (cut / "done.json").unlink()
    (cut / "checkpoints" / "round_0003.pt").unlink()
    lines = (cut / "metrics.csv").read_text().splitlines()
    (cut / "metrics.csv").write_text("\n".join(lines[:-1]) + "\n")
    run_pair(config.to_dict(), str(cut))

    def returns(run):
        return [row["eval_return_mean"] for row in csv.DictReader((run / "metrics.csv").open())]

    assert returns(cut) == returns(tmp_path / "whole") and len(returns(cut)) == 3


def test_compare_wandb_groups_the_pairs_and_tags_each_with_its_method(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    try:
        out = compare(_tiny(tmp_path / "cmp", wandb=True, seeds=1))
    finally:
        wandb.teardown()  # W&B keeps its settings (WANDB_DIR) process-wide; later tests set their own
    for method in ("ppo", "iif"):
        config = json.loads((out / f"{method}__seed1" / "config.json").read_text())
        assert config["wandb"] and config["wandb_group"] == "cmp" and config["wandb_tags"] == [method, "CartPole-v1"]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2  # one W&B run per pair


def test_legends_define_named_methods(tmp_path):
    from rlinfluence.experiments.summary import _definitions

    (tmp_path / "compare.json").write_text(json.dumps(
        {"methods": ["ppo", "fast=ppo@learning_rate=0.04", "iif-trusted=iif@scoring_target=trusted,drop_pct=25",
                     "iif@learning_rate=0.1"]}))
    assert _definitions(tmp_path) == {"fast": "ppo@learning_rate=0.04",
                                      "iif-trusted": "iif@scoring_target=trusted,drop_pct=25"}
    assert _definitions(tmp_path / "missing") == {}


def test_a_reference_that_got_worse_gives_no_normalised_scores_and_p_compares_raw_returns(tmp_path):
    """Dividing by a negative span (the reference's plateau below its start) would reverse every
    comparison: the normalised scores are undefined there, and P(improvement) reads raw returns."""
    from rlinfluence.statistics import normalise

    assert np.isnan(normalise(np.array([1.0, 2.0]), start=0.5, plateau=0.1)).all()
    assert np.isnan(normalise(np.array([1.0]), start=0.5, plateau=0.5)).all()
    assert normalise(np.array([0.3]), start=0.1, plateau=0.5)[0] == pytest.approx(0.5)
    worse = [0.03, 0.02, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0]  # a reference taken over by a backdoor
    learns = [0.02, 0.2, 0.5, 0.8, 1.0, 1.0, 1.0, 1.0]
    for seed in (1, 2, 3):
        _fake_run(tmp_path / f"ppo__seed{seed}", worse)
        _fake_run(tmp_path / f"oracle__seed{seed}", learns)
    rows = {r["method"]: r for r in summarize(tmp_path, ["ppo", "oracle"], [1, 2, 3], reference="ppo", reps=200)}
    assert math.isnan(rows["oracle"]["iqm_auc_norm"]) and math.isnan(rows["oracle"]["diff_auc"])
    assert rows["oracle"]["poi_auc"] == 1.0  # it learns, the reference does not: not reversed to 0
    assert rows["oracle"]["verdict80"] == "undefined: the reference did not improve"
