"""Speculative decoding: the proposers and the policy that decides where drafting pays.

A decoding request with ``k`` proposed tokens ``d_1 .. d_k`` becomes a ``(k+1)``-token
row ``[x, d_1, .., d_k]`` in the engine's ordinary batched forward pass (``x`` is the
request's last sampled token); :func:`~mlx_ferrum.engine.rejection_sampler.verify` then
keeps a prefix of the proposal and adds one token of its own, so every verified row
yields 1 to ``k+1`` tokens.

Proposers:

- :class:`NgramProposer`: prompt lookup (Saxena 2023, "Prompt Lookup Decoding",
  github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``NgramProposer``): find the
  latest earlier occurrence of the last ``n`` tokens (``n`` from ``prompt_lookup_max``
  down to ``prompt_lookup_min``) in the prompt and output so far, and propose the
  ``k`` tokens that followed it. No model runs; the proposal is deterministic.
- :class:`DraftModelProposer`: a smaller model sharing the tokenizer runs ``k``
  autoregressive steps on its own model runner and KV cache (Leviathan et al. 2023,
  "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023,
  "Accelerating Large Language Model Decoding with Speculative Sampling"), drawing each
  draft token from the same logits chain the target's tokens come from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..config import RuntimeConfig
from ..errors import ConfigurationError, FerrumError
from ..executor.llm_executor import LlmExecutor
from ..runner import SeqWork
from .rejection_sampler import Proposal, distributions, draw, uniforms
from .sampling import SamplerState, process_logits

__all__ = [
    "SpeculationPolicy",
    "SpeculativeRequest",
    "ngram_propose",
    "NgramProposer",
    "DraftModelProposer",
    "make_proposer",
]


@dataclass
class SpeculativeRequest:
    """One decoding request that may speculate this step.

    Attributes:
        request_id: the request (also its cache id in every runner).
        token_ids: prompt plus output so far; the last one is not yet in the target's cache.
        num_speculative_tokens: most tokens to propose (k >= 1).
        state: the request's sampler state (params, history, PRNG key).
    """

    request_id: str
    token_ids: list[int]
    num_speculative_tokens: int
    state: SamplerState


# ---------------------------------------------------------------------------
# proposers
# ---------------------------------------------------------------------------


def ngram_propose(token_ids: Sequence[int], k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier match of the last n-gram.

    Tries ``n = prompt_lookup_max`` down to ``prompt_lookup_min``; for the first ``n`` whose
    last ``n`` tokens also occur earlier in ``token_ids``, returns the ``k`` tokens that
    followed the latest such occurrence; when fewer than ``k`` follow it (the text ends in
    a loop of period ``p < k``), the loop is continued: token ``j`` repeats token ``j - p``.

    Args:
        token_ids: prompt plus output so far.
        k: most tokens to return.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths, ``1 <= min <= max``.

    Returns:
        ``k`` token ids, or ``[]`` when no n-gram matches.
    """
    length = len(token_ids)
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = arr[length - n :]
        # windows starting at 0 .. length-1-n: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            # A match close to the end (a loop of period < k) continues into the tokens
            # proposed so far, as repeating the loop would.
            out = [int(t) for t in arr[start : start + k]]
            while len(out) < k:
                out.append(out[len(out) - (length - start)])
            return out
    return []


class NgramIndex:
    """The latest start of every n-gram (``min_n <= n <= max_n``) of a growing token
    list, kept up to date by reading only the tokens added since the last call, so a
    proposal costs a few dictionary lookups instead of a scan of the whole history.

    :meth:`propose` returns exactly what :func:`ngram_propose` returns for the same
    tokens (the reference it is tested against). The index covers the windows wholly
    inside ``token_ids[:-1]`` (every occurrence but the suffix itself); when the list is
    not an extension of the one indexed before (shorter, or a different tail), it is
    rebuilt.

    Args:
        min_n, max_n: n-gram lengths, ``1 <= min_n <= max_n``.
    """

    #: tokens of the indexed list compared on each call to tell an extension from a new list
    CHECK_TOKENS = 8

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # windows inside token_ids[:indexed] are in the tables
        self._tail: list[int] = []

    def _extend(self, token_ids: Sequence[int], end: int) -> None:
        if end < self.indexed or list(token_ids[max(0, self.indexed - self.CHECK_TOKENS) : self.indexed]) != self._tail:
            for table in self.tables.values():
                table.clear()
            self.indexed = 0
        for n, table in self.tables.items():
            # later starts overwrite earlier ones: each entry is the latest occurrence
            for start in range(max(0, self.indexed - n + 1), end - n + 1):
                table[tuple(token_ids[start : start + n])] = start
        self.indexed = end
        self._tail = list(token_ids[max(0, end - self.CHECK_TOKENS) : end])

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """As :func:`ngram_propose` ``(token_ids, k, min_n, max_n)``."""
        length = len(token_ids)
        self._extend(token_ids, max(0, length - 1))
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(token_ids[length - n :]))
            if start is not None:
                start += n
                out = list(token_ids[start : start + k])
                while len(out) < k:  # a loop of period < k continues (see ngram_propose)
                    out.append(out[len(out) - (length - start)])
                return out
        return []


class NgramProposer:
    """Prompt-lookup proposer (no model). See :func:`ngram_propose`; each request keeps
    an :class:`NgramIndex` of its tokens between steps.

    Args:
        prompt_lookup_min, prompt_lookup_max: n-gram lengths to match.
    """

    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[SpeculativeRequest]) -> list[Proposal]:
        """One deterministic :class:`Proposal` per request (possibly empty)."""
        out = []
        for r in requests:
            index = self._indexes.get(r.request_id)
            if index is None:
                index = self._indexes[r.request_id] = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
            out.append(Proposal(index.propose(r.token_ids, r.num_speculative_tokens)))
        return out

    def committed(self, request_id: str, num_tokens: int) -> None:
        """Nothing to roll back: the index holds committed tokens only."""

    def release(self, request_id: str) -> None:
        """Forget the request's index (idempotent)."""
        self._indexes.pop(request_id, None)


class DraftModelProposer:
    """A draft model on its own :class:`~mlx_ferrum.executor.LlmExecutor` (a runner with the
    block manager it drives itself: the draft has no scheduler) and KV cache.

    Each :meth:`propose` feeds every request's tokens the draft has not seen yet
    (the whole prompt the first time), then runs ``k - 1`` more one-token steps for the
    batch, all requests in one forward pass per step. Greedy requests get the draft's
    argmax; sampled ones a draw from the draft's processed distribution ``q`` (returned
    for the acceptance rule). The draft's cache always holds a prefix of the request's
    tokens: :meth:`committed` cuts it back after verification.

    Args:
        model: the draft model; its vocabulary must be the target's (same tokenizer).
        config: runtime settings of the target; the draft uses the same KV layout
            without prefix caching.
        vocab_size: the target's vocabulary size, checked against the draft's.

    Raises:
        ConfigurationError: the vocabularies differ.
    """

    def __init__(self, model, config: RuntimeConfig, vocab_size: Optional[int] = None):
        if vocab_size is not None and model.args.vocab_size != vocab_size:
            raise ConfigurationError(
                f"the draft model has a vocabulary of {model.args.vocab_size} and the target of {vocab_size}: "
                "pick a draft that shares the target's tokenizer"
            )
        draft_config = dataclasses.replace(config, speculative=None, prefix_cache=False)
        self.runner = LlmExecutor(model, draft_config, model_id="draft")

    def propose(self, requests: Sequence[SpeculativeRequest]) -> list[Proposal]:
        """One :class:`Proposal` per request; on a draft failure (pool full, context
        full) the affected batch proposes nothing this step."""
        ex = self.runner
        cap = ex.kv_capacity()
        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[np.ndarray]] = [[] for _ in requests]
        feed: dict[int, list[int]] = {}
        for b, r in enumerate(requests):
            n = len(r.token_ids)
            if n + r.num_speculative_tokens - 1 > cap:
                continue
            have = ex.num_tokens(r.request_id) if ex.has_cache(r.request_id) else 0
            if have >= n:  # the draft must recompute the last token to get its logits
                ex.trim_cache(r.request_id, n - 1)
                have = n - 1
            feed[b] = r.token_ids[have:]
        while feed:
            order = list(feed)
            try:
                logits = ex.run([SeqWork(requests[b].request_id, feed[b]) for b in order])
            except FerrumError:
                break
            params, histories = [], []
            for b in order:
                st = requests[b].state
                params.append(st.params)
                histories.append(st.history + tokens[b] if st.params.repetition_penalty != 1.0 else st.history)
            argmax_array, probs_array = distributions(
                process_logits(mx.concatenate(logits, axis=0), params, histories))
            argmax = argmax_array.tolist()
            probs = np.array(probs_array, dtype=np.float64) if probs_array is not None else None
            feed = {}
            for j, b in enumerate(order):
                st = requests[b].state
                if st.params.greedy:
                    tok = argmax[j]
                else:
                    q = probs[j]
                    tok = draw(q, float(uniforms(st, 1)[0]))
                    qs[b].append(q)
                tokens[b].append(tok)
                if len(tokens[b]) < requests[b].num_speculative_tokens:
                    feed[b] = [tok]
        return [
            Proposal(t, np.stack(q) if q else None) if not requests[b].state.params.greedy and t else Proposal(t)
            for b, (t, q) in enumerate(zip(tokens, qs))
        ]

    def committed(self, request_id: str, num_tokens: int) -> None:
        """The request's first ``num_tokens`` tokens are final: drop draft K/V past them."""
        ex = self.runner
        if ex.has_cache(request_id) and ex.num_tokens(request_id) > num_tokens:
            ex.trim_cache(request_id, num_tokens)

    def release(self, request_id: str) -> None:
        """Free the request's draft cache (idempotent)."""
        self.runner.release_cache(request_id)


@dataclass
class _RequestRecord:
    """What the policy remembers of one request's drafts."""

    acceptance: float = 1.0  # moving average of accepted / proposed
    backoff: int = 0  # steps the next failure skips (0: none yet)
    skip_until: int = 0  # the first step this request may propose again


class SpeculationPolicy:
    """Decides, per step and request, whether speculating is worth its cost.

    Speculation is exact (it never changes what a request generates) but not free: a
    verified row carries ``k`` extra tokens through the forward pass, and a request that
    proposes must have its previous token on the host, which stops the engine from
    queuing the next step before the current one is read back. So it pays only where
    drafts are accepted. The rules:

    - **By batch size** (vLLM's ``speculative_disable_by_batch_size``): no request
      speculates while ``speculative_disable_by_batch_size`` or more requests run. The
      default, 2, speculates only for a request that runs alone. On MLX's CPU backend,
      with the threshold at 8, ordinary stories ran 0.98 / 0.95 / 0.86 / 0.84x of no
      speculation at 2 / 3 / 4 / 7 requests, and a text that repeats its context 1.23 /
      1.03 / 0.92 / 0.86x (``benchmarks/bench_speculative.py``, docs/benchmarks.md): a
      drafting step is synchronous and every verified row carries ``k`` more tokens,
      so beside other requests drafts cost about what they save. Traffic that mostly
      repeats its context (quoting, code edits) gains at 2 requests with a threshold of 3.
    - **By measured acceptance**: each request keeps a moving average of its drafts'
      acceptance (accepted / proposed, weight 1/2 on the newest). An average below
      ``speculative_min_acceptance`` sends the request into back-off: it skips the next
      1, then 2, 4 ... up to :attr:`MAX_BACKOFF` steps before it proposes again. A
      well-accepted draft clears the back-off. Requests in back-off decode on the
      pipelined plain step.
    - **When the proposer finds nothing**: while other requests run, the request backs
      off the same way but at most :attr:`MAX_NO_MATCH_BACKOFF` steps, so that its wish
      to propose does not keep the whole batch off the pipelined step. A request that
      runs alone does not back off: its synchronous step costs about what a pipelined
      one does, and a back-off there skipped drafts that would have been accepted
      (a repetitive text ran 99 instead of 107 steps for 200 tokens without it).

    Args:
        config: ``num_speculative_tokens``, ``speculative_disable_by_batch_size``,
            ``speculative_min_acceptance``.
    """

    MAX_BACKOFF = 64
    MAX_NO_MATCH_BACKOFF = 2

    def __init__(self, config: RuntimeConfig):
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.speculative_disable_by_batch_size
        self.min_acceptance = config.speculative_min_acceptance
        self._records: dict[str, _RequestRecord] = {}

    def enabled_for_batch(self, num_running: int) -> bool:
        """False while ``num_running`` requests are too many to speculate."""
        return num_running < self.disable_by_batch_size

    def wants(self, request_id: str, step: int) -> bool:
        """True when ``request_id`` is not backing off at ``step``."""
        record = self._records.get(request_id)
        return record is None or step >= record.skip_until

    def record(self, request_id: str, proposed: int, accepted: int, step: int, num_running: int = 1) -> None:
        """Note one draft of ``request_id`` at ``step``: ``proposed`` tokens (0 when the
        proposer found nothing), ``accepted`` of them; ``num_running``: requests in the
        engine at that step (a request alone never backs off for finding nothing)."""
        record = self._records.setdefault(request_id, _RequestRecord())
        if proposed > 0:
            record.acceptance = 0.5 * record.acceptance + 0.5 * (accepted / proposed)
        if self.min_acceptance <= 0.0:
            return  # back-off turned off
        if proposed > 0 and record.acceptance < self.min_acceptance:
            record.backoff = min(max(1, 2 * record.backoff), self.MAX_BACKOFF)
        elif proposed == 0:
            if num_running <= 1:
                return
            # finding nothing costs the batch its step overlap, and text that repeats
            # itself soon matches again: a short back-off
            record.backoff = min(max(1, 2 * record.backoff), self.MAX_NO_MATCH_BACKOFF)
        else:
            record.backoff = 0
            return
        record.skip_until = step + 1 + record.backoff

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._records.pop(request_id, None)


def make_proposer(config: RuntimeConfig, vocab_size: int):
    """The proposer ``config.speculative`` names: None (off), :class:`NgramProposer` for
    ``"ngram"``, else a :class:`DraftModelProposer` over the checkpoint at that path or
    hub id (loaded in the target's KV layout).

    Raises:
        ConfigurationError: the draft's vocabulary differs from the target's.
        ModelLoadError: the draft checkpoint cannot be loaded (see :mod:`mlx_ferrum.errors`).
    """
    spec = config.speculative
    if spec is None:
        return None
    if spec == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from ..models.loader import load_model

    model, _cfg, _path = load_model(spec)
    return DraftModelProposer(model, config, vocab_size)
