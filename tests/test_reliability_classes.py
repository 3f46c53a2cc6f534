"""Reliability, second pass: each class of failure has one mechanism, tested on other instances
than the ones first reported. Every refusal is one line ``error: ...``, exit code 2, and nothing
is trained or written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from rlinfluence.cli import main

from .conftest import TINY
from .test_reliability import assert_refused


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# -- names from user input stay inside their folder -------------------------------------------
@pytest.mark.parametrize("name", ["../../escaped_out", "../escaped", "a/b", "..", "."])
def test_rlhf_method_names_cannot_leave_the_run_root(capsys, tmp_path, name):
    root = tmp_path / "inside" / "runs"
    assert_refused(capsys, ["rlhf", "--method", name, "--run-root", root, "--no-progress"], "method", repr(name))
    assert not (tmp_path / "inside").exists() and _files(tmp_path) == []


@pytest.mark.parametrize("key, figure", [("../../outside/secret", "x"), ("diagnosis", "../../outside/x")])
def test_the_report_embeds_no_file_outside_the_run(capsys, run_copy, tmp_path, key, figure):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret__x.png").write_bytes(b"\x89PNG secret")
    analyses = run_copy / "analyses"
    analyses.mkdir(exist_ok=True)
    (analyses / "evil.json").write_text(json.dumps({"key": key, "title": "t", "figures": {figure: "c"}}))
    assert_refused(capsys, ["report", run_copy, "--score-rounds", "0"], "outside")
    assert not (run_copy / "report.html").exists()


# -- what defines a run or a study cannot be mixed -------------------------------------------
def _tiny_compare(out: Path, *extra: str) -> list[str]:
    return ["compare", "--env", "CartPole-v1", "--methods", "ppo", "iif", "--seeds", "1", "--rounds", "1",
            "--eval-episodes", "1", "--set", "n_steps=64", "batch_size=32", "n_epochs=1", "eval_envs=1",
            "--workers", "1", "--no-progress", "--out", str(out), *extra]


@pytest.mark.parametrize("changed", [["--tune", "learning_rate=0.001,0.004", "--tune-seeds", "1"],
                                     ["--rounds", "2"], ["--methods", "ppo", "random"]])
def test_a_compare_folder_rerun_with_other_settings_is_refused_before_anything_runs(capsys, tmp_path, changed):
    out = tmp_path / "cmp"
    first = _tiny_compare(out, "--tune", "learning_rate=0.001,0.002", "--tune-seeds", "1")
    assert main(first) == 0
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    args = _tiny_compare(out, *changed)
    if changed[0] != "--tune":  # keep the original grid, change the other key
        args += ["--tune", "learning_rate=0.001,0.002", "--tune-seeds", "1"]
    assert_refused(capsys, args, "holds a comparison run with", "nothing was run")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("args, fragment", [
    (["train", "--filter", "iif-robust", "--drop-pct", "50"], "--filter iif-robust sets --drop-pct itself"),
    (["train", "--filter=iif-robust", "--drop-pct=12.5"], "--filter iif-robust sets --drop-pct itself"),
    (["compare", "--methods", "ppo", "iif-robust@drop_pct=50"], "iif-robust sets drop_pct=auto"),
    (["compare", "--methods", "ppo", "x=iif-robust@learning_rate=0.1,drop_pct=25"], "iif-robust sets drop_pct=auto"),
])
def test_iif_robust_with_its_own_option_set_is_refused_not_relabelled(capsys, tmp_path, args, fragment):
    assert_refused(capsys, [*args, "--run-root" if args[0] == "train" else "--out", tmp_path / "x"], fragment)
    assert not (tmp_path / "x").exists()


def test_a_saved_round_replaced_by_another_rounds_file_is_refused(capsys, trained, run_copy):
    buffers, checkpoints = run_copy / "buffers", run_copy / "checkpoints"
    shutil.copy(buffers / "round_0000.safetensors", buffers / "round_0001.safetensors")
    assert_refused(capsys, ["attribute", run_copy, "--round", "1"], "holds round 0, not 1")
    shutil.copy(trained / "buffers" / "round_0001.safetensors", buffers / "round_0001.safetensors")
    shutil.copy(checkpoints / "round_0000.pt", checkpoints / "round_0001.pt")
    assert_refused(capsys, ["attribute", run_copy, "--round", "1"], "holds theta(0), not theta(1)")


@pytest.mark.parametrize("key, value, fragment", [
    ("n_steps", 64, "has 128 steps x 1 envs, but the run's config.json says n_steps=64"),
    ("batch_size", 64, "minibatches of 32, but the run's config.json says batch_size=64"),
])
def test_a_config_edited_after_training_is_refused_by_every_reader(capsys, run_copy, key, value, fragment):
    config = json.loads((run_copy / "config.json").read_text())
    config[key] = value
    (run_copy / "config.json").write_text(json.dumps(config))
    assert_refused(capsys, ["attribute", run_copy, "--round", "1"], fragment, "was config.json edited?")


def test_a_filter_edited_into_the_config_before_resume_is_refused(capsys, run_copy):
    (run_copy / "checkpoints" / "round_0002.pt").unlink()
    config = json.loads((run_copy / "config.json").read_text())
    config["filter"] = "iif"
    (run_copy / "config.json").write_text(json.dumps(config))
    assert_refused(capsys, ["train", "--resume", run_copy], "was trained with the filter", "KeepAll")


@pytest.mark.parametrize("text", ['{"a": ' * 100000 + "1" + "}" * 100000, b"\xff\xfe{not utf-8", "[1, 2]"])
def test_an_unreadable_config_before_resume_is_one_line(capsys, run_copy, text):
    path = run_copy / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_refused(capsys, ["train", "--resume", run_copy], "config.json")


# -- aggregate's inputs and output ------------------------------------------------------------
@pytest.fixture(scope="module")
def compare_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("agg") / "cmp"
    assert main(_tiny_compare(out)) == 0
    return out


@pytest.mark.parametrize("damage, fragment", [
    (lambda f: (f / "scores.csv").write_bytes(b"\x00\xff\x00binary"), "scores.csv"),
    (lambda f: (f / "scores.csv").write_text(""), "scores.csv"),
    (lambda f: (f / "scores.csv").write_text("method,seed\nppo,1\n"), "has no column"),
    (lambda f: (f / "scores.csv").write_text("method,seed,reference,auc,final\nppo,1,ppo,abc,0.5\n"),
     "auc must be numeric, got 'abc'"),
    (lambda f: (f / "scores.csv").write_text("method,seed,reference,auc,final\niif,1,ppo,0.4,0.5\n"),
     "has no row of its reference 'ppo'"),
    (lambda f: (f / "compare.json").write_text("{not json"), "compare.json"),
    (lambda f: (f / "compare.json").write_text("{}"), "no env"),
    (lambda f: (f / "compare.json").write_text("[1, 2]"), "no env"),
])
def test_aggregate_refuses_damaged_folders(capsys, compare_folder, tmp_path, damage, fragment):
    folder = tmp_path / "cmp"
    shutil.copytree(compare_folder, folder)
    damage(folder)
    assert_refused(capsys, ["aggregate", folder, "--out", tmp_path / "agg"], fragment)
    assert not (tmp_path / "agg").exists()


def test_aggregate_checks_its_output_folder_first(capsys, compare_folder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_refused(capsys, ["aggregate", compare_folder, "--out", blocker], "is a file; give a folder")
    assert_refused(capsys, ["aggregate", compare_folder, "--out", blocker / "sub"], "is a file, not a directory")


@pytest.mark.parametrize("damage, fragment", [
    (lambda run: (run / "failed.json").write_text("garbage{"), "failed.json"),
    (lambda run: (run / "failed.json").write_text(""), "failed.json"),
    (lambda run: (run / "metrics.csv").write_bytes(b"\x00\xff binary \xfe"), "metrics.csv"),
    (lambda run: (run / "metrics.csv").write_text("round,eval_return_mean,train_seconds\n0,abc,1.0\n"),
     "not a number"),
])
def test_compare_refuses_damaged_pair_files_with_one_line(capsys, compare_folder, tmp_path, damage, fragment):
    folder = tmp_path / "cmp"
    shutil.copytree(compare_folder, folder)
    damage(folder / "iif__seed1")
    assert_refused(capsys, _tiny_compare(folder), fragment)


def test_a_stray_corrupt_tuning_table_is_one_line(capsys, compare_folder, tmp_path):
    folder = tmp_path / "cmp"
    shutil.copytree(compare_folder, folder)
    (folder / "tuning.csv").write_text("method,learning_rate\nppo,0.1\n")
    assert_refused(capsys, _tiny_compare(folder), "tuning.csv", "has no column")


def test_intervene_refuses_a_run_listed_twice_and_diagnose_a_negative_top(capsys, run_copy):
    assert_refused(capsys, ["intervene", run_copy, run_copy], "twice")
    assert_refused(capsys, ["intervene", run_copy, str(run_copy) + "/"], "twice")
    namesake = run_copy.parent / "elsewhere" / run_copy.name  # another run, the same folder name
    shutil.copytree(run_copy, namesake)
    assert_refused(capsys, ["intervene", run_copy, namesake], "share the folder name")
    assert_refused(capsys, ["diagnose", run_copy, "--round", "1", "--top", "-1"], "--top must be >= 1")


# -- sizes: refused up front with the limit ---------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["train", "--n-envs", "100000"], "n_envs must be <= 1024"),
    (["train", "--eval-envs", "5000"], "eval_envs must be <= 1024"),
    (["train", "--hidden-sizes", "100000", "100000"], "hidden_sizes must each be <= 8192"),
    (["train", "--n-steps", "1000000000", "--batch-size", "1000"], "at most 16777216 fit a round's buffer"),
    (["train", "--torch-threads", "100000"], "torch_threads must be <= 512"),
    (["compare", "--methods", "ppo", "--bootstrap-reps", "1000000000"], "--bootstrap-reps must be in [1, 1000000]"),
    (["compare", "--methods", "ppo", "--workers", "100000"], "--workers must be <= 256"),
    (["aggregate", "x", "--bootstrap-reps", "1000000000"], "--bootstrap-reps must be in [1, 1000000]"),
    (["rlhf", "--response-length", "100000"], "response_length must be <= 2048"),
])
def test_sizes_that_would_take_the_machine_down_are_refused(capsys, tmp_path, args, fragment):
    flag = {"train": "--run-root", "compare": "--out", "aggregate": "--out", "rlhf": "--run-root"}[args[0]]
    assert_refused(capsys, [*args, flag, tmp_path / "out"], fragment)
    assert not (tmp_path / "out").exists()


def test_validate_refuses_more_subsets_than_it_could_retrain(capsys, run_copy):
    assert_refused(capsys, ["validate", run_copy, "--round", "1", "--subsets", "1000000000000"], "--subsets must be <=")


def test_an_unreachable_ray_cluster_is_refused_in_seconds(capsys, tmp_path):
    pytest.importorskip("ray")
    assert_refused(capsys, _tiny_compare(tmp_path / "cmp", "--ray-address", "127.0.0.1:1"), "no Ray cluster answers")
    assert not (tmp_path / "cmp").exists()  # refused before its folder (and lock) exist


# -- one clear line instead of a traceback ----------------------------------------------------
@pytest.mark.parametrize("args, fragments", [
    (["--env", "Hopper-v4"], ["Hopper-v4 needs a package", "mujoco"]),
    (["--env", "phys2d/CartPole-v1"], ["needs the package 'jax'"]),
    (["--encoder", "cnn"], ["--encoder cnn needs an image observation", "(4,)"]),
])
def test_train_refuses_with_what_is_missing(capsys, tmp_path, args, fragments):
    assert_refused(capsys, ["train", *TINY, *args, "--run-root", tmp_path / "runs"], *fragments)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--seed", "-1"], "seed must be in [0, 2**32)"),
    (["--seed", str(2**40)], "seed must be in [0, 2**32)"),
    (["--vf-coef", "nan"], "vf_coef must be a finite number"),
    (["--init-kl-coef", "nan"], "init_kl_coef must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--kl-horizon", "inf"], "kl_horizon must be a finite number"),
])
def test_rlhf_refuses_values_numpy_would_trip_over(capsys, tmp_path, args, fragment):
    assert_refused(capsys, ["rlhf", *args, "--run-root", tmp_path / "runs"], fragment)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("prompt", [3, None, ""])
def test_a_prompt_that_is_not_text_is_refused(tmp_path, prompt):
    from rlinfluence.errors import UserError
    from rlinfluence.rlhf.data import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"split": "train", "prompt": "fine"}) + "\n"
                    + json.dumps({"split": "train", "prompt": prompt}) + "\n")
    with pytest.raises(UserError, match="line 2: 'prompt' must be a non-empty string"):
        load_prompts("train", path)


def test_online_wandb_without_a_key_is_refused_before_training(capsys, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert_refused(capsys, ["train", *TINY, "--wandb", "--run-root", tmp_path / "runs"], "no W&B key is set")
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("command", [["diagnose", "{run}", "--round", "1"], ["validate", "{run}", "--round", "1"],
                                     ["intervene", "{run}", "--rounds", "1"], ["audit", "{run}"]])
def test_an_analysis_of_a_read_only_run_is_refused_before_the_work(capsys, run_copy, command):
    os.chmod(run_copy, 0o555)
    try:
        assert_refused(capsys, [a.format(run=run_copy) for a in command], "is not writable")
    finally:
        os.chmod(run_copy, 0o755)


def test_the_damaged_pair_fixtures_are_what_compare_reads(compare_folder):
    # the folder the damage tests copy is a finished comparison (so each refusal is the damage's)
    assert (compare_folder / "summary.csv").is_file() and not pd.read_csv(compare_folder / "scores.csv").empty


def test_no_write_goes_through_a_planted_link(tmp_path, capsys):
    """A link planted at the old predictable temporary name is left alone (the temporary file is
    created exclusively under a random name), a link at the output itself is replaced, not written
    through, and an output folder that is a link is refused with one line, its target untouched."""
    from rlinfluence.errors import UserError
    from rlinfluence.rundir import atomic_write

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".sources.csv.tmp").symlink_to(victim)
    atomic_write(out / "sources.csv", lambda p: p.write_text("a,b\n"))
    assert (out / "sources.csv").read_text() == "a,b\n" and victim.read_text() == "keep me"
    (out / "report.html").symlink_to(victim)
    atomic_write(out / "report.html", lambda p: p.write_text("<html/>"))
    assert not (out / "report.html").is_symlink() and victim.read_text() == "keep me"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "audit").symlink_to(elsewhere)
    with pytest.raises(UserError, match="its folder is a link"):
        atomic_write(out / "audit" / "sources.csv", lambda p: p.write_text("x"))
    assert not any(elsewhere.iterdir())


def test_a_second_resume_of_a_running_run_is_refused(tmp_path, capsys):
    """While one process resumes a run (it holds the run's lock), a second `train --resume` of the
    same folder is one error line, exit 2, and leaves the run's logs as they were."""
    from rlinfluence.cli import main
    from rlinfluence.rundir import run_lock

    assert main(["train", "--env", "CartPole-v1", "--n-envs", "2", "--n-steps", "64", "--batch-size", "64",
                 "--total-timesteps", "256", "--eval-episodes", "2", "--run-root", str(tmp_path), "--no-progress",
                 "--no-tensorboard"]) == 0
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    metrics = (run / "metrics.csv").read_text()
    before = sorted(p.name for p in run.rglob("*"))
    with run_lock(run, "training"):  # the first resume, still running
        assert main(["train", "--resume", str(run), "--total-timesteps", "512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another training is running in" in err[0], err
    assert (run / "metrics.csv").read_text() == metrics and sorted(p.name for p in run.rglob("*")) == before
    assert main(["train", "--resume", str(run), "--total-timesteps", "512"]) == 0  # released: it resumes


def test_an_atomic_write_leaves_the_permissions_an_ordinary_write_gives(tmp_path):
    """mkstemp creates owner-only files: the output must not stay 0600 in a shared run folder."""
    import os

    from rlinfluence.rundir import atomic_write

    ordinary = tmp_path / "ordinary.txt"
    ordinary.write_text("x")
    atomic = tmp_path / "atomic.txt"
    atomic_write(atomic, lambda p: p.write_text("x"))
    assert os.stat(atomic).st_mode & 0o777 == os.stat(ordinary).st_mode & 0o777


def test_the_python_api_refuses_a_choice_the_command_line_would():
    """tyro checks a Literal option on the command line; PPOConfig built in Python must too."""
    import pytest

    from rlinfluence.errors import UserError
    from rlinfluence.ppo import PPO, PPOConfig

    for field, value in (("optimizer", "rmsprop"), ("scoring_target", "Trusted"), ("vec_env", "threads")):
        with pytest.raises(UserError, match=f"{field} must be one of"):
            PPO(PPOConfig(env="CartPole-v1", **{field: value}), run_dir=False)


def test_a_checkpoint_of_another_format_and_an_rlhf_config_with_an_unknown_choice_are_refused(tmp_path):
    """A checkpoint written by a newer layout is refused before anything is restored, not loaded
    in part; a resumed LM config.json with "algo": "bogus" does not train."""
    import pytest
    import torch

    from rlinfluence.errors import UserError
    from rlinfluence.ppo import PPO, PPOConfig
    from rlinfluence.rlhf.config import RLHFConfig
    from rlinfluence.rundir import CheckpointError

    trainer = PPO(PPOConfig(env="CartPole-v1", n_steps=64, batch_size=64, total_timesteps=64, eval_episodes=0,
                            progress=False), run_dir=False)
    path = tmp_path / "model.pt"
    trainer.save(path)
    assert PPO.load(path).round == 0
    state = torch.load(path, weights_only=True)
    torch.save({**state, "format": "rlinfluence-ppo-v9"}, path)
    with pytest.raises(CheckpointError, match="checkpoint format 'rlinfluence-ppo-v9'"):
        PPO.load(path)
    for field, value in (("algo", "bogus"), ("filter", "bogus")):
        with pytest.raises(UserError, match=f"{field} must be one of"):
            RLHFConfig(**{field: value}).validate()


def test_a_stray_copy_in_buffers_is_not_a_round(capsys, run_copy):
    """`round_0001 (copy).safetensors` beside the saved rounds: attribute, report and audit read
    the rounds and leave the copy out, instead of a traceback from parsing its name."""
    import shutil

    from rlinfluence import cli
    from rlinfluence.rundir import RunDirectory

    buffers = run_copy / "buffers"
    shutil.copy(buffers / "round_0001.safetensors", buffers / "round_0001 (copy).safetensors")
    assert RunDirectory.open_existing(run_copy, tensorboard=False).saved_buffer_rounds() == [0, 1]
    assert cli.main(["attribute", str(run_copy), "--round", "9"]) == 2
    assert "saved rounds: 0..1" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["audit", "analyses"])
def test_an_output_folder_that_is_a_file_is_refused_before_the_scoring(capsys, run_copy, folder):
    (run_copy / folder).write_text("not a folder")
    assert_refused(capsys, ["audit", run_copy], f"{folder}' is a file")
