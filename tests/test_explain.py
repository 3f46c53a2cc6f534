"""`rlinfluence explain`: drops found beyond their noise; each counterfactual changes only what it
says; a verdict per constructed case; the serial plain re-run reproduces the run; bad input is one
error line, exit 2."""

import numpy as np
import pandas as pd
import pytest
import torch

from rlinfluence import cli
from rlinfluence.analysis.explain import (
    counterfactuals,
    driving_records,
    explain_window,
    find_drops,
    replay_window,
    verdict_of,
)
from rlinfluence.checkpoint import load_round
from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO, PPOConfig


def test_a_drop_is_an_update_whose_return_fell_beyond_its_noise_across_the_runs_updates():
    metrics = pd.DataFrame({"round": range(5), "eval_return_mean": [0.2, 0.5, 0.45, 0.1, 0.3],
                            "eval_return_std": [0.1] * 5, "approx_kl": [0.01, 0.01, 0.01, 0.2, 0.01]})
    drops = find_drops(metrics, eval_episodes=100)  # s.e. 0.1 * sqrt(2 / 100) = 0.014; z(0.05 / 4 updates) = 2.24
    assert [d.round for d in drops] == [3, 2] and drops[0].size == pytest.approx(0.35)
    assert drops[0].kl_spike and not drops[1].kl_spike
    assert [d.round for d in find_drops(metrics, 100, threshold=0.1)] == [3]
    assert [d.round for d in find_drops(metrics, eval_episodes=1)] == [3]  # 1 episode: s.e. 0.14, only 0.35 passes
    # a 0.04 fall (2.8 s.e.) is a drop among 4 updates, noise among 100: z(0.05 / 100) = 3.48
    flat = pd.DataFrame({"round": range(101), "eval_return_mean": [0.5, 0.46] * 50 + [0.5],
                         "eval_return_std": [0.1] * 101, "approx_kl": [0.01] * 101})
    assert find_drops(flat, eval_episodes=100) == []
    assert len(find_drops(flat.iloc[:5], eval_episodes=100)) == 2


def test_a_slide_is_a_fall_over_a_window_of_updates_that_no_single_update_makes():
    # three updates of -0.03 each: no one is beyond noise (s.e. 0.014, z 2.5), the window of 3 is
    metrics = pd.DataFrame({"round": range(7), "eval_return_mean": [0.5, 0.5, 0.47, 0.44, 0.41, 0.41, 0.41],
                            "eval_return_std": [0.1] * 7, "approx_kl": [0.01, 0.01, 0.02, 0.03, 0.01, 0.01, 0.01]})
    assert find_drops(metrics, eval_episodes=100) == []
    slides = find_drops(metrics, eval_episodes=100, window=3)
    # rows 1 -> 4 evaluate theta(2) -> theta(5): updates 2, 3, 4; an overlapping window is not listed again
    assert [(d.round, d.updates) for d in slides] == [(2, 3)] and slides[0].size == pytest.approx(0.09)
    assert slides[0].approx_kl == pytest.approx(0.03)


def test_a_set_of_sources_is_named_when_leaving_them_out_together_recovers_beyond_its_own_band():
    rows = pd.DataFrame([
        {"kind": "harmful", "counterfactual": "harmful 10% influence", "recovered_fraction": 0.1},
        *({"kind": "random", "counterfactual": f"random 10% draw {j}", "recovered_fraction": v} for j, v in enumerate(CHANCE)),
        *({"kind": "random-source", "counterfactual": f"random 12.5% draw {j}", "recovered_fraction": v}
          for j, v in enumerate(CHANCE)),
        {"kind": "source", "counterfactual": "source 2", "recovered_fraction": 0.3},  # half the cause each
        {"kind": "source", "counterfactual": "source 6", "recovered_fraction": 0.35},
        {"kind": "source-set", "counterfactual": "sources 2,6", "recovered_fraction": 0.9},
        {"kind": "step", "counterfactual": "lr/4", "recovered_fraction": 0.6}])
    random_set = [{"kind": "random-set", "counterfactual": f"random 25% draw {j}", "recovered_fraction": v}
                  for j, v in enumerate([0.1, 0.2, 0.0, 0.15, 0.1])]
    rows = pd.concat([rows, pd.DataFrame(random_set)], ignore_index=True)
    rows["ci_low"] = rows["recovered_fraction"] - 0.2
    assert verdict_of(rows) == "sources 2,6"
    # removing as many random records recovers as much: chance, and the step is left
    rows.loc[rows["kind"] == "random-set", "recovered_fraction"] = [0.8, 0.95, 0.7, 0.9, 0.85]
    assert verdict_of(rows) == "step"


def _rows(**recovered):
    names = {"harmful": "harmful 10% influence", "random": "random 10% draw", "random-source": "random 12.5% draw",
             "source": "source", "step": "lr/2"}
    rows = []
    for kind, values in recovered.items():
        for j, value in enumerate(np.atleast_1d(values)):
            name = f"{names[kind]} {j + (kind == 'source') * 2}" if kind in ("random", "random-source", "source") \
                else names[kind]
            rows.append({"kind": kind, "counterfactual": name, "recovered_fraction": value, "ci_low": value - 0.2})
    return pd.DataFrame(rows)


CHANCE = [0.1, 0.0, 0.2, 0.05, 0.15]


@pytest.mark.parametrize(("recovered", "verdict"), [
    ({"harmful": 0.9, "random": CHANCE, "random-source": CHANCE, "source": [0.1, 0.0], "step": 0.1}, "data"),
    ({"harmful": 0.6, "random": CHANCE, "random-source": CHANCE, "source": [0.95, 0.1], "step": 0.1}, "source 2"),
    ({"harmful": 0.1, "random": CHANCE, "random-source": CHANCE, "source": [0.1, 0.0], "step": 0.9}, "step"),
    # chance does it: the random band recovers too
    ({"harmful": 0.9, "random": [0.8, 0.7, 0.95], "random-source": CHANCE, "source": [0.1, 0.0], "step": 0.1},
     "not explained"),
    # a source above the band's largest draw but within 3 standard deviations of its mean: chance
    ({"harmful": 0.1, "random": CHANCE, "random-source": [0.0, 0.6, 0.1, 0.5, 0.0], "source": [0.65, 0.0],
      "step": 0.9}, "step"),
    ({"harmful": 0.1, "random": CHANCE, "random-source": CHANCE, "source": [0.1, 0.0], "step": 0.1},
     "not explained"),
    # a step that went too far, where every source left out moves the return: the best of seven beats
    # the five random draws' band, not the band the other six sources give with them
    ({"harmful": 0.1, "random": CHANCE, "random-source": CHANCE, "source": [0.7, 0.5, 0.3, 0.55, 0.4, 0.6, 0.45],
      "step": 0.9}, "step"),
])
def test_each_constructed_case_gets_its_verdict(recovered, verdict):
    assert verdict_of(_rows(**recovered)) == verdict


def test_after_a_kl_spike_a_removal_explains_only_if_it_restores_a_normal_step():
    rows = _rows(harmful=0.9, random=CHANCE, **{"random-source": CHANCE}, source=[0.1, 0.0], step=0.9)
    rows = pd.concat([pd.DataFrame([{"kind": "plain", "counterfactual": "plain"}]), rows], ignore_index=True)
    rows["kl_level"] = 0.05
    rows["approx_kl"] = 3.0  # thirty times the step: every re-run stays a spike, the lucky removal too
    assert verdict_of(rows) == "step"
    rows.loc[rows["kind"] == "harmful", "approx_kl"] = 0.01  # removing those records restores a normal step
    assert verdict_of(rows) == "data"
    rows["approx_kl"] = 0.01  # no spike: the removal beyond its band is the data, as without the column
    assert verdict_of(rows) == "data"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    config = PPOConfig(env="CartPole-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=4 * 256,
                       eval_episodes=4, save_buffers=True, tracin=True, seed=2, progress=False, tensorboard=False,
                       run_root=str(tmp_path_factory.mktemp("explain")))
    return PPO(config).learn().run.path


def test_each_counterfactual_changes_only_what_it_says(run):
    saved = load_round(run, 1)
    chosen, harm = counterfactuals(saved, pct=10.0, draws=2, worst_episodes=2)
    n = len(saved.buffer)
    source = saved.buffer.record_ids()[:, 1]
    by_name = {c.name: c for c in chosen}
    assert set(harm) == {"influence", "influence-fresh", "tracin", "abs-advantage"}
    assert by_name["plain"].keep.all() and by_name["plain"].lr_scale == 1.0 and by_name["plain"].n_epochs is None
    for name in ("harmful 10% influence", "harmful 10% influence-fresh", "harmful 10% tracin",
                 "harmful 10% abs-advantage", "random 10% draw 1"):
        c = by_name[name]
        assert int((~c.keep).sum()) == round(0.1 * n) and c.lr_scale == 1.0 and c.n_epochs is None
    assert int((~by_name["random 25% draw 2"].keep).sum()) == n // 4  # as many as one of the 4 sources has
    dropped = ~by_name["harmful 10% influence"].keep
    assert harm["influence"][dropped].min() >= harm["influence"][~dropped].max()  # the most harmful
    extreme = saved.buffer.flat("advantages").abs()
    assert extreme[~by_name["harmful 10% abs-advantage"].keep].min() >= extreme[by_name["harmful 10% abs-advantage"].keep].max()
    for s in range(4):
        assert torch.equal(by_name[f"source {s}"].keep, source != s)
    assert by_name["lr/2"].keep.all() and by_name["lr/2"].lr_scale == 0.5
    assert by_name["epochs/2"].keep.all() and by_name["epochs/2"].n_epochs == saved.trainer.config.n_epochs // 2
    episodes = [c for c in chosen if c.kind == "episode"]
    assert len(episodes) == 2 and all(0 < int((~c.keep).sum()) < n for c in episodes)


def test_explain_writes_one_row_per_counterfactual_and_the_plain_rerun_reproduces_the_run(run, capsys):
    assert cli.main(["explain", str(run), "--round", "2", "--episodes", "4", "--draws", "2"]) == 0
    out = capsys.readouterr().out
    table = pd.read_csv(run / "explain.csv")
    assert {"round", "counterfactual", "return_mean", "recovered_fraction", "ci_low", "ci_high", "verdict"} <= \
        set(table.columns)
    assert table["plain_reproduces_run"].all() and (table["round"] == 2).all()
    # a fall within noise on these episodes is not explained: nothing would divide by it
    assert (table["drop_ci_low"].iloc[0] > 0) == (table["verdict"].iloc[0] != "the re-run does not reproduce the drop")
    assert table["drop_ci_low"].iloc[0] > 0 or table["recovered_fraction"].isna().all()
    assert table["counterfactual"].iloc[0] == "plain" and "verdict:" in out
    assert cli.main(["report", str(run)]) == 0  # explain is a section of the run's report
    html = next(run.glob("report*.html")).read_text()
    assert "Why did the run get worse?" in html and "Update 2" in html


def test_the_listed_harmful_records_are_harmful_beyond_float_noise(run):
    saved = load_round(run, 1)
    n = len(saved.buffer)
    harm = torch.zeros(n, dtype=torch.float64)
    harm[:3] = torch.tensor([2e-3, 1e-3, 5e-4], dtype=torch.float64)
    harm[3:6] = torch.tensor([4e-16, -4e-16, 1e-12], dtype=torch.float64)  # float rounding, not harm
    listed = driving_records(saved, harm, pct=10.0)
    assert listed["records"].sum() == 3 and (listed["harm"] > 0).all()
    assert driving_records(saved, torch.full((n,), -1e-3, dtype=torch.float64), pct=10.0).empty


def test_a_window_is_replayed_round_after_round_and_its_plain_replay_lands_on_the_run(run, capsys):
    rounds = [load_round(run, j) for j in (1, 2)]
    policy, _ = replay_window(rounds, [r.keep for r in rounds])
    saved = load_round(run, 3).start["policy"]
    assert all(torch.equal(policy[name], saved[name]) for name in saved)  # bit for bit, round after round
    source_out = [r.keep & (r.buffer.record_ids()[:, 1] != 0) for r in rounds]
    changed, _ = replay_window(rounds, source_out)
    assert any(not torch.equal(changed[name], saved[name]) for name in saved)
    table, harm = explain_window(run, 1, 2, episodes=4, draws=2)
    assert len(harm) == 2 and (table["updates"] == 2).all() and table["plain_reproduces_run"].all()
    assert {"source 0", "source 3", "harmful 10% influence", "random 25% draw 2", "lr/2"} <= set(table["counterfactual"])
    assert cli.main(["explain", str(run), "--round", "1", "--window", "2", "--episodes", "4", "--draws", "2"]) == 0
    out = capsys.readouterr().out
    assert "updates 1..2:" in out and "round 2: " in out and "verdict:" in out
    assert cli.main(["explain", str(run), "--round", "3", "--window", "2"]) == 2  # the window would end past the run


@pytest.mark.parametrize(("damage", "message"), [
    (lambda text: "", "has no round: the run has nothing to explain yet"),
    (lambda text: text + text.splitlines()[-1] + "\n", "round 3 has a row already"),
])
def test_a_metrics_file_that_is_empty_or_repeats_a_round_is_one_error_line(run, tmp_path, capsys, damage, message):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    metrics = copy / "metrics.csv"
    metrics.write_text(damage(metrics.read_text()))
    assert cli.main(["explain", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]
    if message.startswith("round"):
        assert cli.main(["report", str(copy)]) == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--round", "9"], "--round 9 is out of range"),
    (["--round", "1", "--pct", "100"], "--pct must be in (0, 100)"),
    (["--drops", "0"], "--drops must be >= 1"),
])
def test_bad_input_is_one_error_line(run, capsys, args, message):
    assert cli.main(["explain", str(run), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_run_without_saved_rounds_is_one_error_line(tmp_path, capsys):
    config = PPOConfig(env="CartPole-v1", n_envs=2, n_steps=64, batch_size=64, total_timesteps=256, eval_episodes=2,
                       seed=1, progress=False, tensorboard=False, run_root=str(tmp_path))
    path = PPO(config).learn().run.path
    assert cli.main(["explain", str(path)]) == 2
    assert "without --save-buffers" in capsys.readouterr().err


def test_drops_are_not_looked_for_across_unevaluated_rounds():
    metrics = pd.DataFrame({"round": range(4), "eval_return_mean": [0.2, float("nan"), 0.1, 0.3],
                            "eval_return_std": [0.1] * 4})
    with pytest.raises(UserError, match="round 1 has no evaluation.*name one with --round K"):
        find_drops(metrics, eval_episodes=100)
