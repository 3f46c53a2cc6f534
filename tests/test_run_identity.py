"""A run's files prove they belong together, every saved value is checked before it is analysed,
and the option layer refuses what the parser would settle silently (the fourth reliability pass).

Each class plants its fault and asserts the one-line refusal (exit 2) and that nothing was written.
Commands run in-process through ``rlinfluence.cli.main``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlinfluence.cli import main
from rlinfluence.identity import ACCEPT_EDITED_CONFIG, RUN_FILE
from rlinfluence.rundir import load_checkpoint

from .conftest import TINY, only_run


def refused(capsys, *args: object) -> str:
    """The one error line of a refused command (after any progress lines it printed)."""
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    errors = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1 and err.strip().endswith(errors[0]), err
    return errors[0]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 2-round CartPole runs with saved buffers, seeds 1 and 2 (same shapes, other runs)."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (1, 2):
        assert main(["train", *TINY, "--save-buffers", "--seed", str(seed), "--run-root", str(root / str(seed))]) == 0
    return only_run(root / "1"), only_run(root / "2")


@pytest.fixture
def run(two_runs, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(two_runs[0], copy)
    return copy


def _nothing_written(run, before):
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_every_file_of_a_run_carries_its_id(two_runs):
    first, second = two_runs
    ids = [json.loads((r / RUN_FILE).read_text())["run_id"] for r in two_runs]
    assert ids[0] != ids[1] and len(ids[0]) == 32
    assert load_checkpoint(first / "checkpoints" / "round_0001.pt")["run_id"] == ids[0]
    from safetensors import safe_open

    with safe_open(str(first / "buffers" / "round_0001.safetensors"), framework="pt") as file:
        assert file.metadata()["run_id"] == ids[0]
    assert json.loads((first / RUN_FILE).read_text())["written_by"] == "rlinfluence train"


@pytest.mark.parametrize("folder, name", [("buffers", "round_0001.safetensors"), ("checkpoints", "round_0001.pt")])
def test_a_file_copied_from_another_run_is_refused(two_runs, run, capsys, folder, name):
    shutil.copy(two_runs[1] / folder / name, run / folder / name)  # same shapes: only the id tells
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    line = refused(capsys, "audit", run)
    assert "is not this run's" in line and name in line and "copied from another run" in line
    _nothing_written(run, before)
    assert "is not this run's" in refused(capsys, "validate", run, "--round", "1", "--subsets", "5")


def test_an_edited_config_is_refused_naming_the_field_or_read_with_a_warning_on_purpose(run, capsys, monkeypatch):
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "learning_rate": 0.5, "n_epochs": 7}))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    line = refused(capsys, "validate", run, "--round", "1", "--subsets", "5")
    assert "edited after the run" in line and "learning_rate 0.0003 -> 0.5" in line and "n_epochs 2 -> 7" in line
    _nothing_written(run, before)
    monkeypatch.setenv(ACCEPT_EDITED_CONFIG, "1")
    assert main(["attribute", str(run), "--round", "1"]) == 0
    assert "warning:" in capsys.readouterr().err


def test_a_run_written_by_another_trainer_is_not_resumed_by_ours(run, capsys):
    identity = json.loads((run / RUN_FILE).read_text())
    (run / RUN_FILE).write_text(json.dumps({**identity, "written_by": "stable-baselines3 (RunDirectoryCallback)"}))
    assert "not rlinfluence's trainer" in refused(capsys, "train", "--resume", run)


@pytest.mark.parametrize("name, value, fragment", [
    ("obs", float("nan"), "obs of record 5 is"),
    ("actions", 7.0, "outside the action space Discrete(2)"),
    ("advantages", 3e38, "beyond what the round's rewards and values allow"),
    ("rewards", float("inf"), "not finite"),
])
def test_a_saved_value_the_run_cannot_have_recorded_is_refused_by_every_reader(run, capsys, name, value, fragment):
    path = run / "buffers" / "round_0001.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
    tensors = load_file(str(path))
    tensors[name] = tensors[name].clone()
    tensors[name][5] = value
    save_file(tensors, str(path), metadata=metadata)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for command in (["audit", run], ["validate", run, "--round", "1", "--subsets", "5"], ["report", run],
                    ["attribute", run, "--round", "1"]):
        line = refused(capsys, *command)
        assert fragment in line and "round_0001.safetensors" in line, line
    _nothing_written(run, before)


@pytest.mark.parametrize("args, fragment", [
    (["train", "--env", "CartPole-v1", "--env", "Acrobot-v1"], "--env is given 2 times"),
    (["train", "--progress", "--no-progress"], "--progress is given 2 times"),
    (["train", "--seed=1", "--seed", "2"], "--seed is given 2 times"),
    (["train", "--method", "a\nb"], "holds a control character"),
    (["train", "--run-root", "runs\r"], "holds a control character"),
    (["explain", ".", "--threshold", "nan"], "--threshold nan: not a number"),
    (["train", *TINY, "--n-envs", "2", "--corrupt", "reward-flip:envs=1,from=2"], "past the run's last round (0)"),
    (["train", "--corrupt", "logp-mismatch:envs=1,temperature=1e-300"], "in [0.01, 100]"),
    (["rlhf", "--reward-workers", "4", "--broken-reward-workers", "1", "1"], "named 2 times"),
    (["train", "--total-timesteps", "10000000000000000"], "this run would write about"),
    (["train", "--n-envs", "4", "--n_envs", "2"], "--n-envs is given 2 times"),
    (["explain", ".", "--threshold", "inf"], "--threshold must be a finite number"),
    (["compare", "--env", "CartPole-v1", "--seeds", "1000000000000000000"], "at most 10000 seeds"),
    (["audit", ""], "RUN is empty"),
    (["audit", "/nonexistent"], "does not exist: not a run directory"),
])
def test_the_option_layer_refuses_what_the_parser_would_settle_silently(capsys, tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    assert fragment in refused(capsys, *args)
    assert not list(tmp_path.rglob("config.json"))  # nothing was written


def test_a_pickle_payload_and_a_truncated_checkpoint_say_what_they_are(tmp_path):
    import pickle

    from rlinfluence.rundir import CheckpointError

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / "pickle.pt").write_bytes(pickle.dumps({"policy": Payload()}))
    with pytest.raises(CheckpointError, match="weights-only load refused it: it holds a pickle"):
        load_checkpoint(tmp_path / "pickle.pt")
    torch.save({"policy": {"w": torch.zeros(64)}}, tmp_path / "good.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:700])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(tmp_path / "cut.pt")


def test_a_missing_rounds_buffer_names_the_rounds_that_are_saved(run, capsys):
    (run / "buffers" / "round_0001.safetensors").unlink()
    assert "(saved rounds: 0)" in refused(capsys, "attribute", run, "--round", "1")


def test_no_output_writes_over_a_runs_own_files(run, capsys, tmp_path):
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for out in (run / "config.json", run / "buffers" / "round_0000.safetensors", run / "metrics.csv"):
        assert "one of a run directory's own files" in refused(capsys, "attribute", run, "--round", "1", "--out", out)
    assert "one of a run directory's own files" in refused(capsys, "report", run, "--out", run / "metrics.csv")
    assert "is a run directory" in refused(capsys, "compare", "--env", "CartPole-v1", "--methods", "ppo", "--seeds", "1",
                                           "--rounds", "1", "--out", run)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_report_refuses_metrics_that_do_not_match_the_completed_rounds(run, capsys):
    metrics = run / "metrics.csv"
    header, *rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join([header, rows[1]]) + "\n")  # round 0's row gone
    assert "rows missing for rounds 0" in refused(capsys, "report", run)
    metrics.write_text("")
    assert "metrics.csv" in refused(capsys, "report", run)


def test_a_run_from_before_run_ids_with_an_edited_rollout_size_is_not_resumed(run, capsys):
    (run / "run.json").unlink()
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "n_steps": 64, "batch_size": 32}))
    assert "config.json's rounds are n_steps * n_envs = 64 steps" in refused(capsys, "train", "--resume", run,
                                                                             "--total-timesteps", "512")


def test_a_run_refused_before_its_first_round_leaves_no_folder_it_made(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "would write about" in refused(capsys, "train", "--total-timesteps", "10000000000000000")
    assert list(tmp_path.iterdir()) == []  # neither the run nor the runs/ folder it made
