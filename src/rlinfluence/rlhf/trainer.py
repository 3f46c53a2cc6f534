"""PPO / GRPO for causal LMs with LoRA, and IIF on its sequences (docs/method.md, sections 3.3, 4.5, 5, 9).

One round k:

    1. sample     B prompts of the train split (x group_size responses) with pi_theta(k)
    2. advantages PPO: per-token KL penalty beta (log pi - log pi_ref), reward at the last token,
                  GAE(gamma 1, lambda 0.95), whitened;  GRPO: group-relative scores
    3. filter     IIF: score every sequence (f_seq on held-out halves of the round's own groups,
                  f_seq on a freshly sampled validation rollout, its rewards the proxy's or the
                  gold reward's, or the token-level return target), drop the negatives (or the
                  neg-bottom p%); DTV alike with the round's mean gradient as the target; or a
                  rule of the field: advantage sign, PODS, random (rlinfluence.rlhf.filters)
    4. optimise   ppo_epochs x floor(|kept| / mini_batch_size) Adam steps, fresh permutation per
                  epoch; PPO: L_pg + c_vf L_vf (value head trained), GRPO: clipped + beta k3
    5. KL control beta <- adaptive update with the round's mean KL
    6. evaluate   every eval_every rounds: mean reward (and toxicity) on held-out test prompts
                  (not timed in train_seconds)

``RLHFConfig`` (``rlinfluence.rlhf.config``) holds every hyperparameter and is also the CLI of
``rlinfluence rlhf``.
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from rlinfluence.errors import UserError
from rlinfluence.filters import (
    FilterContext,
    drop_lowest,
    guard_minibatch,
    iif_drop_count,
)
from rlinfluence.influence import ZeroTargetGradient
from rlinfluence.progress import progress_bar
from rlinfluence.rlhf.audit import harm_table, write_harm_table
from rlinfluence.rlhf.config import RLHFConfig  # noqa: F401  (importable from here)
from rlinfluence.rlhf.core import AdaptiveKLController, grpo_loss, mean_response_logp, ppo_losses
from rlinfluence.rlhf.data import GOLD_TASKS, load_prompts
from rlinfluence.rlhf.filters import (
    advantage_sign,
    gold_agreement,
    pods,
    random_subset,
    zero_variance_groups,
)
from rlinfluence.rlhf.influence import heldout_sequence_influence, sequence_influence
from rlinfluence.rlhf.model import PolicyWithValueHead, load_policy
from rlinfluence.rlhf.report import save_completions, write_report
from rlinfluence.rlhf.reward import (
    GOLD_REWARDS,
    RELEVANCE_PROMPT,
    TASK_REWARDS,
    ProfanityReward,
    RelevanceGoldReward,
    RewardFn,
    SentimentReward,
    ShardedReward,
    TriggerReward,
)
from rlinfluence.rlhf.rollout import Rollout, add_advantages, concatenate, sample
from rlinfluence.rundir import RunDirectory, load_checkpoint
from rlinfluence.seeding import derived_seed  # streams: 0 training, 1 validation, 2 evaluation


class RLHFTrainer:
    """``RLHFTrainer(config).learn()`` trains and writes the run directory.

    ``policy``, ``reward_fn`` and the prompt lists default to what ``config`` names (model on
    ``device``, the task's reward, the prompt file's splits); pass them to train on anything
    else. Set ``run_dir=False`` to write nothing.
    """

    def __init__(
        self,
        config: RLHFConfig,
        *,
        policy: PolicyWithValueHead | None = None,
        reward_fn: RewardFn | None = None,
        train_prompts: list[str] | None = None,
        val_prompts: list[str] | None = None,
        test_prompts: list[str] | None = None,
        run_dir: str | Path | RunDirectory | None | Literal[False] = None,
    ):
        config.validate()
        self.config = cfg = config
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.torch_threads)
        self.generator = torch.Generator().manual_seed(cfg.seed)  # prompt order and minibatches
        self.clock = time.process_time if cfg.clock == "cpu" else time.perf_counter

        def prompts(given: list[str] | None, split: str, limit: int | None) -> list[str]:
            chosen = list(given) if given is not None else load_prompts(split, cfg.prompts_file, cfg.task)
            if not chosen:
                raise UserError(f"the {split} prompt set is empty")
            blank = [i for i, p in enumerate(chosen) if not str(p).strip()]
            if blank:
                raise UserError(f"{split} prompt {blank[0]} is empty")
            return chosen[:limit]

        self.train_prompts = prompts(train_prompts, "train", None)
        needs_val = cfg.filter == "iif" and cfg.target == "seq" and cfg.target_source == "fresh"
        self.val_prompts = prompts(val_prompts, "val", cfg.val_prompts) if needs_val else []
        self.test_prompts = prompts(test_prompts, cfg.eval_split, cfg.test_prompts)
        self.reference_reward = reward_fn if reward_fn is not None else TASK_REWARDS[cfg.task]()
        sharded = cfg.reward_workers > 1 or cfg.broken_reward_workers
        self.reward_fn = ShardedReward(self.reference_reward, cfg.reward_workers, cfg.broken_reward_workers) \
            if sharded else self.reference_reward
        self.gold = GOLD_REWARDS[cfg.task]() if cfg.task in GOLD_REWARDS else None
        self.policy = policy if policy is not None else load_policy(
            cfg.model, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules) or None, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
        self.policy.eval()  # no dropout anywhere: the round starts at ratio 1 exactly
        has_template = bool(getattr(self.policy.tokenizer, "chat_template", None))
        self.chat = cfg.prompt_format == "chat" or (cfg.prompt_format == "auto" and cfg.task in ("sentiment", *GOLD_TASKS)
                                                   and has_template)
        if cfg.prompt_format == "chat" and not has_template:
            raise UserError(f"--prompt-format chat: the tokenizer of {cfg.model!r} has no chat template (use plain)")
        self._check_context()
        trainable = self.policy.lora_parameters() + (list(self.policy.v_head.parameters()) if cfg.algo == "ppo" else [])
        self.optimizer = torch.optim.Adam(trainable, lr=cfg.learning_rate, eps=cfg.adam_eps)
        self.kl_ctl = AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
        self.round = 0
        self.sequences = 0
        self.train_seconds = 0.0
        self._order: list[int] = []
        self._initial_eval: dict[str, float] | None = None
        self.last_rollout: Rollout | None = None
        self.last_scores: torch.Tensor | None = None
        self.run: RunDirectory | None = None
        if run_dir is not False:
            name = cfg.model.removeprefix("builtin:").rstrip("/").split("/")[-1].removesuffix(".gguf")
            self.run = (
                run_dir if isinstance(run_dir, RunDirectory)
                else RunDirectory.create(cfg.run_root, f"rlhf-{name}", cfg.method_label, cfg.seed, cfg.tensorboard)
                if run_dir is None else RunDirectory.at(run_dir, cfg.tensorboard)
            )
            self.run.write_config(cfg.to_dict(), written_by="rlinfluence rlhf")

    def _check_context(self) -> None:
        """``UserError`` naming the first prompt that, with ``response_length`` new tokens, does not
        fit the model's context (its position embeddings would be indexed past their end)."""
        config = getattr(getattr(self.policy, "lm", None), "config", None)
        context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        if not isinstance(context, int) or not hasattr(self.policy, "prompt_texts"):
            return
        room = context - self.config.response_length
        for split, prompts in (("train", self.train_prompts), ("val", self.val_prompts), ("test", self.test_prompts)):
            if not prompts:  # the val split where nothing reads it
                continue
            texts = self.policy.prompt_texts(prompts, self.chat)
            lengths = [len(ids) for ids in self.policy.tokenizer(texts, add_special_tokens=not self.chat)["input_ids"]]
            too_long = next((i for i, n in enumerate(lengths) if n > room), None)
            if too_long is not None:
                raise UserError(f"{split} prompt {too_long} ({prompts[too_long][:40]!r}...) is {lengths[too_long]} tokens: "
                                f"with response_length {self.config.response_length} it exceeds the model's context "
                                f"of {context} tokens (shorten it, or lower --response-length)")

    # -- the loop -----------------------------------------------------------------------
    def learn(self) -> RLHFTrainer:
        """Run ``config.rounds`` rounds (evaluating as configured), then write the report. Ctrl-C
        (``KeyboardInterrupt``) saves the last completed round's state as a checkpoint before it
        propagates, whatever ``checkpoint_every``: the completed rounds resume."""
        cfg = self.config
        if self.round == 0:
            self._initial_eval = self.evaluate()
        completed: dict[str, Any] | None = None  # the last completed round's state, not yet checkpointed
        try:
            with progress_bar(cfg.progress, f"rlhf {cfg.method_label}", cfg.rounds, self.round) as advance:
                while self.round < cfg.rounds:
                    m = self.train_round()
                    checkpointed = cfg.checkpoint_every and self.round % cfg.checkpoint_every == 0
                    completed = None if checkpointed or self.run is None else copy.deepcopy(self.state_dict())
                    tox = m.get("test_toxicity", math.nan)
                    advance(f"reward {m['reward_mean']:.3f}  kept {m['kept_fraction']:.2f}  kl {m['kl']:.3f}"
                            + (f"  test tox {tox:.3f}" if math.isfinite(tox) else ""))
        except KeyboardInterrupt:
            if completed is not None:
                self.run.save_checkpoint(completed["round"], completed)
            raise
        if self.run is not None:
            self.save_checkpoint()
            self.run.close()
            write_report(self.run)
        return self

    def _next_prompts(self) -> list[str]:
        cfg = self.config
        picked = []
        while len(picked) < cfg.prompts_per_round:
            if not self._order:
                self._order = torch.randperm(len(self.train_prompts), generator=self.generator).tolist()
            picked.append(self.train_prompts[self._order.pop()])
        return [p for p in picked for _ in range(cfg.responses_per_prompt)]  # groups are consecutive

    def rollout(self, prompts: list[str], stream: int) -> Rollout:
        """Sample and advantage ``prompts`` with pi_theta(k); sampling seeded by (seed, round, stream)
        so that methods sharing a seed see the same sampling noise for the same round."""
        cfg = self.config
        torch.manual_seed(derived_seed(cfg.seed, self.round, stream))
        rollout = sample(self.policy, prompts, self.reward_fn, cfg.response_length, values=cfg.algo == "ppo",
                         temperature=cfg.temperature, records_per_pass=cfg.records_per_pass, chat=self.chat,
                         clock=self.clock)
        return self.add_advantages(rollout)

    def add_advantages(self, rollout: Rollout) -> Rollout:
        """``rlinfluence.rlhf.rollout.add_advantages`` of ``rollout``'s scores with this run's settings
        (algo, the KL coefficient now, gamma, lambda, group size)."""
        cfg = self.config
        return add_advantages(rollout, cfg.algo, self.kl_ctl.value, cfg.gamma, cfg.gae_lambda, cfg.responses_per_prompt)

    def informative_groups(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """DAPO's dynamic sampling: the round's groups whose rewards differ, topped up with such
        groups of new prompts (at most ``max_resample`` extra draws of ``prompts_per_round``
        prompts) to ``prompts_per_round`` groups. The extra sequences sampled and their seconds
        are counted. A round with fewer informative sequences than one minibatch keeps its own
        rollout (``minibatch_guard`` 1; with none at all every advantage is 0 and only the KL
        term moves the policy)."""
        cfg = self.config
        size, wanted = cfg.responses_per_prompt, cfg.prompts_per_round * cfg.responses_per_prompt
        parts, seconds, extra = [], 0.0, 0
        for draw in range(cfg.max_resample + 1):
            if draw:
                start = self.clock()
                more = self.rollout(self._next_prompts(), stream=10 + draw)  # a sampling stream per draw
                seconds += self.clock() - start
                extra += len(more)
            else:
                more = rollout
            parts.append(more.select((~zero_variance_groups(more.scores, size)).nonzero().squeeze(1)))
            if sum(len(p) for p in parts) >= wanted:
                break
        found = [p for p in parts if len(p)]
        informative = min(sum(map(len, found)), wanted)
        stats = {"extra_sequences": float(extra), "extra_generation_seconds": seconds,
                 "informative_groups": float(informative // size),
                 "minibatch_guard": float(informative < cfg.mini_batch_size)}
        if informative < cfg.mini_batch_size:  # too few to fill one minibatch: the round's own rollout
            return rollout, stats
        merged = concatenate(found, self.policy.tokenizer.pad_token_id)
        return merged.select(torch.arange(informative)), stats

    def rule_keep(self, rollout: Rollout, gold: torch.Tensor | None) -> torch.Tensor:
        """The keep mask of a filter that needs no gradient (``rlinfluence.rlhf.filters``); random
        draws are seeded by (seed, round), so a resumed run draws the same."""
        cfg = self.config
        if cfg.filter == "advantage-sign":
            return advantage_sign(rollout.sequence_advantages)
        if cfg.filter == "pods":
            return pods(rollout.scores, cfg.responses_per_prompt, cfg.pods_keep)
        if cfg.filter == "gold-oracle":
            return gold_agreement(rollout.sequence_advantages, gold, cfg.responses_per_prompt)
        generator = torch.Generator().manual_seed(derived_seed(cfg.seed, self.round, 3))
        return random_subset(len(rollout), cfg.random_keep, generator)

    def scores(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """Influence of every sequence of ``rollout`` on the configured target, and timings
        (``val_sample_seconds`` = the fresh validation rollout, 0 without one)."""
        cfg = self.config
        validation, val_sample_seconds = None, 0.0
        if cfg.filter == "iif" and cfg.target == "seq" and cfg.target_source == "fresh":
            t0 = self.clock()
            prompts = [p for p in self.val_prompts for _ in range(cfg.responses_per_prompt)]
            validation = self.rollout(prompts, stream=1)
            if cfg.target_reward == "gold":  # the labelled validation set: its advantages from the gold reward
                validation.scores = self.gold_reward(validation.responses, validation.input_ids, validation.mask,
                                                     validation.ref_logp).to(validation.mask.device)
                self.add_advantages(validation)
            val_sample_seconds = self.clock() - t0
        t1 = self.clock()
        common = self._score_kwargs()
        if cfg.filter == "dtv":
            scores = sequence_influence(self.policy, rollout, target="mean", **common)
        elif cfg.uses_heldout_target:
            scores = heldout_sequence_influence(self.policy, rollout, group_size=cfg.responses_per_prompt, **common)
        else:
            scores = sequence_influence(self.policy, rollout, target=cfg.target, validation=validation, **common)
        t2 = self.clock()
        stats = {"val_sample_seconds": val_sample_seconds, "score_seconds": t2 - t1, "n_negative": float((scores < 0).sum()),
                 "score_mean": float(scores.mean()), "score_std": float(scores.std()) if len(scores) > 1 else 0.0}
        if validation is not None:
            stats["val_reward_mean"] = float(validation.scores.mean())
        return scores, stats

    def train_round(self) -> dict[str, Any]:
        """One round: sample -> advantages -> (IIF) -> optimise -> KL update -> (evaluate) -> log."""
        cfg = self.config
        t0 = self.clock()
        rollout = collected = self.rollout(self._next_prompts(), stream=0)
        stats: dict[str, float] = {}
        if cfg.filter == "dynamic-sampling":
            rollout, stats = self.informative_groups(rollout)
        gold, gold_seconds = None, 0.0
        if self.gold is not None:  # the judge's, not the training's, seconds: kept out of the round's
            start = self.clock()
            gold = self.gold_reward(rollout.responses, rollout.input_ids, rollout.mask, rollout.ref_logp)
            gold_seconds = self.clock() - start
        if cfg.train_reward == "gold":  # the judge is the training reward: its seconds are the round's
            proxy, rollout.scores, gold_seconds = rollout.scores, gold.to(rollout.scores), 0.0
            self.add_advantages(rollout)
            rollout.scores = proxy  # the update reads the advantages; the proxy stays each completion's reward
        t1 = self.clock()
        keep = torch.ones(len(rollout), dtype=torch.bool)
        if cfg.filter in ("advantage-sign", "pods", "random", "gold-oracle"):
            keep = self.rule_keep(rollout, gold)
            context = FilterContext(self.policy, self.round, cfg.mini_batch_size)
            keep = guard_minibatch(keep, rollout.sequence_advantages, context)  # topped up by the best advantages
            stats.update(context.stats)
        elif cfg.filter in ("iif", "dtv"):
            try:
                scores, stats = self.scores(rollout)
            except ZeroTargetGradient as exc:  # no attribution signal: keep every sequence
                warnings.warn(f"round {self.round}: IIF kept every sequence (skipped=1): {exc}", RuntimeWarning, stacklevel=2)
                stats = {"skipped": 1.0, "minibatch_guard": 0.0, "n_negative": 0.0}
                self.last_scores = torch.zeros(len(rollout))
            else:
                keep = drop_lowest(scores, iif_drop_count(scores, cfg.drop_pct, cfg.drop_mode))
                context = FilterContext(self.policy, self.round, cfg.mini_batch_size)
                keep = guard_minibatch(keep, scores, context)
                stats.update(context.stats, skipped=0.0)
                self.last_scores = scores
        audit_seconds = self.audit(collected) if cfg.audit else 0.0
        t2 = self.clock()
        update = self.update(rollout, keep)
        t3 = self.clock()
        kl = rollout.mean_kl
        beta = self.kl_ctl.value
        self.kl_ctl.update(kl, len(rollout))
        self.train_seconds += t3 - t0 - audit_seconds - gold_seconds
        self.sequences += len(rollout)
        self.round += 1
        self.last_rollout = rollout

        metrics: dict[str, Any] = {
            "round": self.round - 1, "env_steps": self.sequences, "train_seconds": self.train_seconds,
            "generation_seconds": rollout.seconds["generation"], "forward_seconds": rollout.seconds["forward"],
            "reward_seconds": rollout.seconds["reward"], "influence_seconds": t2 - t1 - audit_seconds,
            "optimisation_seconds": t3 - t2, "round_seconds": t3 - t0 - audit_seconds - gold_seconds,
            "reward_mean": float(rollout.scores.mean()), "reward_std": float(rollout.scores.std()),
            "kl": kl, "kl_coef": beta, "response_tokens_mean": float(rollout.mask.sum(1).mean()),
            **update, **stats,
        }
        if cfg.audit:
            metrics["audit_seconds"] = audit_seconds
        if gold is not None:
            metrics["gold_mean"] = float(gold.mean())
        if self._initial_eval is not None:  # the evaluation of theta(0), logged with round 0
            metrics.update({f"{k}_initial": v for k, v in self._initial_eval.items()})
            self._initial_eval = None
        if (cfg.eval_every and self.round % cfg.eval_every == 0) or self.round == cfg.rounds:
            metrics.update(self.evaluate())
        if self.run is not None:
            self.run.log_round(metrics, filter_stats=stats.keys())
            save_completions(self.run.path, self.round - 1, rollout, keep,
                             self.last_scores if cfg.filter in ("iif", "dtv") else None, gold)
            if cfg.checkpoint_every and self.round % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        return metrics

    def _score_kwargs(self) -> dict[str, Any]:
        """The loss settings every sequence score of a round takes (``rlinfluence.rlhf.influence``)."""
        cfg = self.config
        return dict(algo=cfg.algo, value_loss=cfg.score_value_loss, vf_coef=cfg.vf_coef, beta=self.kl_ctl.value,
                    records_per_pass=cfg.records_per_pass)

    def audit(self, rollout: Rollout) -> float:
        """Write the harm table of the round's collected ``rollout`` at theta(k)
        (``rlinfluence.rlhf.audit``); the seconds it took (kept out of the round's). The influence
        family only with ``audit_gradient_families``, reusing IIF's scores where they are the same
        held-out f_seq scores of this rollout."""
        cfg = self.config
        start = self.clock()
        if not cfg.audit_gradient_families:
            influence = None
        elif cfg.filter == "iif" and cfg.uses_heldout_target and self.last_scores is not None:
            influence = self.last_scores
        else:
            try:
                influence = heldout_sequence_influence(self.policy, rollout, group_size=cfg.responses_per_prompt,
                                                       **self._score_kwargs())
            except ZeroTargetGradient:  # no attribution signal this round: every sequence scores 0
                influence = torch.zeros(len(rollout))
        workers = self.reward_fn  # a ShardedReward: --audit needs 3 or more reward workers
        table = harm_table(self.round, rollout.scores, rollout.sequence_advantages, influence,
                           torch.as_tensor(self.reference_reward(rollout.responses), dtype=torch.float32),
                           workers.sources(len(rollout)),
                           workers.corrupted(len(rollout)) if cfg.broken_reward_workers else None, cfg.seed)
        if self.run is not None:
            write_harm_table(self.run.path, table)
        return self.clock() - start

    # -- optimise -----------------------------------------------------------------------
    def update(self, rollout: Rollout, keep: torch.Tensor) -> dict[str, float]:
        """``ppo_epochs`` passes over the kept sequences, ``mini_batch_size`` per Adam step (remainder
        dropped); with ``equal_steps`` each epoch takes the unfiltered round's floor(N / mini_batch_size)
        steps, the kept sequences drawn in fresh permutations, one after another, until they fill them."""
        cfg = self.config
        kept = keep.nonzero().squeeze(1)
        n_mb = (len(keep) if cfg.equal_steps else len(kept)) // cfg.mini_batch_size
        if len(kept) < cfg.mini_batch_size:
            raise UserError(f"round {self.round}: {len(kept)} sequences kept, fewer than mini_batch_size {cfg.mini_batch_size}")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        totals = {"policy_loss": 0.0, "value_loss": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0}
        steps = 0
        for _ in range(cfg.ppo_epochs):
            perms = [kept[torch.randperm(len(kept), generator=self.generator)]
                     for _ in range(-(-n_mb * cfg.mini_batch_size // len(kept)))]
            perm = torch.cat(perms)
            for m in range(n_mb):
                mb = rollout.select(perm[m * cfg.mini_batch_size : (m + 1) * cfg.mini_batch_size])
                logp, values = self.policy(mb.input_ids, mb.attention_mask, mb.mask.shape[1], values=cfg.algo == "ppo")
                if cfg.algo == "ppo":
                    pg, vf, st = ppo_losses(logp, mb.logp, mb.token_advantages, values, mb.values, mb.returns,
                                            mb.mask, cfg.clip_range, cfg.clip_range_value)
                    loss = pg + cfg.vf_coef * vf
                    totals["value_loss"] += float(vf.detach())
                else:
                    pg, st = grpo_loss(logp, mb.logp, mb.ref_logp, mb.sequence_advantages, mb.mask,
                                       cfg.clip_range, self.kl_ctl.value)
                    loss = pg
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                self.optimizer.step()
                totals["policy_loss"] += float(pg.detach())
                totals["approx_kl"] += st["approx_kl"]
                totals["clip_fraction"] += st["clip_fraction"]
                steps += 1
        trainable = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not bool(torch.stack([torch.isfinite(p).all() for p in trainable]).all()):  # one device sync
            dtype = next(self.policy.parameters()).dtype  # the base model's embedding
            raise UserError(f"round {self.round}: the update made the trainable weights non-finite (base weights "
                            f"{str(dtype).removeprefix('torch.')} on {self.policy.device}); lower --learning-rate, "
                            "or train over a float32 base (--dtype float32)")
        return {**{k: v / steps for k, v in totals.items()}, "kept_fraction": len(kept) / len(keep), "n_updates": steps}

    # -- the gold judge ----------------------------------------------------------------
    @torch.no_grad()
    def gold_reward(self, texts: list[str], input_ids: torch.Tensor, mask: torch.Tensor,
                    ref_logp: torch.Tensor) -> torch.Tensor:
        """The gold reward of completions (a gold task): ``input_ids`` [N, P + R] prompts and
        responses, ``mask`` [N, R] the response tokens, ``ref_logp`` [N, R] their log pi_ref after
        their prompt."""
        if isinstance(self.gold, SentimentReward | TriggerReward):  # a judgement of the text alone
            return self.gold(texts)
        prompted = mean_response_logp(ref_logp, mask)
        if not isinstance(self.gold, RelevanceGoldReward):
            return self.gold(texts, prompted)
        return self.gold(texts, prompted, self.relevance_pmi(input_ids, mask, ref_logp))

    @torch.no_grad()
    def relevance_pmi(self, input_ids: torch.Tensor, mask: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        """[N] pmi(y) = mean_t log pi_ref(y_t | x, y_<t) - mean_t log pi_ref(y_t | x0, y_<t), x0 =
        ``RELEVANCE_PROMPT``: each response (the last R tokens of ``input_ids``, ``mask`` [N, R])
        re-scored by the reference model after the neutral prompt (no sampling, so no random draw
        is consumed); ``ref_logp`` [N, R] is its log pi_ref after its own prompt."""
        n, length = mask.shape
        device = self.policy.device
        neutral = self.policy.tokenizer(self.policy.prompt_texts([RELEVANCE_PROMPT], self.chat), return_tensors="pt",
                                        add_special_tokens=not self.chat)
        ids = torch.cat([neutral.input_ids.to(device).expand(n, -1), input_ids[:, -length:].to(device)], 1)
        attention = torch.cat([neutral.attention_mask.to(device).expand(n, -1), mask.to(device).long()], 1)
        step = self.config.records_per_pass
        unprompted = torch.cat([self.policy(ids[i : i + step], attention[i : i + step], length, values=False,
                                            reference=True)[0] for i in range(0, n, step)])
        return mean_response_logp(ref_logp, mask) - mean_response_logp(unprompted.to(mask.device), mask)

    # -- evaluate -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Test reward of pi_theta: one sampled response per held-out prompt (sampling seeded by
        (seed, round)); ``eval_return_mean`` = mean test reward (for ``rlinfluence report``), and
        ``test_toxicity`` = mean P(offensive) = 1 - mean reward when the reward is ``ProfanityReward``;
        ``eval_gold_mean`` = mean gold reward (a gold task)."""
        cfg = self.config
        start = self.clock()
        torch.manual_seed(derived_seed(cfg.seed, self.round, 2))
        texts, gold = [], []
        for i in range(0, len(self.test_prompts), cfg.records_per_pass):
            out = self.policy.generate(self.test_prompts[i : i + cfg.records_per_pass], cfg.response_length,
                                       cfg.temperature, self.chat)
            chunk = self.policy.decode(out["input_ids"], out["mask"])
            texts += chunk
            if self.gold is not None:
                mask = out["mask"].float()
                logp = self.policy(out["input_ids"], out["attention_mask"], mask.shape[1], values=False, reference=True)[0]
                gold.append(self.gold_reward(chunk, out["input_ids"], mask, logp))
        reward = self.reference_reward  # the evaluation's scorer is sound whatever the training's workers do
        toxic = reward.offensive_probability(texts) if isinstance(reward, ProfanityReward) else None
        rewards = 1 - toxic if toxic is not None else torch.as_tensor(reward(texts), dtype=torch.float32)
        result = {"eval_return_mean": float(rewards.mean()), "eval_return_std": float(rewards.std())}
        if toxic is not None:
            result["test_toxicity"] = float(toxic.mean())
        if self.gold is not None:
            result["eval_gold_mean"] = float(torch.cat(gold).mean())
        result["eval_seconds"] = self.clock() - start
        return result

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """LoRA + value head, optimiser, KL coefficient, RNG, the prompts left of the current pass
        over the train split, and counters (``weights_only`` loadable). Every other draw is seeded
        by (seed, round), so a run resumed from this state continues as if never stopped."""
        return {
            "format": "rlinfluence-rlhf-v1", "model": self.config.model, "round": self.round,
            "sequences": self.sequences, "train_seconds": self.train_seconds,
            "policy": self.policy.trainable_state(), "optimizer": self.optimizer.state_dict(),
            "kl_coef": self.kl_ctl.value, "generator": self.generator.get_state(),
            "prompt_order": torch.tensor(self._order, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "state") -> None:
        """Restore what ``state_dict`` saved; ``UserError`` naming ``source`` if it is not a
        checkpoint of this model's trainable weights."""
        if state.get("format") != "rlinfluence-rlhf-v1" or "prompt_order" not in state:
            raise UserError(f"{source} is not a resumable rlinfluence RLHF checkpoint")
        mine = self.policy.trainable_state()
        theirs = state["policy"]
        if set(theirs) != set(mine) or any(theirs[k].shape != mine[k].shape for k in mine):
            raise UserError(f"{source} holds other trainable weights than {self.config.model!r} with this LoRA config")
        self.policy.load_trainable_state(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.value = float(state["kl_coef"])
        self.generator.set_state(state["generator"])
        self._order = state["prompt_order"].tolist()
        self.round, self.sequences = int(state["round"]), int(state["sequences"])
        self.train_seconds = float(state["train_seconds"])
        self._initial_eval = None  # logged with round 0, which a checkpoint always follows

    @classmethod
    def resume(cls, run_dir: str | Path, **components: Any) -> RLHFTrainer:
        """Continue the run in ``run_dir`` from its newest checkpoint, with its saved config; the
        rows of rounds after that checkpoint are dropped (they are trained again). ``components``:
        the ``policy``, ``reward_fn`` or prompt lists the run was given, if not its config's."""
        run = RunDirectory.open_existing(run_dir)
        run.check_writable()
        config = RLHFConfig.from_dict(run.read_config(), source=repr(str(run.path / "config.json")))
        checkpoint = run.latest_checkpoint()
        trainer = cls(config, run_dir=run, **components)
        trainer.load_state_dict(load_checkpoint(checkpoint), source=repr(str(checkpoint)))
        run.truncate(trainer.round)
        return trainer

    def save_checkpoint(self) -> None:
        if self.run is not None:
            self.run.save_checkpoint(self.round, self.state_dict())

