"""The launch stage's pieces: a step's runner work, its prompt scores and its lazy sampling.

Plain functions over the scheduler's items (:class:`~mlx_ferrum.engine.scheduler.ScheduledItem`)
and :class:`~mlx_ferrum.engine.sequence.Sequence` s, used by :class:`~mlx_ferrum.engine.engine.Engine`
to launch a step; nothing here reads a token back from the device or ends a request
(the engine does both: see ``Engine._launch`` and ``Engine._resolve``). The pipelined
step follows vLLM's async scheduling: a token still being computed is taken on the
device (``SeqWork.prev_row``) and stands as :data:`~mlx_ferrum.engine.output_processor.IN_FLIGHT`
in ``output_ids`` until it is read back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ..errors import NonFiniteLogitsError
from ..runner import SeqWork
from . import sequence as _prompt_lp
from .output_processor import IN_FLIGHT
from .rejection_sampler import Proposal
from .sampling import sample
from .sequence import Sequence


@dataclass
class InFlight:
    """A launched step, not read back yet.

    Attributes:
        tokens: ``[B]`` int32 sampled ids, on the device (the next step's ``prev_tokens``).
        finite: ``[B]`` bool, whether row ``b``'s logits were all finite.
        results: per row ``b``, ``(SampleResult, row in it)`` (one shared result when the
            batched sample succeeded; one per row after the row-by-row fallback; ``None``
            for a row whose sampling failed).
        rows: ``(sequence, row, output index)`` per sampled request still running.
        row_of: request id -> row.
        unsampled: the step's other sequences (a prompt chunk short of the last token):
            their KV came from the same evaluation, so they end too when it failed.
    """

    tokens: mx.array
    finite: mx.array
    results: list
    rows: list = field(default_factory=list)
    row_of: dict = field(default_factory=dict)
    unsampled: list = field(default_factory=list)


def grammar_allowed(seq: Sequence, proposal: Proposal) -> tuple[Proposal, int]:
    """``proposal`` cut to the prefix ``seq``'s grammar allows (unchanged without one), and
    the number of draft tokens it proposed: a draft token the grammar forbids would be
    rejected by the masked verification anyway, so it is not sent to the model.

    Raises:
        whatever the grammar raises (the caller drops that row's draft).
    """
    proposed = len(proposal.token_ids)
    if seq.grammar is None or not proposed:
        return proposal, proposed
    allowed = seq.grammar.allowed_prefix(proposal.token_ids, seq.stop_ids)
    if allowed == proposed:
        return proposal, proposed
    probs = proposal.draft_probs[:allowed] if proposal.draft_probs is not None else None
    return Proposal(proposal.token_ids[:allowed], probs), proposed


def live_items(items: list, proposals: dict) -> tuple[list, dict]:
    """``items`` without the rows whose request finished since it was scheduled, and
    ``proposals`` (keyed by item index) re-keyed to the kept rows."""
    live = [i for i, it in enumerate(items) if not it.seq.finished]
    if len(live) == len(items):
        return items, proposals
    return [items[i] for i in live], {j: proposals[i] for j, i in enumerate(live) if i in proposals}


def non_finite_error() -> NonFiniteLogitsError:
    """The exception of a request whose logits held NaN or Inf."""
    return NonFiniteLogitsError(
        "the model produced NaN or Inf logits for this request: check the checkpoint's weights "
        "and rope_theta, or load it in float32")


def mask_undecodable(logits: mx.array, decodable: Optional[mx.array]) -> mx.array:
    """``logits`` (``[..., vocab]``) with the ids outside ``decodable`` (``[1, vocab]`` bool;
    None: every id decodes) at ``-inf``."""
    if decodable is None:
        return logits
    return mx.where(decodable, logits, mx.array(-mx.inf, dtype=logits.dtype))


def build_work(items: list, proposals: dict, flight_rows: dict) -> list[SeqWork]:
    """The runner's work for ``items`` (``lora_slot`` left unset).

    A token still in flight is taken on the device from the previous step's sampled
    tokens (``prev_row``: its row in ``flight_rows``, request id -> row); a row with a
    proposal (``proposals``: item index -> :class:`Proposal`) carries it after its token
    and returns the logits of every position. Sets each sequence's
    ``metrics.first_scheduled_time`` (seconds since the epoch) when unset.
    """
    now = time.time()
    work = []
    for i, it in enumerate(items):
        s = it.seq
        if s.metrics.first_scheduled_time is None:
            s.metrics.first_scheduled_time = now
        end = s.num_computed + it.num_tokens
        tokens = s.token_at(s.num_computed, end)
        if i in proposals:
            work.append(SeqWork(s.request_id, tokens + proposals[i].token_ids, all_logits=True, as_decode=True))
            continue
        prev_row = -1
        if end == s.num_tokens and s.output_ids and s.output_ids[-1] == IN_FLIGHT:
            prev_row = flight_rows[s.request_id]
            tokens[-1] = 0
        work.append(SeqWork(s.request_id, tokens, return_logits=it.samples, prev_row=prev_row,
                            all_logits=_prompt_lp.wants_prompt_rows(s, it.num_tokens)))
    return work


def first_logit_rows(work: list[SeqWork]) -> list[int]:
    """Per item of ``work``, the index of its first row in the step's logits (items return
    ``num_logit_rows`` rows each, in order)."""
    rows, r = [], 0
    for w in work:
        rows.append(r)
        r += w.num_logit_rows
    return rows


def score_prompts(items: list, work: list[SeqWork], logits: mx.array, skip=()) -> list[mx.array]:
    """Queue the prompt scores of every chunk that returned all its rows (prompt logprobs);
    returns the arrays to evaluate with the step. Call before ``num_computed`` moves.
    ``logits`` holds every item's rows in ``work`` order; items whose index is in ``skip``
    (drafted decode rows) hold no prompt."""
    arrays = []
    r = 0
    for i, (it, w) in enumerate(zip(items, work)):
        n = w.num_logit_rows
        if w.all_logits and i not in skip and it.seq.params.prompt_logprobs is not None:
            chunk = _prompt_lp.chunk_scores(logits[r : r + n], it.seq.prompt_ids, it.seq.num_computed,
                                            it.seq.params.prompt_logprobs)
            if chunk is not None:
                it.seq.prompt_score_chunks.append(chunk)
                arrays.extend(chunk.arrays())
        r += n
    return arrays


def sample_rows(take: mx.array, seqs: list[Sequence], pending: Optional[mx.array] = None,
                allowed: Optional[mx.array] = None,
                decodable: Optional[mx.array] = None) -> tuple[InFlight, dict[int, Exception]]:
    """Sample every row of ``take`` (``[B, V]`` logits) at once, lazily; when that raises,
    row by row with the random keys restored, so a failure (a bad parameter, a fault)
    belongs only to the request it comes from.

    Each sequence sampled gets an :data:`IN_FLIGHT` placeholder in ``output_ids`` and a
    row in the returned :class:`InFlight`; the failed ones are returned as
    ``{row: exception}`` for the caller to end (nothing else of theirs is touched).

    Args:
        pending: ``[B]`` int32 on the device, each row's generated token still in flight
            (``-1``: none), which the penalties count (see :func:`sample`).
        allowed: the grammar bitmask of the rows (structured output), or None.
        decodable: see :func:`mask_undecodable`.
    """
    states = [s.sampler for s in seqs]
    saved = [st.key for st in states]
    finite = mx.all(mx.isfinite(take), axis=-1)
    take = mask_undecodable(take, decodable)
    errors: dict[int, Exception] = {}
    try:
        res = sample(take, states, record=False, pending=pending, allowed=allowed)
        results = [(res, b) for b in range(len(seqs))]
        tokens = res.tokens
    except Exception:  # noqa: BLE001 - find the row(s) at fault
        results, pieces = [], []
        for b, st in enumerate(states):
            st.key = saved[b]  # the failed batched call may have split it
            try:
                r = sample(take[b : b + 1], [st], record=False,
                           pending=pending[b : b + 1] if pending is not None else None,
                           allowed=allowed[b : b + 1] if allowed is not None else None)
                results.append((r, 0))
                pieces.append(r.tokens.astype(mx.int32))
            except Exception as e:  # noqa: BLE001
                errors[b] = e
                results.append((None, 0))
                pieces.append(mx.zeros((1,), dtype=mx.int32))
        tokens = mx.concatenate(pieces)
    flight = InFlight(tokens, finite, results)
    for b, s in enumerate(seqs):
        if b in errors:
            continue
        s.output_ids.append(IN_FLIGHT)
        flight.rows.append((s, b, len(s.output_ids) - 1))
        flight.row_of[s.request_id] = b
    return flight, errors
