"""One GRPO + IIF round of SmolLM2-135M-Instruct on a given device: seconds per stage.

    python benchmarks/lm/rlhf_gpu_round.py --device cuda                       # 64 prompts x 4 x 48 tokens, bf16
    python benchmarks/lm/rlhf_gpu_round.py --device cpu --prompts 64 --clock cpu   # the same round on the CPU
    python benchmarks/lm/rlhf_gpu_round.py --device cpu --prompts 8 --group-size 2 --response-length 16   # a check

The sentiment task, the default IIF (f_seq on held-out halves of the round's own prompt groups,
drop every negative sequence), 4 epochs of one-sequence minibatches, LoRA r 16 on q_proj and
v_proj. Before the round one short generation warms the device up (CUDA context, kernels), so
the round's first stage is not charged for it; no evaluation runs. Each of the trainer's stages
ends by reading its results on the host (decoded texts, scores, losses), which waits for the
GPU, so a stage's seconds include its queued device work. Prints ``name: value`` lines: the load and warm-up times, each stage's
seconds, the round's, the kept fraction and the number of optimiser steps.
"""

from __future__ import annotations

import sys  # noqa: E402
import time
from pathlib import Path  # noqa: E402

import torch

from rlinfluence.rlhf import SMOLLM2, RLHFConfig, RLHFTrainer, load_policy, resolve_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

STAGES = ("generation_seconds", "forward_seconds", "reward_seconds", "influence_seconds", "optimisation_seconds",
          "round_seconds")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--records-per-pass", type=int, default=64, help="sequences per forward pass (memory)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (CPU runs only)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    device = resolve_device(args.device)
    if args.clock == "cpu" and device.type == "cuda":
        parser.error("--clock cpu measures host CPU time, not the GPU's: use --clock wall with cuda")
    torch.set_num_threads(args.threads)
    print(f"device: {device}{f' ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else ''}")
    print(f"torch: {torch.__version__}")

    start = time.perf_counter()
    policy = load_policy(SMOLLM2, lora_r=16, lora_alpha=32, seed=args.seed, device=str(device), dtype=args.dtype)
    print(f"model_load_seconds: {time.perf_counter() - start:.2f}")
    print(f"dtype: {policy.lm.get_input_embeddings().weight.dtype}")
    start = time.perf_counter()
    policy.generate(["Warm up."], response_length=4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"warmup_seconds: {time.perf_counter() - start:.2f}")

    config = RLHFConfig(model=SMOLLM2, algo="grpo", filter="iif", seed=args.seed, rounds=2, eval_every=0,
                        prompts_per_round=args.prompts, group_size=args.group_size, response_length=args.response_length,
                        records_per_pass=args.records_per_pass, torch_threads=args.threads, clock=args.clock,
                        device=str(device), dtype=args.dtype, progress=False, tensorboard=False)
    trainer = RLHFTrainer(config, policy=policy, run_dir=False)
    metrics = trainer.train_round()  # round 0 of 2, so no end-of-training evaluation
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        print(f"max_memory_allocated_gib: {torch.cuda.max_memory_allocated(device) / 2**30:.2f}")
    print(f"sequences: {args.prompts} x {args.group_size}, response_length: {args.response_length}, clock: {args.clock}")
    for stage in STAGES:
        print(f"{stage}: {metrics[stage]:.3f}")
    print(f"influence_share_of_round: {metrics['influence_seconds'] / metrics['round_seconds']:.3f}")
    print(f"kept_fraction: {metrics['kept_fraction']:.3f}")
    print(f"optimiser_steps: {metrics['n_updates']}")
    print(f"response_tokens_mean: {metrics['response_tokens_mean']:.1f}")
    print(f"reward_mean: {metrics['reward_mean']:.4f}")


if __name__ == "__main__":
    main()
