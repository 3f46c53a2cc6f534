import csv

import numpy as np
import pytest

from rlinfluence.errors import UserError
from rlinfluence.experiments import (
    CompareConfig,
    Curve,
    ci95,
    compare,
    first_reach,
    pair_metrics,
    parse_overrides,
    reduction,
    running_max_levels,
    se_ave,
    summarize,
    time_reduction,
)

STANDARD = [0.0, 0.2, 0.1, 0.5, 0.5, 0.8, 0.7, 0.9]


def test_first_reach_counts_rounds_from_one():
    assert first_reach(STANDARD, 0.0) == 1
    assert first_reach(STANDARD, 0.5) == 4
    assert first_reach(STANDARD, 0.95) is None


def test_se_levels_are_the_successive_new_maxima():
    assert running_max_levels(STANDARD) == [0.0, 0.2, 0.5, 0.8, 0.9]


def test_se_metrics_on_hand_made_curves():
    faster = [0.0, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    # levels 0, .2, .5, .8, .9 reached at 1, 2, 4, 6, 8 by standard and 1, 2, 2, 3, 3 by faster
    expected = [0, 0, 50, 50, 62.5]
    value, unreached = se_ave(STANDARD, faster)
    assert value == pytest.approx(sum(expected) / 5) and unreached == 0
    assert reduction(STANDARD, faster, 0.9) == pytest.approx(62.5)
    seconds = [float(i + 1) for i in range(8)]
    half_time = [0.5 * s for s in seconds]
    assert time_reduction(STANDARD, seconds, faster, half_time, 0.9) == pytest.approx(100 * (1 - 1.5 / 8))


def test_never_reached_and_round_zero_cases():
    never = [0.0] * 8
    assert reduction(STANDARD, never, 0.9) is None
    value, unreached = se_ave(STANDARD, never)
    assert value == pytest.approx(0.0) and unreached == 4  # only the round-1 level is reached
    seconds = np.arange(1.0, 9.0)
    metrics = pair_metrics(Curve(np.array(STANDARD), seconds), Curve(np.array(never), seconds))
    assert metrics["se_peak"] is None and metrics["rt_peak"] is None
    # a level reached at the very first round by both curves is a 0% reduction, not a division by zero
    assert reduction([1.0, 1.0], [1.0, 1.0], 1.0) == 0.0


def test_a_reference_that_never_improves_leaves_every_level_figure_undefined():
    flat, seconds = np.array([-5.0, -6.0, -5.5, -7.0, -6.5, -6.0, -5.8, -6.2]), np.arange(1.0, 9.0)
    better = np.array([-5.0, -3.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    metrics = pair_metrics(Curve(flat, seconds), Curve(better, seconds))
    level_keys = [k for k in metrics if k.startswith(("se_", "rt_", "rounds_to", "seconds_to")) and "ave" not in k]
    assert level_keys and all(metrics[k] is None for k in level_keys), metrics
    assert metrics["final_return"] == 0.0 and metrics["auc"] == pytest.approx(better.mean())  # still measured


def _fake_run(folder, returns, wall, cpu=None):
    folder.mkdir(parents=True)
    with (folder / "metrics.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "eval_return_mean", "train_seconds"] + (["train_cpu_seconds"] if cpu is not None else []))
        for i, r in enumerate(returns):
            writer.writerow([i, r, wall[i]] + ([cpu[i]] if cpu is not None else []))


def test_rt_figures_follow_the_chosen_clock(tmp_path):
    rounds = np.arange(1.0, 9.0)
    faster = [0.0, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]  # reaches PPO's peak at round 3 of 8
    # iif's wall clock ran on a loaded machine (3x slower per round); its CPU time did not change
    _fake_run(tmp_path / "ppo__seed1", STANDARD, rounds, cpu=rounds)
    _fake_run(tmp_path / "iif__seed1", faster, 3 * rounds, cpu=rounds)
    wall, cpu = (summarize(tmp_path, ["ppo", "iif"], [1], clock=c)[1] for c in ("wall", "cpu"))
    assert wall["se_peak_mean"] == cpu["se_peak_mean"] == pytest.approx(62.5)
    assert wall["rt_peak_mean"] == pytest.approx(100 * (1 - 9 / 8))
    assert cpu["rt_peak_mean"] == pytest.approx(62.5)
    _fake_run(tmp_path / "old" / "ppo__seed1", STANDARD, rounds)  # logged before train_cpu_seconds existed
    _fake_run(tmp_path / "old" / "iif__seed1", faster, rounds)
    with pytest.raises(UserError, match="has no train_cpu_seconds"):
        summarize(tmp_path / "old", ["ppo", "iif"], [1], clock="cpu")


def test_ci95_uses_the_t_quantile():
    mean, lo, hi = ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and hi - mean == pytest.approx(2.776 * (2.5 ** 0.5) / 5 ** 0.5, rel=1e-3)


def test_overrides_parse_and_reject_unknown_keys_and_wrong_types():
    assert parse_overrides(["optimizer=adam", "learning_rate=1e-3", "max_grad_norm=null", "n_epochs=4"]) == {
        "optimizer": "adam", "learning_rate": 1e-3, "max_grad_norm": None, "n_epochs": 4}
    with pytest.raises(UserError, match="unknown PPOConfig key 'colour'"):
        parse_overrides(["colour=red"])
    with pytest.raises(UserError, match="n_steps=abc: expected int"):
        parse_overrides(["n_steps=abc"])
    with pytest.raises(UserError, match="optimizer=rmsprop: expected one of adam, sgd"):
        parse_overrides(["optimizer=rmsprop"])


def _tiny_compare(out, **kw):
    return CompareConfig(env="CartPole-v1", methods="ppo,iif,random", seeds=2, rounds=2, eval_episodes=2,
                         set=("n_steps=128", "batch_size=32", "n_epochs=2", "eval_envs=2", "tensorboard=false"),
                         out=str(out), progress=False, **kw)


def _summary_without_clocks(out):
    """The summary rows less the seconds-based columns, which differ between any two runs."""
    with (out / "summary.csv").open() as f:
        return [{k: v for k, v in r.items() if "second" not in k and "rt_" not in k} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def serial_compare(tmp_path_factory):
    """One serial comparison that every other executor is checked against."""
    return compare(_tiny_compare(tmp_path_factory.mktemp("serial"), workers=1))


def test_compare_end_to_end_is_deterministic_and_resumes(serial_compare, tmp_path):
    out = serial_compare
    for name in ("summary.md", "summary.csv", "curves.png"):
        assert (out / name).stat().st_size > 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        f"{m}__seed{s}" for m in ("iif", "ppo", "random") for s in (1, 2)]
    again = compare(_tiny_compare(tmp_path / "b", workers=2))  # other executor, same numbers
    assert _summary_without_clocks(out) == _summary_without_clocks(again)
    before = (out / "ppo__seed1" / "metrics.csv").read_text()
    compare(_tiny_compare(out, workers=1))  # finished pairs are skipped
    assert (out / "ppo__seed1" / "metrics.csv").read_text() == before


def test_compare_with_ray(serial_compare, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = compare(_tiny_compare(tmp_path / "ray", ray_address="local"))
    finally:
        ray.shutdown()
    assert _summary_without_clocks(out) == _summary_without_clocks(serial_compare)


def test_a_bad_value_inside_a_ray_task_is_the_one_line_error(tmp_path):
    ray = pytest.importorskip("ray")
    from rlinfluence.config import check_drop_pct
    from rlinfluence.executor import run_calls

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(UserError) as raised:
            run_calls(check_drop_pct, [(50.0,), (150.0,)], workers=1, ray_address="local")
    finally:
        ray.shutdown()
    assert type(raised.value) is UserError and str(raised.value) == "drop_pct must be in (0, 100], got 150.0"


def test_a_second_comparison_in_the_same_folder_is_refused(tmp_path):
    from rlinfluence.experiments import folder_lock

    tmp_path.mkdir(exist_ok=True)
    with folder_lock(tmp_path), pytest.raises(UserError, match="another comparison is running"):
        compare(_tiny_compare(tmp_path, workers=1))


def test_resuming_a_pair_with_other_settings_is_refused(tmp_path):
    from rlinfluence.experiments import run_pair

    config = _tiny_compare(tmp_path).run_config("ppo", 1)
    run_pair(config.to_dict(), str(tmp_path / "pair"))
    (tmp_path / "pair" / "done.json").unlink()  # as if killed before the end
    changed = {**config.to_dict(), "learning_rate": 0.1}
    with pytest.raises(UserError, match="run with other settings \\(learning_rate: 0.0003 -> 0.1\\)"):
        run_pair(changed, str(tmp_path / "pair"))
