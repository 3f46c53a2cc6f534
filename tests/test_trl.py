"""IIF inside TRL's GRPOTrainer (rlinfluence.integrations.trl), on a tiny random GPT-2 on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.integrations.trl import IIFGRPOConfig, IIFGRPOTrainer  # noqa: E402
from rlinfluence.rlhf.model import tiny_gpt2  # noqa: E402

PROMPTS = ["hello ", "the cat ", "a b c ", "zz top "]


def mean_code_point(completions: list[str], **kwargs) -> list[float]:
    """A toy reward that differs between almost any two completions."""
    return [sum(map(ord, c)) / (100.0 * max(len(c), 1)) for c in completions]


def constant_reward(completions: list[str], **kwargs) -> list[float]:
    return [1.0] * len(completions)


def make_trainer(trainer_class: type = IIFGRPOTrainer, reward=mean_code_point, tmp_path=None, **config) -> GRPOTrainer:
    lm, tokenizer = tiny_gpt2(seed=0)
    tokenizer.padding_side = "left"
    config_class = IIFGRPOConfig if trainer_class is IIFGRPOTrainer else GRPOConfig
    config = {"per_device_train_batch_size": 8, **config}
    args = config_class(
        output_dir=str(tmp_path), num_generations=4, max_completion_length=8,
        max_steps=1, learning_rate=0.05, report_to=[], use_cpu=True, seed=0, logging_steps=1,
        save_strategy="no", disable_tqdm=True, **config,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's fan_in_fan_out notice, TRL's CPU notices
        return trainer_class(model=lm, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             processing_class=tokenizer, peft_config=lora)


def lora_state(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


def generation_batch(trainer: GRPOTrainer) -> dict:
    """One training generation batch, scored (and filtered, for IIF) as in ``train()``."""
    trainer.model.train()
    torch.manual_seed(0)
    inputs = next(iter(trainer.get_train_dataloader()))
    return trainer._generate_and_score_completions(inputs)


def brute_force_scores(trainer: GRPOTrainer, batch: dict) -> torch.Tensor:
    """<grad u_i, grad f> by autograd, one completion at a time, from the model's own logits."""
    model = trainer.model
    params = [p for name, p in model.named_parameters() if "lora_" in name and p.requires_grad]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    completion, mask, advantages = batch["completion_ids"], batch["completion_mask"].float(), batch["advantages"]
    width, n = completion.shape[1], len(advantages)

    def token_logps(i: int) -> torch.Tensor:
        logits = model(input_ids=ids[i : i + 1], attention_mask=attention[i : i + 1]).logits[0, -width - 1 : -1]
        return (logits / trainer.temperature).log_softmax(-1).gather(-1, completion[i, :, None]).squeeze(-1)

    def objective(i: int) -> torch.Tensor:
        logp = token_logps(i)
        per_token = advantages[i] * logp
        if trainer.beta:
            diff = batch["ref_per_token_logps"][i] - logp
            ratio = torch.exp(logp - logp.detach())  # TRL's importance ratio on the KL term (value 1)
            if trainer.importance_sampling_level == "sequence":
                ratio = torch.exp(((logp - logp.detach()) * mask[i]).sum() / mask[i].sum().clamp(min=1))
            per_token = per_token - trainer.beta * (torch.exp(diff) - diff - 1) * ratio
        u = (per_token * mask[i]).sum()
        return u / mask[i].sum().clamp(min=1) if trainer.loss_type == "grpo" else u

    def target_gradient(rows: list[int]) -> tuple[torch.Tensor, ...]:
        f = sum(advantages[j] / len(rows) * (token_logps(j) * mask[j]).sum() for j in rows)
        return torch.autograd.grad(f, params)

    group = [i // trainer.num_generations for i in range(n)]
    model.eval()
    whole = target_gradient(list(range(n)))
    scores = []
    for i in range(n):
        if trainer.args.iif_target == "held-out":  # the prompt groups of the other parity
            target = target_gradient([j for j in range(n) if group[j] % 2 != group[i] % 2])
        else:
            target = whole
        grads = torch.autograd.grad(objective(i), params)
        scores.append(sum((g * t).sum() for g, t in zip(grads, target, strict=True)))
    model.train()
    return torch.stack(scores).detach()


def test_drop_pct_zero_reproduces_grpo_trainer(tmp_path) -> None:
    plain = make_trainer(GRPOTrainer, tmp_path=tmp_path / "plain")  # built and trained before the other:
    before = lora_state(plain)  # each trainer seeds the global RNG when built, sampling draws from it
    plain.train()
    iif = make_trainer(IIFGRPOTrainer, tmp_path=tmp_path / "iif", iif_drop_pct=0.0)
    assert all(torch.equal(before[k], v) for k, v in lora_state(iif).items())
    iif.train()
    after_plain, after_iif = lora_state(plain), lora_state(iif)
    assert any(not torch.equal(before[k], v) for k, v in after_plain.items())  # the step did something
    assert all(torch.equal(after_plain[k], v) for k, v in after_iif.items())
    plain_log, iif_log = plain.state.log_history[0], iif.state.log_history[0]
    assert plain_log["loss"] == iif_log["loss"] and plain_log["grad_norm"] == iif_log["grad_norm"]
    assert iif_log["influence/kept_fraction"] == 1.0 and iif_log["influence/skipped"] == 0.0
    assert iif_log["influence/seconds"] > 0 and "influence/kept_fraction" not in plain_log
    assert iif.influence_scores is not None and iif.influence_scores.abs().sum() > 0


@pytest.mark.parametrize(
    "config",
    [{}, {"loss_type": "grpo", "beta": 0.05}, {"loss_type": "dr_grpo", "beta": 0.05, "importance_sampling_level": "sequence"},
     {"iif_target": "held-out", "per_device_train_batch_size": 12}],
    ids=["dapo", "grpo-kl", "dr_grpo-kl-sequence", "held-out"],
)
def test_scores_equal_brute_force_per_completion_gradients(tmp_path, config) -> None:
    trainer = make_trainer(tmp_path=tmp_path, iif_drop_pct=0.0, iif_records_per_pass=3, **config)
    before = lora_state(trainer)
    batch = generation_batch(trainer)
    assert trainer.model.training  # scoring ran in eval mode and restored the flag
    assert all(torch.equal(before[k], v) for k, v in lora_state(trainer).items())
    expected = brute_force_scores(trainer, batch)
    assert expected.abs().max() > 0
    torch.testing.assert_close(trainer.influence_scores, expected, rtol=1e-4, atol=1e-6 * expected.abs().max())


@pytest.mark.parametrize("drop_mode", ["neg-bottom", "neg"])
def test_dropped_completions_have_zero_weight_in_the_loss(tmp_path, drop_mode) -> None:
    trainer = make_trainer(tmp_path=tmp_path, iif_drop_pct=100.0, iif_drop_mode=drop_mode)
    batch = generation_batch(trainer)
    scores, keep = trainer.influence_scores, trainer.influence_keep
    assert torch.equal(keep, scores >= 0) and 0 < int(keep.sum()) < len(keep)  # p = 100%: every negative one
    dropped = ~keep
    assert not batch["completion_mask"][dropped].any()
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())
    assert trainer._metrics["train"]["influence/kept_fraction"] == [keep.float().mean().item()]
    assert trainer._metrics["train"]["influence/n_dropped"] == [float(dropped.sum())]

    trainer.current_gradient_accumulation_steps = 1
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def loss_and_grads(batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)  # the same dropout masks (GPT-2's dropout is on in training) for every call
        loss = trainer.compute_loss(trainer.model, batch)
        return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, params)]

    loss, grads = loss_and_grads(batch)
    perturbed = dict(batch, advantages=batch["advantages"].clone())
    perturbed["advantages"][dropped] = torch.randn(int(dropped.sum())) * 10  # a dropped row must not matter
    perturbed_loss, perturbed_grads = loss_and_grads(perturbed)
    assert torch.equal(loss, perturbed_loss) and all(map(torch.equal, grads, perturbed_grads))
    kept_advantages = dict(batch, advantages=torch.where(keep, batch["advantages"] + 1.0, batch["advantages"]))
    assert not torch.equal(loss_and_grads(kept_advantages)[0], loss)  # while a kept one does


def test_constant_rewards_skip_scoring_and_keep_everything(tmp_path) -> None:
    trainer = make_trainer(reward=constant_reward, tmp_path=tmp_path, iif_drop_pct=100.0, iif_drop_mode="neg")
    with pytest.warns(RuntimeWarning, match="influence/skipped = 1"):
        generation_batch(trainer)
    assert trainer.influence_keep.all() and not trainer.influence_scores.any()
    assert trainer._metrics["train"]["influence/skipped"] == [1.0]
    assert list(trainer._logs["extra"]["kept"]) == [True] * 8


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"iif_drop_pct": 150.0}, "iif_drop_pct must be a number in"),
        ({"iif_drop_pct": -1}, "iif_drop_pct must be a number in"),
        ({"iif_drop_mode": "worst"}, "unknown iif_drop_mode 'worst'"),
        ({"iif_records_per_pass": 0}, "iif_records_per_pass must be a positive int"),
        ({"iif_target": "validation"}, "unknown iif_target 'validation'"),
        ({"iif_target": "held-out", "per_device_train_batch_size": 4, "num_generations": 4}, "at least 2 prompt groups"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
        ({"entropy_coef": 0.01}, "entropy bonus"),
        ({"rollout_filter": "gfpo"}, "unknown rollout_filter 'gfpo'"),
        ({"rollout_filter": "pods", "rollout_pods_keep": 9}, "rollout_pods_keep must be in"),
    ],
)
def test_bad_config_is_a_user_error(config, message) -> None:
    with pytest.raises(UserError, match=message):
        IIFGRPOConfig(output_dir="unused", report_to=[], use_cpu=True, **config)


def test_trainer_refuses_a_plain_config_and_a_model_without_lora(tmp_path) -> None:
    lm, tokenizer = tiny_gpt2(seed=0)
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(UserError, match="IIFGRPOConfig"):
        IIFGRPOTrainer(model=lm, reward_funcs=mean_code_point, args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True),
                       train_dataset=dataset, processing_class=tokenizer)
    args = IIFGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                         report_to=[])
    with pytest.raises(UserError, match="LoRA"):
        IIFGRPOTrainer(model=lm, reward_funcs=mean_code_point, args=args, train_dataset=dataset,
                       processing_class=tokenizer)


@pytest.mark.parametrize("config", [{"rollout_filter": "pods", "rollout_pods_keep": 4},
                                    {"rollout_filter": "random", "rollout_random_keep": 1.0},
                                    {"rollout_filter": "zero-variance"}], ids=["pods", "random", "zero-variance"])
def test_every_rule_filter_at_keep_all_trains_as_grpo_trainer(tmp_path, config) -> None:
    plain = make_trainer(GRPOTrainer, tmp_path=tmp_path / "plain")
    plain.train()
    filtered = make_trainer(IIFGRPOTrainer, tmp_path=tmp_path / "filtered", **config)
    filtered.train()
    assert filtered.influence_keep.all()  # mean_code_point differs within every group: nothing to drop
    after_plain, after_filtered = lora_state(plain), lora_state(filtered)
    assert all(torch.equal(after_plain[k], v) for k, v in after_filtered.items())


def test_rule_filters_mask_what_they_drop(tmp_path) -> None:
    for config, expected in [({"rollout_filter": "advantage-sign"}, lambda a: a >= 0),
                             ({"rollout_filter": "pods", "rollout_pods_keep": 2}, None)]:
        trainer = make_trainer(tmp_path=tmp_path / config["rollout_filter"], **config)
        batch = generation_batch(trainer)
        keep = trainer.influence_keep
        if expected is not None:
            assert torch.equal(keep, expected(batch["advantages"].cpu()))
        else:
            assert keep.reshape(-1, 4).sum(1).tolist() == [2, 2]
        assert not batch["completion_mask"][~keep].any() and 0 < int(keep.sum()) < len(keep)


def test_a_trl_whose_batch_moved_is_refused_loudly() -> None:
    """The one surface the integration reads (GRPOTrainer._generate_and_score_completions's batch)."""
    from rlinfluence.integrations.trl import BATCH_KEYS, _check_surface

    assert hasattr(GRPOTrainer, "_generate_and_score_completions")
    _check_surface(dict.fromkeys(BATCH_KEYS))
    with pytest.raises(UserError, match="has no completion_mask"):
        _check_surface({k: None for k in BATCH_KEYS if k != "completion_mask"})
