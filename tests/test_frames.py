"""Frames of the saved rounds (``--save-frames``): saved, shown with the top and bottom records of
the diagnosis, attribution, timeline and report pages (rendered in headless Chromium), a hint
without them; the RLHF report's kept and dropped completions side by side."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from rlinfluence import cli
from rlinfluence.frames import HOW_TO_SAVE, MAX_SIDE, load_frames, record_strip
from rlinfluence.ppo import PPO

from .conftest import tiny_config
from .test_analysis import CHROMIUM, _check_html, rendered_in_chromium

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory) -> Path:
    """2 rounds of 128 CartPole steps in 2 envs, buffers and frames saved."""
    config = tiny_config(env="CartPole-v1", n_envs=2, n_steps=64, batch_size=32, save_buffers=True,
                         save_frames=True)
    return PPO(config, run_dir=tmp_path_factory.mktemp("runs") / "cartpole").learn().run.path


def test_every_record_of_a_saved_round_has_a_small_frame(cartpole_run):
    for k in (0, 1):
        frames = load_frames(cartpole_run, k, n_records=128)
        assert frames.dtype == np.uint8 and frames.shape[0] == 128 and frames.shape[-1] == 3
        assert max(frames.shape[1:3]) == MAX_SIDE  # CartPole renders 600 x 400
    assert (cartpole_run / "frames" / "round_0001.npz").stat().st_size < 100_000
    assert not np.array_equal(frames[0], frames[1])  # the cart moves between steps
    assert load_frames(cartpole_run, 7) is None


def test_strip_stays_in_the_records_episode():
    env = np.array([0, 0, 0, 0, 0, 1, 1])
    episode = np.array([3, 3, 4, 4, 4, 9, 9])
    step = np.array([0, 1, 2, 3, 4, 0, 1])
    assert record_strip(3, env, episode, step, width=1).tolist() == [2, 3, 4]
    assert record_strip(2, env, episode, step, width=5).tolist() == [2, 3, 4]  # not episode 3, not env 1
    assert record_strip(5, env, episode, step, width=2).tolist() == [5, 6]


def _cards(text: str) -> int:
    return text.count('<figure class="record">')


def test_diagnose_attribute_timeline_and_report_show_the_frames(cartpole_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(cartpole_run, run)
    assert cli.main(["diagnose", str(run), "--round", "1", "--bottom", "5", "--html"]) == 0
    assert cli.main(["attribute", str(run), "--round", "0", "--top", "3", "--html"]) == 0
    assert cli.main(["timeline", str(run), "--state-index", "5", "--neighbours", "3", "--top", "2", "--html"]) == 0
    assert cli.main(["report", str(run), "--score-rounds", "1"]) == 0
    assert HOW_TO_SAVE not in capsys.readouterr().out
    pages = {
        "diagnosis": (run / "analyses" / "diagnosis_round_1.html", 5 + 5),  # bottom 5, top 5
        "attribution": (next(run.glob("attribution_round_0*.html")), 3 + 3),  # next to its Parquet file
        "timeline": (run / "analyses" / "timeline.html", 2 + 2),  # top 2 of both rounds
        "report": (run / "report.html", 8 + 8 + 10 + 4),  # influence (last round), then the saved analyses
    }
    for name, (path, cards) in pages.items():
        text = path.read_text(encoding="utf-8")
        assert _cards(text) == cards, name
        assert re.search(r"action \d, advantage -?[\d.e+-]+, score -?[\d.e+-]+", text), name
        assert 'class="current"' in text, name
        _check_html(text)
    diagnosis = (run / "analyses" / "diagnosis_round_1.html").read_text(encoding="utf-8")
    assert diagnosis.count("<h1>") == 1 and "<h2>" not in diagnosis  # the page title is not repeated


def test_without_frames_the_pages_say_how_to_get_them(tmp_path, capsys):
    config = tiny_config(env="CartPole-v1", total_timesteps=64, n_steps=64, batch_size=32, save_buffers=True)
    run = PPO(config, run_dir=tmp_path / "run").learn().run.path
    assert cli.main(["diagnose", str(run), "--round", "0", "--bottom", "5", "--html"]) == 0
    assert HOW_TO_SAVE in capsys.readouterr().out
    text = (run / "analyses" / "diagnosis_round_0.html").read_text(encoding="utf-8")
    assert "--save-buffers --save-frames" in text and _cards(text) == 0


@pytest.mark.parametrize("flags, message", [
    (["--env", "CartPole-v1"], "--save-frames needs --save-buffers"),
    (["--env", "CountingChain-v0", "--save-buffers"], "CountingChain-v0 renders no rgb_array frames"),
])
def test_save_frames_needs_buffers_and_an_env_that_renders(tmp_path, capsys, flags, message):
    code = cli.main(["train", *flags, "--save-frames", "--total-timesteps", "64", "--run-root", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium not installed (apt-get install chromium)")
def test_frames_render_in_headless_chromium(cartpole_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cartpole_run, run)
    assert cli.main(["diagnose", str(run), "--round", "1", "--bottom", "2", "--html"]) == 0
    page = (run / "analyses" / "diagnosis_round_1.html").read_text(encoding="utf-8")
    # each frame's decoded and shown size
    frames = [s.split(":") for s in rendered_in_chromium(
        page, tmp_path, "document.querySelectorAll('figure.record img')",
        "i.complete + ':' + i.naturalWidth + ':' + i.getBoundingClientRect().width")]
    assert len(frames) >= 4 * (1 + 2)  # each of the 2 + 2 cards: its frame and a strip of at least 2
    assert all(done == "true" and int(width) == MAX_SIDE and float(shown) > 20 for done, width, shown in frames), frames


# -- RLHF: kept and dropped completions ----------------------------------------------------
def test_rlhf_report_shows_kept_and_dropped_completions_side_by_side(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    import torch

    from rlinfluence.rlhf import TINY_GPT2, RLHFConfig, RLHFTrainer
    from rlinfluence.rlhf.report import load_completions

    def vowel_reward(texts: list[str]) -> torch.Tensor:
        return torch.tensor([sum(c in "aeiou" for c in t) / max(len(t), 1) for t in texts])

    config = RLHFConfig(model=TINY_GPT2, filter="iif", rounds=1, prompts_per_round=6, response_length=5,
                        val_prompts=2, test_prompts=2, lora_r=2, lora_alpha=4, ppo_epochs=1, records_per_pass=6,
                        progress=False, tensorboard=False, run_root=str(tmp_path))
    prompts = ["You are such a", "hi", "Shut up, you", "That referee is a", "ok then", "Why are you"]
    trainer = RLHFTrainer(config, reward_fn=vowel_reward, train_prompts=prompts, val_prompts=prompts[:2],
                          test_prompts=prompts[4:]).learn()
    completions = load_completions(trainer.run.path, 0)
    assert len(completions) == 6 and completions["score"].notna().all()
    assert completions["kept"].tolist() == (completions["score"] >= 0).tolist()  # drop_mode neg
    assert torch.equal(torch.tensor(completions["score"].to_numpy(), dtype=torch.float32), trainer.last_scores)
    text = (trainer.run.path / "report.html").read_text(encoding="utf-8")
    _check_html(text)
    side_by_side = text[text.index('<div class="side-by-side">'):]
    n_kept = int(completions["kept"].sum())
    assert f"kept: {n_kept} of 6" in side_by_side and f"dropped: {6 - n_kept} of 6" in side_by_side
    assert side_by_side.count("<tr>") == 2 + 6  # two header rows, every completion once
    assert str(completions["prompt"].iloc[0]) in side_by_side


def test_rendering_frames_is_left_out_of_the_training_clocks(cartpole_run):
    """--save-frames renders every step; that time is logged as frames_seconds and not counted in
    train_seconds (the clock the speed comparisons read)."""
    import pandas as pd

    metrics = pd.read_csv(cartpole_run / "metrics.csv")
    assert (metrics["frames_seconds"] > 0).all()
    rounds = metrics["train_seconds"].diff().fillna(metrics["train_seconds"])
    stages = metrics[["collect_seconds", "filter_seconds", "update_seconds"]].sum(axis=1)
    assert ((rounds - stages).abs() < 0.05).all()  # training = the stages, rendering excluded
