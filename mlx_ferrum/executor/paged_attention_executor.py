"""PagedAttentionExecutor: identity projections over the paged KV cache, for verification.

ferrum's deterministic executor (``shared/seeds/PagedAttentionExecutor.txt``): each
token's embedding is a one-hot vector of length ``num_kv_heads * head_dim`` with its
1 at index ``token_id % (num_kv_heads * head_dim)``, and ``Q = K = V = embedding``
(one query head per KV head). Attention runs through the same code as real models
(:func:`~mlx_ferrum.layers.attention.attention` over a
:class:`~mlx_ferrum.kv_cache.PagedKvPool`), so its outputs check the paged path: for
a query whose 1 lies in head ``h0``, head ``h0`` weighs each earlier token ``j`` by
``exp(scale * [token j has the same one-hot index]) / Z`` and every other head weighs
all tokens equally. The logits are the per-head sums of the attention output,
spread across the vocabulary: ``logits[v] = sum(out[v % num_kv_heads])``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..config import RuntimeConfig
from ..kv_cache import LayerGroupKvManager
from ..layers.attention import AttentionMetadata, attention
from .llm_executor import LlmExecutor
from .types import DecodeOutput, PrefillOutput


class IdentityAttentionModel(nn.Module):
    """One attention layer with identity projections; ``[1, T]`` ids -> ``[1, T, vocab]`` logits (float32).

    Positions play no part (no RoPE), so the outputs depend only on which tokens each
    query sees: exactly what the paged cache must get right.
    """

    def __init__(self, vocab_size: int, num_kv_heads: int, head_dim: int, max_position_embeddings: int):
        super().__init__()
        self.dtype = mx.float32
        self.args = SimpleNamespace(
            model_type="identity",
            vocab_size=vocab_size,
            hidden_size=num_kv_heads * head_dim,
            num_hidden_layers=1,
            num_attention_heads=num_kv_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
        )

    def embed(self, input_ids: mx.array) -> mx.array:
        """One-hot ``[B, L, num_kv_heads * head_dim]`` float32 at ``token_id % width``."""
        width = self.args.hidden_size
        return (input_ids[..., None] % width == mx.arange(width)).astype(mx.float32)

    def __call__(self, input_ids: mx.array, meta: Optional[AttentionMetadata] = None) -> mx.array:
        a = self.args
        b, l = input_ids.shape
        x = self.embed(input_ids).reshape(b, l, a.num_key_value_heads, a.head_dim).transpose(0, 2, 1, 3)
        out = attention(x, x, x, meta, 0, a.head_dim ** -0.5)  # [B, H, L, D]
        head_sums = out.sum(axis=-1).transpose(0, 2, 1)  # [B, L, H]
        idx = getattr(meta, "logits_indices", None) if meta is not None else None
        if idx is not None:
            head_sums = head_sums.reshape(-1, a.num_key_value_heads)[idx][None]
        spread = mx.arange(a.vocab_size) % a.num_key_value_heads
        return head_sums[..., spread]


class PagedAttentionExecutor(LlmExecutor):
    """The ``ModelExecutor`` over :class:`IdentityAttentionModel` and a paged KV cache.

    Args:
        vocab_size: logits width.
        num_kv_heads, head_dim: embedding width is their product.
        block_size: tokens per block.
        num_blocks: blocks in the pool (ignored when ``kv_manager`` is given).
        max_seq_len: most tokens per sequence.
        kv_manager: a shared :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager` (as in
            ferrum's ``new(config, kv_manager)``), or None to make one.
        config: other runtime settings; the layout is always paged.

    Attributes:
        prefill_count, decode_count: calls served (batched calls count once per sequence).
    """

    def __init__(
        self,
        vocab_size: int = 64,
        num_kv_heads: int = 2,
        head_dim: int = 8,
        block_size: int = 16,
        num_blocks: int = 64,
        max_seq_len: int = 1024,
        kv_manager: Optional[LayerGroupKvManager] = None,
        config: Optional[RuntimeConfig] = None,
    ):
        model = IdentityAttentionModel(vocab_size, num_kv_heads, head_dim, max_seq_len)
        cfg = config if config is not None else RuntimeConfig(kv_layout="paged")
        cfg.kv_layout = "paged"
        cfg.block_size = kv_manager.block_size if kv_manager is not None else block_size
        cfg.max_num_blocks = kv_manager.num_blocks if kv_manager is not None else num_blocks
        cfg.kv_capacity = max_seq_len
        super().__init__(model, cfg, model_id="paged-attention-identity", manager=kv_manager)
        self.prefill_count = 0
        self.decode_count = 0

    def batch_prefill(self, inputs) -> list[PrefillOutput]:
        """See :meth:`LlmExecutor.batch_prefill`; counts each input in ``prefill_count``."""
        out = super().batch_prefill(inputs)
        self.prefill_count += len(out)
        return out

    def batch_decode(self, inputs) -> list[DecodeOutput]:
        """See :meth:`LlmExecutor.batch_decode`; counts each input in ``decode_count``."""
        out = super().batch_decode(inputs)
        self.decode_count += len(out)
        return out

    def forward_verify(self, inputs) -> list[DecodeOutput]:
        """See :meth:`LlmExecutor.forward_verify`; counts one decode per token."""
        out = super().forward_verify(inputs)
        self.decode_count += len(out)
        return out
