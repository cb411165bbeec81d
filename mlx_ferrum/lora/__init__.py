"""LoRA adapters: reading PEFT and mlx-lm folders, and the registry of slots a model runner serves.

The per-token product lives in :mod:`mlx_ferrum.layers.lora`; the model runner binds each
pass's slots (``SeqWork.lora_slot``), and the engine maps request adapter names to slots.
"""

from .formats import LoraAdapter, LoraModule, load_adapter, resolve_adapter_path
from .registry import LoraRegistry, adaptable_modules, match_adapter, prefix_salt, salt_token_ids

__all__ = ["LoraAdapter", "LoraModule", "LoraRegistry", "adaptable_modules", "load_adapter", "match_adapter",
           "prefix_salt", "resolve_adapter_path", "salt_token_ids"]
