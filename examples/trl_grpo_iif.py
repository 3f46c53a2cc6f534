"""IIF inside TRL's GRPOTrainer, offline (docs/trl.md).

    python examples/trl_grpo_iif.py                                        # a tiny random GPT-2 built from a config
    python examples/trl_grpo_iif.py --model ~/models/SmolLM2-135M-Instruct --target held-out --max-steps 20
    python examples/trl_grpo_iif.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda   # a Hugging Face id

(A GGUF file will not do: transformers' Trainer refuses to train a GGUF-quantised model; save it
as a float model directory with ``save_pretrained`` first.)

The reward is TRL's quick-start one (completions close to 20 characters). Every generation batch's
most harmful completions (negative influence on the batch's own return target) are dropped from
the loss, and the ``influence/*`` metrics appear next to TRL's own in the log.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from peft import LoraConfig

from rlinfluence.integrations.trl import IIFGRPOConfig, IIFGRPOTrainer
from rlinfluence.rlhf.model import TINY_GPT2, load_base, resolve_device

PROMPTS = [
    "The weather today is", "My favourite food is", "On weekends I like to", "The best way to learn is",
    "A good friend is someone who", "The city at night", "When I wake up I", "The train was late, so",
    "Describe your morning:", "A short note to a neighbour:", "The garden in spring", "Tell me about tea:",
]


def reward_len(completions: list[str], **kwargs) -> list[float]:
    """1 at 20 characters, less the further a completion is from that."""
    return [-abs(20 - len(completion)) / 20 for completion in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_GPT2,
                        help=f"{TINY_GPT2} (random weights, nothing downloaded), a local model directory or a "
                             "Hugging Face id")
    parser.add_argument("--drop-pct", type=float, default=50.0, help="IIF's p: drop floor(p%% of the negative completions)")
    parser.add_argument("--drop-mode", default="neg-bottom", choices=["neg-bottom", "bottom", "neg"])
    parser.add_argument("--target", default="batch", choices=["batch", "held-out"],
                        help="score against the whole batch, or each half of the prompt groups against the other")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (bf16 mixed precision on cuda)")
    parser.add_argument("--output-dir", default="runs/trl_grpo_iif")
    args = parser.parse_args()

    device = resolve_device(args.device)
    model, tokenizer = load_base(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())  # GPT-2 stores weights as (in, out)
    lora = LoraConfig(r=16, lora_alpha=32, fan_in_fan_out=conv1d)  # peft's default target modules

    config = IIFGRPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=16, num_generations=4, max_completion_length=24,
        max_steps=args.max_steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=device.type == "cpu", bf16=device.type == "cuda", seed=0,
        iif_drop_pct=args.drop_pct, iif_drop_mode=args.drop_mode, iif_target=args.target,
    )
    trainer = IIFGRPOTrainer(model=model, reward_funcs=reward_len, args=config, processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora)
    trainer.train()
    for step in trainer.state.log_history:
        if "influence/kept_fraction" in step:
            print(f"step {step['step']}: reward {step['reward']:.3f}  kept {step['influence/kept_fraction']:.3f}  "
                  f"influence {step['influence/seconds']:.3f} s of a {step['step_time']:.3f} s step")


if __name__ == "__main__":
    main()
