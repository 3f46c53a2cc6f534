"""The three applications (diagnosis, timeline, intervention) and the HTML report, on tiny runs."""

from __future__ import annotations

import base64
import io
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rlinfluence import cli
from rlinfluence.analysis.diagnosis import (
    diagnose,
    diagnosis_section,
    monte_carlo_advantages,
    spearman,
)
from rlinfluence.analysis.intervention import intervene_round, intervention_section, parse_rounds
from rlinfluence.analysis.report import build_report, load_sections, save_section
from rlinfluence.analysis.timeline import (
    dirichlet_roughness,
    estimate_phases,
    knn_weights,
    roughness,
    select_state_action,
    timeline,
    timeline_section,
)
from rlinfluence.buffer import RolloutBuffer
from rlinfluence.checkpoint import load_round
from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO

from .conftest import tiny_config

CHROMIUM = Path("/usr/bin/chromium")


def _train(root: Path, env: str, **overrides) -> Path:
    settings = dict(total_timesteps=1024, n_steps=256, batch_size=64, n_epochs=2, eval_episodes=4, save_buffers=True)
    config = tiny_config(env=env, **{**settings, **overrides})
    trainer = PPO(config, run_dir=root / env)
    trainer.learn()
    return trainer.run.path


@pytest.fixture(scope="module")
def frozenlake_run(tmp_path_factory) -> Path:
    """4 rounds of 256 FrozenLake steps, every buffer and checkpoint saved."""
    return _train(tmp_path_factory.mktemp("runs"), "FrozenLake-v1")


# -- Monte-Carlo advantage -----------------------------------------------------------------
def _chain_buffer() -> RolloutBuffer:
    """States 0 -> 1 -> 2 -> goal; action 1 moves right, 0 stays; reward 1 when leaving state 2.

    step: 0      1      2        3      4      5      6        7      8
          (0,R)  (1,R)  (2,R)+1  (0,S)  (0,R)  (1,R)  (2,R)+1  (0,R)  (1,S)   <- buffer ends
    """
    states = [0, 1, 2, 0, 0, 1, 2, 0, 1]
    actions = [1, 1, 1, 0, 1, 1, 1, 1, 0]
    buf = RolloutBuffer.empty(0, 9, 1, (3,), torch.float32, (), torch.int64)
    buf.obs[:, 0] = torch.eye(3)[states]
    buf.actions[:, 0] = torch.tensor(actions)
    buf.rewards[[2, 6], 0] = 1.0
    buf.terminated[[2, 6], 0] = True
    return buf


def test_monte_carlo_advantage_on_a_deterministic_chain():
    gamma = 0.5
    a_bar = monte_carlo_advantages(_chain_buffer(), "FrozenLake-v1", gamma).numpy()
    # returns-to-go: episode 1 (.25, .5, 1); episode 2 (.125, .25, .5, 1); steps 7-8 incomplete
    q_right, q_stay = (0.25 + 0.25) / 2, 0.125
    v0 = (0.25 + 0.125 + 0.25) / 3
    expected = [q_right - v0, 0, 0, q_stay - v0, q_right - v0, 0, 0, q_right - v0, math.nan]
    np.testing.assert_allclose(a_bar, expected, atol=1e-12)  # (1, stay) never completes: NaN


def test_monte_carlo_advantage_refuses_continuous_observations():
    with pytest.raises(UserError, match="not available.*Acrobot-v1 has continuous observations"):
        monte_carlo_advantages(_chain_buffer(), "Acrobot-v1", 0.99)


def test_spearman_matches_rank_definition():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert math.isnan(spearman(x, np.ones(4)))


# -- roughness -----------------------------------------------------------------------------
def test_roughness_of_constant_scores_is_zero():
    emb = np.random.default_rng(0).normal(size=(30, 4))
    assert roughness(np.full(30, 0.7), emb, u=5) == 0.0


def test_dirichlet_roughness_of_alternating_values_on_a_chain():
    n = 6
    chain = np.zeros((n, n))
    for i in range(n - 1):
        chain[i, i + 1] = chain[i + 1, i] = 1.0
    alternating = np.arange(n) % 2
    assert dirichlet_roughness(alternating, chain) == pytest.approx(1.0)
    assert dirichlet_roughness(np.linspace(0, 1, n), chain) == pytest.approx(1 / 25)  # smooth: low
    assert math.isnan(dirichlet_roughness(alternating, np.zeros((n, n))))


def test_knn_graph_is_symmetrised_with_median_distance_sigma():
    positions = np.array([[0.0], [1.0], [2.5], [4.5]])  # nearest neighbours: 1, 0, 1, 2
    sparse_weights, sigma = knn_weights(positions, u=1)
    assert sparse_weights.nnz == 6  # sparse: the 3 edges, both ways
    weights = sparse_weights.toarray()
    assert sigma == pytest.approx(2.25)  # median of 1, 1.5, 2, 2.5, 3.5, 4.5
    edges = {(i, j) for i, j in zip(*np.nonzero(np.triu(weights)), strict=True)}
    assert edges == {(0, 1), (1, 2), (2, 3)}  # 1->0 and 0->1 merged; 2->1 adds (1, 2)
    assert weights[1, 2] == pytest.approx(math.exp(-(1.5 / 2.25) ** 2))
    np.testing.assert_array_equal(weights, weights.T)


def test_roughness_uses_positive_scores_normalised_by_the_largest_magnitude():
    positions = np.array([[0.0], [1.0], [100.0], [2.5], [4.5]])
    scores = np.array([1.0, 0.5, -2.0, 1.0, 0.5])  # the negative record is not a node
    # nodes form the chain above with values /2: .5 .25 .5 .25 -> every edge (1/4)^2
    assert roughness(scores, positions, u=1) == pytest.approx(1 / 16)
    assert math.isnan(roughness(np.array([1.0, -1.0, -1.0]), positions[:3]))


def test_phases_are_estimated_from_the_data():
    rounds = np.arange(8)
    scale = np.array([1.0, 0.9, 0.8, 0.5, 0.3, 0.05, 0.08, 0.02])
    rough = np.array([0.2, 0.3, 0.25, 0.1, 0.08, 0.09, 0.07, 0.1])
    assert estimate_phases(rounds, scale, rough) == {"clustering": 3, "saturation": 5}
    assert estimate_phases(rounds, np.ones(8), np.full(8, 0.2)) == {"clustering": None, "saturation": None}
    one_noisy_round = np.array([0.1, 0.1, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1])  # smoothed away: no drop
    assert estimate_phases(rounds, np.ones(8), one_noisy_round)["clustering"] is None


# -- diagnosis -----------------------------------------------------------------------------
def test_diagnosis_on_a_tiny_frozenlake_run(frozenlake_run):
    d = diagnose(frozenlake_run, 2, bottom=20)
    t = d.table
    assert d.mc_reason is None and len(t) == 256
    scores = t["score"].to_numpy()
    assert np.all(scores[d.bottom] <= np.sort(scores)[19]) and len(d.bottom) == 20
    a_bar, a_hat = t["mc_advantage"].to_numpy(), t["advantage"].to_numpy()
    valid = np.isfinite(a_bar)
    assert d.stats["A_bar coverage"] == pytest.approx(valid.mean())
    expected_all = ((a_bar * a_hat)[valid] < 0).mean()
    assert d.stats["mismatch fraction, all"] == pytest.approx(expected_all)
    rho = d.stats["spearman(score, A_bar*A_hat)"]
    assert -1 <= rho <= 1
    assert rho == pytest.approx(spearman(scores[valid], (a_bar * a_hat)[valid]))
    section = diagnosis_section(d)
    assert set(section.figures) == {"scatter", "grid"}


def test_diagnosis_of_a_continuous_env_says_mc_is_not_available(tmp_path):
    run = _train(tmp_path, "CartPole-v1")
    d = diagnose(run, 0, bottom=10)
    assert "CartPole-v1 has continuous observations" in d.mc_reason
    assert "mc_advantage" not in d.table.columns
    assert "not available" in " ".join(diagnosis_section(d).paragraphs)


def test_diagnosis_of_minigrid_draws_the_agents_views(tmp_path):
    run = _train(tmp_path, "MiniGrid-Empty-8x8-v0", total_timesteps=512, eval_episodes=1)
    d = diagnose(run, 1, bottom=10)
    assert d.mc_reason is None and np.isfinite(d.table["mc_advantage"]).any()
    assert set(diagnosis_section(d).figures) == {"scatter", "views"}


def test_round_not_saved_is_a_clear_error(frozenlake_run):
    with pytest.raises(UserError, match="no saved buffer for round 9"):
        diagnose(frozenlake_run, 9)


# -- timeline ------------------------------------------------------------------------------
def test_timeline_on_a_tiny_run(frozenlake_run):
    target = select_state_action(frozenlake_run, state_index=3)
    assert "record 3 of round 3" in target.description
    assert ", ... (16 values)]" in target.description  # FrozenLake's 16-value one-hot, shortened visibly
    t = timeline(frozenlake_run, target, neighbours=10, top=5)
    assert t.rounds["round"].tolist() == [0, 1, 2, 3]
    assert ((t.rounds["pi"] > 0) & (t.rounds["pi"] <= 1)).all()
    assert (t.rounds["roughness"].dropna() >= 0).all()
    assert len(t.top) == 20 and set(t.top["top_rank"]) == {1, 2, 3, 4, 5}
    assert "timeline" in timeline_section(t).figures


@pytest.mark.parametrize("kwargs, message", [
    (dict(state_index=256), r"--state-index 256 is out of range: round 3 has 256 records"),
    (dict(state_index=-1, state_round=1), "out of range"),
    (dict(), "exactly one of --state-index"),
    (dict(state=(1.0, 0.0)), "--state has 2 values"),
    (dict(state_index=0, action=(7,)), r"--action must be one integer in \[0, 4\)"),
    (dict(state_index=0, state_round=8), "no saved buffer for round 8"),
])
def test_timeline_bad_input(frozenlake_run, kwargs, message):
    with pytest.raises(UserError, match=message):
        select_state_action(frozenlake_run, **kwargs)


def test_timeline_rounds_not_saved(frozenlake_run):
    target = select_state_action(frozenlake_run, state_index=0)
    with pytest.raises(UserError, match=r"rounds \[7\] are not saved.*saved: 0..3"):
        timeline(frozenlake_run, target, rounds=[1, 7])


# -- intervention --------------------------------------------------------------------------
def test_intervention_is_deterministic_and_reproduces_the_run(frozenlake_run):
    first = intervene_round(frozenlake_run, 1, eval_episodes=8)
    second = intervene_round(frozenlake_run, 1, eval_episodes=8)
    assert first == second
    assert first["a_matches_run"] is True  # (a) is exactly the run's own update theta(1) -> theta(2)
    assert 0 < first["dropped"] < first["records"]
    assert first["delta_b"] == pytest.approx(first["R_b"] - first["R_a"])
    assert first["delta_c"] == pytest.approx(first["R_c"] - first["R_a"])
    if first["d_matched"]:
        assert first["b_minus_d"] == pytest.approx(first["R_b"] - first["R_d"])
    else:
        assert math.isnan(first["b_minus_d"])


def test_an_unmatched_arm_d_keeps_b_minus_d_out():
    """The bisection gave up (Acrobot: kl_d 0.0077 against kl_b 0.0187): (d) is marked unmatched
    and (b) - (d) is left empty; matched within 10%, it is R(b) - R(d)."""
    from rlinfluence.analysis.intervention import d_comparison

    returns_b, returns_d = np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 1.0])
    unmatched = d_comparison(0.0187, 0.0077, returns_b, returns_d)
    assert unmatched["d_matched"] is False and math.isnan(unmatched["b_minus_d"])
    matched = d_comparison(0.0187, 0.0190, returns_b, returns_d)
    assert matched["d_matched"] is True and matched["b_minus_d"] == pytest.approx(4 / 3)


def test_arm_d_matches_the_approx_kl_of_arm_b(frozenlake_run):
    row = intervene_round(frozenlake_run, 2, eval_episodes=4)
    assert row["kl_b"] != pytest.approx(row["kl_a"], rel=0.1)  # otherwise the test shows nothing
    assert row["kl_d"] == pytest.approx(row["kl_b"], rel=0.10)
    assert 1 <= row["d_retrains"] <= 8 and row["d_lr_scale"] != 1.0
    # the full buffer at the chosen scale, retrained again, gives the same approx_kl (deterministic)
    saved = load_round(frozenlake_run, 2)
    assert saved.retrain(lr_scale=row["d_lr_scale"])["approx_kl"] == pytest.approx(row["kl_d"])


def test_match_kl_bisects_and_treats_a_diverging_scale_as_too_large():
    from rlinfluence.analysis.intervention import match_kl

    class Round:  # approx_kl grows as scale^2; the update diverges past scale 5
        def retrain(self, lr_scale):
            if lr_scale > 5:
                raise UserError("round 3: non-finite loss inf")
            return {"approx_kl": 0.001 * lr_scale ** 2}

    scale, kl, retrains = match_kl(Round(), target_kl=0.001 * 3.0 ** 2, kl_at_one=0.001)
    assert kl == pytest.approx(0.009, rel=0.05) and scale == pytest.approx(3.0, rel=0.03) and retrains <= 8
    scale, kl, _ = match_kl(Round(), target_kl=1.0, kl_at_one=0.001)  # unreachable without diverging
    assert scale <= 5 and math.isfinite(kl)


def test_parse_rounds():
    assert parse_rounds("20, 5,10,5") == [5, 10, 20]
    for bad in ("a,b", "", "-1"):
        with pytest.raises(UserError, match="--rounds"):
            parse_rounds(bad)


# -- report --------------------------------------------------------------------------------
class _StrictHTML(HTMLParser):
    """Well-formedness: every non-void element closed in order; collects <img> sources."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.images, self.tags, self.errors = [], [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "img":
            self.images.append(dict(attrs))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def _check_html(text: str) -> list[dict]:
    from PIL import Image

    assert text.startswith("<!DOCTYPE html>")
    parser = _StrictHTML()
    parser.feed(text)
    parser.close()
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    assert {"html", "head", "title", "body", "meta"} <= parser.tags
    assert not {"script", "link", "iframe"} & parser.tags
    assert not re.search(r"""(src|href)=["'](?!data:)""", text)  # self-contained
    for img in parser.images:
        prefix = "data:image/png;base64,"
        assert img["src"].startswith(prefix) and img.get("alt")
        image = Image.open(io.BytesIO(base64.b64decode(img["src"][len(prefix):], validate=True)))
        image.load()
        assert image.format == "PNG" and min(image.size) > 50
    return parser.images


def test_report_html_is_valid_and_every_image_decodes(frozenlake_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(frozenlake_run, run)
    d = diagnose(run, 2, bottom=20)
    save_section(run / "analyses", diagnosis_section(d))
    save_section(run / "analyses", intervention_section(
        pd.DataFrame([intervene_round(run, 2, eval_episodes=4)])))
    assert [s.key for s in load_sections(run / "analyses")] == ["diagnosis_round_2", "intervention"]
    path, sections = build_report(run, score_rounds=2)
    assert [s.key for s in sections] == ["learning", "influence", "diagnosis_round_2", "intervention"]
    images = _check_html(path.read_text(encoding="utf-8"))
    assert len(images) == 5  # curve, histograms, scatter, grid, bars


def test_cli_commands_write_html_and_bad_input_is_one_line(frozenlake_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(frozenlake_run, run)
    assert cli.main(["diagnose", str(run), "--round", "1", "--bottom", "10", "--html"]) == 0
    assert cli.main(["timeline", str(run), "--state-index", "5", "--rounds", "0,3", "--neighbours", "5",
                     "--html"]) == 0
    assert cli.main(["intervene", str(run), "--rounds", "1", "--eval-episodes", "4", "--html"]) == 0
    assert cli.main(["report", str(run), "--score-rounds", "1"]) == 0
    for name in ("diagnosis_round_1.html", "timeline.html", "intervention.html"):
        _check_html((run / "analyses" / name).read_text(encoding="utf-8"))
    assert len(_check_html((run / "report.html").read_text(encoding="utf-8"))) == 2 + 2 + 1 + 1
    capsys.readouterr()
    for args, message in (
        (["diagnose", str(run), "--round", "9"], "error: no saved buffer for round 9"),
        (["timeline", str(run), "--state-index", "999"], "error: --state-index 999 is out of range"),
        (["intervene", str(run), "--rounds", "x"], "error: --rounds must be comma-separated"),
    ):
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err


def rendered_in_chromium(page: str, tmp_path: Path, images: str, facts: str) -> list[str]:
    """Load ``page`` in headless Chromium and return, for each image of the JS expression
    ``images`` (an iterable of <img>), the JS string ``facts`` of it (``i`` is the image), after load."""
    probe = tmp_path / "probe.html"  # the page plus a script writing the facts into the DOM
    probe.write_text(page.replace("</body>", (
        "<script>window.addEventListener('load', () => { document.body.setAttribute('data-probe', "
        f"Array.from({images}).map(i => {facts}).join(' ')); }});</script></body>")), encoding="utf-8")
    out = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return re.search(r'data-probe="([^"]*)"', out.stdout).group(1).split()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium not installed (apt-get install chromium)")
def test_report_renders_its_images_in_headless_chromium(frozenlake_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(frozenlake_run, run)
    path, _ = build_report(run, score_rounds=1)
    sizes = rendered_in_chromium(path.read_text(encoding="utf-8"), tmp_path, "document.images",
                                 "i.complete + ':' + i.naturalWidth")
    assert len(sizes) == 2 and all(s.startswith("true:") and int(s.split(":")[1]) > 50 for s in sizes), sizes


def test_records_show_a_grid_cell_or_an_image_not_a_mean():
    from rlinfluence.analysis.tables import _obs_summary

    one_hot = np.zeros(16, np.float32)
    one_hot[6] = 1
    assert _obs_summary(one_hot) == "state 6 (row 1, col 2 of 4x4)"  # FrozenLake 4x4
    assert _obs_summary(np.full((7, 7, 3), 200, np.uint8)) == "image 7x7x3"  # not MiniGrid's object codes
    assert _obs_summary(np.array([0.1, -0.2, 0.3, 0.0])) == "[0.1, -0.2, 0.3, 0]"


def test_a_minigrid_record_says_where_the_goal_is_from_the_agent():
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the envs)
    from minigrid.core.constants import OBJECT_TO_IDX

    from rlinfluence.analysis import tables

    assert (OBJECT_TO_IDX["empty"], OBJECT_TO_IDX["goal"]) == (tables._MINIGRID_EMPTY, tables._MINIGRID_GOAL)
    assert max(OBJECT_TO_IDX.values()) == tables._MINIGRID_MAX
    assert all(OBJECT_TO_IDX[name] == code for code, name in tables._MINIGRID_NAMES.items())
    env = gym.make("MiniGrid-Empty-8x8-v0")
    obs, _ = env.reset(seed=0)  # agent at (1, 1) facing east, the goal at (6, 6), walls round the 8x8
    assert tables._obs_summary(obs["image"]) == "view 7x7: no goal in view; wall 6 ahead"
    for action in (2, 2, 2, 1, 2, 2, 2, 2):  # 3 forward, turn right (south), 4 forward: agent at (4, 5)
        obs, *_ = env.step(action)
    assert tuple(env.unwrapped.agent_pos) == (4, 5)
    # facing south, the goal is 1 row further down and 2 columns east: east is the agent's left
    assert tables._obs_summary(obs["image"]) == "view 7x7: goal 1 ahead, 2 left; wall 2 ahead"
    obs, *_ = env.step(0)  # turn left: facing east, the goal 2 ahead and 1 to the right (south)
    assert tables._obs_summary(obs["image"]) == "view 7x7: goal 2 ahead, 1 right; wall 3 ahead"


def test_frame_strips_say_the_round_step_not_the_episode_step():
    from rlinfluence.analysis.report import render_html
    from rlinfluence.sections import FrameCard, Gallery, Section

    png = figure_png_of_one_pixel()
    card = FrameCard("record 5 (env 0, step 624)", "action 1", png, [png, png], [623, 624], 1)
    html = render_html("t", [Section("s", "s", galleries=[Gallery("g", [card])])])
    assert "round step 624" in html and "of its episode\"" not in html


def figure_png_of_one_pixel() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    return buffer.getvalue()
