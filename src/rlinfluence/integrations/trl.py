"""TRL integration: IIF inside TRL's ``GRPOTrainer`` (TRL 1.16), without a fork.

    from peft import LoraConfig
    from rlinfluence.integrations.trl import IIFGRPOConfig, IIFGRPOTrainer

    args = IIFGRPOConfig(output_dir="out", num_generations=4, iif_drop_pct=50, iif_target="held-out")
    trainer = IIFGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                             peft_config=LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    trainer.train()

For every generation batch, right after TRL has sampled the completions and computed their
rewards and group-relative advantages (``_generate_and_score_completions``), and before the
batch is shuffled into micro-batches, the trainer scores every completion i by

    score_i = < grad u_i(theta), grad f(theta) >     at theta = theta(k), over the LoRA A and B
                                                     matrices only (ghost dot products)

    f   = (1/|T|) sum_{j in T} A_j sum_t m_jt log pi(y_jt | x_j, y_j<t)   (a return over completions T)
    u_i = c_i sum_t m_it [ A_i log pi(y_it | x_i, y_i<t) - beta k3_it ]    (completion i's GRPO term)

with T the whole generation batch (``iif_target="batch"``, the default) or, with ``"held-out"``,
the other half of the batch's prompt groups (even- and odd-numbered groups score each other, so a
completion's own term A_i^2 |grad log pi_i|^2 / |T| >= 0 and its group's correlated terms are not
in its score); A the batch's advantages as TRL computed them (``scale_rewards``,
``multi_objective_aggregation`` included); m the loss mask (completion tokens, times TRL's
``tool_mask`` in tool calling); k3 TRL's KL estimate exp(r) - r - 1, r = log pi_ref - log pi
(under ``use_bias_correction_kl``, the default, times TRL's importance ratio: 1 at theta(k), but
with its gradient); c_i = 1/T_i (T_i = sum_t m_it) for the per-sequence losses ``grpo`` and
``sapo``, c_i = 1 for the token-sum losses (``dapo``, ``bnpo``, ``dr_grpo``, ``cispo``, ``luspo``,
``vespo``). -u_i is completion i's part of TRL's loss at ratio 1 up to the loss's positive batch
constant (1/B, 1/num_items, ...), which scales every score alike and so changes no drop decision.
Positive = training on the completion raises f (helpful), negative = harmful. No extra
generation is needed: the target is built from the batch itself.

The lowest scores are dropped as IIF drops records (``rlinfluence.filters.iif_drop_count``):
``neg-bottom`` floor(p% of the negative completions), ``bottom`` floor(p% of all), ``neg`` every
negative one. A dropped completion is masked out of the loss the way TRL masks a truncated one
with ``mask_truncated_completions=True``: its ``completion_mask`` row is zeroed (so it weighs 0 in
every epoch of ``num_iterations``) and ``num_items_in_batch`` (the token count ``dapo``, ``cispo``,
``vespo`` normalise by) counts kept tokens only; the per-sequence losses still average over the
micro-batch's B rows, as TRL does for truncated completions. Nothing is dropped when p gives 0
completions: ``drop_pct=0`` with ``neg-bottom``/``bottom`` trains exactly as ``GRPOTrainer``.

The field's rule filters ride on the same one method (``rollout_filter``: ``advantage-sign``,
``pods``, ``random``, ``zero-variance``; ``rlinfluence.rlhf.filters``), computed from TRL's
advantages and masked the same way. DAPO's refill of dropped groups needs new generations inside
TRL's loop and is not offered here (``rlinfluence rlhf --filter dynamic-sampling`` has it); DTV
is the ``batch`` target above (f = the batch's mean policy-gradient objective). The batch fields
read (``BATCH_KEYS``) are checked on every batch, so a TRL whose surface moved is refused loudly.

Logged through TRL's metrics (``trainer.log``: the console, W&B, TensorBoard, ...):
``influence/kept_fraction``, ``influence/n_negative``, ``influence/n_dropped``,
``influence/skipped`` and ``influence/seconds`` (scoring and masking time per generation batch);
the completions table (``log_completions=True``) gets the columns ``influence`` and ``kept``.
``influence/skipped = 1``: the target had zero gradient (every advantage exactly 0, e.g. equal
rewards within every group), every score is 0 and every completion is kept.

Cost per generation batch: one forward + backward over its completions for grad f, one more for
the scores, ``iif_records_per_pass`` completions at a time (default
``per_device_train_batch_size``, a training micro-batch's memory). Scoring runs in eval mode and
never changes the model (``rlinfluence.influence.unchanged``).

Refused with a ``UserError`` (the scores would not match the loss TRL trains): vLLM generation,
``top_entropy_quantile < 1``, an entropy bonus (``entropy_coef``, ``use_adaptive_entropy``),
``off_policy_mask_threshold``, MoE router losses, vision-language models, several processes
(DDP, DeepSpeed, FSDP), and a model without a trainable peft LoRA adapter. trl is optional; this module needs it (``pip install "rlinfluence[trl]"``).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch import nn

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'rlinfluence.integrations.trl needs trl (an optional dependency): pip install "rlinfluence[trl]"'
    ) from exc

from rlinfluence.errors import UserError
from rlinfluence.filters import DropMode, drop_lowest, iif_drop_count
from rlinfluence.influence import (
    Records,
    ReturnTarget,
    ZeroTargetGradient,
    per_record_dots,
    plan_ghost,
    target_gradient,
    unchanged,
)
from rlinfluence.rlhf.filters import advantage_sign, pods, random_subset, zero_variance_groups
from rlinfluence.rlhf.influence import heldout_halves
from rlinfluence.seeding import derived_seed

__all__ = ["IIFGRPOConfig", "IIFGRPOTrainer", "completion_influence"]

DROP_MODES = get_args(DropMode)
ROLLOUT_FILTERS = ("iif", "advantage-sign", "pods", "random", "zero-variance")
BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch")
"""What this integration reads from ``GRPOTrainer._generate_and_score_completions``'s batch (TRL
1.16): the one surface it rides on; a TRL that changes it is refused loudly (``_check_surface``)."""
TARGETS = ("batch", "held-out")
SEQUENCE_MEAN_LOSSES = ("grpo", "sapo")
"""TRL loss types that average each completion over its own tokens (c_i = 1/T_i)."""
TOKEN_SUM_LOSSES = ("dapo", "bnpo", "dr_grpo", "cispo", "luspo", "vespo")
"""TRL loss types that sum tokens and divide by a batch-wide constant (c_i = 1)."""


@dataclass
class IIFGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus IIF's settings (``iif_*``); every GRPO field keeps its meaning.

    Bad IIF values, and GRPO features the scores cannot follow (module docstring), raise
    ``UserError`` when the config is built.
    """

    iif_drop_pct: float = field(
        default=12.5,
        metadata={"help": "p in [0, 100]: IIF drops floor(p% of the negative completions) (neg-bottom), "
                          "floor(p% of all) (bottom); ignored by neg. 0 trains exactly as GRPOTrainer."},
    )
    iif_drop_mode: str = field(
        default="neg-bottom",
        metadata={"help": "Which completions IIF drops: neg-bottom, bottom or neg (every negative score)."},
    )
    iif_target: str = field(
        default="batch",
        metadata={"help": "The return target: batch (every completion of the generation batch) or held-out "
                          "(each half of the prompt groups scored against the other half)."},
    )
    iif_records_per_pass: int | None = field(
        default=None,
        metadata={"help": "Completions per scoring forward/backward (default per_device_train_batch_size)."},
    )
    rollout_filter: str = field(
        default="iif",
        metadata={"help": "Which completions each generation batch trains on: iif (the influence scores above), "
                          "advantage-sign (A >= 0), pods (rollout_pods_keep of each group, max reward variance), "
                          "random (a rollout_random_keep fraction) or zero-variance (drop the groups of equal "
                          "rewards, DAPO's dynamic sampling without its refill)."},
    )
    rollout_pods_keep: int = field(default=0, metadata={"help": "pods: completions kept per group (0 = half)."})
    rollout_random_keep: float = field(default=0.54, metadata={"help": "random: the kept fraction."})

    def __post_init__(self) -> None:
        super().__post_init__()
        pct = self.iif_drop_pct
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct <= 100:
            raise UserError(f"iif_drop_pct must be a number in [0, 100], got {pct!r}")
        if self.iif_drop_mode not in DROP_MODES:
            raise UserError(f"unknown iif_drop_mode {self.iif_drop_mode!r} (choose {', '.join(DROP_MODES)})")
        if self.iif_target not in TARGETS:
            raise UserError(f"unknown iif_target {self.iif_target!r} (choose {', '.join(TARGETS)})")
        if self.iif_target == "held-out" and self.generation_batch_size < 2 * self.num_generations:
            raise UserError(f"iif_target held-out needs at least 2 prompt groups per generation batch, got "
                            f"generation_batch_size {self.generation_batch_size} / num_generations {self.num_generations}")
        if self.rollout_filter not in ROLLOUT_FILTERS:
            raise UserError(f"unknown rollout_filter {self.rollout_filter!r} (choose {', '.join(ROLLOUT_FILTERS)})")
        if not 0 <= self.rollout_pods_keep <= self.num_generations:
            raise UserError(f"rollout_pods_keep must be in [0, num_generations {self.num_generations}], "
                            f"got {self.rollout_pods_keep}")
        if not 0 < self.rollout_random_keep <= 1:
            raise UserError(f"rollout_random_keep must be in (0, 1], got {self.rollout_random_keep}")
        per_pass = self.iif_records_per_pass
        if per_pass is not None and (isinstance(per_pass, bool) or not isinstance(per_pass, int) or per_pass < 1):
            raise UserError(f"iif_records_per_pass must be a positive int or None, got {per_pass!r}")
        unsupported = {
            "use_vllm=True (the loss is reweighted by vLLM's sampling log-probs)": self.use_vllm,
            f"top_entropy_quantile={self.top_entropy_quantile} (< 1 masks tokens by entropy)":
                self.top_entropy_quantile < 1.0,
            f"entropy_coef={self.entropy_coef} (an entropy bonus)": self.entropy_coef != 0.0,
            "use_adaptive_entropy=True (an entropy bonus)": self.use_adaptive_entropy,
            f"off_policy_mask_threshold={self.off_policy_mask_threshold}": self.off_policy_mask_threshold is not None,
            f"loss_type={self.loss_type!r}": self.loss_type not in SEQUENCE_MEAN_LOSSES + TOKEN_SUM_LOSSES,
        }
        refused = [name for name, used in unsupported.items() if used]
        if refused:
            raise UserError(f"IIF in GRPOTrainer does not support {'; '.join(refused)}: influence scores would not "
                            "match the loss GRPOTrainer trains (docs/trl.md, 'Limits')")


def _check_surface(batch: dict[str, Any]) -> None:
    """``UserError`` if TRL's generation batch lacks a field this integration reads (``BATCH_KEYS``):
    the one place an upgrade of TRL can break it, refused before anything trains on a wrong mask."""
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        import trl

        raise UserError(f"TRL {trl.__version__}'s generation batch has no {', '.join(missing)}: this integration "
                        "rides on TRL 1.16's GRPOTrainer._generate_and_score_completions (pip install 'trl>=1.16,<1.17')")


class _CompletionPolicy(nn.Module):
    """TRL's model behind the interface of rlinfluence's engine: a record is one completion.

    ``obs`` = ``[N, 2, P + C]`` (prompt + completion ids, attention mask), ``actions`` = the loss
    mask ``[N, C]``; ``log_prob(obs, actions)`` = sum_t m_t log pi(y_t). Log-probabilities come from
    the fused LM head GRPOTrainer puts on the model (its temperature), called as the trainer's
    ``_get_per_token_logps_and_entropies`` calls it, but through the model class's own ``forward``:
    that skips the mixed-precision autocast wrapper accelerate puts on the instance (``bf16``),
    under which a LoRA layer's captured input and output gradient differ in dtype; scores are
    therefore taken in the LoRA weights' dtype.
    """

    def __init__(self, trainer: GRPOTrainer):
        super().__init__()
        self.model = trainer.model
        self.trainer = trainer

    def token_log_probs(self, obs: torch.Tensor, n_completion: int) -> torch.Tensor:
        input_ids, attention_mask = obs[:, 0], obs[:, 1]
        labels = input_ids.masked_fill(attention_mask == 0, -100)  # only completion tokens are scored
        labels[:, :-n_completion] = -100
        forward = type(self.model).forward  # not the instance's: accelerate wraps that in autocast
        outputs = forward(self.model, input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                          fused_lm_head=True)
        return outputs.log_probs[:, -n_completion:]

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (self.token_log_probs(obs, actions.shape[1]) * actions).sum(1)

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable LoRA A and B matrices (the parameters influence is attributed over)."""
        params = [p for name, p in self.model.named_parameters() if "lora_" in name and p.requires_grad]
        if not params:
            raise UserError("IIF in GRPOTrainer attributes over LoRA matrices: pass peft_config=LoraConfig(...) "
                            "or a peft model with a trainable LoRA adapter")
        return params


def _completion_objective(policy: _CompletionPolicy, obs: torch.Tensor, loss_mask: torch.Tensor,
                          advantages: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """u_i = c_i sum_t m_it [A_i log pi(y_it) - beta k3_it] per completion, shape [N] (module docstring)."""
    trainer = policy.trainer
    logp = policy.token_log_probs(obs, loss_mask.shape[1])
    per_token = advantages[:, None] * logp
    if trainer.beta != 0.0:  # TRL's KL term (ref_logps are only computed then)
        diff = ref_logps - logp
        k3 = torch.exp(diff) - diff - 1
        if trainer.args.use_bias_correction_kl:  # times TRL's importance ratio: 1, with a gradient
            log_ratio = logp - logp.detach()
            if trainer.importance_sampling_level == "sequence":
                log_ratio = ((log_ratio * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1.0))[:, None]
            k3 = k3 * torch.exp(log_ratio)
        per_token = per_token - trainer.beta * k3
    u = (per_token * loss_mask).sum(1)
    if trainer.loss_type in SEQUENCE_MEAN_LOSSES:
        u = u / loss_mask.sum(1).clamp(min=1.0)
    return u


def completion_influence(trainer: GRPOTrainer, batch: dict[str, Any]) -> torch.Tensor:
    """Influence score of every completion of a generation ``batch`` on its return target, shape [N].

    ``batch`` is what ``GRPOTrainer._generate_and_score_completions`` returns (prompt and
    completion ids and masks, ``advantages``, ``ref_per_token_logps`` when ``beta != 0``);
    ``trainer``'s model must still be theta(k), the one that sampled it. Scores as in the module
    docstring, on the CPU, with the target and completions per pass of ``trainer.args``
    (``iif_target``, ``iif_records_per_pass``; for a plain ``GRPOConfig``: the whole batch and
    ``per_device_train_batch_size``). Raises ``ZeroTargetGradient`` when grad f is exactly zero
    and ``UserError`` when the model has no trainable LoRA parameters.
    """
    policy = _CompletionPolicy(trainer)
    params = policy.lora_parameters()
    n = len(batch["advantages"])
    if getattr(trainer.args, "iif_target", "batch") == "batch":
        pairs = [(torch.arange(n), torch.arange(n))]  # (scored rows, target rows)
    else:  # completions come in consecutive groups of num_generations, one group per prompt
        half = heldout_halves(n, trainer.num_generations)
        halves = [(half == h).nonzero().squeeze(1) for h in (0, 1)]
        pairs = [(halves[0], halves[1]), (halves[1], halves[0])]
    completion_mask = batch["completion_mask"]
    loss_mask = completion_mask if "tool_mask" not in batch else completion_mask * batch["tool_mask"]
    loss_mask = loss_mask.to(torch.float32)
    obs = torch.stack([torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                       torch.cat([batch["prompt_mask"], completion_mask], 1)], 1)
    advantages = batch["advantages"].to(torch.float32)
    ref_logps = batch.get("ref_per_token_logps")
    records = (obs, loss_mask, advantages, torch.zeros_like(loss_mask) if ref_logps is None else ref_logps)
    records_per_pass = getattr(trainer.args, "iif_records_per_pass", None) or trainer.args.per_device_train_batch_size
    scores = torch.zeros(n)
    with unchanged(policy):
        plan = plan_ghost(policy, params)
        for scored, target_rows in pairs:
            index = target_rows.to(obs.device)
            target = Records(obs[index], loss_mask[index], advantages[index])
            direction = target_gradient(ReturnTarget(), policy, params, target, records_per_pass)
            index = scored.to(obs.device)
            scores[scored] = per_record_dots(policy, plan, _completion_objective, tuple(r[index] for r in records),
                                             direction, records_per_pass).cpu()
    return scores


class IIFGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that drops each generation batch's most harmful completions from the loss (IIF).

    Takes ``GRPOTrainer``'s arguments, with ``args`` an ``IIFGRPOConfig``. Scores, drops and
    logs as the module docstring says, in training only (evaluation batches are not filtered).
    ``influence_scores`` and ``influence_keep`` hold the last generation batch's scores and
    keep mask (CPU, in the batch's order before TRL shuffles it into micro-batches).
    """

    args: IIFGRPOConfig

    def __init__(self, model: Any, reward_funcs: Any = None, args: IIFGRPOConfig | None = None, **kwargs: Any):
        if not isinstance(args, IIFGRPOConfig):
            raise UserError(f"IIFGRPOTrainer needs args=IIFGRPOConfig(...) (GRPOConfig plus the iif_* fields), "
                            f"got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, **kwargs)
        unsupported = {
            f"{self.accelerator.num_processes} processes (only one is supported)": self.accelerator.num_processes > 1,
            "DeepSpeed": self.is_deepspeed_enabled,
            "FSDP": self.is_fsdp_enabled,
            "vision-language models": self._is_vlm,
            "a MoE router auxiliary loss (router_aux_loss_coef != 0)": self.aux_loss_enabled,
        }
        refused = [name for name, used in unsupported.items() if used]
        if refused:
            raise UserError(f"IIF in GRPOTrainer does not support {'; '.join(refused)} (docs/trl.md, 'Limits')")
        _CompletionPolicy(self).lora_parameters()  # UserError now rather than at the first batch
        self.influence_scores: torch.Tensor | None = None
        self.influence_keep: torch.Tensor | None = None

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        _check_surface(batch)
        n = len(batch["advantages"])
        if not self.model.training:  # evaluation: nothing is trained, nothing to filter
            self._log_completion_columns([None] * n, [None] * n)
            return batch
        start = time.perf_counter()
        if self.args.rollout_filter != "iif":
            scores, keep, skipped = torch.zeros(n), self._rule_keep(batch["advantages"].detach().cpu()), 0.0
        else:
            try:
                scores = completion_influence(self, batch)
            except ZeroTargetGradient as exc:  # no attribution signal: every score is 0, keep every completion
                warnings.warn(f"IIFGRPOTrainer kept every completion of this batch (influence/skipped = 1): {exc}",
                              RuntimeWarning, stacklevel=2)
                scores, keep, skipped = torch.zeros(n), torch.ones(n, dtype=torch.bool), 1.0
            else:
                drop = iif_drop_count(scores, self.args.iif_drop_pct, self.args.iif_drop_mode)
                keep, skipped = drop_lowest(scores, drop), 0.0
        if not keep.all():  # drop as mask_truncated_completions does; untouched when nothing is dropped
            device_keep = keep.to(batch["completion_mask"].device)
            batch["completion_mask"] = batch["completion_mask"] * device_keep[:, None].to(batch["completion_mask"].dtype)
            loss_mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
            batch["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self.influence_scores, self.influence_keep = scores, keep
        metrics = self._metrics["train"]
        metrics["influence/kept_fraction"].append(float(keep.float().mean()))
        metrics["influence/n_negative"].append(float((scores < 0).sum()))
        metrics["influence/n_dropped"].append(float(n - int(keep.sum())))
        metrics["influence/skipped"].append(skipped)
        metrics["influence/seconds"].append(time.perf_counter() - start)
        self._log_completion_columns(scores.tolist(), keep.tolist())
        return batch

    def _rule_keep(self, advantages: torch.Tensor) -> torch.Tensor:
        """The keep mask of a rule filter (``rlinfluence.rlhf.filters``) from TRL's advantages. Within
        a group they are the rewards up to a positive affine map, so the max-variance subset and the
        equal-reward groups are the rewards' own; random draws are seeded by (seed, step)."""
        args, size = self.args, self.num_generations
        if args.rollout_filter == "advantage-sign":
            return advantage_sign(advantages)
        if args.rollout_filter == "pods":
            return pods(advantages, size, args.rollout_pods_keep)
        if args.rollout_filter == "zero-variance":
            return ~zero_variance_groups(advantages, size)
        generator = torch.Generator().manual_seed(derived_seed(args.seed, self.state.global_step, 3))
        return random_subset(len(advantages), args.rollout_random_keep, generator)

    def _log_completion_columns(self, scores: list[float | None], kept: list[bool | None]) -> None:
        # every batch adds a row per completion to TRL's completions table, so every batch adds these columns
        self._logs["extra"]["influence"].extend(scores)
        self._logs["extra"]["kept"].extend(kept)
