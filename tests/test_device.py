"""``--device``: names checked without torch's help, CUDA asked for where there is none refused in
one line before anything is written, the CPU-only options refused on another device, ``auto``
on a CPU-only machine the same numbers as ``cpu``, and saved runs read on the CPU wherever they
trained. (On a machine with CUDA the GPU path itself runs; this suite has no GPU.)"""

from __future__ import annotations

import json

import pytest
import torch

from rlinfluence import PPO
from rlinfluence.checkpoint import load_round
from rlinfluence.cli import main
from rlinfluence.errors import UserError
from tests.conftest import TINY, tiny_config

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "CPU", ""])
def test_an_unknown_device_name_is_one_clear_error(name):
    with pytest.raises(UserError, match="unknown device"):
        tiny_config(device=name).validate()


@no_cuda
def test_cuda_without_cuda_is_one_line_and_writes_nothing(run_root, capsys):
    assert main(["train", "--env", "CartPole-v1", *TINY, "--device", "cuda", "--run-root", str(run_root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0]
    assert not run_root.exists() or not any(run_root.iterdir())


@pytest.mark.parametrize(("option", "message"), [
    (dict(filter="quarantine", n_envs=3), "--filter quarantine runs on the CPU only"),
    (dict(step_control="norm", filter="iif"), "--step-control runs on the CPU only"),
    (dict(filter="iif", drop_pct="auto"), "--drop-pct auto runs on the CPU only"),
    (dict(tracin=True, save_buffers=True), "--tracin runs on the CPU only"),
])
def test_cpu_only_options_are_refused_on_another_device(option, message):
    with pytest.raises(UserError, match=message):
        tiny_config(device="cuda", **option).validate()


@no_cuda
def test_auto_on_a_cpu_only_machine_trains_the_same_numbers_as_cpu(one_thread):
    states = []
    for device in ("cpu", "auto"):
        trainer = PPO(tiny_config(device=device, filter="iif"), run_dir=False).learn()
        assert trainer.device == torch.device("cpu")
        states.append(trainer.policy.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_saved_run_is_read_on_the_cpu_whatever_device_it_trained_on(run_root, one_thread):
    trainer = PPO(tiny_config(save_buffers=True, run_root=str(run_root))).learn()
    config_path = trainer.run.path / "config.json"
    config = json.loads(config_path.read_text())
    config["device"] = "cuda:0"  # as a run trained on a GPU machine says
    config_path.write_text(json.dumps(config))
    identity = json.loads((trainer.run.path / "run.json").read_text())
    (trainer.run.path / "run.json").write_text(json.dumps({**identity, "config": config}))
    saved = load_round(trainer.run.path, 1)
    assert saved.trainer.device == torch.device("cpu") and saved.trainer.config.device == "cpu"
    assert next(saved.trainer.policy.parameters()).device.type == "cpu"
