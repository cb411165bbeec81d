"""The rejection sampler: accept a prefix of each speculative proposal, add one target token.

A decoding request with ``k`` proposed tokens ``d_1 .. d_k`` runs as a ``(k+1)``-token row
``[x, d_1, .., d_k]`` in the engine's batched forward pass; row ``i`` of its logits is the
target model's distribution ``p_i`` after ``d_i``. :func:`verify` then:

- greedy rows (``temperature == 0``, or a temperature so small that it overflows
  float32) accept while the target's argmax equals the proposal, then take the target's
  argmax: the output is token for token what greedy decoding without speculation gives;
- sampled rows use the rejection rule of Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding" (Algorithm 1) / Chen et al. 2023, "Accelerating
  Large Language Model Decoding with Speculative Sampling" (Algorithm 2): accept ``d_i``
  with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection draw from
  ``normalize(max(0, p_i - q_i))``; when all ``k`` are accepted draw a bonus token from
  ``p_k``. Each emitted token is then distributed exactly as under ``p``, the
  distribution :func:`~mlx_ferrum.engine.sampling.process_logits` gives, the one
  :func:`~mlx_ferrum.engine.sampling.sample` draws from. A deterministic proposal
  (n-gram) has ``q_i`` = a point mass on ``d_i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .sampling import ProcessedLogits, SamplerState, process_logits

__all__ = ["Proposal", "Verified", "verify", "token_logprobs", "distributions", "draw", "uniforms"]


@dataclass
class Proposal:
    """Proposed tokens of one request.

    Attributes:
        token_ids: ``d_1 .. d_m`` with ``0 <= m <= k``.
        draft_probs: ``[m, vocab]`` float64 numpy: the distribution ``q_i`` each ``d_i``
            was drawn from, or None for a deterministic proposal (a point mass on ``d_i``).
    """

    token_ids: list[int]
    draft_probs: Optional[np.ndarray] = None


@dataclass
class Verified:
    """Result of verifying one proposal: ``token_ids`` (the accepted ``d_1 .. d_n`` and
    one target token, so ``n + 1`` ids) and ``num_accepted`` (``n``)."""

    token_ids: list[int]
    num_accepted: int


def uniforms(state: SamplerState, n: int) -> np.ndarray:
    """``n`` uniforms in [0, 1) from the request's own key (split once)."""
    return np.array(mx.random.uniform(shape=(n,), key=state.next_key()), dtype=np.float64)


def draw(weights: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of an index from non-negative ``weights`` with the uniform ``u``."""
    cdf = np.cumsum(weights)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(i, len(weights) - 1)


def token_logprobs(logits: mx.array, token_ids: Sequence[int], top: int):
    """Log-probabilities under the raw logits, as :func:`sample` reports them.

    Args:
        logits: ``[R, V]`` raw logits.
        token_ids: ``R`` chosen ids.
        top: how many top alternatives per row (0 = none).

    Returns:
        ``(chosen [R] list of float, top_ids [R][top] or None, top_logprobs [R][top] or None)``.
    """
    raw = logits.astype(mx.float32)
    logp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    idx = mx.array(list(token_ids), dtype=mx.int32).reshape(-1, 1)
    chosen = mx.take_along_axis(logp, idx, axis=-1).reshape(-1).tolist()
    if top <= 0:
        return chosen, None, None
    k = min(top, raw.shape[-1])
    part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
    part_lp = mx.take_along_axis(logp, part, axis=-1)
    order = mx.argsort(-part_lp, axis=-1)
    return chosen, mx.take_along_axis(part, order, axis=-1).tolist(), mx.take_along_axis(part_lp, order, axis=-1).tolist()


def _distributions(chain: ProcessedLogits, argmax: mx.array) -> Optional[mx.array]:
    """``[R, V]`` float32 sampling distributions of the chain's rows (a point mass on the
    argmax where a row must take it), or None when every row is greedy."""
    if chain.filtered is None:
        return None
    point_mass = mx.arange(chain.filtered.shape[-1])[None, :] == argmax[:, None]
    return mx.where(chain.take_argmax[:, None], point_mass.astype(mx.float32), mx.softmax(chain.filtered, axis=-1))


def distributions(chain: ProcessedLogits) -> tuple[mx.array, Optional[mx.array]]:
    """The argmax ``[R]`` and the sampling distributions ``[R, V]`` (None when every row is
    greedy) of a processed chain: what a proposer draws its draft tokens from.

    Rows that must take the argmax (a tiny temperature) get a point mass on it.
    """
    argmax = mx.argmax(chain.penalised, axis=-1)
    return argmax, _distributions(chain, argmax)




def verify(logits: Sequence[mx.array], proposals: Sequence[Proposal], states: Sequence[SamplerState],
           also: Sequence[mx.array] = (), allowed: Optional[Sequence[Optional[mx.array]]] = None) -> list[Verified]:
    """Accept a prefix of each proposal and add one target token (see the module docstring).

    Args:
        logits: per request, ``[m_b + 1, V]`` target logits for ``[x, d_1 .. d_m]``.
        proposals: per request, its :class:`Proposal` (``m_b`` tokens).
        states: per request, its sampler state. Sampled rows split its key once; the
            history is read, not changed (the caller appends the emitted tokens).
        also: arrays of the caller's evaluated in the same ``mx.eval`` as the
            acceptance's own (one wait for the device instead of two).
        allowed: optional, per request, a ``[m_b + 1, ceil(V / 32)]`` int32 packed token
            bitmask (its grammar's state after each draft prefix) or None (unconstrained):
            acceptance and the bonus token follow the grammar.

    Returns:
        One :class:`Verified` per request.

    Raises:
        ValueError: a logits block does not have ``m_b + 1`` rows.
    """
    params, histories, generated = [], [], []
    for lg, prop, st in zip(logits, proposals, states):
        m = len(prop.token_ids)
        if lg.shape[0] != m + 1:
            raise ValueError(f"verify got {lg.shape[0]} logits rows for {m} proposed tokens: expected {m + 1}")
        penalised = st.params.presence_penalty != 0.0 or st.params.frequency_penalty != 0.0
        for i in range(m + 1):
            params.append(st.params)
            histories.append(st.history + prop.token_ids[:i] if st.params.repetition_penalty != 1.0 else st.history)
            generated.append(st.history[st.num_prompt_tokens:] + prop.token_ids[:i] if penalised else [])
    rows = mx.concatenate(list(logits), axis=0)
    masks = None
    if allowed is not None and any(a is not None for a in allowed):
        words = (rows.shape[-1] + 31) // 32
        masks = mx.concatenate([a.astype(mx.int32) if a is not None else mx.full((lg.shape[0], words), -1, mx.int32)
                                for lg, a in zip(logits, allowed)], axis=0)
    chain = process_logits(rows, params, histories, generated, allowed=masks)
    argmax_array = mx.argmax(chain.penalised, axis=-1)
    probs_array = _distributions(chain, argmax_array)
    # one wait for everything the host reads (and for ``also``, the caller's arrays)
    mx.eval(argmax_array, *([] if probs_array is None else [probs_array]), *also)
    argmax = argmax_array.tolist()
    probs = np.array(probs_array, dtype=np.float64) if probs_array is not None else None

    out: list[Verified] = []
    off = 0
    for prop, st in zip(proposals, states):
        d = prop.token_ids
        m = len(d)
        if st.params.greedy:
            n = 0
            while n < m and argmax[off + n] == d[n]:
                n += 1
            out.append(Verified(d[:n] + [argmax[off + n]], n))
        else:
            u = uniforms(st, m + 1)
            tok: Optional[int] = None
            n = 0
            while n < m:
                p = probs[off + n]
                q_d = 1.0 if prop.draft_probs is None else prop.draft_probs[n][d[n]]
                if u[n] * q_d < p[d[n]]:  # u < p/q without dividing by a zero q
                    n += 1
                    continue
                if prop.draft_probs is None:
                    residual = p.copy()
                    residual[d[n]] = 0.0
                else:
                    residual = np.maximum(p - prop.draft_probs[n], 0.0)
                if residual.sum() <= 0.0:  # only by rounding: p == q, so p itself is exact
                    residual = p
                tok = draw(residual, u[m])
                break
            if tok is None:
                tok = draw(probs[off + m], u[m])
            out.append(Verified(d[:n] + [tok], n))
        off += m + 1
    return out
