"""Support for the LoRA tests: tiny transformers checkpoints with ``peft`` adapters, the
same adapters in mlx-lm's format, and a greedy loop over ``LlmExecutor.run`` with slots.

Needs torch, transformers and peft (the ``ref`` extra); importing modules skip when
they are missing. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is missing: pip install -e '.[ref]'")
transformers = pytest.importorskip("transformers", reason="transformers is missing: pip install -e '.[ref]'")
peft = pytest.importorskip("peft", reason="peft is missing: pip install -e '.[ref]'")

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 128


def hf_config(family: str):
    """A tiny transformers config: ``"llama"`` or ``"qwen2"`` (q/k/v bias)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.08)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    raise ValueError(family)


def make_base(folder: Path, family: str = "llama", seed: int = 0):
    """Save a random tiny base model with ``save_pretrained``; return the torch model (fp32, eval)."""
    torch.manual_seed(seed)
    config = hf_config(family)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model.save_pretrained(folder)
    return model


def make_peft_adapter(base, folder: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                      targets=tuple(ALL_PROJECTIONS), **lora_kwargs):
    """Wrap ``base`` (a fresh copy of its weights) with a random PEFT LoRA and save it to
    ``folder``; returns the peft model (eval) for the reference logits."""
    import copy

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             lora_dropout=0.0, **lora_kwargs)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # B starts at nn.Linear's init (too large for O(1) logits at rank 4)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    model.eval()
    model.save_pretrained(folder)
    return model


def peft_to_mlx_lm(peft_folder: Path, out: Path) -> Path:
    """Write the PEFT adapter in ``peft_folder`` in mlx-lm's format (``lora_a`` ``[in, r]``,
    ``lora_b`` ``[r, out]``, one scale) into ``out``. Needs one ``r``/``lora_alpha`` for all modules."""
    from safetensors.numpy import load_file

    config = json.loads((peft_folder / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(peft_folder / "adapter_model.safetensors"))
    weights = {}
    keys = set()
    for key, value in tensors.items():
        path = key.removeprefix("base_model.model.")
        module, leaf = path.rsplit(".lora_", 1)
        keys.add(module.split(".", 3)[-1])  # the path inside a layer, e.g. self_attn.q_proj
        weights[f"{module}.lora_{leaf[0].lower()}"] = mx.array(value.T)  # A [r,in]->[in,r], B [out,r]->[r,out]
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": -1,
        "lora_parameters": {"rank": r, "scale": scale, "dropout": 0.0, "keys": sorted(keys)},
    }))
    return out


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """transformers (+ peft) eager forward: ``[len(ids), vocab]`` float32."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from ``generate`` (transformers' own KV cache)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return [int(t) for t in out[0][len(prompt):]]


def run_greedy(executor, prompts: list[list[int]], slots: list[int], n: int, cache_prefix: str = "g"
               ) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill every prompt (all positions' logits) and decode ``n - 1`` more greedy tokens,
    all rows in ONE batch per step, row ``i`` with LoRA slot ``slots[i]``.

    Returns each row's tokens and float32 logits ``[len(prompt) + n - 1, vocab]``; caches released.
    """
    from mlx_ferrum.executor.llm_executor import SeqWork

    ids = [f"{cache_prefix}-{i}" for i in range(len(prompts))]
    outs = executor.run([SeqWork(c, list(p), all_logits=True, lora_slot=s) for c, p, s in zip(ids, prompts, slots)])
    rows = [[np.array(o.astype(mx.float32))] for o in outs]
    tokens = [[int(np.argmax(r[0][-1]))] for r in rows]
    for _ in range(n - 1):
        outs = executor.run([SeqWork(c, [t[-1]], lora_slot=s) for c, t, s in zip(ids, tokens, slots)])
        for i, o in enumerate(outs):
            row = np.array(o.astype(mx.float32))
            rows[i].append(row)
            tokens[i].append(int(np.argmax(row[-1])))
    for c in ids:
        executor.release_cache(c)
    return tokens, [np.concatenate(r, axis=0) for r in rows]


def executor_with(model, layout: str = "paged", max_loras: int = 4, rank: int = 16, eager: Optional[bool] = None,
                  **extra):
    """An ``LlmExecutor`` with LoRA on (small pool)."""
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.executor import LlmExecutor

    kw = dict(kv_layout=layout, enable_lora=True, max_loras=max_loras, max_lora_rank=rank, **extra)
    if layout == "paged":
        kw.update(block_size=8, max_num_blocks=256)
    if eager is not None:
        kw["enforce_eager"] = eager
    return LlmExecutor(model, RuntimeConfig(**kw))
