"""IIF (influence-based filtering) for Stable-Baselines3's PPO, in a few lines.

Before every update the callback scores each record of SB3's rollout buffer by its snapshot
influence on the return and drops the most harmful ones (12.5% of the negative-influence
records); the filtered buffer then trains on the kept records only.

    pip install "stable-baselines3>=2.4" rlinfluence
    python examples/sb3_iif.py                      # LunarLander-v3, ~100k steps
    python examples/sb3_iif.py --env CartPole-v1 --timesteps 20000
"""

from __future__ import annotations

import argparse

import torch
from stable_baselines3 import PPO
from stable_baselines3.common.evaluation import evaluate_policy

from rlinfluence.integrations.sb3 import FilteredRolloutBuffer, InfluenceFilterCallback

parser = argparse.ArgumentParser()
parser.add_argument("--env", default="LunarLander-v3")
parser.add_argument("--timesteps", type=int, default=102_400)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()

model = PPO(
    "MlpPolicy",
    args.env,
    rollout_buffer_class=FilteredRolloutBuffer,  # 1. a buffer that can train on kept records only
    # the paper's preset (SGD lr 5e-3, no gradient clipping); SB3's defaults work too
    learning_rate=5e-3, n_steps=2048, batch_size=64, n_epochs=10, max_grad_norm=1e10,
    policy_kwargs=dict(optimizer_class=torch.optim.SGD),
    seed=args.seed,
    verbose=1,  # the influence/* numbers appear in SB3's log table (and csv / tensorboard)
)
iif = InfluenceFilterCallback(drop_pct=12.5)  # 2. the filter: target="return", drop_mode="neg-bottom"
model.learn(args.timesteps, callback=iif)

print("kept fraction per round:", [round(h["kept_fraction"], 3) for h in iif.history])
print("scoring seconds per round:", [round(h["seconds"], 3) for h in iif.history])
mean, std = evaluate_policy(model, model.get_env(), n_eval_episodes=20, deterministic=False)
print(f"eval return: {mean:.1f} +/- {std:.1f}")

# The last rollout's scores, in SB3's flat order (record env * n_steps + step); positive =
# helpful. For attribution without filtering call attribute(model, model.rollout_buffer) in your
# own callback's _on_rollout_end (while the policy is still the one that collected the buffer).
print("most harmful records of the last rollout:", torch.argsort(iif.scores)[:5].tolist())
