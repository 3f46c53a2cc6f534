"""PPO's hyperparameters: ``PPOConfig``, their coercion from text and JSON, their validation.

This module imports no torch (nor gymnasium, scipy or pandas at import time), so that the
command line builds its parsers, ``--help`` included, without them: ``rlinfluence.cli`` imports
every config class from modules like this one and the heavy modules only inside its commands.
The trainer is ``rlinfluence.ppo.PPO``; ``PPOConfig`` is also importable from there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import types
import typing
import warnings
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import numpy as np

from rlinfluence.corruptions import check_corruptions
from rlinfluence.errors import UserError
from rlinfluence.helptext import EmptyMeansNone, StatedDefault, shown_as
from rlinfluence.presets import PRESETS

DEFAULT_ADVANTAGE_NORM: Final = "chunk"  # Final: typed Literal["chunk"], a default for Literal fields
"""How IIF normalises advantages when it scores (``rlinfluence.influence.snapshot_influence``):
in random chunks of batch_size records, as the update's minibatches do (docs/method.md, section 2.2)."""
AUTO = "auto"
"""drop_pct ``auto``: IIF chooses p each round (``rlinfluence.filters``)."""
FILTER_NAMES = ("none", "iif", "random", "advantage", "td-error", "reward-extremes", "dtv", "advantage-sign", "oracle",
                "quarantine")
"""The filters ``rlinfluence.filters.make_filter`` builds (``none`` = standard PPO)."""
DROP_FILTERS = ("iif", "random", "advantage", "reward-extremes", "dtv", "advantage-sign")
"""The filters that drop ``drop_pct`` % of the records; to the others p means nothing."""


LIMITS: dict[str, int] = {"n_envs": 1024, "eval_envs": 1024, "torch_threads": 512, "hidden_sizes": 8192,
                          "n_epochs": 10_000, "eval_episodes": 1_000_000}
"""Upper bounds of the sizes ``PPOConfig.validate`` accepts (each far above any useful value)."""
MAX_RECORDS = 2**24
"""At most this many records (n_steps * n_envs) per round."""


def check_plain_name(key: str, name: str) -> None:
    """``UserError`` unless ``name`` can be one path component inside its parent folder: not
    empty, no path separator, not ``.`` or ``..``, no NUL (a run directory's name comes from it,
    so it must not reach outside ``--run-root``)."""
    if not name or any(sep in name for sep in "/\\\0") or name in (".", ".."):
        raise UserError(f"{key} must be a plain name (no path separator, not '..'), got {name!r}")


def check_drop_pct(drop_pct: float | str, auto: bool = False) -> None:
    """``UserError`` unless p is in (0, 100] (or ``"auto"`` where the filter chooses p itself)."""
    if drop_pct == AUTO:
        if not auto:
            raise UserError("drop_pct auto chooses p each round for --filter iif only; give this filter a number")
        return
    if isinstance(drop_pct, bool) or not (isinstance(drop_pct, (int, float)) and 0 < drop_pct <= 100):
        raise UserError(f"drop_pct must be in (0, 100], got {drop_pct}" + (" (or auto)" if auto else ""))


def observation_part(text: str) -> tuple[str, str, tuple[int, ...]]:
    """(key, "image" or "flat", shape) of a ``PPOConfig.observation_parts`` entry; ``UserError`` naming
    a malformed one."""
    match = re.fullmatch(r"([^:.]+):(image|flat):(\d+(?:x\d+)*)", text)
    shape = tuple(int(n) for n in match.group(3).split("x")) if match else ()
    if not match or min(shape) < 1 or len(shape) != (3 if match.group(2) == "image" else 1):
        raise UserError(f"observation part {text!r}: expected KEY:image:HxWxC or KEY:flat:N")
    return match.group(1), match.group(2), shape


@dataclass
class PPOConfig:
    """PPO hyperparameters. Defaults are Stable-Baselines3's; ``PPOConfig.for_env`` applies the
    paper's preset for its six environments (SGD 5e-3, no gradient clipping, ...)."""

    env: str = "CartPole-v1"
    """gymnasium env id (presets: FrozenLake-v1, Acrobot-v1, MiniGrid-Empty-8x8-v0, highway-v0,
    LunarLander-v3, BipedalWalker-v3)"""
    seed: int = 1
    """seed of python, numpy, torch (initial policy, sampling, minibatches) and the envs"""
    total_timesteps: int = 100_000
    """environment steps to train for; rounds = ceil(total_timesteps / (n_steps * n_envs))"""
    n_envs: int = 1
    """parallel environments"""
    vec_env: Literal["sync", "async"] = "sync"
    """sync: the envs step in this process, one after the other (gymnasium SyncVectorEnv); async:
    each in its own process (AsyncVectorEnv), for envs whose step is slow; the same numbers either way
    (the CPU clock then counts this process only, not the env workers)"""
    obs_norm_clip: float | None = None
    """observations normalised by running statistics, clipped to +-this (SB3's VecNormalize clip_obs):
    each saved round holds the statistics, which its evaluations and collections apply; None = raw"""
    n_steps: int = 2048
    """steps per environment per round"""
    batch_size: int = 64
    """minibatch size, at most n_steps * n_envs; where it does not divide a round's (kept) records,
    each epoch's last records left over from whole minibatches sit that epoch out (train warns)"""
    n_epochs: int = 10
    """passes over the kept records per round"""
    learning_rate: float = 3e-4
    """constant learning rate"""
    optimizer: Literal["adam", "sgd", "adamw"] = "adam"
    """adam (eps adam_eps), plain sgd (no momentum) or adamw (Adam with decoupled weight_decay);
    state is carried across rounds"""
    adam_eps: float = 1e-5
    """Adam's epsilon (SB3's default)"""
    weight_decay: float = 0.01
    """adamw: the decoupled weight decay (torch's default); the other optimisers take none"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    clip_range: float = 0.2
    """PPO ratio clip epsilon"""
    clip_range_vf: Annotated[float | None, shown_as("FLOAT")] = None
    """value clip around the old value; None = no value clipping"""
    normalize_advantage: bool = True
    """normalise advantages within each minibatch"""
    ent_coef: float = 0.0
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: Annotated[float | None, shown_as("FLOAT")] = 0.5
    """global gradient-norm clip; None = no clipping (as the paper's code ran)"""
    target_kl: Annotated[float | None, shown_as("FLOAT")] = None
    """stop the round's update once approx_kl > 1.5 * target_kl (SB3); None = never"""
    adaptive_kl: Annotated[float | None, shown_as("FLOAT")] = None
    """KL-adaptive learning rate (RSL-RL's adaptive schedule): before each optimiser step the rate
    is divided by 1.5 when the minibatch's approx_kl > 2 * adaptive_kl and multiplied by 1.5 when
    0 < approx_kl < adaptive_kl / 2, kept within [learning_rate / 100, 10 * learning_rate] and
    carried from round to round (in the checkpoint); None = a constant rate"""
    filter: Literal["none", "iif", "iif-robust", "random", "advantage", "td-error", "reward-extremes",
                    "dtv", "advantage-sign", "oracle", "quarantine"] = "none"
    """records to drop before each update: none = standard PPO; iif = influence-based filtering
    (the paper's); iif-robust = iif with ROBUST_IIF's options (drop_pct auto; docs/results/variants.md);
    dtv = records whose policy gradient opposes the buffer's mean one (no target);
    advantage-sign = the most negative-advantage records (as many of the negatives as iif drops);
    oracle = exactly the records a --corrupt corruption changed (the ceiling of any detector);
    quarantine = every record of the sources (training envs) that the audit's test over the last
    quarantine_window rounds flags, until they test clean again"""
    quarantine_window: int = 6
    """quarantine: the rounds its test looks back over (the smallest p with 7 sources is 7^-window)"""
    quarantine_alpha: float = 0.01
    """quarantine: the family-wise error rate of each round's test (the chance of a false quarantine
    in a round of a clean run is at most this)"""
    quarantine_guarantee: Literal["round", "run"] = "round"
    """quarantine: round = each round's test at quarantine_alpha; run = each at quarantine_alpha / the
    run's planned rounds, so that a clean run has at most quarantine_alpha chance of any false
    quarantine in all its planned rounds (Bonferroni; its cost in early flags is measured for the
    audit's per-run level, docs/results/hidden-faults.md, not for this one)"""
    quarantine_attribution: bool = False
    """quarantine: add the gradient families (influence, dtv) to the cheap ones (consistency checks,
    reward, value and advantage statistics)"""
    drop_pct: float | Literal["auto"] = 50.0
    """p in (0, 100]: iif drops p% of the negative records (neg-bottom); baselines p% of records;
    auto (iif): choose p each round from 0, 6.25, 12.5, 25, 50, 100 by a cross-fitted lookahead"""
    drop_mode: Literal["neg-bottom", "bottom", "neg"] = "neg-bottom"
    """iif: neg-bottom = the floor(p N_neg) lowest negatives; bottom = lowest p%; neg = all negatives"""
    advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM
    """iif scoring: advantages normalised in random chunks of batch_size, the whole buffer, or not"""
    random_match: Literal["iif", "pct"] = "iif"
    """random: drop as many records as iif would (iif) or p% of all records (pct)"""
    heuristic: Literal["H1", "H2"] = "H1"
    """advantage: H1 = largest |A_bar - A_hat|, H2 = smallest A_bar * A_hat among sign mismatches"""
    step_control: Literal["none", "norm", "kl"] = "none"
    """filtered rounds: norm = scale the round's learning rate by |g_all| / |g_kept|, the lengths
    of the policy-gradient of all and of the kept records at theta(k), so that dropping records
    (whose gradients disagreed with the rest) does not lengthen the update step; kl = scale it by
    sqrt(KL_all / KL_kept), the approx_kl (on the whole buffer) after one probe epoch on all and on
    the kept records, so the round's KL stays at the level the unfiltered update would reach"""
    precondition: Literal["none", "adam"] = "none"
    """iif/random scores: adam = <grad l_i, P^-1 grad f> with P Adam's diagonal preconditioner
    (bias-corrected second moments + eps) before the round's update; needs --optimizer adam"""
    gate: Literal["none", "split-half"] = "none"
    """iif/random: split-half = filter only if the return target's gradients on two random halves
    of the buffer's episodes agree (cosine >= gate_threshold); otherwise keep every record"""
    gate_threshold: float = 0.3
    """the split-half reliability (cosine) below which a round is not filtered"""
    validation_steps: int = 0
    """iif/random scoring target: 0 = the buffer itself (the authors); k > 0 = a separate rollout
    of k steps per env with pi_theta(k) on its own envs each round (extra env steps, counted in
    validation_env_steps, its time in train_seconds)"""
    corrupt: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """corruptions of the training rollout with ground truth, KIND:key=value,... (repeatable):
    reward-flip:envs=K, reward-noise:frac=F,scale=S, trigger:frac=F,bonus=B, stale:frac=F,lag=L,
    action-mismatch:envs=K,mode=actuator|log, reward-delay:envs=K,lag=L,
    done-flag:envs=K,mode=truncation-as-termination|termination-as-truncation,
    obs-bug:envs=K,mode=scale|swap|lag, logp-mismatch:envs=K,temperature=T; kinds with envs=K also
    take from=R (broken from round R); the envs broken are printed at the start
    (rlinfluence.corruptions); evaluation always sees the clean reward"""
    trusted_envs: int = 0
    """the last K training envs are a trusted source: never corrupted (their records still train)"""
    scoring_target: Literal["buffer", "trusted"] = "buffer"
    """iif/random's return target: buffer = computed on the scored buffer itself (the paper's),
    trusted = on the trusted envs' records only, so corrupted records do not judge themselves"""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """hidden layers of the actor MLP, and of the critic's unless critic_hidden_sizes is given"""
    critic_hidden_sizes: tuple[int, ...] | None = None
    """hidden layers of the critic MLP (None: hidden_sizes)"""
    activation: Literal["tanh", "relu"] = "tanh"
    """the actor's and critic's hidden activation"""
    encoder: Literal["auto", "flatten", "cnn", "nature"] = "auto"
    """observation encoder; auto = CNN for HWC uint8 images, else flatten; nature = SB3's CnnPolicy
    extractor (NatureCNN) with features_dim features"""
    features_dim: int = 512
    """the nature encoder's features per image (SB3's features_dim, or cnn_output_dim of a Dict's images)"""
    observation_parts: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """for the nature encoder on a flattened Dict observation (SB3's MultiInputPolicy with images): its
    parts in order, each KEY:image:AxBxC (an image of that shape as the env makes it, through its own
    NatureCNN) or KEY:flat:N (as it is); empty: one image"""
    eval_episodes: int = 50
    """stochastic-policy evaluation episodes per round (0 = no evaluation)"""
    eval_every: int = 1
    """evaluate after every N-th round and after the last (the rounds between log no evaluation:
    their eval_return_mean is empty); explain and the comparisons need every round's"""
    eval_envs: int = 16
    """evaluation environments stepped in one batch"""
    eval_seed: int = 100_000
    """episode e of every evaluation is reset with seed eval_seed + e (shared by all methods)"""
    torch_threads: int = 1
    """torch CPU threads (small networks run fastest on one)"""
    device: str = "cpu"
    """where the policy, its optimiser, each round's update and the influence scores run: cpu, cuda,
    cuda:N or auto (cuda if available); the envs step on the CPU whatever it is, and a small MLP
    trains fastest on the CPU (a GPU pays for image encoders and wide networks). The analyses of a
    saved run read it on the CPU"""
    run_root: str = "runs"
    """parent folder of run directories"""
    method: Annotated[str | None, StatedDefault, shown_as("NAME")] = None
    """method label in the run directory name (default: ppo, or the filter's name)"""
    save_checkpoints: bool = True
    """write checkpoints/round_XXXX.pt after every round (needed for --resume)"""
    save_buffers: bool = False
    """also save every round's buffer and minibatch schedule (for attribution and analyses)"""
    save_frames: bool = False
    """with save_buffers: also save a small rendered frame of every record (frames/round_XXXX.npz),
    shown with the top and bottom records by diagnose, attribute --html, timeline and report"""
    record_minibatches: bool = False
    """keep, for every optimiser step, its minibatch record indices and lr (full TracIn)"""
    tracin: bool = False
    """score every record by full local TracIn (return target) inside the round's own update,
    without a replay: saved with --save-buffers (audit --scorer tracin reads it), its time logged
    as tracin_seconds"""
    compile: bool = False
    """torch.compile the update's minibatch loss, forward and backward (on the CPU it needs a C++
    compiler): its updates about 30% faster once compiled, a few seconds to compile, so it pays on
    long runs; float rounding differs from the eager update (not bit for bit); not with tracin"""
    update_engine: Literal["auto", "torch", "numpy"] = "auto"
    """how the update's minibatch steps run: torch (autograd), or numpy (the same loss, its gradient
    written out, the optimiser's step on one flat vector: several times faster steps at small
    minibatches; MLP policies on the CPU with SGD or Adam; float32 rounding differs from torch's,
    so not bit for bit; not with tracin or compile); auto: numpy wherever it covers the run, torch
    elsewhere (tracin and compile included: such a run is not the same run without them), said once
    and recorded in config.json; comparisons pin torch unless --set"""
    tensorboard: bool = True
    """write TensorBoard event files"""
    wandb: bool = False
    """also log every round to Weights & Biases (pip install 'rlinfluence[wandb]'; WANDB_MODE=offline
    logs locally, to WANDB_DIR)"""
    wandb_project: str = "rlinfluence"
    """the W&B project of --wandb"""
    wandb_group: Annotated[str | None, StatedDefault, shown_as("NAME")] = None
    """the W&B group of --wandb (compare --wandb: the comparison's folder name; default: none)"""
    wandb_tags: Annotated[tuple[str, ...], EmptyMeansNone] = ()
    """W&B tags of --wandb (compare --wandb: the method and the env)"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        # iif-robust is stored expanded, so that config.json says what ran; a conflicting option
        # leaves it unexpanded for validate() to refuse (tyro would box an error raised here)
        if self.filter == "iif-robust" and not self._robust_conflicts():
            for key, robust in ROBUST_IIF.items():
                setattr(self, key, robust)
            self.filter, self.method = "iif", self.method or "iif-robust"

    def _robust_conflicts(self) -> list[str]:
        """The ROBUST_IIF options set to another value than their default and iif-robust's."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [f"iif-robust sets {key}={robust}, got {key}={getattr(self, key)}" for key, robust in ROBUST_IIF.items()
                if getattr(self, key) not in (defaults[key], robust)]

    def check_filter_options(self) -> None:
        """``UserError`` for an option the configured filter ignores (a filter object given to the
        trainer reads what it wants, so only the trainer's own filter is checked)."""
        if self.scoring_target == "trusted" and self.filter not in ("iif", "random"):
            raise UserError(f"scoring_target trusted sets the return target of iif (and random's matched count); "
                            f"--filter {self.filter} scores nothing against it")

    @classmethod
    def for_env(cls, env: str, **overrides: Any) -> PPOConfig:
        """The paper's preset for ``env`` (if it has one), then ``overrides``; with
        ``filter="iif-robust"`` the preset's values of ROBUST_IIF's options give way to it."""
        preset = dict(PRESETS[env].config_overrides()) if env in PRESETS else {}
        if overrides.get("filter") == "iif-robust":  # its options replace the preset's (MiniGrid's p = 12.5)
            preset = {k: v for k, v in preset.items() if k not in ROBUST_IIF}
        return cls(env=env, **{**preset, **overrides})

    @property
    def method_label(self) -> str:
        return self.method or ("ppo" if self.filter == "none" else self.filter)

    @property
    def rollout_size(self) -> int:
        return self.n_steps * self.n_envs

    @property
    def rounds(self) -> int:
        return math.ceil(self.total_timesteps / self.rollout_size)

    def _check_device(self) -> None:
        """``UserError`` for a device name outside auto|cpu|cuda|cuda:N, for the options that run on
        the CPU only with another device, and (torch imported here) for CUDA this machine lacks."""
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise UserError(f"unknown device {self.device!r} (choose auto, cpu, cuda or cuda:N)")
        if self.device != "cpu":
            cpu_only = {"--filter quarantine": self.filter == "quarantine", "--step-control": self.step_control != "none",
                        "--gate": self.gate != "none", "--drop-pct auto": self.drop_pct == "auto", "--tracin": self.tracin}
            for option, used in cpu_only.items():
                if used:
                    raise UserError(f"{option} runs on the CPU only (its checks read the policy in NumPy or replay "
                                    f"the update there): use --device cpu, not {self.device}")
        from rlinfluence.device import resolve_device  # torch: imported when a run is validated

        resolve_device(self.device)

    def validate(self, check_env: bool = True) -> None:
        """Raise ``UserError`` naming the first invalid value (``check_env`` False: the env is not
        built, for a run read where its env cannot be re-created)."""
        check_field_types(self, FIELD_TYPES)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{f.name} must be a finite number, got {value}")
            choices = literal_choices(FIELD_TYPES[f.name])  # the Python API, where tyro checked nothing
            if choices and value not in choices:
                raise UserError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        positive_ints = ("total_timesteps", "n_envs", "n_steps", "batch_size", "n_epochs", "features_dim",
                         "eval_envs", "torch_threads", "eval_every")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for part in self.observation_parts:
            observation_part(part)
        if self.obs_norm_clip is not None and (self.obs_norm_clip <= 0 or self.vec_env == "async"):
            raise UserError(f"obs_norm_clip {self.obs_norm_clip} with vec_env {self.vec_env}: the clip must be > 0, "
                            "and the statistics live in this process (vec_env sync)")
        # sizes that would take the machine down (minutes of env building, an allocator error,
        # a thread pool out of memory) are refused up front with the limit
        for name, limit in LIMITS.items():
            if name == "hidden_sizes":
                for field, sizes in (("hidden_sizes", self.hidden_sizes), ("critic_hidden_sizes", self.critic_hidden_sizes)):
                    too_big = [size for size in sizes or () if size > limit]
                    if too_big:
                        raise UserError(f"{field} must each be <= {limit}, got {too_big[0]}")
            elif getattr(self, name) > limit:
                raise UserError(f"{name} must be <= {limit}, got {getattr(self, name)}")
        if self.rollout_size > MAX_RECORDS:
            raise UserError(f"n_steps * n_envs = {self.n_steps} * {self.n_envs} = {self.rollout_size} records per "
                            f"round; at most {MAX_RECORDS} fit a round's buffer")
        if not self.learning_rate > 0:
            raise UserError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise UserError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.batch_size > self.rollout_size:
            raise UserError(
                f"batch_size {self.batch_size} must be at most n_steps * n_envs = "
                f"{self.n_steps} * {self.n_envs} = {self.rollout_size}"
            )
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("clip_range", "clip_range_vf", "max_grad_norm", "target_kl", "adaptive_kl"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"{name} must be > 0 (or None), got {value}")
        if self.compile and self.tracin:
            raise UserError("compile and tracin: TracIn records the eager update's layers; choose one")
        if self.update_engine == "numpy" and (self.tracin or self.compile):
            raise UserError(f"update_engine numpy and {'tracin' if self.tracin else 'compile'}: "
                            f"{'TracIn records' if self.tracin else 'compile compiles'} the torch update; choose one")
        if self.adaptive_kl is not None and self.step_control != "none":
            raise UserError(f"adaptive_kl and step_control {self.step_control!r} both set the step's length: choose one")
        if self.filter == "iif-robust":
            raise UserError(f"{self._robust_conflicts()[0]}: use --filter iif to choose the options yourself")
        check_drop_pct(self.drop_pct, auto=self.filter == "iif")
        if self.precondition == "adam" and self.optimizer != "adam":
            raise UserError("precondition adam scores for Adam's step; it needs --optimizer adam, "
                            f"got {self.optimizer}")
        if not -1 <= self.gate_threshold <= 1:
            raise UserError(f"gate_threshold must be in [-1, 1] (a cosine), got {self.gate_threshold}")
        check_corruptions(self.corrupt, self.n_envs, self.trusted_envs, n_rounds=self.rounds)
        if self.filter == "oracle" and not self.corrupt:
            raise UserError("the oracle filter drops the records a corruption changed: it needs --corrupt")
        if self.quarantine_window < 1:
            raise UserError(f"quarantine_window must be >= 1, got {self.quarantine_window}")
        if not 0 < self.quarantine_alpha < 1:
            raise UserError(f"quarantine_alpha must be in (0, 1), got {self.quarantine_alpha}")
        if self.filter == "quarantine":
            # imported here, not with the module: the CLI starts without pandas
            from rlinfluence.sources import MIN_SOURCES

            if self.n_envs - self.trusted_envs < MIN_SOURCES:
                raise UserError(f"the quarantine filter compares each source with 2 or more others: it needs at least "
                                f"{MIN_SOURCES} untrusted envs (n_envs {self.n_envs} - trusted_envs {self.trusted_envs})")
        if self.scoring_target == "trusted" and not self.trusted_envs:
            raise UserError("scoring_target trusted needs trusted_envs >= 1 (the envs its target is computed on)")
        if self.scoring_target == "trusted" and self.validation_steps:
            raise UserError("scoring_target trusted and validation_steps are two scoring targets: choose one")
        for name in ("seed", "eval_seed", "eval_episodes", "validation_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.seed >= 2**32:
            raise UserError(f"seed must be < 2**32, got {self.seed}")
        if not self.adam_eps > 0:
            raise UserError(f"adam_eps must be > 0, got {self.adam_eps}")
        if self.vf_coef < 0:
            raise UserError(f"vf_coef must be >= 0, got {self.vf_coef}")
        if self.tracin and not self.save_buffers:
            raise UserError("--tracin needs --save-buffers (the scores are saved with the round's buffer)")
        if self.save_frames and not self.save_buffers:
            raise UserError("--save-frames needs --save-buffers (frames are kept for the saved rounds' records)")
        for field, sizes in (("hidden_sizes", self.hidden_sizes), ("critic_hidden_sizes", self.critic_hidden_sizes)):
            if any(size < 1 for size in sizes or ()):
                raise UserError(f"{field} must all be >= 1, got {list(sizes)}")
        if self.method is not None:
            check_plain_name("method", self.method)
        self._check_device()
        # the checks that need an env, a renderer or wandb import them here, not at start-up
        from rlinfluence.envs import check_env_id, mc_unavailable_reason
        from rlinfluence.frames import check_renders
        from rlinfluence.rundir import check_wandb_installed

        if not check_env:
            return
        check_env_id(self.env)
        if self.save_frames:
            check_renders(self.env)
        if self.wandb:
            check_wandb_installed()
        if self.filter == "advantage" and (reason := mc_unavailable_reason(self.env)) is not None:
            raise UserError(f"--filter advantage needs Monte-Carlo advantages: {reason}")
        if self.filter in ("iif", "random") and self.batch_size == self.rollout_size:
            warnings.warn(f"{self.filter} with batch_size = n_steps * n_envs = {self.rollout_size} keeps every "
                          "record (its guard keeps at least one full minibatch): this run is plain PPO",
                          UserWarning, stacklevel=2)

    def to_dict(self) -> dict[str, Any]:
        """Every field, but ``drop_pct`` only for a filter that drops p % (``DROP_FILTERS``): config.json
        says what ran (read back, a missing field is its default)."""
        data = dataclasses.asdict(self)
        if self.filter not in DROP_FILTERS:
            del data["drop_pct"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> PPOConfig:
        """The config ``to_dict`` wrote, every value type-checked against its field
        (``UserError`` naming ``source`` and the first bad key). A config without ``update_engine``
        was written before it existed, by a run of the torch update."""
        if not isinstance(data, dict):
            raise UserError(f"{source} is not a JSON object of PPOConfig keys")
        data = {"update_engine": "torch", **data}
        unknown = sorted(set(data) - set(FIELD_TYPES))
        if unknown:
            raise UserError(f"{source}: unknown config keys {unknown}")
        try:
            return cls(**{key: coerce(key, value) for key, value in data.items()})
        except UserError as exc:
            raise UserError(f"{source}: {exc}") from None


FIELD_TYPES: dict[str, Any] = typing.get_type_hints(PPOConfig)


def literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The values a field typed ``Literal[...]`` (possibly ``Annotated``) may take; () for any
    other type (a union with a Literal, as ``float | Literal["auto"]``, is checked by its own rule)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()

ROBUST_IIF: dict[str, Any] = {"drop_pct": "auto"}
"""What ``--filter iif-robust`` sets on top of iif: the option that did best against tuned PPO
among the variants tried on seeds 1-5 (docs/results/variants.md): p chosen each round by the
cross-fitted lookahead, among candidates that include p = 0 (no filtering). Step control and the
gate lost there. Its confirmation on fresh seeds: docs/results/tuned-ppo.md. ``--filter iif``
keeps the paper's behaviour."""


def coerce(key: str, text: str | Any) -> Any:
    """The value of ``PPOConfig.key`` written as ``text`` (JSON where it parses), type-checked.

    ``UserError`` names the key, the value and the expected type.
    """
    key = key.strip().replace("-", "_")
    if key not in FIELD_TYPES:
        raise UserError(f"unknown PPOConfig key {key!r}")
    value = text
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
    try:
        return _check(FIELD_TYPES[key], value)
    except (TypeError, ValueError):
        raise UserError(f"{key}={text!s}: expected {_type_name(FIELD_TYPES[key])}") from None


def _check(tp: Any, value: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(arg, value)
            except (TypeError, ValueError):
                continue
        raise TypeError
    if origin is Literal:
        if value in args:
            return value
        raise ValueError
    if origin is tuple:
        if not isinstance(value, list | tuple):
            value = [value]
        return tuple(_check(args[0], v) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is str:
        return value if isinstance(value, str) else json.dumps(value)
    raise TypeError


def _matches(tp: Any, value: Any) -> bool:
    """Whether ``value`` is of the field type ``tp`` as it stands (no conversion: ``coerce`` reads
    text). An int is a float; a list is a tuple; a ``Literal`` field is checked by its choices."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(value is None if a is type(None) else _matches(a, value) for a in args)
    if origin is Literal:
        return value in args
    if origin is tuple:
        return isinstance(value, list | tuple) and all(_matches(args[0], v) for v in value)
    if tp is bool:
        return isinstance(value, bool | np.bool_)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if tp is str:
        return isinstance(value, str)
    return True


def check_field_types(config: Any, field_types: dict[str, Any]) -> None:
    """``UserError`` naming the first field of the dataclass ``config`` whose value is not of its
    type (the Python API and a hand-edited config.json, where tyro checked nothing: ``n_envs="4"``
    would otherwise fail deep inside, or ``seed=1.5`` be truncated)."""
    for f in dataclasses.fields(config):
        tp, value = field_types[f.name], getattr(config, f.name)
        if literal_choices(tp) or _matches(tp, value):
            continue  # a Literal field: validate names its choices
        raise UserError(f"{f.name} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is tuple:
        return f"a list of {_type_name(args[0])}"
    return "None" if tp is type(None) else tp.__name__
