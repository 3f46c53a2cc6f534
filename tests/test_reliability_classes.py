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
    """A one-seed, one-round comparison; a flag in ``extra`` replaces the one given here (a list
    flag given twice is refused)."""
    base = ["--env", "CartPole-v1", "--methods", "ppo", "iif", "--seeds", "1", "--rounds", "1",
            "--eval-episodes", "1", "--set", "n_steps=64", "batch_size=32", "n_epochs=1", "eval_envs=1",
            "--workers", "1", "--no-progress", "--out", str(out)]
    replaced, kept, skipping = {a for a in extra if a.startswith("--")}, [], False
    for a in base:
        if a.startswith("--"):
            skipping = a in replaced
        if not skipping:
            kept.append(a)
    return ["compare", *kept, *extra]


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
@pytest.mark.parametrize("identity", [True, False])
def test_a_config_edited_after_training_is_refused_by_every_reader(capsys, run_copy, key, value, fragment, identity):
    """By the run's identity (run.json names the edit), and in a run from before run ids by the saved
    buffer's own shape and schedule."""
    if not identity:
        (run_copy / "run.json").unlink()
    config = json.loads((run_copy / "config.json").read_text())
    old, config[key] = config[key], value
    (run_copy / "config.json").write_text(json.dumps(config))
    for command in (["attribute", run_copy, "--round", "1"], ["audit", run_copy], ["validate", run_copy, "--round", "1"]):
        if identity:
            assert_refused(capsys, command, "edited after the run", f"{key} {old} -> {value}")
        else:
            assert_refused(capsys, command, fragment, "was config.json edited?")


def test_a_filter_edited_into_the_config_before_resume_is_refused(capsys, run_copy):
    (run_copy / "checkpoints" / "round_0002.pt").unlink()
    config = json.loads((run_copy / "config.json").read_text())
    config["filter"] = "iif"
    (run_copy / "config.json").write_text(json.dumps(config))
    assert_refused(capsys, ["train", "--resume", run_copy], 'edited after the run (filter "none" -> "iif")')
    (run_copy / "run.json").unlink()  # a run from before run ids: the checkpoint's filter still tells
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
    (lambda run: (run / "failed.json").write_text("[1, 2]"), "failed.json"),  # an empty one: no record (below)
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
    (["--vf-coef", "nan"], "--vf-coef nan: not a number"),
    (["--init-kl-coef", "nan"], "--init-kl-coef nan: not a number"),
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
    assert "saved rounds: 0..1)" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["audit", "analyses"])
def test_an_output_folder_that_is_a_file_is_refused_before_the_scoring(capsys, run_copy, folder):
    (run_copy / folder).write_text("not a folder")
    assert_refused(capsys, ["audit", run_copy], f"{folder}' is a file")


# -- third pass (issue 42): each class on other instances than the ones reported --------------
@pytest.mark.parametrize("args, flag", [
    (["train", "--env", "CartPole-v1", "--hidden-sizes", "8", "--hidden-sizes=16"], "--hidden-sizes"),
    (["compare", "--set", "n_steps=64", "--set", "batch_size=32"], "--set"),
    (["audit", "run", "--rounds", "0", "--rounds", "1"], "--rounds"),
])
def test_a_list_flag_given_twice_is_refused_not_cut_to_its_last_values(capsys, tmp_path, monkeypatch, args, flag):
    monkeypatch.chdir(tmp_path)
    assert_refused(capsys, args, flag, "2 times")
    assert _files(tmp_path) == []


def test_the_python_api_refuses_a_value_of_another_type_naming_the_field():
    """A string for a number, a float for an int, a string for a list: named, not a deep
    TypeError, and not truncated (seed=1.5 would train as seed 1)."""
    from rlinfluence.errors import UserError
    from rlinfluence.ppo import PPO, PPOConfig
    from rlinfluence.rlhf.config import RLHFConfig

    for field, value in (("batch_size", "64"), ("seed", 1.5), ("gamma", "0.99"), ("hidden_sizes", 64),
                         ("normalize_advantage", 1)):
        with pytest.raises(UserError, match=f"^{field} must be"):
            PPO(PPOConfig(env="CartPole-v1", **{field: value}), run_dir=False)
    for field, value in (("ppo_epochs", "2"), ("clip_range", "0.2"), ("seed", 2.5)):
        with pytest.raises(UserError, match=f"^{field} must be"):
            RLHFConfig(**{field: value}).validate()
    with pytest.raises(UserError, match="lora_target_modules must be a list of str"):
        RLHFConfig.from_dict({"lora_target_modules": "q_proj"}, "config.json").validate()


def test_the_python_api_names_the_bad_argument(trained):
    """Deep IndexErrors and TypeErrors become errors naming the argument and the bad value."""
    import torch

    from rlinfluence.checkpoint import load_round
    from rlinfluence.errors import UserError
    from rlinfluence.influence import ActionTarget, score_buffer
    from rlinfluence.integrations.sb3_audit import AuditCallback

    for bad in (1.0, "0", -1, None):
        with pytest.raises(UserError, match="round_index must be an int"):
            load_round(trained, bad)
    saved = load_round(trained, 0)
    policy, buffer = saved.trainer.policy, saved.buffer
    with pytest.raises(ValueError, match="buffer must be a RolloutBuffer"):
        score_buffer(policy, {"obs": buffer.flat("obs")})
    obs = buffer.flat("obs")[:2]
    for action, fragment in ((torch.tensor([0, 3]), "action 3 is out of range: the policy has 2 actions"),
                             (torch.tensor([0.5, 1.0]), "action 0.5 is not an action index"),
                             (torch.tensor([-2, 0]), "action -2 is negative")):
        with pytest.raises(ValueError, match=fragment):
            score_buffer(policy, buffer, target=ActionTarget(obs, action))
    with pytest.raises(ValueError, match="ActionTarget action must be a tensor or number, got str"):
        score_buffer(policy, buffer, target=ActionTarget(obs[0], "left"))
    with pytest.raises(ValueError, match="path must be the run folder"):
        AuditCallback(path=7)


def _study(path: Path, **changes) -> Path:
    """A compare.json as a study writes it (nothing trained: the confirmation reads only it)."""
    study = {"env": "CartPole-v1", "methods": ["ppo"], "reference": "ppo", "rounds": 1, "drop_pct": None,
             "eval_episodes": 1, "set": ["n_steps=64", "batch_size=32"], "corrupt": [], "first_seed": 4, "seeds": 1,
             "tune_first_seed": 1001, "tune_seeds": 2, "tune": [], "chosen": {"ppo": {}}, **changes}
    path.write_text(json.dumps(study))
    return path


def test_a_confirmation_of_a_confirmation_keeps_off_every_earlier_studys_seeds(tmp_path):
    from rlinfluence.errors import UserError
    from rlinfluence.experiments.comparison import confirmation_config
    from rlinfluence.experiments.specs import CompareConfig

    # a confirmation (seed 4) of a study that evaluated on seeds 1-2 and tuned on 7-8
    confirmation = _study(tmp_path / "c.json", confirms={"study": "s", "study_seeds": [1, 2], "study_tune_seeds": [7, 8]})
    for first_seed in (2, 7):
        with pytest.raises(UserError, match=f"seed {first_seed} was used by the study or a study it confirms"):
            confirmation_config(CompareConfig(confirm=str(confirmation), first_seed=first_seed, seeds=1))
    _, _, record = confirmation_config(CompareConfig(confirm=str(confirmation), first_seed=5, seeds=1))
    assert record["seeds_used"] == [1, 2, 4, 7, 8]  # the next confirmation inherits them all
    third = _study(tmp_path / "third.json", first_seed=5, confirms=record)
    with pytest.raises(UserError, match="seed 8 was used"):
        confirmation_config(CompareConfig(confirm=str(third), first_seed=8, seeds=1))


@pytest.mark.parametrize("text, fragment", [
    ('"a string"', "it holds a str, not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "cannot read it"),
    (None, "'seeds' is '1'"),
    (None, "'chosen' must map each method"),
])
def test_a_malformed_study_to_confirm_is_one_line(capsys, tmp_path, text, fragment):
    path = tmp_path / "study.json"
    if text is not None:
        path.write_text(text)
    else:
        _study(path, **({"seeds": "1"} if "seeds" in fragment else {"chosen": {"ppo": [1]}}))
    assert_refused(capsys, ["compare", "--confirm", path, "--first-seed", "9", "--out", tmp_path / "out"], fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [["--methods", "ppo", "random@eval_seed=5"], ["--tune", "eval_seed=3,4"]])
def test_no_method_of_a_comparison_is_evaluated_on_its_own_episodes(capsys, tmp_path, extra):
    assert_refused(capsys, _tiny_compare(tmp_path / "out", *extra), "eval_seed")
    assert not (tmp_path / "out").exists()


def test_a_refused_comparison_leaves_nothing_that_refuses_the_corrected_rerun(capsys, tmp_path, monkeypatch):
    """Refused by an env check (an obs-bug swap on a one-feature observation), or later, after
    compare.json was written: no folder of its own left, and no compare.json in a given one."""
    from rlinfluence.errors import UserError
    from rlinfluence.experiments import comparison

    out = tmp_path / "new"
    assert_refused(capsys, ["compare", "--env", "CountingChain-v0", "--methods", "ppo", "--seeds", "1", "--rounds", "1",
                            "--set", "n_steps=8", "batch_size=8", "n_envs=2", "--corrupt", "obs-bug:envs=1,mode=swap",
                            "--workers", "1", "--no-progress", "--out", out], "swap needs 2")
    assert not out.exists()

    def refused(*args, **kwargs):
        raise UserError("refused by a pair")

    given = tmp_path / "given"
    given.mkdir()
    with monkeypatch.context() as m:
        m.setattr(comparison, "_run", refused)
        assert_refused(capsys, _tiny_compare(out), "refused by a pair")
        assert_refused(capsys, _tiny_compare(given), "refused by a pair")
    assert not out.exists() and not (given / "compare.json").exists()
    assert main(_tiny_compare(given, "--rounds", "2")) == 0  # the corrected rerun runs


def test_an_empty_failure_record_left_by_a_full_disk_does_not_block_the_rerun(capsys, compare_folder, tmp_path):
    """A 0-byte failed.json (an earlier version's write on a full disk) is no end: that pair runs
    again, and the comparison completes (failed.json is now written whole or not at all)."""
    from rlinfluence.experiments.execution import failure, finished

    folder = tmp_path / "cmp"
    shutil.copytree(compare_folder, folder)
    pair = folder / "iif__seed1"
    (pair / "done.json").unlink()
    (pair / "failed.json").write_text("")
    assert not finished(pair) and failure(pair) is None
    assert main(_tiny_compare(folder)) == 0
    assert finished(pair) and failure(pair) is None and (pair / "done.json").stat().st_size > 0


@pytest.mark.parametrize("tables, fragment", [
    ({0: {"influence": 1.0}, 1: {}}, "hold different score columns"),
    ({0: {}, 1: {}}, "hold no harm column"),
])
def test_user_score_tables_that_would_be_misread_are_refused(capsys, tmp_path, tables, fragment):
    run = tmp_path / "run"
    (run / "audit" / "scores").mkdir(parents=True)
    for k, scores in tables.items():
        table = pd.DataFrame({"round": k, "source": [0, 1, 2] * 4, "episode": k, "step": range(12), "trusted": False})
        table.assign(**scores, dtv=0.5).drop(columns=[] if scores else ["dtv"]).to_parquet(
            run / "audit" / "scores" / f"round_{k:06d}.parquet", index=False)
    assert_refused(capsys, ["audit", run, "--no-progress"], fragment)
    assert not (run / "audit" / "sources.csv").exists()


def test_ctrl_c_during_a_local_pool_prints_no_worker_traceback(tmp_path):
    """Ctrl-C reaches the whole process group: the workers leave it to the parent, which stops them."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import time; from rlinfluence.executor import run_calls; "
            "print('started', flush=True); run_calls(time.sleep, [(60,), (60,)], 2, None)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stdout.readline().strip() == "started"
    time.sleep(4)  # the workers are up (spawned, imported) and sleeping
    started = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert time.monotonic() - started < 30  # the sleeping calls were stopped, not waited for
    assert err.count("Traceback") <= 1 and "spawn_main" not in err and "multiprocessing/pool" not in err, err


def test_rlhf_prompts_that_are_not_utf8_or_too_long_are_one_line(tmp_path):
    import torch

    from rlinfluence.errors import UserError
    from rlinfluence.rlhf import TINY_GPT2, RLHFConfig, RLHFTrainer, load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"split": "train", "prompt": "ok"}\n{"split": "train", "prompt": "na\xefve"}\n')
    with pytest.raises(UserError, match=r"not UTF-8 text \(line 2"):
        load_prompts("train", path)
    config = RLHFConfig(model=TINY_GPT2, rounds=1, prompts_per_round=2, response_length=4, test_prompts=1, lora_r=4,
                        progress=False, tensorboard=False, run_root=str(tmp_path / "runs"))
    with pytest.raises(UserError, match="test prompt 0 .* exceeds the model's context of 256 tokens"):
        RLHFTrainer(config, reward_fn=lambda texts: torch.zeros(len(texts)), train_prompts=["hi", "yo"],
                    val_prompts=["hi"], test_prompts=["ab " * 200])
    assert not (tmp_path / "runs").exists()


def test_a_saved_round_missing_a_key_the_reader_needs_is_one_line(capsys, run_copy):
    from safetensors.torch import load_file, save_file

    path = run_copy / "buffers" / "round_0001.safetensors"
    for key in ("final_values", "schedule_lr"):
        tensors = load_file(str(path))
        save_file({k: v for k, v in tensors.items() if k != key}, str(path))
        assert_refused(capsys, ["attribute", run_copy, "--round", "1"], "lacks", key)
        save_file(tensors, str(path))


@pytest.mark.parametrize("folder", ["buffers", "analyses"])
def test_a_resume_through_a_planted_folder_link_is_refused_before_training(capsys, run_copy, tmp_path, folder):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if (run_copy / folder).exists():
        shutil.rmtree(run_copy / folder)
    (run_copy / folder).symlink_to(elsewhere)
    metrics = (run_copy / "metrics.csv").read_text()
    assert_refused(capsys, ["train", "--resume", run_copy, "--total-timesteps", "384"], f"{folder}' is a link")
    assert not any(elsewhere.iterdir()) and (run_copy / "metrics.csv").read_text() == metrics


def test_files_written_together_are_all_or_none(tmp_path):
    """A full disk on the second of a table and its section: neither is replaced, no temporary left."""
    import errno

    from rlinfluence.atomic import atomic_write_all
    from rlinfluence.errors import UserError

    (tmp_path / "table.parquet").write_text("old table")

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="section.json'?: No space left"):
        atomic_write_all([(tmp_path / "table.parquet", lambda p: p.write_text("new")), (tmp_path / "section.json", full)])
    assert _files(tmp_path) == ["table.parquet"] and (tmp_path / "table.parquet").read_text() == "old table"


def test_a_compare_pair_folder_that_is_a_link_is_one_line(capsys, compare_folder, tmp_path):
    folder = tmp_path / "cmp"
    shutil.copytree(compare_folder, folder)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder / "iif__seed1", elsewhere)
    (folder / "iif__seed1").symlink_to(elsewhere)
    before = _files(elsewhere)
    assert_refused(capsys, _tiny_compare(folder), "iif__seed1' is a link")
    assert _files(elsewhere) == before and (folder / "compare.json").is_file()
