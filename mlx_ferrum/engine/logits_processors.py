"""The logits chain: every processor between a model's logits and a token draw, in one place.

Normal decoding (:func:`~mlx_ferrum.engine.sampling.sample`), speculative verification
(:func:`~mlx_ferrum.engine.rejection_sampler.verify`) and the draft model's proposals
all call :func:`process_logits`, so the three see the same distribution: the same
penalties, bias, grammar mask, temperature guard and filters.

Processing order (Hugging Face ``generate``'s warper order, also vLLM's):

1. repetition penalty on the raw logits (Keskar et al. 2019, "CTRL", section 4.1;
   HF ``RepetitionPenaltyLogitsProcessor``), then presence and frequency penalties on
   the generated tokens (OpenAI's API reference, "Parameter details"; vLLM's
   ``apply_penalties``);
2. the per-request additive ``logit_bias`` (OpenAI's ``logit_bias``: ``{token id: bias}``,
   bias in [-100, 100], added to that token's logit before sampling);
3. the structured-output token bitmask (llguidance's packed layout);
4. temperature, with a guard: a tiny temperature that pushes finite logits past
   float32's range makes its row act as greedy (the scaled logits no longer rank the
   tokens);
5. top-k (Fan et al. 2018, "Hierarchical Neural Story Generation");
6. top-p / nucleus (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration");
7. min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and
   Coherent LLM Outputs").

Rows with ``temperature == 0`` take the argmax of the logits after steps 1-3.

Every processor takes ``logits`` of shape ``[B, V]`` (cast to float32) and per-row
parameters (a Python scalar shared by all rows, or a length-``B`` sequence / mx array),
and returns a new ``[B, V]`` float32 array; filtered entries become ``-inf``. Ties at a
top-k / top-p threshold are all kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import mlx.core as mx

from ..errors import ExecutorError
from .structured import apply_token_bitmask

if TYPE_CHECKING:  # only for annotations: sampling imports this module
    from .sampling import SamplingParams

__all__ = [
    "ProcessedLogits",
    "process_logits",
    "apply_repetition_penalty",
    "apply_presence_frequency_penalty",
    "apply_logit_bias",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "apply_min_p",
]

_NEG_INF = float("-inf")
RowParam = Union[float, int, Sequence[float], mx.array]

#: Below this temperature a sampled row is checked for logits that overflowed when
#: scaled (``logit / temperature`` beyond float32's range); such a row takes its argmax.
_OVERFLOW_CHECK_BELOW = 1e-20


@dataclass
class ProcessedLogits:
    """What :func:`process_logits` returns.

    - ``penalised``: ``[R, V]`` float32, the logits after the penalties, ``logit_bias`` and
      the grammar mask; its argmax is the greedy choice.
    - ``filtered``: ``[R, V]`` float32 after temperature, top-k, top-p and min-p
      (``softmax`` of a row is that row's sampling distribution; ``-inf`` where
      filtered), or None when every row is greedy.
    - ``take_argmax``: ``[R]`` bool, rows that must take the argmax of ``penalised``:
      greedy rows, and sampled rows whose tiny temperature overflowed float32 (None when
      ``filtered`` is None: then every row does).
    """

    penalised: mx.array
    filtered: Optional[mx.array] = None
    take_argmax: Optional[mx.array] = None


def process_logits(
    logits: mx.array,
    params: Sequence["SamplingParams"],
    histories: Sequence[Sequence[int]],
    generated: Optional[Sequence[Sequence[int]]] = None,
    pending: Optional[mx.array] = None,
    allowed: Optional[mx.array] = None,
) -> ProcessedLogits:
    """Run the whole logits chain (see the module docstring) on ``R`` rows.

    Args:
        logits: ``[R, V]`` raw logits, any float dtype.
        params: ``R`` :class:`~mlx_ferrum.engine.sampling.SamplingParams`, one per row.
        histories: ``R`` token-id histories, prompt included (the repetition penalty).
        generated: ``R`` lists of generated ids only (the presence and frequency
            penalties); None when no row has them.
        pending: optional ``[R]`` int32 device array: per row, a generated token the
            histories do not hold yet (``-1``: none); the penalties count it on the device.
        allowed: optional ``[R, ceil(V / 32)]`` int32 packed token bitmask (structured
            output); rows of all ones are unchanged.

    Returns:
        :class:`ProcessedLogits`; every array is lazy.

    Raises:
        ExecutorError: ``logits`` is not ``[R, V]``, or a per-row list has the wrong length.
    """
    x = _as_2d(logits)
    vocab = x.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        x = apply_repetition_penalty(x, histories, [p.repetition_penalty for p in params], pending=pending)
    if generated is not None and any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        x = apply_presence_frequency_penalty(
            x, generated, [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
            pending=pending,
        )
    if any(p.logit_bias for p in params):
        x = apply_logit_bias(x, [p.logit_bias for p in params])
    if allowed is not None:
        x = apply_token_bitmask(x, allowed)
    greedy_rows = [p.greedy for p in params]
    if all(greedy_rows):
        return ProcessedLogits(penalised=x)
    y = apply_temperature(x, [1.0 if p.greedy else p.temperature for p in params])
    take_argmax = mx.array(greedy_rows)
    if any(not p.greedy and p.temperature < _OVERFLOW_CHECK_BELOW for p in params):
        # such a row is as sharp as greedy, and its scaled logits no longer rank the tokens
        take_argmax = take_argmax | mx.any(mx.isinf(y) & mx.isfinite(x), axis=-1)
    ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]  # top_k > vocab keeps all
    if any(ks):
        y = apply_top_k(y, ks[0] if len(set(ks)) == 1 else ks)
    if any(p.top_p < 1.0 for p in params):
        y = apply_top_p(y, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        y = apply_min_p(y, [p.min_p for p in params])
    return ProcessedLogits(penalised=x, filtered=y, take_argmax=take_argmax)


def _rows(value: RowParam, batch: int, dtype=mx.float32) -> mx.array:
    """A per-row parameter as a ``[B, 1]`` array (a scalar is broadcast)."""
    if isinstance(value, mx.array):
        arr = value.astype(dtype)
    elif isinstance(value, (int, float)):
        arr = mx.full((batch,), value, dtype=dtype)
    else:
        arr = mx.array(list(value), dtype=dtype)
    if arr.size != batch:
        raise ExecutorError(f"a per-row sampling parameter has {arr.size} values for a batch of {batch} rows")
    return arr.reshape(batch, 1)


def _as_2d(logits: mx.array) -> mx.array:
    if logits.ndim != 2:
        raise ExecutorError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    return logits.astype(mx.float32)


def _pending_hits(pending: Optional[mx.array], batch: int, vocab: int) -> Optional[mx.array]:
    """``[B, V]`` bool: row ``b`` holds ``pending[b]`` (a token sampled on the device and not
    yet in the host history; ``-1``: none), or None without pending tokens."""
    if pending is None:
        return None
    pending = pending.astype(mx.int32).reshape(batch, 1)
    return mx.arange(vocab, dtype=mx.int32)[None, :] == pending


def apply_repetition_penalty(
    logits: mx.array, history: Sequence[Sequence[int]], penalty: RowParam, pending: Optional[mx.array] = None
) -> mx.array:
    """Penalise every token id that occurs in a row's history.

    For each id in ``history[b]`` (counted once, however often it occurs), a positive
    logit is divided by ``penalty[b]`` and a negative one multiplied by it (CTRL,
    Keskar et al. 2019; the same as HF ``RepetitionPenaltyLogitsProcessor``).
    Ids outside ``[0, V)`` are ignored.

    Args:
        logits: ``[B, V]``, any float dtype.
        history: ``B`` sequences of token ids (prompt and generated).
        penalty: > 0 per row; ``1`` leaves the row unchanged.
        pending: optional ``[B]`` int32 device array: one more token per row that the
            host history lacks (the pipelined step's token still being read back; ``-1``
            for none), counted as part of the history.

    Returns:
        ``[B, V]`` float32.

    Raises:
        ExecutorError: ``logits`` is not 2-D, or ``history`` / ``penalty`` have the wrong length.
    """
    x = _as_2d(logits)
    batch, vocab = x.shape
    if len(history) != batch:
        raise ExecutorError(f"repetition penalty got {len(history)} histories for {batch} rows")
    pen = _rows(penalty, batch)
    rows: list[int] = []
    cols: list[int] = []
    for b, ids in enumerate(history):
        unique = {int(t) for t in ids if 0 <= int(t) < vocab}
        rows.extend([b] * len(unique))
        cols.extend(unique)
    extra = _pending_hits(pending, batch, vocab)
    if not rows and extra is None:
        return x
    seen = mx.zeros((batch, vocab), dtype=mx.bool_)
    if rows:
        seen = seen.at[mx.array(rows), mx.array(cols)].add(True)
    if extra is not None:
        seen = seen | extra
    penalised = mx.where(x < 0, x * pen, x / pen)
    return mx.where(seen, penalised, x)


def apply_presence_frequency_penalty(
    logits: mx.array, generated: Sequence[Sequence[int]], presence: RowParam, frequency: RowParam,
    pending: Optional[mx.array] = None,
) -> mx.array:
    """Subtract ``presence * [count > 0] + frequency * count`` from each logit.

    ``count[b, v]`` is how often id ``v`` occurs in ``generated[b]`` (the output only,
    not the prompt, as in OpenAI's API and vLLM). Ids outside ``[0, V)`` are ignored.

    Args:
        logits: ``[B, V]``, any float dtype.
        generated: ``B`` sequences of generated token ids.
        presence, frequency: per row, in [-2, 2]; ``0`` leaves the row unchanged.
        pending: optional ``[B]`` int32 device array of one more generated token per row
            that ``generated`` lacks (``-1`` for none); see :func:`apply_repetition_penalty`.

    Returns:
        ``[B, V]`` float32.

    Raises:
        ExecutorError: ``logits`` is not 2-D, or the per-row arguments have the wrong length.
    """
    x = _as_2d(logits)
    batch, vocab = x.shape
    if len(generated) != batch:
        raise ExecutorError(f"presence/frequency penalty got {len(generated)} histories for {batch} rows")
    rows: list[int] = []
    cols: list[int] = []
    for b, ids in enumerate(generated):
        for t in ids:
            if 0 <= int(t) < vocab:
                rows.append(b)
                cols.append(int(t))
    extra = _pending_hits(pending, batch, vocab)
    if not rows and extra is None:
        return x
    counts = mx.zeros((batch, vocab), dtype=mx.float32)
    if rows:
        counts = counts.at[mx.array(rows), mx.array(cols)].add(1.0)
    if extra is not None:
        counts = counts + extra.astype(mx.float32)
    return x - _rows(presence, batch) * (counts > 0).astype(mx.float32) - _rows(frequency, batch) * counts


def apply_logit_bias(logits: mx.array, biases: Sequence[Optional[dict[int, float]]]) -> mx.array:
    """Add each row's ``{token id: bias}`` to its logits, in one scatter-add for the batch.

    Args:
        logits: ``[B, V]``, any float dtype.
        biases: ``B`` dicts (or None for no bias) of token id -> bias (float).

    Returns:
        ``[B, V]`` float32.

    Raises:
        ExecutorError: ``logits`` is not 2-D, ``biases`` has the wrong length, or an id is
            outside ``[0, V)`` (the engine checks ids when it takes a request).
    """
    x = _as_2d(logits)
    batch, vocab = x.shape
    if len(biases) != batch:
        raise ExecutorError(f"logit_bias got {len(biases)} rows of biases for {batch} rows of logits")
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for b, bias in enumerate(biases):
        if bias:
            rows.extend([b] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
    if not rows:
        return x
    if min(cols) < 0 or max(cols) >= vocab:
        raise ExecutorError(f"a logit_bias token id is outside the vocabulary [0, {vocab})")
    # ids of one row are unique (dict keys), so add == set-on-zeros; one scatter for all rows
    delta = mx.zeros((batch, vocab), dtype=mx.float32).at[mx.array(rows), mx.array(cols)].add(mx.array(values, dtype=mx.float32))
    return x + delta


def apply_temperature(logits: mx.array, temperature: RowParam) -> mx.array:
    """``logits / temperature`` per row.

    Args:
        logits: ``[B, V]``.
        temperature: > 0 per row (greedy rows must be handled by the caller).

    Returns:
        ``[B, V]`` float32.
    """
    x = _as_2d(logits)
    return x / _rows(temperature, x.shape[0])


def apply_top_k(logits: mx.array, top_k: Union[int, Sequence[int], mx.array]) -> mx.array:
    """Keep each row's ``k`` largest logits (and any tied with the k-th); ``k <= 0`` is off.

    Top-k sampling, Fan et al. 2018. ``k >= V`` keeps everything.

    Args:
        logits: ``[B, V]``.
        top_k: int per row.

    Returns:
        ``[B, V]`` float32, filtered entries ``-inf``.
    """
    x = _as_2d(logits)
    batch, vocab = x.shape
    if isinstance(top_k, int):
        if top_k <= 0 or top_k >= vocab:
            return x
        # One shared k: a partial selection is enough.
        kth = mx.min(mx.topk(x, top_k, axis=-1), axis=-1, keepdims=True)
        return mx.where(x < kth, _NEG_INF, x)
    if not isinstance(top_k, mx.array):  # clamp before int32 conversion: huge k means "keep all"
        top_k = [min(int(t), vocab) for t in top_k]
    k = _rows(top_k, batch, mx.int32)
    k = mx.where(k <= 0, vocab, mx.minimum(k, vocab))
    ascending = mx.sort(x, axis=-1)
    kth = mx.take_along_axis(ascending, vocab - k, axis=-1)
    return mx.where(x < kth, _NEG_INF, x)


def apply_top_p(logits: mx.array, top_p: RowParam) -> mx.array:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches ``p``.

    Holtzman et al. 2019. A token is kept when the probability mass of the tokens
    ranked strictly above it is below ``p``, so the most likely token always survives.
    ``p >= 1`` is off.

    Args:
        logits: ``[B, V]`` (already temperature-scaled).
        top_p: in (0, 1] per row.

    Returns:
        ``[B, V]`` float32, filtered entries ``-inf``.
    """
    x = _as_2d(logits)
    batch = x.shape[0]
    p = _rows(top_p, batch)
    order = mx.argsort(-x, axis=-1)
    sorted_logits = mx.take_along_axis(x, order, axis=-1)
    sorted_probs = mx.softmax(sorted_logits, axis=-1)
    mass_above = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    n_keep = mx.maximum(mx.sum(mass_above < p, axis=-1, keepdims=True), 1)
    threshold = mx.take_along_axis(sorted_logits, n_keep - 1, axis=-1)
    filtered = mx.where(x < threshold, _NEG_INF, x)
    return mx.where(p >= 1.0, x, filtered)


def apply_min_p(logits: mx.array, min_p: RowParam) -> mx.array:
    """Min-p filter: drop tokens with probability below ``min_p`` times the top probability.

    Nguyen et al. 2024. Computed in log space: keep ``logit >= max_logit + log(min_p)``.
    ``min_p == 0`` is off.

    Args:
        logits: ``[B, V]`` (already temperature-scaled).
        min_p: in [0, 1] per row.

    Returns:
        ``[B, V]`` float32, filtered entries ``-inf``.
    """
    x = _as_2d(logits)
    m = _rows(min_p, x.shape[0])
    log_ratio = mx.where(m > 0, mx.log(mx.maximum(m, 1e-38)), _NEG_INF)
    threshold = mx.max(x, axis=-1, keepdims=True) + log_ratio
    return mx.where(x < threshold, _NEG_INF, x)
