"""Issue 17: every bad input is one ``error:`` line with exit code 2 and no traceback, nothing is
left behind where nothing completed, numbers are checked where they enter, a corrupt latest
checkpoint is skipped on resume, and local compare workers die with their parent.

Commands run in-process through ``rlinfluence.cli.main`` (fast: no interpreter start-up per case).
"""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlinfluence import atomic
from rlinfluence.cli import main
from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO
from rlinfluence.rundir import load_checkpoint

from .conftest import TINY, only_run, overriding, tiny_config


class TextObservation(gym.Env):
    """A Text observation space (no vector a policy could take)."""

    observation_space = gym.spaces.Text(8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "start", {}

    def step(self, action):
        return "step", 0.0, False, False, {}


class ScheduledReward(gym.Env):
    """obs = [t / 100]; reward 1 for the first ``calm`` steps of an episode, then ``reward``."""

    observation_space = gym.spaces.Box(0.0, 10.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, reward: float = float("nan"), calm: int = 5):
        self.reward, self.calm = reward, calm

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        reward = 1.0 if self.t <= self.calm else self.reward
        return np.array([self.t / 100], np.float32), reward, False, False, {}


gym.register("TextObservation-v0", entry_point=TextObservation, max_episode_steps=20)
gym.register("NanReward-v0", entry_point=ScheduledReward, max_episode_steps=20)
# finite rewards, but returns so large that the value loss overflows float32 ...
gym.register("HugeReward-v0", entry_point=ScheduledReward, max_episode_steps=20,
             kwargs={"reward": 1e30})
# ... from the second round on (episodes of 400 steps, 128 steps per round)
gym.register("LateHugeReward-v0", entry_point=ScheduledReward, max_episode_steps=400,
             kwargs={"reward": 1e30, "calm": 150})


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_refused(capsys, args, *fragments) -> str:
    code, _, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]




# -- bad values: refused before anything is written -------------------------------------------
@pytest.mark.parametrize("args, fragments", [
    (["--seed", "-1"], ["seed", "-1"]),
    (["--seed", "5000000000"], ["seed", "5000000000"]),
    (["--adam-eps", "-1"], ["adam_eps", "-1"]),
    (["--eval-seed", "-1"], ["eval_seed", "-1"]),
    (["--hidden-sizes", "0"], ["hidden_sizes", "[0]"]),
    (["--vf-coef", "-1"], ["vf_coef", "-1"]),
    (["--ent-coef", "nan"], ["--ent-coef", "nan", "not a number"]),
    (["--learning-rate", "inf"], ["learning_rate", "inf"]),
    (["--method", "../../x"], ["method", "../../x"]),
    (["--method", ".."], ["method", ".."]),
    (["--eval-episodes", "-1"], ["eval_episodes", "-1"]),
    (["--env", "TextObservation-v0"], ["Text", "not supported", "Box", "Discrete", "Dict"]),
    (["--env", "NanReward-v0", "--filter", "iif"], ["round 0", "non-finite reward", "nan"]),
    (["--env", "HugeReward-v0"], ["round 0", "non-finite loss", "inf"]),
    (["--env", "Acrobot-v1", "--filter", "advantage"], ["--filter advantage", "continuous observations"]),
])
def test_train_refuses_and_leaves_no_directory(capsys, tmp_path, args, fragments):
    root = tmp_path / "runs"
    assert_refused(capsys, ["train", *overriding(TINY, args), "--run-root", root], *fragments)
    assert not root.exists() or not list(root.iterdir())


def test_nan_weights_stop_before_the_checkpoint_and_keep_the_last_good_one(capsys, tmp_path):
    root = tmp_path / "runs"
    line = assert_refused(capsys, ["train", *TINY, "--env", "LateHugeReward-v0", "--run-root", root],
                          "round 1", "non-finite loss", "1 completed rounds are kept", "--resume")
    run_dir = only_run(root)
    assert str(run_dir) in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["round_0000.pt", "round_0001.pt"]
    state = load_checkpoint(run_dir / "checkpoints" / "round_0001.pt")
    assert all(torch.isfinite(v).all() for v in state["policy"].values())
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 2  # header + round 0


def test_library_nan_reward_is_a_user_error_before_the_update():
    trainer = PPO(tiny_config(env="NanReward-v0"), run_dir=False)
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    with pytest.raises(UserError, match="non-finite reward"):
        trainer.train_round()
    torch.testing.assert_close(trainer.policy.state_dict(), before)


@pytest.mark.parametrize("args, fragments", [
    (["--seeds", "0"], ["--seeds", "0"]),
    (["--workers", "0"], ["--workers", "0"]),
    (["--smooth", "-3"], ["--smooth", "-3"]),
    (["--set", "n_steps=abc"], ["n_steps=abc", "int"]),
    (["--methods", "ppo,iif@hidden_sizes=0"], ["hidden_sizes", "0"]),
])
def test_compare_refuses_before_anything_runs(capsys, tmp_path, args, fragments):
    out = tmp_path / "cmp"
    methods = [] if "--methods" in args else ["--methods", "ppo"]  # a list flag is given once
    assert_refused(capsys, ["compare", "--env", "CartPole-v1", *methods, "--out", out, *args], *fragments)
    assert not out.exists()


# -- files read back ------------------------------------------------------------------------
def _edit_checkpoint(path: Path, edit) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _edit_metrics(run_dir: Path, edit) -> None:
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    rows = edit(rows)
    with (run_dir / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["round"])
        writer.writeheader()
        writer.writerows(rows)


CORRUPTIONS = {
    "garbage": lambda p: p.write_bytes(b"\x00garbage"),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "missing round": lambda p: _edit_checkpoint(p, lambda s: s.pop("round")),
    "malformed RNG": lambda p: _edit_checkpoint(p, lambda s: s.update(generator=torch.zeros(3, dtype=torch.uint8))),
    "not a checkpoint": lambda p: torch.save({"policy": {}, "x": [1, 2]}, p),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_resume_skips_an_unusable_latest_checkpoint(capsys, run_copy, corruption):
    CORRUPTIONS[corruption](run_copy / "checkpoints" / "round_0002.pt")
    code, out, err = run(capsys, "train", "--resume", run_copy)
    assert code == 0, err
    assert "Traceback" not in err and "weights_only" not in err
    assert "round_0002.pt" in err and "resuming from round_0001.pt" in err
    assert "episodes restart" in out
    rounds = [int(r["round"]) for r in csv.DictReader((run_copy / "metrics.csv").open())]
    assert rounds == [0, 1]
    assert load_checkpoint(run_copy / "checkpoints" / "round_0002.pt")["round"] == 2


def test_resume_with_no_loadable_checkpoint(capsys, run_copy):
    for path in (run_copy / "checkpoints").iterdir():
        path.write_bytes(b"")
    line = assert_refused(capsys, ["train", "--resume", run_copy], "no checkpoint", "loads", "round_0002.pt")
    assert "weights_only" not in line


def _set_config(run_dir: Path, **values) -> None:
    """config.json edited in a run from before run ids (no run.json, which would refuse any edit:
    tests/test_run_identity.py): the config's own checks must catch the values."""
    (run_dir / "run.json").unlink()
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, **values}))


@pytest.mark.parametrize("damage, fragments", [
    (lambda r: _set_config(r, n_steps="abc"), ["config.json", "n_steps=abc", "int"]),
    (lambda r: _set_config(r, hidden_sizes=[64, "x"]), ["config.json", "hidden_sizes"]),
    (lambda r: _set_config(r, optimizer="rmsprop"), ["config.json", "optimizer=rmsprop"]),
    (lambda r: (r / "config.json").write_text("[1, 2]"), ["config.json", "not a JSON object"]),
    (lambda r: (r / "metrics.csv").write_bytes(b"\xff\xfe\x00garbage\n\x00\x01"), ["metrics.csv"]),
    (lambda r: _edit_metrics(r, lambda rows: [{**rows[0], "value_loss": "abc"}, rows[1]]),
     ["metrics.csv", "line 2", "value_loss", "abc"]),
    (lambda r: (r / "metrics.csv").unlink(), ["metrics.csv", "rows missing for rounds 0..1"]),
    (lambda r: _edit_metrics(r, lambda rows: [rows[0], rows[1], rows[1]]), ["metrics.csv", "line 4", "round 1 has a row already"]),
    (lambda r: _edit_metrics(r, lambda rows: rows[1:]), ["metrics.csv", "rows missing for rounds 0"]),
])
def test_resume_refuses_damaged_run_files(capsys, run_copy, damage, fragments):
    damage(run_copy)
    before = sorted(p.name for p in run_copy.rglob("*"))
    assert_refused(capsys, ["train", "--resume", run_copy], *fragments)
    assert sorted(p.name for p in run_copy.rglob("*")) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_resume_into_a_read_only_run_directory(capsys, run_copy):
    os.chmod(run_copy, 0o555)
    try:
        assert_refused(capsys, ["train", "--resume", run_copy], "not writable", str(run_copy))
    finally:
        os.chmod(run_copy, 0o755)


def test_full_disk_names_the_file_and_the_run_resumes_afterwards(capsys, tmp_path, monkeypatch):
    fsync = atomic._fsync

    def full_at_round_2(path):
        if path.name.startswith(".round_0002.pt.") and path.name.endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(path)

    monkeypatch.setattr(atomic, "_fsync", full_at_round_2)
    root = tmp_path / "runs"
    line = assert_refused(capsys, ["train", *TINY, "--run-root", root],
                          "cannot write", "round_0002.pt", "No space left on device", "--resume")
    run_dir = only_run(root)
    assert str(run_dir) in line and not list(run_dir.rglob(".*.tmp"))
    monkeypatch.setattr(atomic, "_fsync", fsync)
    assert run(capsys, "train", "--resume", run_dir)[0] == 0
    assert (run_dir / "checkpoints" / "round_0002.pt").is_file()


def _damage_buffer(path: Path, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()  # the run's id: a damaged file of this run, not a foreign one
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("damage, fragments", [
    (lambda p: p.write_bytes(b"\x00garbage"), ["cannot read buffer", "round_0001.safetensors"]),
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), ["cannot read buffer"]),
    (lambda p: _damage_buffer(p, lambda t: t.update(obs=t["obs"][:, :2].contiguous())),
     ["does not fit env CartPole-v1", "obs", "(2,)", "(4,)"]),
    (lambda p: _damage_buffer(p, lambda t: t.update(rewards=t["rewards"][:5].contiguous())),
     ["rewards has 5 records", "128"]),
    (lambda p: _damage_buffer(p, lambda t: t.pop("advantages")), ["lacks advantages"]),
    (lambda p: shutil.copy(p.with_name("round_0000.safetensors"), p), ["holds round 0, not 1"]),
])
def test_attribute_refuses_damaged_buffers(capsys, run_copy, damage, fragments):
    damage(run_copy / "buffers" / "round_0001.safetensors")
    assert_refused(capsys, ["attribute", run_copy, "--round", "1"], *fragments)
    assert not list(run_copy.glob("attribution_round_*"))


@pytest.mark.parametrize("damage, fragments", [
    (lambda r: (r / "metrics.csv").write_text("round,eval_return_mean\n0,abc\n"), ["line 2", "abc"]),
    (lambda r: (r / "metrics.csv").write_text("just some text\nwithout,columns,at,all\n"), ["'round'"]),
    (lambda r: _edit_metrics(r, lambda rows: [{k: v for k, v in row.items() if k != "eval_return_mean"}
                                              for row in rows]), ["eval_return_mean"]),
])
def test_report_refuses_damaged_metrics(capsys, run_copy, damage, fragments):
    damage(run_copy)
    assert_refused(capsys, ["report", run_copy, "--score-rounds", "0"], "metrics.csv", *fragments)
    assert not (run_copy / "report.html").exists()


# -- command-line values ----------------------------------------------------------------------
@pytest.mark.parametrize("command, fragments", [
    (["attribute", "{run}", "--round", "1", "--top", "-1"], ["--top", "-1"]),
    (["attribute", "{run}", "--round", "1", "--out", "{tmp}"], ["--out", "is a directory"]),
    (["attribute", "{run}", "--round", "1", "--out", "{file}/x.parquet"], ["is a file", "not a directory"]),
    (["report", "{run}", "--out", "{tmp}"], ["--out", "is a directory"]),
    (["report", "{run}", "--out", "{file}/sub/r.html"], ["is a file", "not a directory"]),
    (["timeline", "{run}", "--state", "nan", "0", "0", "0"], ["--state", "nan", "not a number"]),
    (["timeline", "{run}", "--state-index", "3", "--top", "0"], ["--top", "0"]),
    (["intervene"], ["at least one RUN_DIR"]),
    (["intervene", "{run}", "--eval-episodes", "0"], ["--eval-episodes", "0"]),
])
def test_analysis_commands_refuse_bad_values(capsys, run_copy, tmp_path, command, fragments):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    args = [a.format(run=run_copy, tmp=tmp_path, file=blocker) for a in command]
    before = sorted(p.name for p in run_copy.rglob("*"))
    assert_refused(capsys, args, *fragments)
    assert sorted(p.name for p in run_copy.rglob("*")) == before


# -- processes ------------------------------------------------------------------------------
PARENT = textwrap.dedent("""
    import sys
    from rlinfluence.experiments.execution import run_jobs
    from tests.conftest import tiny_config

    root = sys.argv[1]
    jobs = [(tiny_config(seed=s, total_timesteps=10**8, save_checkpoints=False).to_dict(), f"{root}/pair{s}") for s in (1, 2)]
    run_jobs(jobs, workers=2, ray_address=None, on_done=print)
""")


def _workers(pid: int) -> list[int]:
    """Live (not zombie) pool workers of ``pid`` (multiprocessing's resource tracker excluded:
    it is no worker and ends by itself once every end of its pipe is closed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_compare_workers_die_with_their_parent(tmp_path):
    root = Path(__file__).resolve().parents[1]
    log = (tmp_path / "parent.log").open("w")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=root,
                              stdout=subprocess.DEVNULL, stderr=log)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pair{s}" / "metrics.csv").exists() for s in (1, 2)):
            assert parent.poll() is None, (tmp_path / "parent.log").read_text()
            assert time.monotonic() < deadline, "the pairs never started"
            time.sleep(0.2)
        workers += _workers(parent.pid)
        assert len(workers) == 2, workers
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "orphaned workers still running"
    finally:
        log.close()
        if parent.poll() is None:
            parent.kill()
        for w in filter(_alive, workers):
            os.kill(w, signal.SIGKILL)


def test_iif_whose_guard_keeps_every_record_says_it_is_plain_ppo():
    with pytest.warns(UserWarning, match="keeps every record .* this run is plain PPO"):
        tiny_config(filter="iif", n_steps=64, batch_size=64).validate()


def test_a_run_killed_before_its_config_was_written_says_so_on_resume(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # created, then killed
    assert_refused(capsys, ["train", "--resume", tmp_path / "run"], "no config.json", "no round ran")
