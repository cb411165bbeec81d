"""Sampling: ``SamplingParams``, the logits chain, per-request sampler state and the
batched, per-row-seeded sampler.

:func:`sample` runs the logits chain (:func:`process_logits`), then draws one token per
row by the Gumbel-max trick (``argmax(logits + Gumbel noise)``), the noise drawn from the
row's own PRNG key. Reported log-probabilities are those of the raw logits (before any
processor).

**The logits chain**: every processor between a model's logits and a token draw, in one
place. Normal decoding (:func:`sample`), speculative verification
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

Why one file (about 770 lines): the parameters, the chain and the sampler are one path
from logits to a token, and they call each other both ways: :func:`sample` runs the
chain, and the chain asks each row's :class:`SamplingParams` whether it is greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import mlx.core as mx

from ..errors import ExecutorError, SamplingParamsError
from .structured import StructuredOutputsParams, apply_token_bitmask

__all__ = [
    "SamplingParams",
    "SamplerState",
    "SampleResult",
    "sample",
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


# ---------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: Temperatures below float32's smallest normal number act as 0: such a value is a
#: denormal (flushed to zero on some backends) whose reciprocal overflows float32, so
#: dividing the logits by it gives inf/NaN rather than a sharper distribution.
_GREEDY_BELOW = 1.1754943508222875e-38


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    Fields (validated on construction):

    - ``temperature`` (float >= 0): divides the logits; ``0`` means greedy (argmax), and so
      does any temperature below float32's smallest normal number (about 1.2e-38: it is
      flushed to zero, or its reciprocal overflows, in the float32 the sampler computes in).
    - ``top_p`` (float in (0, 1]): nucleus sampling; ``1`` is off.
    - ``top_k`` (int >= 1, or ``0`` / ``-1`` for off): keep the ``k`` largest logits. A
      ``top_k`` at or above the vocabulary size is clamped to it, i.e. keeps every token.
    - ``min_p`` (float in [0, 1]): drop tokens whose probability is below
      ``min_p * max probability``; ``0`` is off.
    - ``repetition_penalty`` (float > 0): CTRL penalty on every token already seen
      (prompt and output); ``1`` is off.
    - ``presence_penalty`` (float in [-2, 2]): subtracted once from the logit of every
      token already generated; ``0`` is off.
    - ``frequency_penalty`` (float in [-2, 2]): subtracted from a token's logit once per
      time it was generated; ``0`` is off.
    - ``seed`` (int in [0, 2**64) or ``None``): the row's PRNG seed; ``None`` draws one
      from MLX's global generator (so ``mx.random.seed`` makes it reproducible).
    - ``max_tokens`` (int >= 1): tokens to generate at most.
    - ``stop`` (list of non-empty str; a single str is accepted): stop strings,
      excluded from the output.
    - ``stop_token_ids`` (list of int >= 0): ids that end generation besides EOS.
    - ``logprobs`` (int >= 0 or ``None``): also return the chosen token's log-probability
      and that many top alternatives.
    - ``ignore_eos`` (bool): keep generating past EOS.
    - ``logit_bias`` (dict of token id (int >= 0) -> bias (number in [-100, 100]), or
      ``None``): added to those tokens' logits before sampling (after the penalties,
      before temperature); ``-100`` all but bans a token, ``100`` all but forces it.
      Ids are checked against the vocabulary when the engine takes the request.
    - ``speculative`` (bool, default True): ``False`` opts this request out of
      speculative decoding when the engine runs it (``RuntimeConfig.speculative``).
    - ``prompt_logprobs`` (int >= 0 or ``None``): also return, per prompt token, its
      log-probability given the tokens before it and that many top alternatives
      (``RequestOutput.prompt_logprobs``; the first token's entry is ``None``). Computed
      in the batched prefill; such a request does not read the prefix cache.
    - ``structured_outputs`` (:class:`~mlx_ferrum.engine.structured.StructuredOutputsParams`,
      a dict of its fields, or ``None``): constrain the output to a JSON schema, any JSON
      object, a regex, a Lark grammar or a choice of strings. The request opts out of
      speculative decoding. A constraint that cannot be completed within ``max_tokens``
      ends with ``"length"``; one that does not compile raises
      :class:`~mlx_ferrum.errors.StructuredOutputError` when the engine takes the request.

    Raises:
        SamplingParamsError: a field is out of range (the message names the field and
            the accepted range).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[int] = None
    ignore_eos: bool = False
    speculative: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        def bad(name, accepted):
            raise SamplingParamsError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {accepted}")

        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "use a finite number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            bad("top_p", "use a number in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "use an int >= 1, or 0 / -1 for off")
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            bad("min_p", "use a number in [0, 1] (0 = off)")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "use a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2 <= v <= 2):
                bad(name, "use a number in [-2, 2] (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**64)):
            bad("seed", "use None or an int in [0, 2**64)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "use an int >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "use a string or a list of non-empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "use a list of ints >= 0")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "use None or an int >= 0")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "use None or an int >= 0")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "use None, a StructuredOutputsParams or a dict of its fields")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "use True or False")
        if not isinstance(self.speculative, bool):
            bad("speculative", "use True or False")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "use None or a dict {token id: bias}")
            for tid, bias in self.logit_bias.items():
                if not _is_int(tid) or tid < 0:
                    raise SamplingParamsError(
                        f"SamplingParams.logit_bias key {tid!r} is invalid: use token ids (ints >= 0) as keys"
                    )
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise SamplingParamsError(
                        f"SamplingParams.logit_bias[{tid}]={bias!r} is invalid: use a number in [-100, 100]"
                    )
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items() if b != 0} or None

    def check_vocab(self, vocab_size: int) -> None:
        """Check the token ids this request names against a ``vocab_size``-token vocabulary.

        Raises:
            SamplingParamsError: a ``logit_bias`` key is not in ``[0, vocab_size)``.
        """
        for tid in self.logit_bias or ():
            if tid >= vocab_size:
                raise SamplingParamsError(
                    f"SamplingParams.logit_bias key {tid} is outside the vocabulary [0, {vocab_size}): use valid token ids"
                )

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax: ``temperature`` is 0 or rounds to zero
        in float32 (below its smallest normal number, ``_GREEDY_BELOW``)."""
        return self.temperature < _GREEDY_BELOW


# ---------------------------------------------------------------------------
# the logits chain
# ---------------------------------------------------------------------------


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
    params: Sequence[SamplingParams],
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


# ---------------------------------------------------------------------------
# per-request state and the batched sampler
# ---------------------------------------------------------------------------


def _random_key() -> mx.array:
    """A PRNG key drawn from MLX's global generator (reproducible under ``mx.random.seed``),
    left lazy: it is evaluated with the first step that samples from it."""
    return mx.random.randint(0, 2**31 - 1, shape=(2,)).astype(mx.uint32)


@dataclass(init=False)
class SamplerState:
    """One request's sampling state.

    - ``params``: its :class:`SamplingParams`.
    - ``key``: its PRNG key (``mx.random.key(seed)``, uint32 ``[2]``), split once per
      sampled step, so a seed gives the same tokens whatever else shares the batch.
      Without a seed it is drawn from MLX's global generator on first use (a property),
      that is on the thread that samples, inside a step: drawing it when the request
      is added would need an ``mx.eval`` there (the key may be read on another thread),
      which waits for the step in flight, once per admitted request.
    - ``history``: token ids seen so far (prompt, then each sampled token), read by the
      repetition penalty.
    - ``num_prompt_tokens``: how many leading ``history`` ids are the prompt (the
      presence and frequency penalties read only the ids after them).
    """

    params: SamplingParams
    _key: Optional[mx.array] = field(default=None, repr=False)
    history: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0

    def __init__(self, params: SamplingParams, key: Optional[mx.array] = None,
                 history: Optional[list[int]] = None, num_prompt_tokens: int = 0):
        self.params = params
        self._key = key
        self.history = [] if history is None else history
        self.num_prompt_tokens = num_prompt_tokens

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> "SamplerState":
        """A fresh state: key from ``params.seed`` (or, on first use, MLX's global
        generator); history = prompt."""
        key = mx.random.key(params.seed) if params.seed is not None else None
        history = [int(t) for t in prompt_ids]
        return cls(params=params, key=key, history=history, num_prompt_tokens=len(history))

    @property
    def key(self) -> mx.array:
        """The PRNG key, uint32 ``[2]`` (drawn now when the request has no seed and no key yet)."""
        if self._key is None:
            self._key = _random_key()
        return self._key

    @key.setter
    def key(self, value: mx.array) -> None:
        self._key = value

    def next_key(self) -> mx.array:
        """Split the key: keep one half, return the other for this step's draw."""
        self.key, sub = mx.random.split(self.key)
        return sub

    def append(self, token_id: int) -> None:
        """Record a generated token (for the repetition penalty)."""
        self.history.append(int(token_id))


@dataclass
class SampleResult:
    """What :func:`sample` returns.

    - ``tokens``: ``[B]`` int32, the chosen ids.
    - ``logprobs``: ``[B]`` float32, ``log_softmax(raw logits)`` at the chosen ids, or
      ``None`` when no row asked for logprobs.
    - ``top_ids`` / ``top_logprobs``: ``[B, K]`` int32 / float32, the ``K`` most likely
      ids by raw log-probability, best first, ``K`` = the largest ``logprobs`` asked in
      the batch (a row asking fewer reads its first ``params.logprobs`` columns);
      ``None`` when ``K == 0``.
    """

    tokens: mx.array
    logprobs: Optional[mx.array] = None
    top_ids: Optional[mx.array] = None
    top_logprobs: Optional[mx.array] = None


def _gumbel(vocab: int, key: mx.array) -> mx.array:
    """Standard Gumbel noise ``[V]`` float32, finite everywhere (uniforms kept off 0 and 1)."""
    u = mx.random.uniform(shape=(vocab,), key=key)
    u = mx.clip(u, 1e-30, 1.0 - 2.0**-24)
    return -mx.log(-mx.log(u))


_split_keys = mx.vmap(lambda key: mx.random.split(key))


def _gumbel_rows(vocab: int, states: Sequence["SamplerState"]) -> mx.array:
    """Gumbel noise ``[S, V]`` float32 for ``S`` states, each row from its own key.

    The keys are split and the uniforms drawn for all rows at once (``mx.vmap`` over
    the keys), a constant number of graph ops per step instead of a few per row; the
    values are the same as :func:`_gumbel` with :meth:`SamplerState.next_key` row by row.
    """
    keys = mx.stack([s.key for s in states])
    pairs = _split_keys(keys)  # [S, 2, 2]: (kept, drawn)
    for i, s in enumerate(states):
        s.key = pairs[i, 0]
    u = _uniform_rows(pairs[:, 1], vocab)
    u = mx.clip(u, 1e-30, 1.0 - 2.0**-24)
    return -mx.log(-mx.log(u))


def _uniform_rows(keys: mx.array, vocab: int) -> mx.array:
    return mx.vmap(lambda key: mx.random.uniform(shape=(vocab,), key=key))(keys)


def top_logprobs(logp: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` most likely tokens of each row of ``logp`` ``[rows, vocab]`` (log-probabilities,
    float), most likely first: ``(ids [rows, k] int32, logprobs [rows, k])``, for
    ``1 <= k <= vocab``. A partial sort (``argpartition``, then an ``argsort`` of the ``k``
    chosen), as OpenAI's ``top_logprobs`` ranks them."""
    part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
    part_lp = mx.take_along_axis(logp, part, axis=-1)
    order = mx.argsort(-part_lp, axis=-1)
    return mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(part_lp, order, axis=-1)


def sample(
    logits: mx.array, states: Sequence[SamplerState], record: bool = True, pending: Optional[mx.array] = None,
    allowed: Optional[mx.array] = None,
) -> SampleResult:
    """Pick one token per row of ``logits``.

    Row ``b`` uses ``states[b].params``: repetition penalty, presence/frequency
    penalties and ``logit_bias``, then greedy argmax when
    ``temperature == 0``, else temperature, top-k, top-p, min-p and a Gumbel-max draw
    with noise from the row's own key (split once per call for sampled rows).

    Args:
        logits: ``[B, V]`` (or ``[B, 1, V]``) logits of the next token, any float dtype.
        states: ``B`` :class:`SamplerState`, one per row.
        record: append each chosen token to its state's history (this evaluates the
            tokens). Pass ``False`` to keep the result lazy and call
            :meth:`SamplerState.append` yourself.
        pending: optional ``[B]`` int32 device array: per row, a generated token the
            history does not hold yet (``-1``: none). The pipelined engine samples step
            ``t + 1`` before step ``t``'s token is read back; the penalties count that
            token from here, on the device, so they stay exact without a host wait.
        allowed: optional ``[B, ceil(V / 32)]`` int32 packed token bitmask (structured
            output; llguidance's layout, see
            :func:`~mlx_ferrum.engine.structured.apply_token_bitmask`), applied to the
            whole batch in one op after ``logit_bias``; rows of all ones are unchanged.

    Returns:
        :class:`SampleResult`.

    Raises:
        ExecutorError: ``logits`` is not ``[B, V]`` / ``[B, 1, V]`` or ``len(states) != B``.
    """
    if logits.ndim == 3 and logits.shape[1] == 1:
        logits = logits.reshape(logits.shape[0], logits.shape[2])
    if logits.ndim != 2:
        raise ExecutorError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    raw = logits.astype(mx.float32)
    batch, vocab = raw.shape
    if len(states) != batch:
        raise ExecutorError(f"sample() got {len(states)} sampler states for {batch} rows of logits")
    params = [s.params for s in states]
    generated = ([s.history[s.num_prompt_tokens:] for s in states]
                 if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params) else None)
    chain = process_logits(raw, params, [s.history for s in states], generated, pending=pending, allowed=allowed)

    argmax = mx.argmax(chain.penalised, axis=-1).astype(mx.int32)
    if chain.filtered is None:
        tokens = argmax
    else:
        greedy_rows = [p.greedy for p in params]
        noise = _gumbel_rows(vocab, [s for g, s in zip(greedy_rows, states) if not g])
        if len(greedy_rows) != noise.shape[0]:
            at = mx.array([b for b, g in enumerate(greedy_rows) if not g], dtype=mx.int32)
            noise = mx.zeros((batch, vocab), dtype=mx.float32).at[at].add(noise)
        sampled = mx.argmax(chain.filtered + noise, axis=-1).astype(mx.int32)
        tokens = mx.where(chain.take_argmax, argmax, sampled)

    result = SampleResult(tokens=tokens)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if asked:
        logp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        result.logprobs = mx.take_along_axis(logp, tokens.reshape(batch, 1), axis=-1).reshape(batch)
        k = min(max(asked), vocab)
        if k > 0:
            result.top_ids, result.top_logprobs = top_logprobs(logp, k)
    if record:
        for state, tok in zip(states, tokens.tolist()):
            state.append(tok)
    return result
