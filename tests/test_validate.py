"""``rlinfluence validate``: LDS of a saved round, on a tiny FrozenLake run, against brute force."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rlinfluence import cli
from rlinfluence.analysis.report import build_report
from rlinfluence.analysis.validation import (
    SCORERS,
    score_round,
    scorer_names,
    target_change,
    validate_round,
    validation_section,
)
from rlinfluence.checkpoint import load_round
from rlinfluence.errors import UserError
from rlinfluence.influence import Records, ReturnTarget, validate
from rlinfluence.influence.validation import linear_datamodeling_score, one_by_one, random_subsets
from rlinfluence.ppo import PPO

from .conftest import tiny_config

SMALL = dict(subsets=8, random_draws=2, drop_pcts=(10.0, 25.0))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """4 rounds of 256 FrozenLake steps (batch 64, 2 epochs), every buffer and checkpoint saved."""
    config = tiny_config(env="FrozenLake-v1", total_timesteps=1024, n_steps=256, batch_size=64,
                         n_epochs=2, eval_episodes=2, save_buffers=True)
    trainer = PPO(config, run_dir=tmp_path_factory.mktemp("runs") / "fl")
    trainer.learn()
    return trainer.run.path


@pytest.fixture(scope="module")
def round_one(run):
    return validate_round(run, 1, scorers=SCORERS, **SMALL)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks, by brute force."""
    return np.array([np.sum(x < v) + (np.sum(x == v) + 1) / 2 for v in x])


def test_scores_predict_and_every_figure_matches_brute_force(run, round_one, one_thread):
    result = round_one.result
    n = round_one.records
    assert result.masks.shape == (8, n) and (result.masks.sum(1) == n // 2).all()
    assert len({tuple(m.nonzero().flatten().tolist()) for m in result.masks}) == 8
    assert result.retrains == 8 + 1 + 2 * (2 + len(SCORERS))
    saved = load_round(run, 1)
    serial = target_change(saved, ReturnTarget(), batched=False)
    # real change = f(theta_S) - f(theta(1)); the batched re-runs equal a serial one to float tolerance
    assert serial([result.masks[3]])[0] == pytest.approx(result.real[3], rel=1e-3, abs=1e-7)
    assert target_change(saved, ReturnTarget())(list(result.masks[:3])) == pytest.approx(result.real[:3], rel=1e-3,
                                                                                           abs=1e-7)
    for name, s in result.scorers.items():
        scores = validate_round(run, 1, scorers=[name], **SMALL).result.scorers[name]
        assert np.array_equal(scores.predicted, s.predicted)
        ranks = np.corrcoef(_ranks(s.predicted), _ranks(result.real))[0, 1]
        assert s.lds.value == pytest.approx(ranks, abs=1e-12)
        assert s.lds.low <= s.lds.value <= s.lds.high and s.lds.message is None
        for d in s.drops:
            assert d.dropped == round(d.pct / 100 * n) and len(d.random_changes) == 2
            assert d.random_mean == pytest.approx(np.mean(d.random_changes))
            assert d.random_se == pytest.approx(np.std(d.random_changes, ddof=1) / math.sqrt(2))
    assert all(s.lds.value > 0 for s in result.scorers.values())


def test_predicted_change_is_the_sum_of_scores_over_the_subset(round_one, run):
    saved = load_round(run, 1)
    scores = score_round(saved, ReturnTarget(), "snapshot/batch", 0).double()
    predicted = round_one.result.scorers["snapshot/batch"].predicted
    for mask, value in zip(round_one.result.masks, predicted, strict=True):
        assert value == pytest.approx(sum(float(scores[i]) for i in range(len(mask)) if mask[i]))
    lowest = round_one.result.scorers["snapshot/batch"].drops[0]
    keep = torch.ones(len(scores), dtype=torch.bool)
    keep[np.argsort(scores.numpy(), kind="stable")[: lowest.dropped]] = False
    assert target_change(saved, ReturnTarget(), batched=False)([keep])[0] == pytest.approx(lowest.lowest_change,
                                                                                            rel=1e-3, abs=1e-7)
    assert lowest.negative_dropped == int((scores[~keep] < 0).sum())


def test_same_seed_same_results_other_seed_other_subsets(run, round_one, one_thread):
    again = validate_round(run, 1, scorers=SCORERS, **SMALL)
    assert torch.equal(again.result.masks, round_one.result.masks)
    assert np.array_equal(again.result.real, round_one.result.real)
    for name, s in round_one.result.scorers.items():
        assert again.result.scorers[name].lds == s.lds
        assert again.result.scorers[name].drops == s.drops
    other = random_subsets(round_one.records, 8, 0.5, seed=(1, 1))
    assert not torch.equal(other, round_one.result.masks)


def test_full_buffer_retrain_reproduces_the_run(run, round_one):
    assert round_one.reproduces_run is True
    # brute force: the run's own theta(2) on round 1's records
    buffer = load_round(run, 1).buffer
    records = Records(buffer.flat("obs"), buffer.flat("actions"), buffer.flat("advantages"))
    f1 = ReturnTarget().value(load_round(run, 1).trainer.policy, records)
    f2 = ReturnTarget().value(load_round(run, 2).trainer.policy, records)
    assert round_one.result.full_change == f2 - f1


def test_a_target_the_policy_cannot_change_gives_zero_changes_and_a_message(run):
    saved = load_round(run, 1)
    buffer = saved.buffer
    constant = ReturnTarget(buffer.flat("obs"), buffer.flat("actions"), torch.zeros(len(buffer)))
    out = validate(torch.randn(len(buffer), generator=torch.Generator().manual_seed(0)),
                   target_change(saved, constant), subsets=5, random_draws=1, drop_pcts=(10.0,))
    assert np.all(out.real == 0.0) and out.full_change == 0.0
    lds = out.scorers["scores"].lds
    assert math.isnan(lds.value) and math.isnan(lds.low) and math.isnan(lds.high)
    assert "cannot change the target" in lds.message


def test_random_scores_give_an_interval_covering_zero(round_one):
    real = round_one.result.real
    masks = round_one.result.masks.double()
    random = torch.randn(masks.shape[1], generator=torch.Generator().manual_seed(0)).double()
    lds = linear_datamodeling_score((masks @ random).numpy(), real)
    assert lds.low < 0 < lds.high and lds.message is None


def test_constant_predictions_are_a_message_not_a_correlation():
    lds = linear_datamodeling_score(np.ones(6), np.arange(6.0))
    assert math.isnan(lds.value) and "predict no difference" in lds.message
    # a monotone relation: every resample (repeats included) has Spearman 1
    lds = linear_datamodeling_score(np.arange(5.0), np.exp(np.arange(5.0)), resamples=200)
    assert [lds.value, lds.low, lds.high] == pytest.approx([1.0, 1.0, 1.0]) and lds.message is None


@pytest.mark.parametrize("flags", [["--subsets", "4"], ["--subsets", "0"], ["--fraction", "0"],
                                   ["--fraction", "1"], ["--fraction", "1.5"],
                                   ["--fraction", "-0.2"], ["--seed", "-1"], ["--round", "a"],
                                   ["--workers", "0"], ["--ray-address", "127.0.0.1:1"]])
def test_bad_settings_are_one_error_line_exit_2(run, flags, capsys):
    saved = run / "analyses" / "validation.json"
    before = saved.read_bytes() if saved.exists() else None
    assert cli.main(["validate", str(run), "--round", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flags[0]} ")
    assert (saved.read_bytes() if saved.exists() else None) == before  # nothing written


def test_bad_round_target_and_scorers(run):
    with pytest.raises(UserError, match="--state-index"):
        validate_round(run, 1, target="action", state_index=10_000, **SMALL)
    with pytest.raises(UserError, match="round 9"):
        validate_round(run, 9, **SMALL)
    with pytest.raises(UserError, match="scorers"):
        scorer_names([], ["batch"])
    assert scorer_names(["snapshot", "full"], ["chunk", "batch"]) == ["snapshot/chunk",
                                                                     "snapshot/batch", "full"]
    with pytest.raises(UserError, match="--subsets"):
        validate(torch.ones(10), one_by_one(lambda keep: 0.0), subsets=3)


def test_action_target(run, one_thread):
    r = validate_round(run, 2, target="action", state_index=5, **SMALL)
    s = r.result.scorers["snapshot/chunk"]  # the default scorer: IIF's normalisation
    assert r.target == "action" and s.lds.low <= s.lds.value <= s.lds.high


def test_cli_several_rounds_into_the_report(run, tmp_path, capsys, one_thread):
    code = cli.main(["validate", str(run), "--round", "2,0", "--subsets", "5", "--random-draws",
                     "1", "--mode", "snapshot", "full", "--advantage-norm", "chunk", "batch",
                     "--html"])
    assert code == 0
    out = capsys.readouterr().out
    assert "snapshot/chunk" in out and "full" in out and "validation.html" in out
    folder = run / "analyses"
    data = json.loads((folder / "validation.json").read_text())
    assert set(data["figures"]) == {"curve", "scatter"}
    assert [row[0] for row in data["tables"][0]["rows"]] == [0, 0, 0, 2, 2, 2]
    for name in ("curve", "scatter"):
        assert (folder / f"validation__{name}.png").read_bytes()[:4] == b"\x89PNG"
    path, sections = build_report(run, tmp_path / "report.html", score_rounds=0)
    assert "validation" in [s.key for s in sections]
    assert "Counterfactual validation" in path.read_text()


def test_validate_in_worker_processes_writes_the_serial_tables(run, tmp_path):
    tables = {}
    for workers in ("1", "2"):
        copy = shutil.copytree(run, tmp_path / workers / run.name, ignore=shutil.ignore_patterns("analyses"))
        assert cli.main(["validate", str(copy), "--round", "0", "2", "--subsets", "5", "--random-draws", "1",
                         "--mode", "snapshot", "full", "--workers", workers]) == 0
        folder = copy / "analyses"
        tables[workers] = (pd.read_csv(folder / "validation.csv"), (folder / "validation_drops.csv").read_bytes())
    timings = ["score_seconds", "retrain_seconds"]  # the only columns that may differ
    pd.testing.assert_frame_equal(tables["1"][0].drop(columns=timings), tables["2"][0].drop(columns=timings),
                                  check_exact=True)
    assert tables["1"][0]["round"].tolist() == [0, 0, 2, 2]  # in round order, whichever round ended first
    assert tables["1"][1] == tables["2"][1]


def test_one_round_section_has_no_curve(round_one):
    section = validation_section([round_one])
    assert "curve" not in section.figures and "scatter" in section.figures
    assert section.summary["retrain reproduces the run's theta(k+1)"] == "1 of 1 rounds"


def test_core_does_not_import_the_trainer_or_filters():
    code = ("import sys, rlinfluence.influence.validation; "
            "print([m for m in ('rlinfluence.ppo', 'rlinfluence.filters') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_scatter_title_keeps_the_lds_interval():
    from rlinfluence.analysis.validation import scatter_title
    from rlinfluence.influence.validation import LDS

    title = scatter_title(3, "snapshot/chunk", LDS(0.953, 0.91, 0.98, 0.95))
    assert title == "round 3, snapshot/chunk\nLDS +0.95 [+0.91, +0.98]"
    assert scatter_title(3, "full", LDS(float("nan"), float("nan"), float("nan"), 0.95)).endswith("LDS undefined")
