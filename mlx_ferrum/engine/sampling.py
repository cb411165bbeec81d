"""Sampling: ``SamplingParams``, per-request sampler state and the batched, per-row-seeded sampler.

The logits chain (penalties, ``logit_bias``, grammar mask, temperature, top-k, top-p,
min-p) lives in :mod:`~mlx_ferrum.engine.logits_processors`; :func:`sample` runs it, then
draws one token per row by the Gumbel-max trick (``argmax(logits + Gumbel noise)``), the
noise drawn from the row's own PRNG key. Rows with ``temperature == 0`` take the argmax.
Reported log-probabilities are those of the raw logits (before any processor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx

from ..errors import ExecutorError, SamplingParamsError
from .logits_processors import process_logits
from .structured import StructuredOutputsParams

__all__ = [
    "SamplingParams",
    "SamplerState",
    "SampleResult",
    "sample",
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
            part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
            part_lp = mx.take_along_axis(logp, part, axis=-1)
            order = mx.argsort(-part_lp, axis=-1)
            result.top_ids = mx.take_along_axis(part, order, axis=-1)
            result.top_logprobs = mx.take_along_axis(part_lp, order, axis=-1)
    if record:
        for state, tok in zip(states, tokens.tolist()):
            state.append(tok)
    return result
