import csv

import pytest
import torch

from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.rundir import load_checkpoint

from .conftest import tiny_config

WALL_CLOCK = ("train_seconds", "train_cpu_seconds", "collect_seconds", "filter_seconds", "update_seconds",
              "eval_seconds", "steps_per_second", "frames_seconds")


def _metrics(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in csv.DictReader(f)]


class KeepFirst:
    """Keeps the first ``n`` records in flat order."""

    name = "keep-first"

    def __init__(self, n):
        self.n = n

    def __call__(self, buffer, context):
        keep = torch.zeros(len(buffer), dtype=torch.bool)
        keep[: self.n] = True
        context.stats["kept_records"] = self.n
        return keep

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_keep_mask_sets_the_number_of_optimiser_steps_and_the_minibatches():
    cfg = tiny_config(total_timesteps=256, n_steps=256, batch_size=32, n_epochs=3, record_minibatches=True)
    trainer = PPO(cfg, filter=KeepFirst(100), run_dir=False)
    metrics = trainer.train_round()
    # floor(100 / 32) = 3 full minibatches per epoch; the remainder (4 records) is dropped
    assert metrics["n_updates"] == 9 == len(trainer.schedule)
    assert metrics["kept_fraction"] == pytest.approx(100 / 256)
    assert metrics["kept_records"] == 100
    for epoch in range(3):
        steps = [s for s in trainer.schedule if s.epoch == epoch]
        idx = torch.cat([s.indices for s in steps])
        assert len(idx) == 96 and len(set(idx.tolist())) == 96 and int(idx.max()) < 100
        assert all(len(s.indices) == 32 and s.lr == cfg.learning_rate for s in steps)
    epochs = [torch.cat([s.indices for s in trainer.schedule if s.epoch == e]) for e in range(3)]
    assert not torch.equal(epochs[0], epochs[1])  # a fresh permutation every epoch


def test_standard_round_uses_every_record_in_full_minibatches():
    cfg = tiny_config(n_steps=128, n_envs=2, batch_size=64, n_epochs=2)
    metrics = PPO(cfg, run_dir=False).train_round()
    assert metrics["n_updates"] == 2 * 256 // 64 and metrics["kept_fraction"] == 1.0
    assert metrics["env_steps"] == 256


def test_filter_keeping_less_than_a_minibatch_is_a_clear_error():
    trainer = PPO(tiny_config(), filter=KeepFirst(10), run_dir=False)
    with pytest.raises(UserError, match="kept 10 records, fewer than one minibatch"):
        trainer.train_round()


def test_same_seed_same_metrics(run_root):
    runs = [PPO(tiny_config(run_root=str(run_root / str(i)), total_timesteps=384)).learn().run.path for i in range(2)]
    first, second = _metrics(runs[0]), _metrics(runs[1])
    assert len(first) == 3 and first == second
    assert _metrics(PPO(tiny_config(run_root=str(run_root / "x"), seed=2, total_timesteps=384)).learn().run.path) != first


def test_resuming_a_run_of_a_custom_filter_without_it_is_refused(run_root):
    from rlinfluence.filters import KeepAll

    class EveryOther(KeepAll):
        def __call__(self, buffer, context):
            keep = torch.zeros(len(buffer), dtype=torch.bool)
            keep[::2] = True
            return keep

    trainer = PPO(tiny_config(run_root=str(run_root)), filter=EveryOther()).learn()
    with pytest.raises(UserError, match="was trained with the filter .*EveryOther.*pass it"):
        PPO.resume(trainer.run.path)  # would have continued silently as plain PPO
    assert PPO.resume(trainer.run.path, filter=EveryOther()).round == 2


def test_resume_continues_from_the_last_completed_round(run_root):
    trainer = PPO(tiny_config(run_root=str(run_root), total_timesteps=256)).learn()  # 2 rounds
    run_dir = trainer.run.path
    state = torch.load(run_dir / "checkpoints" / "round_0002.pt", weights_only=True)
    assert state["round"] == 2 and state["env_steps"] == 256

    resumed = PPO.resume(run_dir)
    assert resumed.round == 2
    with open(run_dir / "metrics.csv", newline="") as f:
        logged = float(list(csv.DictReader(f))[-1]["train_cpu_seconds"])
    assert 0 < resumed.train_cpu_seconds == state["train_cpu_seconds"] == pytest.approx(logged)
    torch.testing.assert_close(resumed.policy.state_dict(), trainer.policy.state_dict())
    resumed.learn(total_timesteps=512)
    rows = _metrics(run_dir)
    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3]
    assert int(rows[-1]["env_steps"]) == 512

    # resuming is itself reproducible: resume again from round 2 and compare rounds 2..3
    (run_dir / "checkpoints" / "round_0003.pt").unlink()
    (run_dir / "checkpoints" / "round_0004.pt").unlink()
    PPO.resume(run_dir).learn(total_timesteps=512)
    assert _metrics(run_dir) == rows


def test_optimiser_state_is_carried_across_rounds():
    trainer = PPO(tiny_config(optimizer="adam"), run_dir=False)
    trainer.train_round()
    steps = float(trainer.optimizer.state_dict()["state"][0]["step"])
    trainer.train_round()
    assert trainer.optimizer.state_dict()["state"][0]["step"] == 2 * steps


def test_save_and_load_round_trip(tmp_path):
    trainer = PPO(tiny_config(), run_dir=False)
    trainer.train_round()
    trainer.save(tmp_path / "model.pt")
    loaded = PPO.load(tmp_path / "model.pt")
    torch.testing.assert_close(loaded.policy.state_dict(), trainer.policy.state_dict())
    assert loaded.round == 1


def test_corrupt_and_mismatched_checkpoints_are_clear_errors(run_root, tmp_path):
    run_dir = PPO(tiny_config(run_root=str(run_root), total_timesteps=128)).learn().run.path
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot load checkpoint"):
        load_checkpoint(bad)

    other = PPO(tiny_config(hidden_sizes=(8,)), run_dir=False)
    with pytest.raises(UserError, match="does not match the configured network"):
        other.load_state_dict(load_checkpoint(run_dir / "checkpoints" / "round_0001.pt"))
    acrobot = PPO(tiny_config(env="Acrobot-v1"), run_dir=False)
    with pytest.raises(UserError, match="is for env 'CartPole-v1'"):
        acrobot.load_state_dict(load_checkpoint(run_dir / "checkpoints" / "round_0001.pt"))


@pytest.mark.parametrize("env", ["FrozenLake-v1", "MiniGrid-Empty-8x8-v0", "Pendulum-v1"])
def test_presets_and_generic_envs_train_a_round(env):
    cfg = tiny_config(env=env, total_timesteps=128, n_steps=128)
    trainer = PPO(cfg, run_dir=False)
    metrics = trainer.train_round()
    assert metrics["n_updates"] == cfg.n_epochs * 128 // cfg.batch_size
    assert torch.isfinite(torch.tensor(metrics["policy_loss"]))
    if env != "Pendulum-v1":  # presets carry the paper's optimiser
        assert cfg.optimizer == "sgd" and cfg.learning_rate == 5e-3 and cfg.max_grad_norm is None


def test_preset_values_follow_the_paper():
    lunar = PPOConfig.for_env("LunarLander-v3")
    assert (lunar.rounds, lunar.n_steps, lunar.batch_size, lunar.n_epochs) == (150, 2048, 64, 10)
    assert lunar.eval_episodes == 1000
    walker = PPOConfig.for_env("BipedalWalker-v3")
    assert (walker.optimizer, walker.learning_rate, walker.eval_episodes) == ("adam", 3e-4, 100)
    assert PPOConfig.for_env("CartPole-v1") == PPOConfig(env="CartPole-v1")


def test_evaluation_does_not_change_training():
    with_eval = PPO(tiny_config(eval_episodes=3), run_dir=False)
    without = PPO(tiny_config(eval_episodes=0), run_dir=False)
    for trainer in (with_eval, without):
        trainer.train_round()
        trainer.train_round()
    torch.testing.assert_close(with_eval.policy.state_dict(), without.policy.state_dict())


def test_async_envs_give_the_same_numbers_as_sync_ones():
    """--vec-env async steps each env in its own process: the same transitions, the same policy."""
    runs = []
    for vec_env in ("sync", "async"):
        config = PPOConfig(env="CartPole-v1", n_envs=2, n_steps=64, batch_size=32, total_timesteps=256,
                           eval_episodes=0, vec_env=vec_env, seed=4, progress=False)
        trainer = PPO(config, run_dir=False).learn()
        runs.append((trainer.last_buffer.flat("obs").clone(), trainer.policy.state_dict()))
        trainer.env.close()
    (obs_sync, params_sync), (obs_async, params_async) = runs
    assert torch.equal(obs_sync, obs_async)
    assert all(torch.equal(params_sync[k], params_async[k]) for k in params_sync)


def test_eval_every_evaluates_every_nth_round_and_the_last_and_trains_the_same(one_thread, capsys):
    returns, states = {}, {}
    for every in (1, 2):
        trainer = PPO(tiny_config(total_timesteps=128 * 5, eval_every=every, progress=True), run_dir=False)
        rows = []
        trainer.learn(callback=lambda _t, m, rows=rows: rows.append(m["eval_return_mean"]))
        returns[every], states[every] = rows, trainer.policy.state_dict()
    assert [r == r for r in returns[2]] == [False, True, False, True, True]  # rounds 1, 3 and the last
    assert [returns[2][k] for k in (1, 3, 4)] == [returns[1][k] for k in (1, 3, 4)]  # evaluation seeded by the round
    assert all(torch.equal(states[1][k], states[2][k]) for k in states[1])
    lines = capsys.readouterr().err.splitlines()
    assert any("not evaluated" in line for line in lines) and any("eval_return" in line and " s)" in line for line in lines)
    with pytest.raises(UserError, match="eval_every must be >= 1"):
        tiny_config(eval_every=0).validate()
