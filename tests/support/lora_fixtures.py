"""Random LoRA adapters in PEFT's folder format for in-memory models (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_ferrum.lora.registry import adaptable_modules, module_dims


def random_peft_adapter(model, folder: Path, seed: int, rank: int = 4, alpha: float = 8.0, std: float = 0.3,
                        leaves=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) -> Path:
    """Write a PEFT LoRA adapter for every ``leaves`` projection of ``model``'s decoder
    layers, ``N(0, std)`` factors (large enough to change greedy tokens); returns ``folder``."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for path, module in sorted(adaptable_modules(model).items()):
        if path.rsplit(".", 1)[-1] not in leaves:
            continue
        fan_in, fan_out = module_dims(module)
        tensors[f"base_model.model.{path}.lora_A.weight"] = mx.array(rng.normal(0, std, (rank, fan_in)).astype(np.float32))
        tensors[f"base_model.model.{path}.lora_B.weight"] = mx.array(rng.normal(0, std, (fan_out, rank)).astype(np.float32))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), tensors)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(leaves), "use_rslora": False,
    }))
    return folder
