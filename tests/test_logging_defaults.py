"""Logs for batch jobs and dashboards (per-round lines, TensorBoard tags, W&B), ``--version``,
one default normalisation in every entry point, attribution files that say how they were made,
and typed command-line lists (issue 16)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
import time
from importlib.metadata import version

import pyarrow.parquet as pq
import pytest
import torch

import rlinfluence.influence as influence
from rlinfluence import cli
from rlinfluence.analysis import diagnosis, intervention, timeline
from rlinfluence.analysis.validation import score_round
from rlinfluence.checkpoint import load_round
from rlinfluence.filters import FilterContext, InfluenceScorer
from rlinfluence.influence import DEFAULT_ADVANTAGE_NORM, ReturnTarget
from rlinfluence.ppo import PPO, PPOConfig
from tests.conftest import tiny_config

TINY = ["--total-timesteps", "256", "--n-steps", "128", "--batch-size", "32", "--n-epochs", "2",
        "--eval-episodes", "2", "--eval-envs", "2"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 2-round standard PPO run on CartPole with saved buffers."""
    root = tmp_path_factory.mktemp("runs")
    return PPO(tiny_config(save_buffers=True, run_root=str(root))).learn().run.path


@pytest.fixture
def run_copy(saved_run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(saved_run, path)
    return path


# -- logs ---------------------------------------------------------------------------------------
def test_a_batch_job_prints_one_line_per_round_as_each_round_ends(tmp_path):
    command = [sys.executable, "-m", "rlinfluence.cli", "train", "--total-timesteps", "512", *TINY[2:],
               "--run-root", str(tmp_path)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, running = [], []
    for line in process.stderr:  # stderr is a pipe, not a terminal: plain lines, no bar
        if "round " in line:
            lines.append(line.strip())
            running.append(process.poll() is None)
    assert process.wait(timeout=300) == 0
    assert len(lines) == 4 and running[0], lines  # the first round's line came while training went on
    for k, line in enumerate(lines):
        assert line.startswith(f"CartPole-v1 [{k + 1}/4] | round {k} | env_steps {128 * (k + 1)} | train ")
        assert re.search(r"\| train \d+\.\d s \| eval_return \S+ \(\d+\.\d s\) \|", line), line
        assert "| kept_fraction 1.000 |" in line and line.endswith(" s")


def test_tensorboard_files_filter_statistics_under_filter_and_the_rest_elsewhere(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = PPO(tiny_config(filter="iif", tensorboard=True, run_root=str(tmp_path))).learn().run.path
    events = EventAccumulator(str(run), size_guidance={"histograms": 0})  # 0: keep every event
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"charts/eval_return_mean", "charts/kept_fraction", "charts/train_episodes", "charts/n_updates",
            "charts/step_scale", "losses/approx_kl", "time/train_seconds", "time/scoring_seconds",
            "filter/n_negative", "filter/score_mean", "filter/minibatch_guard"} <= scalars
    filter_stats = {"skipped", "n_negative", "score_mean", "score_std", "minibatch_guard"}
    assert {tag for tag in scalars if tag.startswith("filter/")} == {f"filter/{k}" for k in filter_stats}
    assert events.Tags()["histograms"] == ["filter/scores"]
    assert len(events.Histograms("filter/scores")) == 2  # one per round
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_wandb_offline_writes_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    (tmp_path / "wandb_dir").mkdir()
    assert cli.main(["train", *TINY, "--no-progress", "--wandb", "--run-root", str(tmp_path / "runs")]) == 0
    (run,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb"))
    (run_dir,) = (tmp_path / "runs").iterdir()
    run_id = (run_dir / "wandb_id").read_text()
    assert run.name.endswith(run_id)
    # a resumed (here: extended) run continues the same W&B run id
    assert cli.main(["train", "--resume", str(run_dir), "--total-timesteps", "384"]) == 0
    assert (run_dir / "wandb_id").read_text() == run_id
    # W&B writes each session of the run to its own folder, offline-run-<time>-<id>[-n]
    assert sum(run_id in p.name for p in (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*")) == 2
    capsys.readouterr()

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    assert cli.main(["train", *TINY, "--wandb", "--run-root", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --wandb needs Weights & Biases: "
                                               "pip install 'rlinfluence[wandb]'")
    assert not (tmp_path / "none").exists()


def test_version():
    out = subprocess.run([sys.executable, "-m", "rlinfluence.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"rlinfluence {version('rlinfluence')}"


# -- one default normalisation ------------------------------------------------------------------
def test_every_entry_point_scores_a_round_as_iif_does(run_copy, monkeypatch, capsys):
    saved = load_round(run_copy, 1)
    policy, buffer, cfg = saved.trainer.policy, saved.buffer, saved.trainer.config
    # IIF's scorer: chunks of batch_size records of a random permutation (a fresh filter with
    # seed s draws chunk_permutation(N, s) first)
    iif = InfluenceScorer(seed=0).scores(buffer, FilterContext(policy, 1, cfg.batch_size))
    defaults = [PPOConfig().advantage_norm, PPOConfig.for_env("LunarLander-v3").advantage_norm,
                *(args.advantage_norm for args in (cli.AttributeArgs, cli.DiagnoseArgs,
                                                               cli.TimelineArgs, cli.InterveneArgs)),
                *cli.ValidateArgs.advantage_norm]
    assert set(defaults) == {"chunk"} == {DEFAULT_ADVANTAGE_NORM}

    calls, iif_norms = [], []  # what the commands score with
    original = influence.score_buffer

    def spy(policy, buffer, **kwargs):
        scores = original(policy, buffer, **kwargs)
        calls.append((buffer.round, kwargs, scores))
        return scores

    class RecordingIIF(intervention.IIFFilter):
        def __init__(self, *args, **kwargs):
            iif_norms.append(kwargs.get("advantage_norm"))
            super().__init__(*args, **kwargs)

    for module in (influence, diagnosis, timeline):  # the CLI and report look score_buffer up in influence
        monkeypatch.setattr(module, "score_buffer", spy)
    monkeypatch.setattr(intervention, "IIFFilter", RecordingIIF)
    run = str(run_copy)
    assert cli.main(["attribute", run, "--round", "1"]) == 0
    assert cli.main(["diagnose", run, "--round", "1", "--bottom", "5"]) == 0
    assert cli.main(["timeline", run, "--state-index", "3", "--state-round", "1", "--rounds", "1",
                     "--neighbours", "3"]) == 0
    assert cli.main(["report", run, "--score-rounds", "2"]) == 0
    assert cli.main(["intervene", run, "--rounds", "1", "--eval-episodes", "2"]) == 0
    capsys.readouterr()

    torch.testing.assert_close(original(policy, buffer, target=ReturnTarget(), chunk_size=cfg.batch_size), iif)
    table = pq.read_table(run_copy / "attribution_round_1_return_snapshot_chunk.parquet").to_pandas()
    torch.testing.assert_close(torch.as_tensor(table["score"].to_numpy()), iif.double())
    torch.testing.assert_close(score_round(saved, ReturnTarget(), f"snapshot/{cli.ValidateArgs.advantage_norm[0]}",
                                           cli.ValidateArgs.seed), iif)
    assert [k for k, _, _ in calls] == [1, 1, 1, 0, 1]  # attribute, diagnose, timeline, report (rounds 0, 1)
    for k, kwargs, scores in calls:
        assert kwargs.get("advantage_norm", DEFAULT_ADVANTAGE_NORM) == DEFAULT_ADVANTAGE_NORM
        assert kwargs["chunk_size"] == cfg.batch_size and "chunk_seed" not in kwargs
        if k == 1 and isinstance(kwargs["target"], ReturnTarget):
            torch.testing.assert_close(scores, iif)
    assert iif_norms == [DEFAULT_ADVANTAGE_NORM]


def test_the_sb3_adapter_defaults_to_the_same_normalisation():
    pytest.importorskip("stable_baselines3")
    from rlinfluence.integrations import sb3

    for function in (sb3.attribute, sb3.InfluenceFilterCallback):
        assert inspect.signature(function).parameters["advantage_norm"].default == DEFAULT_ADVANTAGE_NORM


# -- attribution files --------------------------------------------------------------------------
def test_attribution_files_record_how_they_were_made_and_do_not_overwrite_each_other(run_copy, capsys):
    run = str(run_copy)
    assert cli.main(["attribute", run, "--round", "1"]) == 0
    first = run_copy / "attribution_round_1_return_snapshot_chunk.parquet"
    before = first.read_bytes()
    time.sleep(0.01)
    assert cli.main(["attribute", run, "--round", "0", "--target", "action", "--state-index", "3",
                     "--mode", "full"]) == 0
    assert cli.main(["attribute", run, "--round", "1", "--advantage-norm", "batch"]) == 0
    capsys.readouterr()
    assert first.read_bytes() == before
    made = {path.name: json.loads(pq.read_schema(path).metadata[b"rlinfluence"])
            for path in run_copy.glob("attribution_round_*.parquet")}
    assert made == {
        first.name: {"run": "run", "round": 1, "target": "return", "state_index": None, "mode": "snapshot",
                     "advantage_norm": "chunk", "chunk_size": 32},
        "attribution_round_0_action3_full.parquet": {
            "run": "run", "round": 0, "target": "action", "state_index": 3, "mode": "full",
            "advantage_norm": "minibatch", "chunk_size": 32},
        "attribution_round_1_return_snapshot_batch.parquet": {
            "run": "run", "round": 1, "target": "return", "state_index": None, "mode": "snapshot",
            "advantage_norm": "batch", "chunk_size": 32},
    }


# -- typed lists --------------------------------------------------------------------------------
def test_round_lists_are_typed_and_checked_before_anything_runs(tmp_path, capsys):
    assert cli._parse(["intervene", "a", "b", "--rounds", "20", "5,10", "5"]).rounds == (5, 10, 20)
    assert cli._parse(["validate", "a", "--round", "0,5"]).round == (0, 5)
    assert cli._parse(["compare", "--methods", "ppo", "iif@drop_pct=25,learning_rate=0.01"]).methods == (
        "ppo", "iif@drop_pct=25,learning_rate=0.01")
    missing = str(tmp_path / "missing")  # never opened: the command line is refused first
    for args, message in [
        (["intervene", missing, "--rounds", "5", "x"], "error: --rounds must be comma-separated or space-separated"),
        (["validate", missing, "--round", "-1"], "error: --round must be comma-separated or space-separated"),
        (["validate", missing, "--round", "1", "--mode", "snapshot", "fast"], "error: invalid choice 'fast'"),
        (["fly"], "error: unknown command 'fly' (commands: train, compare,"),
    ]:
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err


def test_the_progress_bar_keeps_its_bar_count_and_times_at_80_columns():
    import io

    from rich.console import Console

    from rlinfluence.progress import rich_progress

    bar = rich_progress(Console(file=io.StringIO(), width=80))
    task = bar.add_task("LunarLander-v3", total=150, completed=0, info="")
    bar.update(task, advance=75, info="round 74 | env_steps 153600 | eval_return -123.4 | kept_fraction 0.875")
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(bar.make_tasks_table(bar.tasks))
    line = console.file.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= 80
    assert "LunarLander-v3 \u2501" in line and "75/150" in line and "0:00:00" in line and "-:--:--" in line
    assert line.endswith("\u2026")  # the info is what gives way
