"""Prompt log-probabilities (vLLM's ``SamplingParams.prompt_logprobs``), computed in the
batched prefill.

A prefill chunk of a request that asks for them returns the logits of every one of its
tokens (``SeqWork.all_logits``). The logits at position ``p`` score the token at
``p + 1``, so a chunk covering positions ``[start, start + n)`` scores prompt tokens
``start + 1 .. start + n`` (those inside the prompt). The scores are built lazily on the
device in the step that computes the chunk (:func:`chunk_scores`), evaluated with it,
and read back on the host only when the request's first output is built
(:func:`materialize`). The first prompt token has no score (``None``), as in vLLM and
in OpenAI's ``echo`` + ``logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

__all__ = ["PromptScoreChunk", "chunk_scores", "wants_prompt_rows", "materialize"]


@dataclass
class PromptScoreChunk:
    """The lazily computed scores of one prefill chunk.

    Attributes:
        start: the prompt position of the first token scored (``>= 1``).
        token_ids: the scored prompt ids (host ints), ``m`` of them.
        logprobs: ``[m]`` float32, ``log_softmax(logits)`` at each scored id.
        top_ids / top_logprobs: ``[m, k]`` int32 / float32, the ``k`` most likely ids per
            position, best first; None when ``k == 0``.
    """

    start: int
    token_ids: list[int]
    logprobs: mx.array
    top_ids: Optional[mx.array] = None
    top_logprobs: Optional[mx.array] = None

    def arrays(self) -> list[mx.array]:
        """The device arrays to evaluate with the step."""
        return [a for a in (self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


def wants_prompt_rows(seq, num_tokens: int) -> bool:
    """True when the chunk of ``num_tokens`` tokens of ``seq`` from ``seq.num_computed``
    must return every row's logits: the request asks for prompt logprobs and the chunk
    scores at least one prompt token it has not scored yet."""
    k = seq.params.prompt_logprobs
    if k is None or seq.prompt_logprobs is not None:
        return False
    return seq.num_computed + 1 < len(seq.prompt_ids) and num_tokens > 0


def chunk_scores(rows: mx.array, prompt_ids: Sequence[int], start_pos: int, k: int) -> Optional[PromptScoreChunk]:
    """Scores of the prompt tokens a chunk's logits predict (lazy).

    Args:
        rows: ``[n, V]`` logits of the chunk's ``n`` tokens (any float dtype), row ``i``
            at sequence position ``start_pos + i``.
        prompt_ids: the whole prompt.
        start_pos: the chunk's first position.
        k: top alternatives to keep per position (``0``: none).

    Returns:
        A :class:`PromptScoreChunk` for positions ``start_pos + 1 ..`` inside the prompt,
        or None when the chunk scores no prompt token (it starts at the prompt's last
        token or later).
    """
    m = min(rows.shape[0], len(prompt_ids) - 1 - start_pos)
    if m <= 0:
        return None
    x = rows[:m].astype(mx.float32)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    targets = [int(t) for t in prompt_ids[start_pos + 1 : start_pos + 1 + m]]
    chosen = mx.take_along_axis(logp, mx.array(targets, dtype=mx.int32).reshape(m, 1), axis=-1).reshape(m)
    chunk = PromptScoreChunk(start=start_pos + 1, token_ids=targets, logprobs=chosen)
    k = min(k, logp.shape[-1])
    if k > 0:
        part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        part_lp = mx.take_along_axis(logp, part, axis=-1)
        order = mx.argsort(-part_lp, axis=-1)
        chunk.top_ids = mx.take_along_axis(part, order, axis=-1)
        chunk.top_logprobs = mx.take_along_axis(part_lp, order, axis=-1)
    return chunk


def materialize(seq) -> Optional[list[Optional[dict[int, float]]]]:
    """``seq.prompt_logprobs``, built from its pending chunks once every prompt token is
    scored (reads the chunks back: call after their step was evaluated).

    Returns:
        None while the request does not ask for them or they are incomplete; else one
        entry per prompt token: ``None`` for the first, then ``{token id: logprob}``
        holding the prompt's own token and the top ``prompt_logprobs`` alternatives
        (vLLM's shape; natural log).
    """
    if seq.params.prompt_logprobs is None:
        return None
    if seq.prompt_logprobs is not None:
        return seq.prompt_logprobs
    n = len(seq.prompt_ids)
    table: list = [None] * n
    for chunk in seq.prompt_score_chunks:  # a recomputed chunk (preemption) overwrites the same values
        lps = chunk.logprobs.tolist()
        tops = (chunk.top_ids.tolist(), chunk.top_logprobs.tolist()) if chunk.top_ids is not None else None
        for j, (tid, lp) in enumerate(zip(chunk.token_ids, lps)):
            entry = {}
            if tops is not None:
                entry.update(zip(tops[0][j], tops[1][j]))
            entry[tid] = lp
            table[chunk.start + j] = entry
    if any(e is None for e in table[1:]):
        return None
    seq.prompt_logprobs = table
    seq.prompt_score_chunks = []
    return table
