"""Loading GGUF files (llama.cpp's format) with their quantized tensors kept quantized.

- :mod:`.reader`: open and check the file (the ``gguf`` package's reader), split parts.
- :mod:`.config`: metadata -> ``config.json`` dict, tensor names, q/k un-permutation.
- :mod:`.tensors`: GGUF tensor types -> MLX affine quantization.
- :mod:`.tensors16`: Q6_K / Q3_K / Q2_K blocks -> codes and per-16-weight scales (kept
  exact by :mod:`mlx_ferrum.layers.quantized16`).
- :mod:`.checkpoint`: find the file (path, folder, hub) and convert it for the loader.
- :mod:`.tokenizer`: the ``tokenizers`` tokenizer from ``tokenizer.ggml.*`` metadata.
"""

from .checkpoint import find_gguf, load_gguf_checkpoint, use_group16_modules

__all__ = ["find_gguf", "load_gguf_checkpoint", "use_group16_modules"]
