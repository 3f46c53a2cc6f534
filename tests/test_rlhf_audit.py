"""Reward workers in LM RL: the sharded reward and its broken worker, the per-round harm tables of
``--audit``, and the audit's verdict on them (tiny random GPT-2, nothing downloaded)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from rlinfluence.analysis.audit import audit_run  # noqa: E402
from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.readings import reading  # noqa: E402
from rlinfluence.rlhf import TINY_GPT2, RLHFConfig, RLHFTrainer  # noqa: E402
from rlinfluence.rlhf.audit import HARM_FAMILIES  # noqa: E402
from rlinfluence.rlhf.reward import ShardedReward  # noqa: E402
from rlinfluence.rundir import AUDIT_SCORES  # noqa: E402

PROMPTS = ["You are such a", "hi", "Shut up, you", "That referee is a", "ok then", "Why are you"]


def length_reward(texts: list[str]) -> torch.Tensor:
    """Toy reward: the sum of the text's character codes (a function of the text alone, distinct for distinct
    texts here, so a shift shows)."""
    return torch.tensor([float(sum(map(ord, t))) for t in texts])


def test_sharded_reward_shifts_only_the_broken_workers_shard():
    texts = [f"t{i}" * (i + 1) for i in range(10)]
    honest = length_reward(texts)
    sharded = ShardedReward(length_reward, workers=3, broken=[1])
    # array_split of 10 into 3: 4, 3, 3; each shard scored by its own call (index offsets restart)
    assert sharded.sources(10).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert sharded.corrupted(10).tolist() == [False] * 4 + [True] * 3 + [False] * 3
    scores = sharded(texts)
    shard = length_reward(texts[4:7])
    assert torch.equal(scores[4:7], shard.roll(1))  # completion j gets j - 1's score, the first the last's
    assert torch.equal(scores[:4], length_reward(texts[:4])) and torch.equal(scores[7:], length_reward(texts[7:]))
    assert sorted(scores[4:7].tolist()) == sorted(shard.tolist())  # the same scores, on other completions
    assert torch.equal(ShardedReward(length_reward, 3)(texts)[:4], honest[:4])
    with pytest.raises(UserError, match="broken reward worker 3 is not one of the 3 workers"):
        ShardedReward(length_reward, 3, broken=[3])


def config_of(tmp_path, **overrides) -> RLHFConfig:
    base = dict(model=TINY_GPT2, algo="grpo", group_size=2, rounds=2, prompts_per_round=3, response_length=6,
                test_prompts=3, lora_r=4, lora_alpha=8, learning_rate=1e-3, ppo_epochs=1, mini_batch_size=2,
                records_per_pass=6, reward_workers=3, audit=True, progress=False, tensorboard=False,
                run_root=str(tmp_path / "runs"))
    return RLHFConfig(**{**base, **overrides})


def test_audit_writes_a_harm_table_per_round_and_the_recheck_finds_only_the_broken_worker(tmp_path):
    trainer = RLHFTrainer(config_of(tmp_path, broken_reward_workers=(2,), audit_gradient_families=True),
                          reward_fn=length_reward, train_prompts=PROMPTS, test_prompts=PROMPTS[3:])
    trainer.learn()
    folder = trainer.run.path / AUDIT_SCORES
    tables = [pd.read_parquet(folder / f"round_{k:06d}.parquet") for k in range(2)]
    for k, table in enumerate(tables):
        assert table["round"].eq(k).all() and len(table) == 6
        assert table["source"].tolist() == [0, 0, 1, 1, 2, 2]
        assert table["corrupted"].tolist() == [False] * 4 + [True] * 2
        assert table["episode"].tolist() == list(range(6 * k, 6 * k + 6))  # unique across rounds
        assert set(HARM_FAMILIES) <= set(table.columns)
        recheck = table["reward-recheck"].to_numpy()
        assert (recheck[:4] == 0).all() and (recheck[4:] > 0).all()  # the two completions differ
        assert np.allclose(table["abs-advantage"], table["negative-advantage"].abs())
    rows = trainer.run.rows
    assert all(r["audit_seconds"] > 0 for r in rows)
    assert all(r["train_seconds"] > 0 for r in rows)
    sources, found, _ = audit_run(trainer.run.path)
    assert sources["source"].tolist() == [0, 1, 2] and not found.empty  # 2 rounds, 3 workers: no flag reachable
    assert "p_influence" not in sources and "p_influence" in audit_run(trainer.run.path, gradient_families=True)[0]
    # without --audit-gradient-families the influence family is not scored (the verdict tests it only where asked)
    plain = RLHFTrainer(config_of(tmp_path / "plain", rounds=1), reward_fn=length_reward, train_prompts=PROMPTS,
                        test_prompts=PROMPTS[3:])
    plain.learn()
    table = pd.read_parquet(plain.run.path / AUDIT_SCORES / "round_000000.parquet")
    assert set(HARM_FAMILIES) - set(table.columns) == {"influence"}


def test_the_evaluation_scores_with_the_sound_reward(tmp_path):
    calls = []

    def recorded(texts):
        calls.append(len(texts))
        return length_reward(texts)

    trainer = RLHFTrainer(config_of(tmp_path, rounds=1, broken_reward_workers=(0, 1, 2), audit=False),
                          reward_fn=recorded, train_prompts=PROMPTS, test_prompts=PROMPTS[3:])
    assert trainer.reference_reward is recorded and isinstance(trainer.reward_fn, ShardedReward)
    before = len(calls)
    trainer.evaluate()
    assert calls[before:] == [3]  # the 3 test prompts in one call to the sound scorer, not split across workers
    trainer.rollout([p for p in PROMPTS[:3] for _ in range(2)], stream=0)
    assert calls[before + 1:] == [2, 2, 2]  # training's rewards: one call per worker


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(reward_workers=7), "reward_workers 7 exceeds the 6 sequences of a round"),
    (dict(broken_reward_workers=(3,)), "broken reward worker 3 is not one of the 3 reward workers"),
    (dict(reward_workers=2), "--audit compares each reward worker with the others"),
    (dict(reward_workers=0), "reward_workers must be an integer >= 1"),
    (dict(audit=False, audit_gradient_families=True), "adds a family to the harm tables of --audit"),
])
def test_bad_reward_worker_settings_are_one_clear_error(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        config_of(tmp_path, **overrides).validate()


def test_a_rechecked_reward_mismatch_reads_as_a_reward_fault():
    fault, text, _ = reading(["reward-recheck"])
    assert fault == "reward" and "not what the reward function gives" in text
