"""The command line, run as a user runs it: a subprocess of the installed console script (tests that
run many commands call it in-process, ``cli``, with the same exit status and output)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--total-timesteps", "256", "--n-steps", "128", "--batch-size", "32", "--n-epochs", "2",
        "--eval-episodes", "2", "--eval-envs", "2", "--no-progress"]


def rlinfluence(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "rlinfluence.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def cli(capsys):
    """A command run in-process (``rlinfluence.cli.main``): the exit status and output the console
    script gives, without an interpreter start-up per call (for the tests that run many commands)."""
    from rlinfluence.cli import main

    def run(*args):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def _run_dir(root):
    (path,) = list(root.iterdir())
    return path


@pytest.mark.parametrize("env", ["CartPole-v1", "Acrobot-v1"])
def test_train_writes_a_complete_run_directory(env, tmp_path):
    out = rlinfluence("train", "--env", env, *TINY, "--run-root", tmp_path)
    assert out.returncode == 0, out.stderr
    run = _run_dir(tmp_path)
    assert run.name.startswith(f"{env}__ppo__1__")
    config = json.loads((run / "config.json").read_text())
    assert config["env"] == env and config["total_timesteps"] == 256
    if env == "Acrobot-v1":  # preset values unless a flag overrides them
        assert config["optimizer"] == "sgd" and config["max_grad_norm"] is None
    header, *rows = (run / "metrics.csv").read_text().splitlines()
    for column in ("round", "env_steps", "train_seconds", "eval_return_mean", "eval_return_std",
                   "policy_loss", "value_loss", "approx_kl", "clip_fraction", "kept_fraction"):
        assert column in header.split(",")
    assert len(rows) == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round_0000.pt", "round_0001.pt", "round_0002.pt"]
    assert list(run.glob("events.out.tfevents.*"))
    assert not list(run.rglob(".*.tmp"))


def test_resume_from_the_cli(tmp_path, cli):
    assert cli("train", *TINY, "--run-root", tmp_path).returncode == 0
    run = _run_dir(tmp_path)
    (run / "checkpoints" / "round_0002.pt").unlink()  # as if killed during round 2
    out = cli("train", "--resume", run)
    assert out.returncode == 0, out.stderr
    assert len((run / "metrics.csv").read_text().splitlines()) == 3  # header + 2 rounds
    out = cli("train", "--resume", run)  # a finished run says so, and how to extend it
    assert out.returncode == 0 and "is complete: 2 rounds" in out.stdout and "--total-timesteps N" in out.stdout
    assert len((run / "metrics.csv").read_text().splitlines()) == 3
    out = cli("train", "--resume", run, "--total-timesteps", "384")  # rounds of 128 steps
    assert out.returncode == 0, out.stderr
    assert len((run / "metrics.csv").read_text().splitlines()) == 4  # a third round
    assert json.loads((run / "config.json").read_text())["total_timesteps"] == 384
    _assert_one_line_error(cli("train", "--resume", run, "--total-timesteps", "100"), "below the 384 env steps")
    _assert_one_line_error(cli("train", "--resume", run, "--n-epochs", "3"), "unexpected flags ['--n-epochs']")


def test_a_run_prints_its_directory_when_it_starts_and_ctrl_c_says_how_to_resume(tmp_path):
    import signal
    import time

    # A shell without job control starts background jobs with SIGINT ignored, and the child would
    # inherit that (`make test &` in a script): give it the default disposition a terminal gives.
    proc = subprocess.Popen([sys.executable, "-m", "rlinfluence.cli", "train", "--env", "CartPole-v1", "--n-steps",
                             "64", "--batch-size", "64", "--total-timesteps", "100000", "--eval-episodes", "1",
                             "--run-root", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.readline()
        assert first.startswith("run directory: "), first
        run = Path(first.split(": ", 1)[1].strip())
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "round_0002.pt").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "interrupted:" in err and f"rlinfluence train --resume {run}" in err


def _assert_one_line_error(out, *fragments):
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--env", "NoSuchEnv-v9"], ["unknown env id 'NoSuchEnv-v9'"]),
        (["--batch-size", "4096"], ["batch_size 4096", "2048"]),
        (["--n-steps", "16", "--batch-size", "64"], ["batch_size 64", "16"]),
        (["--learning-rate", "0"], ["learning_rate", "0.0"]),
        (["--learning-rate", "-0.001"], ["learning_rate", "-0.001"]),
        # the verdict compares each source with 2 others: 2 untrusted envs are refused before training
        (["--filter", "quarantine", "--n-envs", "3", "--trusted-envs", "1", "--n-steps", "64"],
         ["at least 3 untrusted envs", "n_envs 3 - trusted_envs 1"]),
    ],
)
def test_bad_config_is_one_error_line_and_writes_nothing(args, fragments, tmp_path):
    out = rlinfluence("train", *args, "--run-root", tmp_path / "runs")
    _assert_one_line_error(out, *fragments)
    assert not (tmp_path / "runs").exists()


def test_unwritable_run_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = rlinfluence("train", *TINY, "--run-root", blocker / "runs")
    _assert_one_line_error(out, "cannot create run directory", str(blocker))


def test_resume_with_corrupt_or_mismatched_checkpoint(tmp_path, cli):
    assert cli("train", *TINY, "--run-root", tmp_path / "runs").returncode == 0
    run = _run_dir(tmp_path / "runs")
    before = (run / "metrics.csv").read_text()

    corrupt = tmp_path / "corrupt"  # the newest checkpoint is skipped for the next older one
    shutil.copytree(run, corrupt)
    (corrupt / "checkpoints" / "round_0002.pt").write_bytes(b"\x00garbage")
    out = cli("train", "--resume", corrupt)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "cannot load checkpoint" in out.stderr and "resuming from round_0001.pt" in out.stderr
    assert "weights_only" not in out.stderr
    assert (corrupt / "metrics.csv").read_text().splitlines()[0] == before.splitlines()[0]

    mismatched = tmp_path / "mismatched"
    shutil.copytree(run, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["hidden_sizes"] = [32]
    (mismatched / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(cli("train", "--resume", mismatched), "edited after the run",
                           "hidden_sizes [64, 64] -> [32]")  # the run's identity holds the config it was made with
    assert (mismatched / "metrics.csv").read_text() == before

    _assert_one_line_error(cli("train", "--resume", tmp_path), "not a run directory")
    _assert_one_line_error(cli("train", "--resume", run, "--seed", "3"), "--resume")


def test_unknown_command():
    out = rlinfluence("fly")
    assert out.returncode == 2 and "unknown command 'fly'" in out.stderr


@pytest.mark.parametrize("args, fragments", [
    (["intervene", "RUN", "--rounds", "5", "x"], ["--rounds must be comma-separated or space-separated", "'5 x'"]),
    (["validate", "RUN", "--round", "1", "--mode", "fast"], ["invalid choice 'fast'", "--mode"]),
])
def test_a_command_line_tyro_rejects_is_one_error_line(args, fragments):
    _assert_one_line_error(rlinfluence(*args), *fragments)  # before RUN is even looked at


def test_attribute_a_saved_round(tmp_path, cli):
    import pandas as pd

    assert cli("train", *TINY, "--save-buffers", "--run-root", tmp_path).returncode == 0
    run = _run_dir(tmp_path)
    out = cli("attribute", run, "--round", "1", "--top", "3")
    assert out.returncode == 0, out.stderr
    assert "most harmful" in out.stdout
    table = pd.read_parquet(run / "attribution_round_1_return_snapshot_chunk.parquet")
    assert len(table) == 128 and sorted(table["rank"]) == list(range(1, 129))
    assert list(table.columns) == ["round", "env", "step", "episode", "obs_summary", "obs", "action", "reward",
                                   "advantage", "return", "corrupted", "score", "rank", "kept"]  # as the README lists them
    out = cli("attribute", run, "--round", "0", "--mode", "full", "--target", "action",
                      "--state-index", "3", "--out", tmp_path / "full.parquet")
    assert out.returncode == 0, out.stderr
    assert pd.read_parquet(tmp_path / "full.parquet")["score"].abs().sum() > 0
    _assert_one_line_error(cli("attribute", run, "--round", "9"), "no saved buffer for round 9", "saved rounds: 0..1)")
    _assert_one_line_error(cli("attribute", run, "--round", "1", "--target", "action"), "--state-index")


def test_a_filtered_runs_saved_rounds_keep_the_scores_it_dropped_by(tmp_path, cli):
    """IIF drops the lowest of its own scores (its chunk permutation, from its generator): the saved
    round carries them, every dropped record scores at most every kept negative one, and attribute's
    table has them beside its re-scoring."""
    import pandas as pd

    from rlinfluence.checkpoint import load_round

    assert cli("train", *TINY, "--save-buffers", "--filter", "iif", "--drop-pct", "20",
                       "--run-root", tmp_path).returncode == 0
    run = _run_dir(tmp_path)
    saved = load_round(run, 1)
    scores, keep = saved.filter_scores, saved.keep
    assert scores is not None and scores.shape == keep.shape and (~keep).sum() > 0
    assert scores[~keep].max() <= scores[keep & (scores < 0)].min()
    assert cli("attribute", run, "--round", "1").returncode == 0
    table = pd.read_parquet(run / "attribution_round_1_return_snapshot_chunk.parquet")
    assert table["filter_score"].tolist() == scores.tolist() and table["kept"].tolist() == keep.tolist()


def test_help_states_each_default_once(monkeypatch, capsys):
    from rlinfluence import cli

    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    for command in cli.COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code in (0, None)
        text = capsys.readouterr().out
        assert "(default: )" not in text, command
        flags: list[str] = []  # each flag's help, its wrapped lines joined
        for line in (raw.strip(" \u2502|") for raw in text.splitlines()):
            if line.startswith("-") or not flags:
                flags.append(line)
            else:
                flags[-1] += " " + line
        doubled = [flag for flag in flags if flag.count("(default") > 1]
        assert not doubled, (command, doubled)


def test_train_says_what_it_chose_and_its_help_names_every_corruption(monkeypatch, capsys, tmp_path):
    from rlinfluence import cli
    from rlinfluence.corruptions import KINDS

    assert cli.main(["train", "--env", "CartPole-v1", "--n-envs", "4", "--n-steps", "16", "--batch-size", "16",
                     "--total-timesteps", "128", "--eval-episodes", "0", "--device", "auto", "--corrupt",
                     "action-mismatch:envs=2,mode=actuator,from=1", "--run-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "device: cpu (--device auto)" in out
    assert re.search(r"--corrupt action-mismatch:envs=2,mode=actuator,from=1: breaks training envs \d, \d from round 1", out)
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    assert all(f"{kind}:" in text for kind in KINDS)
