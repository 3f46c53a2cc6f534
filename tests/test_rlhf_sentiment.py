"""The sentiment task (VADER reward, the shipped neutral prompts), the completions Parquet and
the sampled responses of the report, the chat prompt format, and the device flags (CPU only:
CUDA asked for on a machine without it is one clear error, exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("vaderSentiment")

from rlinfluence import cli  # noqa: E402
from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.rlhf import (  # noqa: E402
    TINY_GPT2,
    RLHFConfig,
    RLHFTrainer,
    SentimentReward,
    load_policy,
    load_prompts,
    resolve_device,
    resolve_dtype,
)
from rlinfluence.rlhf.data import PROMPT_FILES  # noqa: E402
from rlinfluence.rlhf.report import COMPLETION_COLUMNS, completions_path, load_completions  # noqa: E402

PROMPTS = ["How do you pack a suitcase?", "What is on a shopping list?", "Describe a bus stop.",
           "How do you boil pasta?", "What happens at a post office?", "Describe a kitchen table."]


def test_vader_reward_on_fixed_strings():
    reward = SentimentReward()
    scores = reward(["I love this, it is wonderful!", "This is terrible and I hate it.", "The bus leaves at noon.", ""])
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    positive, negative, neutral, empty = scores.tolist()
    assert positive == pytest.approx(0.8478, abs=1e-4) and negative == pytest.approx(-0.7783, abs=1e-4)
    assert neutral == 0 and empty == 0
    # VADER's rules: negation flips the valence, "!!!" and capitals intensify it
    good, not_good, loud = reward(["The food is good.", "The food is not good.", "The food is GOOD!!!"]).tolist()
    assert not_good < 0 < good < loud <= 1


def test_shipped_sentiment_prompt_set():
    lines = [json.loads(line) for line in PROMPT_FILES["sentiment"].read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 334 >= 300
    assert len({item["id"] for item in lines}) == len({item["prompt"] for item in lines}) == len(lines)
    splits = {s: load_prompts(s) for s in ("train", "val", "test")}  # the default task is sentiment
    assert [len(splits[s]) for s in ("train", "val", "test")] == [234, 50, 50]
    assert sum(map(len, splits.values())) == len(lines)
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not set(splits[a]) & set(splits[b]), (a, b)
    # neutral: the prompts themselves carry (almost) no VADER sentiment
    assert float(SentimentReward()([item["prompt"] for item in lines]).abs().mean()) < 0.05
    with pytest.raises(UserError, match="unknown task"):
        load_prompts("train", task="poetry")


def test_sentiment_gold_moves_the_last_train_prompts_to_test():
    """The gold task measures on 100 test prompts: the sentiment test split, then the last 50
    train prompts, which leave train; val is the sentiment task's."""
    plain = {s: load_prompts(s, task="sentiment") for s in ("train", "val", "test")}
    gold = {s: load_prompts(s, task="sentiment-gold") for s in ("train", "val", "test")}
    assert [len(gold[s]) for s in ("train", "val", "test")] == [184, 50, 100]
    assert gold["train"] == plain["train"][:184] and gold["val"] == plain["val"]
    assert gold["test"] == plain["test"] + plain["train"][184:]
    assert not set(gold["train"]) & set(gold["test"])


def test_sentiment_is_the_default_task_and_the_completions_are_parquet(tmp_path):
    import pyarrow.parquet as pq

    config = RLHFConfig(model=TINY_GPT2, filter="iif", rounds=2, prompts_per_round=4, response_length=5,
                        test_prompts=2, lora_r=2, lora_alpha=4, ppo_epochs=1, records_per_pass=4, progress=False,
                        tensorboard=False, run_root=str(tmp_path))
    assert config.task == "sentiment" and config.target_source == "rollout"
    trainer = RLHFTrainer(config, train_prompts=PROMPTS, test_prompts=PROMPTS[4:]).learn()
    assert isinstance(trainer.reward_fn, SentimentReward) and not trainer.chat  # tiny-gpt2 has no chat template
    path = completions_path(trainer.run.path, 1)
    assert path.name == "round_0001.parquet"
    schema = pq.read_schema(path)
    assert schema.names == list(COMPLETION_COLUMNS)
    assert [str(schema.field(n).type) for n in COMPLETION_COLUMNS] == ["int64", "string", "string", "double",
                                                                        "double", "bool"]
    completions = load_completions(trainer.run.path, 1)
    rollout = trainer.last_rollout
    assert completions["round"].eq(1).all()
    assert completions["prompt"].tolist() == rollout.prompts and completions["response"].tolist() == rollout.responses
    torch.testing.assert_close(torch.tensor(completions["reward"].to_numpy(), dtype=torch.float32), rollout.scores)
    torch.testing.assert_close(torch.tensor(completions["score"].to_numpy(), dtype=torch.float32), trainer.last_scores)
    assert completions["kept"].tolist() == (completions["score"] >= 0).tolist()  # drop_mode neg
    text = (trainer.run.path / "report.html").read_text(encoding="utf-8")
    assert "Sampled responses per round" in text and "sentiment" in text  # the summary names the task
    bad = completions_path(trainer.run.path, 0)
    bad.write_bytes(b"not parquet")
    with pytest.raises(UserError, match="cannot read completions"):
        load_completions(trainer.run.path, 0)


def test_chat_prompt_format(tmp_path):
    policy = load_policy(TINY_GPT2, lora_r=2, lora_alpha=4)
    assert policy.prompt_texts(["hi"], chat=False) == ["hi"]
    with pytest.raises(UserError, match="no chat template"):
        policy.prompt_texts(["hi"], chat=True)
    with pytest.raises(UserError, match="no chat template"):
        RLHFTrainer(RLHFConfig(model=TINY_GPT2, prompt_format="chat", progress=False), policy=policy,
                    train_prompts=PROMPTS, test_prompts=PROMPTS, run_dir=False)
    policy.tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    assert policy.prompt_texts(["hi"], chat=True) == ["<hi>:"]
    out = policy.generate(["hi", "ok then"], response_length=3, chat=True)
    assert out["input_ids"].shape[1] == len("<ok then>:") + 3  # the template's text is what the model read


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    with pytest.raises(UserError, match="unknown device"):
        resolve_device("tpu")
    with pytest.raises(UserError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve_device("cuda")
    code = cli.main(["rlhf", "--model", TINY_GPT2, "--device", "cuda", "--rounds", "1", "--no-progress",
                     "--run-root", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "CUDA is not available" in err, err
    assert not (tmp_path / "runs").exists()  # failed before anything was written


def test_bfloat16_weights_keep_float32_adapters_and_outputs():
    policy = load_policy(TINY_GPT2, lora_r=2, lora_alpha=4, dtype="bfloat16")
    assert policy.lm.get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.lora_parameters())
    out = policy.generate(["hi"], response_length=3)
    logp, values = policy(out["input_ids"], out["attention_mask"], 3)
    assert logp.dtype == values.dtype == torch.float32 and torch.isfinite(logp).all()
