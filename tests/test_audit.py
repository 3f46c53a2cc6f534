"""audit: a permutation test per source that flags a broken env and not a clean one; detection
AUROC where the truth is known; bad input is one error line."""

import shutil

import numpy as np
import pandas as pd
import pytest

from rlinfluence import cli
from rlinfluence.analysis.audit import audit_run, holm, source_test, verdict_families
from rlinfluence.analysis.harm import ATTRIBUTION_FAMILIES, scorers_of
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.sources import VERDICT_VERSION


def _run(tmp_path, seed, corrupt=()):
    config = PPOConfig(env="CartPole-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=6 * 256, seed=seed,
                       eval_episodes=2, eval_envs=2, corrupt=tuple(corrupt), save_buffers=True, run_root=str(tmp_path),
                       method=f"s{seed}{'flip' if corrupt else ''}", progress=False, tensorboard=False)
    trainer = PPO(config).learn()
    return trainer


def test_holm_adjusts_as_the_step_down_procedure():
    assert holm(np.array([0.01, 0.04, 0.03])).tolist() == pytest.approx([0.03, 0.06, 0.06])
    assert holm(np.array([0.5, 0.9])).tolist() == [1.0, 1.0]


def test_the_source_test_finds_a_source_that_is_worst_every_round_and_no_other():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(6, 5)) + 3.0 * (np.arange(5) == 2)
    _, p = source_test(h, permutations=4000)
    assert p[2] < 0.001 and min(p[s] for s in (0, 1, 3, 4)) > 0.01


def test_audit_flags_the_flipped_env_and_no_env_of_clean_runs(tmp_path, capsys):
    flipped = _run(tmp_path, 1, ["reward-flip:envs=1"])
    bad = int(np.flatnonzero(flipped.corruptor.flipped)[0])
    sources, found, _ = audit_run(flipped.run.path, scorer="negative-advantage")
    assert sources["flagged"].tolist() == [s == bad for s in range(4)]
    assert set(found["level"]) == {"record", "episode", "source"} and set(found["round"]) == set(range(6))
    assert list(sources.columns[:8]) == ["source", "records", "rounds", "mean_score", "ci_low", "ci_high", "p_value",
                                         "p_holm"]
    # the default is the verdict over every family but the gradient ones (its structure is checked here,
    # its power in test_hidden_faults); --gradient-families tests those too
    assert cli.main(["audit", str(flipped.run.path), "--gradient-families"]) == 0
    written = pd.read_csv(flipped.run.path / "audit" / "sources.csv")
    assert {"p_influence", "p_influence-chunk", "p_dtv", "p_dynamics"} <= set(written.columns)
    assert cli.main(["audit", str(flipped.run.path)]) == 0
    written = pd.read_csv(flipped.run.path / "audit" / "sources.csv")
    assert list(written.columns[:5]) == ["source", "records", "rounds", "flagged", "signature"]
    assert {"p_dynamics", "p_logp-gap", "p_reward-extremes"} <= set(written.columns)
    assert not {"p_influence", "p_influence-chunk", "p_dtv", "p_tracin"} & set(written.columns)
    assert list(pd.read_csv(flipped.run.path / "audit" / "detection.csv").columns) == ["scorer", "level", "round",
                                                                                      "auroc", "precision"]
    assert (flipped.run.path / "audit" / "detection.csv").is_file() and (flipped.run.path / "audit" / "sources.png").is_file()
    assert f"flagged (verdict v{VERDICT_VERSION}, adjusted p < 0.01 across sources x families)" in capsys.readouterr().out
    # the per-run guarantee: the audit of R rounds at alpha / (R (R + 1)), which sum to alpha over R = 1, 2, ...
    flagged_p = pd.read_csv(flipped.run.path / "audit" / "sources.csv")["p_adjusted_min"]
    assert cli.main(["audit", str(flipped.run.path), "--guarantee", "run"]) == 0
    assert "adjusted p < 0.000238, the per-run level for 6 rounds across" in capsys.readouterr().out
    per_run = pd.read_csv(flipped.run.path / "audit" / "sources.csv")
    assert per_run["level"].iloc[0] == pytest.approx(0.01 / 42)
    assert per_run["flagged"].tolist() == (flagged_p < 0.01 / 42).tolist()
    assert cli.main(["report", str(flipped.run.path)]) == 0  # the audit is a section of the run's report
    html = next(flipped.run.path.glob("report*.html")).read_text()
    assert "Audit: which worker is broken, and what kind of fault it is" in html and "Detection against the ground truth" in html
    for seed in (2, 3):
        clean = _run(tmp_path, seed)
        for scorer in ("influence", "negative-advantage"):
            sources, found, _ = audit_run(clean.run.path, scorer=scorer)
            assert not sources["flagged"].any() and found.empty


@pytest.mark.parametrize(("extra", "message"), [
    (["--alpha", "2"], "--alpha must be in (0, 1), got 2"),
    (["--scorer", "oracle"], "unknown scorer 'oracle'"),
    (["--scorer", "influence-trusted"], "unknown scorer 'influence-trusted'"),
    (["--permutations", "0"], "--permutations must be in [1, 1000000], got 0"),
    (["--permutations", "100000000"], "--permutations must be in [1, 1000000], got 100000000"),
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: no Ray cluster answers there"),
])
def test_bad_audit_input_is_one_error_line(tmp_path, capsys, extra, message):
    run = _run(tmp_path, 4)
    assert cli.main(["audit", str(run.run.path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (run.run.path / "audit").exists()


AUDIT_TABLES = ("sources.csv", "detection.csv", "ranked_episode.csv")


def _audit_tables(run_dir, *flags):
    """The bytes of the tables ``rlinfluence audit RUN --by episode *flags`` writes."""
    assert cli.main(["audit", str(run_dir), "--by", "episode", *flags]) == 0
    return {name: (run_dir / "audit" / name).read_bytes() for name in AUDIT_TABLES}


@pytest.fixture(scope="module")
def flipped_serial(tmp_path_factory):
    """A 6-round run with a flipped env (every scorer, for detection.csv) and the tables of its
    serial audit."""
    run = _run(tmp_path_factory.mktemp("flipped"), 5, ["reward-flip:envs=1"]).run.path
    return run, _audit_tables(run)


def _unaudited_copy(run, folder):
    return shutil.copytree(run, folder / run.name, ignore=shutil.ignore_patterns("audit", "analyses"))


def test_audit_in_worker_processes_writes_the_serial_tables(flipped_serial, tmp_path):
    run, serial = flipped_serial
    assert len(pd.read_csv(run / "audit" / "detection.csv")) > 0
    assert _audit_tables(_unaudited_copy(run, tmp_path), "--workers", "2") == serial


def test_audit_on_a_ray_cluster_writes_the_serial_tables(flipped_serial, tmp_path):
    ray = pytest.importorskip("ray")
    run, serial = flipped_serial
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:  # the cluster's own HOST:PORT, so that the reachability check is run too
        tables = _audit_tables(_unaudited_copy(run, tmp_path), "--ray-address", context.address_info["gcs_address"])
    finally:
        ray.shutdown()
    assert tables == serial


def test_dtv_scores_equal_brute_force_per_record_gradients():
    import torch

    from rlinfluence.influence import gradient_alignment

    config = PPOConfig(env="CartPole-v1", n_envs=2, n_steps=32, batch_size=16, total_timesteps=64, eval_episodes=0,
                       progress=False)
    trainer = PPO(config, run_dir=False)
    buffer = trainer.collect()
    buffer.compute_advantages(0.99, 0.95)
    obs, actions, adv = (buffer.flat(k) for k in ("obs", "actions", "advantages"))
    norm = (adv - adv.mean()) / (adv.std() + 1e-8)
    params = list(trainer.policy.policy_parameters())
    grads = []
    for i in range(len(obs)):  # g_i = A_i grad log pi(a_i|s_i), one autograd call per record
        logp = trainer.policy.log_prob(obs[i:i + 1], actions[i:i + 1]).sum()
        grads.append(norm[i] * torch.cat([g.flatten() for g in torch.autograd.grad(logp, params)]))
    g = torch.stack(grads)
    expected = g @ g.mean(0)
    assert torch.allclose(gradient_alignment(trainer.policy, obs, actions, adv), expected, rtol=1e-4, atol=1e-6)


def test_the_dtv_filter_drops_the_most_misaligned_records(tmp_path):
    import torch

    from rlinfluence.filters import FilterContext, make_filter
    from rlinfluence.influence import gradient_alignment

    config = PPOConfig(env="CartPole-v1", n_envs=2, n_steps=64, batch_size=16, total_timesteps=128, eval_episodes=0,
                       progress=False)
    trainer = PPO(config, run_dir=False)
    buffer = trainer.collect()
    buffer.compute_advantages(0.99, 0.95)
    keep = make_filter("dtv", drop_pct=50)(buffer, FilterContext(trainer.policy, 0, 16))
    scores = gradient_alignment(trainer.policy, *(buffer.flat(k) for k in ("obs", "actions", "advantages")))
    n_drop = int((scores < 0).sum()) // 2
    assert int((~keep).sum()) == n_drop and scores[~keep].max() <= scores[keep].min()
    assert cli.main(["train", "--env", "CartPole-v1", "--filter", "dtv", "--drop-pct", "25", "--total-timesteps", "128",
                     "--n-steps", "128", "--batch-size", "32", "--eval-episodes", "0", "--run-root", str(tmp_path)]) == 0
    assert torch.isfinite(torch.tensor(pd.read_csv(next(tmp_path.glob("*/metrics.csv")))["kept_fraction"])).all()


def test_the_advantage_sign_filter_drops_the_most_negative_advantages_as_iif_counts():
    import torch

    from rlinfluence.filters import FilterContext, iif_drop_count, make_filter

    config = PPOConfig(env="CartPole-v1", n_envs=2, n_steps=64, batch_size=16, total_timesteps=128, eval_episodes=0,
                       progress=False)
    trainer = PPO(config, run_dir=False)
    buffer = trainer.collect()
    buffer.advantages = torch.randn(buffer.rewards.shape, generator=torch.Generator().manual_seed(0))
    advantages = buffer.flat("advantages")
    assert 0 < int((advantages < 0).sum()) < len(advantages)
    for pct in (50, 100):
        keep = make_filter("advantage-sign", drop_pct=pct)(buffer, FilterContext(trainer.policy, 0, 16))
        assert int((~keep).sum()) == iif_drop_count(advantages, pct, "neg-bottom")
        assert advantages[~keep].max() <= advantages[keep].min() and (advantages[~keep] < 0).all()
    assert (advantages[keep] >= 0).all()  # p = 100: every negative dropped


def test_audit_reads_a_users_own_harm_tables_with_any_source_ids(tmp_path, capsys):
    rng = np.random.default_rng(1)
    scores = tmp_path / "run" / "audit" / "scores"
    scores.mkdir(parents=True)
    workers = np.repeat(["ann", "bob", "cyd", "dee", "eve"], 30)
    for k in range(6):
        harm = rng.normal(size=len(workers)) + 2.0 * (workers == "cyd")
        pd.DataFrame({"round": k, "source": workers, "episode": 3 * k + np.tile(np.arange(3).repeat(10), 5),
                      "step": np.tile(np.arange(10), 15), "trusted": False, "my_score": harm,
                      "corrupted": workers == "cyd"}).to_parquet(scores / f"round_{k:06d}.parquet")
    assert cli.main(["audit", str(tmp_path / "run"), "--by", "record"]) == 0
    sources = pd.read_csv(tmp_path / "run" / "audit" / "sources.csv")
    assert sources.set_index("source")["flagged"].to_dict() == {"ann": False, "bob": False, "cyd": True, "dee": False,
                                                                "eve": False}
    found = pd.read_csv(tmp_path / "run" / "audit" / "detection.csv")
    assert set(found["scorer"]) == {"my_score"} and found.loc[found["level"] == "source", "auroc"].eq(1.0).all()
    ranked = pd.read_csv(tmp_path / "run" / "audit" / "ranked_record.csv")
    assert len(ranked) == 6 * 150 and ranked["harm"].is_monotonic_decreasing
    capsys.readouterr()
    pd.DataFrame({"round": [0], "source": [0]}).to_parquet(scores / "round_000009.parquet")
    assert cli.main(["audit", str(tmp_path / "run")]) == 2
    assert "has no column 'episode'" in capsys.readouterr().err


def test_the_sources_plot_shows_the_most_suspect_sources_when_there_are_many():
    """2,000 sources: the table keeps them all, the plot the 40 with the lowest p (a bar per source
    would take minutes to draw and could not be read)."""
    import io

    from PIL import Image

    from rlinfluence.analysis.audit import PLOTTED_SOURCES, plot_sources

    n = 2000
    rng = np.random.default_rng(0)
    mean = rng.normal(size=n)
    sources = pd.DataFrame({"source": range(n), "mean_score": mean, "ci_low": mean - 1, "ci_high": mean + 1,
                            "p_value": rng.random(n), "flagged": False, "scorer": "harm"})
    few = Image.open(io.BytesIO(plot_sources(sources.head(PLOTTED_SOURCES), 0.01))).size
    assert Image.open(io.BytesIO(plot_sources(sources, 0.01))).size == few


def test_the_audit_help_names_every_scorer_it_takes():
    """--scorer's help lists the scorers and checks by hand: each one the audit takes is named."""
    import re

    from rlinfluence.analysis.harm import scorers_of
    from rlinfluence.cli_faults import AuditArgs

    source = __import__("inspect").getsource(AuditArgs)
    help_text = source.split("scorer: Annotated[str | None, shown_as(\"FAMILY\")] = None")[1].split('"""')[1]
    named = set(re.findall(r"[a-z][a-z-]+", help_text))
    assert set(scorers_of(1)) <= named, set(scorers_of(1)) - named


def test_the_verdict_tests_the_gradient_families_only_where_asked():
    """Version 4: every scorer but random and the gradient families; asked, version 3's families."""
    scorers = scorers_of(1)
    default, asked = verdict_families(scorers), verdict_families(scorers, gradient_families=True)
    assert not set(default) & set(ATTRIBUTION_FAMILIES) and "random" not in default + asked
    assert set(asked) - set(default) == set(ATTRIBUTION_FAMILIES) and {"dynamics", "reward-extremes"} <= set(default)
    assert [f for f in asked if f in default] == default  # the order kept
