"""Scaled dot-product attention and its masks, shared by every attention backend.

:func:`sdpa` is what every backend ends in for dense K/V: the fused
``mx.fast.scaled_dot_product_attention`` on GPUs, :func:`sdpa_base2` on MLX's CPU
backend (where the fused call is itself an unfused composition computing ``exp``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..kernels.exp2 import exp2, exp2_eager, is_fusing
from ..kernels.reference import PREFILL_GROUP_SCORES, causal_attention_base2, weighted_values

_NEG_INF = float("-inf")

_LOG2_E = 1.4426950408889634  # exp(x) == 2 ** (x * log2(e))


def sdpa(q, k, v, scale: float, mask, sinks: Optional[mx.array]) -> mx.array:
    """Scaled dot-product attention on the current device: :func:`sdpa_base2` on MLX's CPU
    backend, ``mx.fast.scaled_dot_product_attention`` elsewhere (same arguments as
    :func:`sdpa_base2`; returns ``[B, num_heads, L_q, head_dim]`` in q's dtype)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return sdpa_base2(q, k, v, scale, mask, sinks)
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks.astype(q.dtype))


def sdpa_base2(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None, sinks: Optional[mx.array] = None) -> mx.array:
    """Scaled dot-product attention with the softmax in base 2 (log2(e) folded into the scale).

    What attention runs on MLX's CPU backend, where ``mx.fast.scaled_dot_product_attention``
    is itself an unfused composition of these ops, computing ``exp``; ``2 ** x`` costs a
    fraction of it there (FlashAttention-2 kernels fold log2(e) the same way). GPUs keep
    the fused kernel.

    Args:
        q: ``[B, num_heads, L_q, head_dim]``; k, v: ``[B, num_kv_heads, L_k, head_dim]``
            (grouped-query attention when ``num_heads > num_kv_heads``).
        scale: softmax scale.
        mask: None, ``"causal"`` (query ``i`` sees keys ``0 .. L_k - L_q + i``), an
            additive float mask or a boolean mask (True: attend), broadcastable to
            ``[B, num_heads, L_q, L_k]``.
        sinks: ``[num_heads]`` attention-sink logits, or None.

    Returns:
        ``[B, num_heads, L_q, head_dim]`` in q's dtype; the softmax is taken in float32.
    """
    b, num_heads, lq, head_dim = q.shape
    num_kv_heads, lk = k.shape[1], k.shape[2]
    if isinstance(mask, str) and not is_fusing() and lq > 1 and b * num_heads * lq * lk > PREFILL_GROUP_SCORES:
        # a long causal pass, op by op: tiles of queries skip the masked half of the scores
        return causal_attention_base2(q, k, v, scale, sinks)
    group = num_heads // num_kv_heads
    rows = group * lq
    qg = (q * (scale * _LOG2_E)).reshape(b, num_kv_heads, rows, head_dim)
    scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32).reshape(b, num_kv_heads, group, lq, lk)
    if isinstance(mask, str):
        allowed = mx.arange(lk)[None, :] <= (mx.arange(lq) + (lk - lq))[:, None]
        scores = mx.where(allowed, scores, _NEG_INF)
    elif mask is not None:
        if mask.ndim == 4:  # [B or 1, H or 1, L_q or 1, L_k] -> the grouped layout
            mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(
                mask.shape[0], num_kv_heads, group, mask.shape[2], mask.shape[3])
        if mask.dtype == mx.bool_:  # True: attend
            scores = mx.where(mask, scores, _NEG_INF)
        else:
            scores = scores + mask.astype(mx.float32) * _LOG2_E
    # op by op (a prefill, a contiguous step), 2**x as one compiled kernel; inside the
    # runner's traced step, the arithmetic that its trace fuses
    power = exp2 if is_fusing() else exp2_eager
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = (sinks.astype(mx.float32) * _LOG2_E).reshape(1, num_kv_heads, group, 1, 1)
        top = mx.maximum(top, sink)
    weights = power(scores - top).reshape(b, num_kv_heads, rows, lk)
    # normalised on the product, not before it: one pass over the scores fewer
    out, denom = weighted_values([(weights, 0)], v)
    if sinks is not None:
        denom = denom + power(sink - top).reshape(b, num_kv_heads, rows, 1)
    return (out / denom).reshape(b, num_heads, lq, head_dim).astype(q.dtype)


def window_mask(qpos: mx.array, kpos: mx.array, window: Optional[int], dtype) -> mx.array:
    """Additive mask broadcast from ``qpos`` and ``kpos`` (positions, int): 0 where ``qpos - window < kpos <= qpos``, else ``-inf``."""
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    return mx.where(allowed, 0.0, _NEG_INF).astype(dtype)



def contiguous_pad_mask(cache_lens_after: list[int], new_tokens: int, dtype) -> Optional[mx.array]:
    """Additive mask ``[B, 1, L, max_len]`` for right-padded contiguous rows.

    Row ``b`` stores ``cache_lens_after[b]`` tokens after this step; its ``L`` new
    tokens are the last ``L`` of them, and query ``j`` may see keys ``0 .. len-L+j``.
    """
    max_len = max(cache_lens_after)
    if len(cache_lens_after) == 1:
        return None
    lens = mx.array(cache_lens_after, dtype=mx.int32)[:, None, None, None]
    kpos = mx.arange(max_len)[None, None, None, :]
    qpos = lens - new_tokens + mx.arange(new_tokens)[None, None, :, None]
    return mx.where(kpos <= qpos, 0.0, _NEG_INF).astype(dtype)
