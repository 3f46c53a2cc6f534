"""An SB3 PPO run written as an rlinfluence run directory (``RunDirectoryCallback``): the saved
theta(k) is the policy that collected round k, the records and advantages are SB3's, the final
checkpoint holds SB3's weights and Adam moments, training is unchanged, and every analysis
command runs on the directory."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")

from stable_baselines3 import PPO as SB3PPO  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402

from rlinfluence import cli  # noqa: E402
from rlinfluence.checkpoint import load_round  # noqa: E402
from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback, our_name  # noqa: E402
from rlinfluence.rundir import load_checkpoint  # noqa: E402
from tests.analysis_commands import EVERY_ANALYSIS  # noqa: E402

ROUNDS = 4


def sb3_model(**kwargs) -> SB3PPO:
    env = make_vec_env("CartPole-v1", n_envs=3, seed=1)
    return SB3PPO("MlpPolicy", env, n_steps=32, batch_size=32, n_epochs=2, seed=1, device="cpu", **kwargs)


AUDIT_AND_EXPLAIN = (["audit", "{run}"], ["explain", "{run}", "--round", "1", "--episodes", "4", "--draws", "2"])
ATTRIBUTE_AND_EXPLAIN = (["attribute", "{run}", "--round", "1"], AUDIT_AND_EXPLAIN[1])


def assert_read_as_logged(run, capsys, commands=()):
    """Round 1 of ``run`` gives its logged log-probs under the saved policy, and ``commands`` exit 0
    on the run without an error line; the saved round is returned."""
    saved = load_round(run, 1)
    logp = saved.trainer.policy.log_prob(saved.buffer.flat("obs"), saved.buffer.flat("actions"))
    assert torch.allclose(logp, saved.buffer.flat("logp"), atol=1e-5)
    for command in commands:
        assert cli.main([c.format(run=run) for c in command]) == 0
    assert "error" not in capsys.readouterr().err
    return saved


@pytest.fixture(scope="module")
def sb3_run(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("sb3") / "run"
    model = sb3_model()
    model.learn(32 * 3 * ROUNDS, callback=RunDirectoryCallback(path, eval_episodes=2))
    return path, model


def test_each_saved_round_is_the_policy_that_collected_it_with_sb3s_records(sb3_run):
    path, model = sb3_run
    config = json.loads((path / "config.json").read_text())
    assert (config["env"], config["n_envs"], config["n_steps"], config["batch_size"]) == ("CartPole-v1", 3, 32, 32)
    assert config["learning_rate"] == pytest.approx(3e-4) and config["hidden_sizes"] == [64, 64]
    for k in range(ROUNDS):
        saved = load_round(path, k)
        buffer = saved.buffer
        logp = saved.trainer.policy.log_prob(buffer.flat("obs").float(), buffer.flat("actions"))
        assert torch.allclose(logp, buffer.flat("logp"), atol=1e-5)  # theta(k) gives the logged log-probs
        assert buffer.obs.shape[:2] == (32, 3) and saved.keep.all()
    rows = [line.split(",") for line in (path / "metrics.csv").read_text().splitlines()]
    assert [int(r[0]) for r in rows[1:]] == list(range(ROUNDS)) and "eval_return_mean" in rows[0]


def test_the_config_holds_sb3s_hyperparameters_and_the_torch_update_for_re_runs(sb3_run):
    config = json.loads((sb3_run[0] / "config.json").read_text())
    model = sb3_run[1]
    assert (config["n_steps"], config["batch_size"], config["n_epochs"]) == (model.n_steps, model.batch_size, model.n_epochs)
    assert (config["gamma"], config["gae_lambda"], config["ent_coef"]) == (model.gamma, model.gae_lambda, model.ent_coef)
    assert config["update_engine"] == "torch"


def test_the_final_checkpoint_holds_sb3s_weights_and_adam_moments(sb3_run):
    path, model = sb3_run
    state = load_checkpoint(path / "checkpoints" / f"round_{ROUNDS:04d}.pt")
    assert state["round"] == ROUNDS
    names = [n for n, _ in model.policy.named_parameters()]
    ours = list(state["policy"])
    adam = model.policy.optimizer.state_dict()["state"]
    from rlinfluence.config import PPOConfig
    from rlinfluence.ppo import PPO

    order = [n for n, _ in PPO(PPOConfig.from_dict(json.loads((path / "config.json").read_text())),
                               run_dir=False).policy.named_parameters()]
    for i, (name, parameter) in enumerate(model.policy.named_parameters()):
        assert torch.equal(state["policy"][our_name(name)], parameter.detach()), name
        moved = state["optimizer"]["state"][order.index(our_name(names[i]))]
        assert torch.equal(moved["exp_avg"], adam[i]["exp_avg"]) and torch.equal(moved["exp_avg_sq"], adam[i]["exp_avg_sq"])
    assert set(ours) == {our_name(n) for n in names}


def test_training_is_unchanged_by_the_callback(sb3_run, tmp_path):
    _, model = sb3_run
    plain = sb3_model()
    plain.learn(32 * 3 * ROUNDS)
    for (name, a), (_, b) in zip(model.policy.named_parameters(), plain.policy.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("command", EVERY_ANALYSIS)
def test_every_analysis_command_runs_on_the_sb3_run_directory(sb3_run, command, capsys):
    path, _ = sb3_run
    assert cli.main([c.format(run=path) for c in command]) == 0
    assert "error" not in capsys.readouterr().err
    if command[0] == "report":  # SB3 records no train seconds: left out, not shown as nan
        from rlinfluence.analysis.report import learning_section
        from rlinfluence.rundir import RunDirectory

        run = RunDirectory.open_existing(path, tensorboard=False)
        summary = learning_section(run, run.read_config()).summary
        assert "train seconds" not in summary and summary["final eval return"] == summary["final eval return"]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(learning_rate=lambda progress: 1e-3 * progress), "learning_rate is a schedule"),
    (dict(policy_kwargs=dict(activation_fn=torch.nn.ELU)), "activation ELU"),
])
def test_what_has_no_counterpart_is_refused_at_the_start(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        sb3_model(**kwargs).learn(96, callback=RunDirectoryCallback(tmp_path / "run"))
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_second_training_into_the_same_folder_is_refused_and_a_continued_one_goes_on(tmp_path):
    callback = RunDirectoryCallback(tmp_path / "run", eval_episodes=0)
    model = sb3_model()
    model.learn(96, callback=callback)
    model.learn(96, callback=callback, reset_num_timesteps=False)  # the same callback: the run goes on
    assert sorted(p.name for p in (tmp_path / "run" / "buffers").iterdir()) == ["round_0000.safetensors",
                                                                                "round_0001.safetensors"]
    assert load_round(tmp_path / "run", 1).trainer.round == 1
    with pytest.raises(UserError, match="already holds a run"):
        sb3_model().learn(96, callback=RunDirectoryCallback(tmp_path / "run"))


def test_time_limit_bootstraps_are_kept_apart_from_the_reward_and_the_thread_count_is_left_alone(tmp_path):
    """SB3 adds gamma * V(final observation) to a time-limit end's reward; the run directory keeps the
    env's reward, marks the end truncated with its bootstrap in final_values (so that the sum is SB3's),
    and the audit's reward-extremes reads the env's reward (on CartPole: 1 everywhere)."""
    import numpy as np
    import pandas as pd
    from stable_baselines3.common.callbacks import BaseCallback

    from rlinfluence.integrations.sb3_audit import AuditCallback

    class SB3Rewards(BaseCallback):
        def __init__(self):
            super().__init__()
            self.rewards = []

        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            self.rewards.append(self.model.rollout_buffer.rewards.copy())

    env = make_vec_env("CartPole-v1", n_envs=3, seed=1, env_kwargs={"max_episode_steps": 12})
    model = SB3PPO("MlpPolicy", env, n_steps=32, batch_size=32, n_epochs=2, seed=1, device="cpu")
    sb3_rewards = SB3Rewards()
    torch.set_num_threads(2)
    model.learn(32 * 3 * 3, callback=[RunDirectoryCallback(tmp_path / "run", eval_episodes=0),
                                      AuditCallback(tmp_path / "run", scorers=("reward-extremes",)), sb3_rewards])
    assert torch.get_num_threads() == 2
    truncations = 0
    for k, theirs in enumerate(sb3_rewards.rewards):
        buffer = load_round(tmp_path / "run", k).buffer
        assert (buffer.rewards == 1).all() and not (buffer.terminated & buffer.truncated).any()
        truncations += int(buffer.truncated.sum())
        assert np.allclose(buffer.gae_rewards(model.gamma).numpy(), theirs, atol=1e-5)
        assert (theirs != 1).any()  # SB3's own rewards do carry bootstraps
        table = pd.read_parquet(tmp_path / "run" / "audit" / "scores" / f"round_{k:06d}.parquet")
        assert (table["reward-extremes"] == 0).all()
    assert truncations > 0


def test_a_vec_env_without_a_gymnasium_id_is_written_for_what_needs_no_env(tmp_path, capsys):
    """A VecEnv whose envs have no ``spec`` attribute at all (SB3's own DictObsVecEnv): the callback
    warns and writes the run on the model's spaces; what needs no env reads it, explain says it needs
    the env (one line), never an AttributeError."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    class NoSpecVecEnv(DummyVecEnv):
        def get_attr(self, attr_name, indices=None):
            if attr_name == "spec":
                raise AttributeError(f"no attribute {attr_name!r}")
            return super().get_attr(attr_name, indices)

    model = SB3PPO("MlpPolicy", NoSpecVecEnv([lambda: gym.make("CartPole-v1")] * 3), n_steps=32, batch_size=32,
                   n_epochs=2, seed=1, device="cpu")
    with pytest.warns(UserWarning, match="no gymnasium id that gymnasium can make: the run is written for what needs no env"):
        model.learn(96 * 3, callback=RunDirectoryCallback(tmp_path / "run"))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["env"].startswith("unregistered:") and config["eval_episodes"] == 0
    for command in (["attribute", "{run}", "--round", "1"], ["audit", "{run}"]):
        assert cli.main([c.format(run=tmp_path / "run") for c in command]) == 0
    capsys.readouterr()
    assert cli.main(["explain", str(tmp_path / "run"), "--round", "1", "--episodes", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recorded without a way to re-create it" in err[0], err


def test_a_discrete_observation_run_is_written_one_hot_and_every_analysis_reads_it(tmp_path, capsys):
    """SB3 stores a Discrete observation as its index and its policy sees it one-hot, as rlinfluence's
    env and policy do: the run directory holds the one-hot observations, whose log-probs are SB3's."""
    model = SB3PPO("MlpPolicy", make_vec_env("FrozenLake-v1", n_envs=3, seed=1), n_steps=32, batch_size=32, n_epochs=2,
                   seed=1, device="cpu")
    model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2))
    saved = assert_read_as_logged(tmp_path / "run", capsys, AUDIT_AND_EXPLAIN)
    assert saved.buffer.obs.shape == (32, 3, 16) and (saved.buffer.obs.sum(-1) == 1).all()


def test_a_batch_size_that_does_not_divide_the_rollout_is_written_and_re_run(tmp_path, capsys):
    """SB3 accepts it (with a warning) and trains on a shorter last minibatch; the run is written, and
    the re-run leaves each epoch's remainder out, as rlinfluence's trainer does (warned there too)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SB3's own warning about the truncated minibatch
        model = SB3PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=3, seed=1), n_steps=32, batch_size=40, n_epochs=2,
                       seed=1, device="cpu")
        model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["batch_size"] == 40
    assert cli.main(["validate", str(tmp_path / "run"), "--round", "1"]) == 0
    assert "error" not in capsys.readouterr().err


def test_different_actor_and_critic_sizes_and_relu_are_written_as_they_are(tmp_path, capsys):
    model = sb3_model(policy_kwargs=dict(net_arch=dict(pi=[32], vf=[64, 16]), activation_fn=torch.nn.ReLU))
    model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["hidden_sizes"], config["critic_hidden_sizes"], config["activation"]) == ([32], [64, 16], "relu")
    saved = load_round(tmp_path / "run", 1)
    logp = saved.trainer.policy.log_prob(saved.buffer.flat("obs"), saved.buffer.flat("actions"))
    assert torch.allclose(logp, saved.buffer.flat("logp"), atol=1e-5)  # the actor is SB3's pi network
    values = saved.trainer.policy.value(saved.buffer.flat("obs"))
    assert torch.allclose(values, saved.buffer.flat("values"), atol=1e-5)  # the critic is SB3's vf network
    assert cli.main(["validate", str(tmp_path / "run"), "--round", "1"]) == 0
    assert "error" not in capsys.readouterr().err


def test_an_adamw_model_is_written_with_its_weight_decay_and_re_run(tmp_path, capsys):
    model = sb3_model(policy_kwargs=dict(optimizer_class=torch.optim.AdamW, optimizer_kwargs=dict(weight_decay=0.05)))
    model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["optimizer"], config["weight_decay"]) == ("adamw", 0.05)
    saved = load_round(tmp_path / "run", 1)
    assert type(saved.trainer.optimizer) is torch.optim.AdamW
    assert saved.trainer.optimizer.param_groups[0]["weight_decay"] == 0.05
    assert cli.main(["validate", str(tmp_path / "run"), "--round", "1"]) == 0
    assert "error" not in capsys.readouterr().err


def test_a_round_the_writer_refuses_stops_the_writing_not_the_training(tmp_path):
    """Another callback changes the logged log-probs after the rollout: the records are not the
    policy's, so the round is not written; the callback warns and stops writing, and SB3 trains on,
    as it would without it."""
    from stable_baselines3.common.callbacks import BaseCallback

    class ChangeLogProbs(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            self.model.rollout_buffer.log_probs += 1.0

    model = sb3_model()
    callback = RunDirectoryCallback(tmp_path / "run", eval_episodes=0)
    with pytest.warns(UserWarning, match="stops writing .*training goes on.*logged log-probs differ"):
        model.learn(32 * 3 * 3, callback=[ChangeLogProbs(), callback])
    assert model.num_timesteps == 32 * 3 * 3 and callback.stopped is not None


def test_values_that_are_not_the_critics_are_kept_as_logged_and_the_critic_checked_against_sb3s(tmp_path, capsys):
    """A policy whose forward returns other values than its critic (SB3's GAE tests): SB3's advantages
    come from them, so the run keeps them (warned once); the log-probs and the critic's mapping (against
    SB3's predict_values) are still checked, and a re-run trains the critic as SB3 does."""
    from stable_baselines3.common.policies import ActorCriticPolicy

    class ConstantValuePolicy(ActorCriticPolicy):
        def forward(self, obs, deterministic=False):
            actions, values, log_prob = super().forward(obs, deterministic)
            return actions, torch.full_like(values, 2.5), log_prob

    model = SB3PPO(ConstantValuePolicy, make_vec_env("CartPole-v1", n_envs=3, seed=1), n_steps=32, batch_size=32,
                   n_epochs=2, seed=1, device="cpu")
    with pytest.warns(UserWarning, match="values are not ConstantValuePolicy's critic's") as warned:
        model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=0))
    assert sum("critic's" in str(w.message) for w in warned) == 1
    saved = load_round(tmp_path / "run", 2)
    assert (saved.buffer.values == 2.5).all()
    logp = saved.trainer.policy.log_prob(saved.buffer.flat("obs"), saved.buffer.flat("actions"))
    assert torch.allclose(logp, saved.buffer.flat("logp"), atol=1e-5)
    assert cli.main(["validate", str(tmp_path / "run"), "--round", "1"]) == 0
    assert "error" not in capsys.readouterr().err


def test_dict_observations_are_written_flat_as_sb3s_extractor_gives_them_and_the_env_re_created(tmp_path, capsys):
    """MultiInputPolicy on a Dict of a Box, a Discrete and a MultiBinary: SB3 one-hots and concatenates
    them in the space's order, as gymnasium's flatten does; the run holds those vectors, their
    log-probs are SB3's, and explain re-creates the env from its entry point, flattened the same way."""
    from stable_baselines3.common.env_util import make_vec_env as sb3_vec_env

    from tests.custom_env import make_dict_env

    model = SB3PPO("MultiInputPolicy", sb3_vec_env(make_dict_env, n_envs=3, seed=1), n_steps=32, batch_size=32,
                   n_epochs=2, seed=1, device="cpu")
    model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2,
                                                          env="tests.custom_env:make_dict_env"))
    saved = assert_read_as_logged(tmp_path / "run", capsys, AUDIT_AND_EXPLAIN)
    assert saved.buffer.obs.shape == (32, 3, 2 + 2 + 2)
    assert torch.equal(saved.buffer.obs[..., 4:].sum(-1), torch.ones(32, 3))  # "side" (keys sorted), one-hot


def test_a_cnn_policy_is_written_with_sb3s_nature_cnn_in_the_envs_own_image_layout(tmp_path, capsys):
    """CnnPolicy (NatureCNN shared by actor and critic) on a height x width x channels image, which SB3
    transposes (VecTransposeImage): the run holds the env's own layout, rlinfluence's NatureCNN
    transposes it back, its log-probs are SB3's, and explain re-creates the env from its entry point."""
    from stable_baselines3.common.env_util import make_vec_env as sb3_vec_env

    from tests.custom_env import make_image_env

    model = SB3PPO("CnnPolicy", sb3_vec_env(make_image_env, n_envs=2, seed=1), n_steps=32, batch_size=32, n_epochs=1,
                   seed=1, device="cpu", policy_kwargs=dict(features_extractor_kwargs=dict(features_dim=16)))
    model.learn(32 * 2 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2,
                                                          env="tests.custom_env:make_image_env"))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["encoder"], config["features_dim"]) == ("nature", 16)
    saved = assert_read_as_logged(tmp_path / "run", capsys, ATTRIBUTE_AND_EXPLAIN)
    assert saved.buffer.obs.shape == (32, 2, 36, 36, 1) and saved.buffer.obs.dtype == torch.uint8


def test_vec_normalize_statistics_are_saved_with_each_round_and_evaluations_apply_them(tmp_path, capsys):
    """VecNormalize's running statistics normalise what the policy observes: each saved round holds
    them, and the env the analyses re-create normalises its observations with them (frozen), so the
    run's policy acts on a fresh observation as SB3's policy does on VecNormalize's."""
    from stable_baselines3.common.vec_env import VecNormalize

    from rlinfluence.envs import make_env

    venv = VecNormalize(make_vec_env("CartPole-v1", n_envs=3, seed=1), clip_obs=5.0)
    model = SB3PPO("MlpPolicy", venv, n_steps=32, batch_size=32, n_epochs=2, seed=1, device="cpu")
    model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["env"], config["obs_norm_clip"]) == ("CartPole-v1", 5.0)
    first, second = (load_checkpoint(tmp_path / "run" / "checkpoints" / f"round_000{k}.pt")["obs_statistics"]
                     for k in (0, 1))
    assert not torch.equal(first["mean"], second["mean"])  # theta(0)'s are those its collection began with
    final = load_round(tmp_path / "run", 2).trainer
    final.load_state_dict(load_checkpoint(tmp_path / "run" / "checkpoints" / "round_0003.pt"))  # theta(3), SB3's last
    assert np.allclose(final.obs_statistics["mean"], venv.obs_rms.mean)
    raw, _ = gym.make("CartPole-v1").reset(seed=7)
    ours = make_env("CartPole-v1", obs_statistics=final.obs_statistics)
    seen, _ = ours.reset(seed=7)
    assert np.allclose(seen, venv.normalize_obs(raw), atol=1e-5)
    action = torch.tensor([1])
    with torch.no_grad():
        _, theirs, _ = model.policy.evaluate_actions(torch.as_tensor(venv.normalize_obs(raw))[None].float(), action)
    assert torch.allclose(final.policy.log_prob(torch.as_tensor(seen)[None], action), theirs, atol=1e-5)
    assert cli.main(["explain", str(tmp_path / "run"), "--round", "1", "--episodes", "4", "--draws", "2"]) == 0
    assert "error" not in capsys.readouterr().err


def test_a_frame_stacked_model_is_written_for_what_needs_no_env(tmp_path, capsys):
    """A frame stack changes what the policy observes in a way the run does not redo: an env re-created
    from the id would observe one frame, so the run is written (warned) without one, as for an
    unregistered env."""
    from stable_baselines3.common.vec_env import VecFrameStack

    model = SB3PPO("MlpPolicy", VecFrameStack(make_vec_env("CartPole-v1", n_envs=3, seed=1), 2), n_steps=32,
                   batch_size=32, n_epochs=2, seed=1, device="cpu")
    with pytest.warns(UserWarning, match="wrapped in VecFrameStack, which changes what the policy observes"):
        model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run"))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["env"] == "unregistered:VecFrameStack" and config["eval_episodes"] == 0
    assert cli.main(["audit", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert cli.main(["explain", str(tmp_path / "run"), "--round", "1", "--episodes", "4"]) == 2


def test_float64_observations_and_a_vec_env_that_gives_fewer_infos_are_written(tmp_path, capsys):
    """Two shapes SB3's own tests use: a float64 Box (SB3's policy casts it to float32, so does the run)
    and a VecEnv whose step returns fewer infos than envs (SB3's DictObsVecEnv: no time-limit end is
    known for the others)."""
    from stable_baselines3.common.env_util import make_vec_env as sb3_vec_env

    from rlinfluence.integrations.sb3 import TimeLimitEnds

    ends = TimeLimitEnds()
    ends.record({"rewards": np.zeros(3), "dones": np.array([True, False, True]), "infos": [{}]})
    assert ends.take(1)[1].tolist() == [[False, False, False]]

    def float64_cartpole():
        return gym.wrappers.DtypeObservation(gym.make("CartPole-v1"), np.float64)

    model = SB3PPO("MlpPolicy", sb3_vec_env(float64_cartpole, n_envs=3, seed=1), n_steps=32, batch_size=32,
                   n_epochs=2, seed=1, device="cpu")
    with pytest.warns(UserWarning, match="is CartPole-v1 wrapped in DtypeObservation: the run is written for what"):
        model.learn(32 * 3 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=0))
    assert_read_as_logged(tmp_path / "run", capsys)


def test_dict_observations_with_an_image_are_written_with_a_nature_cnn_per_image(tmp_path, capsys):
    """MultiInputPolicy on a Dict of a height x width x channels image (NatureCNN, SB3 transposes it)
    and a Discrete: the run holds each part flat in key order (the image in the env's own layout),
    rlinfluence's policy takes the image through its NatureCNN and the rest as it is, and gives SB3's
    log-probs; explain re-creates the env from its entry point."""
    from stable_baselines3.common.env_util import make_vec_env as sb3_vec_env

    from tests.custom_env import make_image_dict_env

    model = SB3PPO("MultiInputPolicy", sb3_vec_env(make_image_dict_env, n_envs=2, seed=1), n_steps=32, batch_size=32,
                   n_epochs=1, seed=1, device="cpu", policy_kwargs=dict(features_extractor_kwargs=dict(cnn_output_dim=8)))
    model.learn(32 * 2 * 3, callback=RunDirectoryCallback(tmp_path / "run", eval_episodes=2,
                                                          env="tests.custom_env:make_image_dict_env"))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["observation_parts"] == ["image:image:36x36x1", "side:flat:2"] and config["features_dim"] == 8
    saved = assert_read_as_logged(tmp_path / "run", capsys, ATTRIBUTE_AND_EXPLAIN)
    assert saved.buffer.obs.shape == (32, 2, 36 * 36 + 2)
    unscaled = SB3PPO("MultiInputPolicy", sb3_vec_env(make_image_dict_env, n_envs=2, seed=1), n_steps=32, seed=1,
                      device="cpu", policy_kwargs=dict(normalize_images=False))
    with pytest.raises(UserError, match="normalize_images=False"):
        unscaled.learn(64, callback=RunDirectoryCallback(tmp_path / "unscaled"))
