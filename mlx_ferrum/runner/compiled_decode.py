"""The compiled decode step: a pure decode pass traced once per bucketed shape with
``mx.compile`` and replayed (the idea of vLLM's CUDA-graph capture sizes).

:class:`CompiledDecodeStep` is a part of :class:`~mlx_ferrum.runner.LlmRunner` (mixed
into it): it reads the runner's store, pass builder, pool, LoRA registry and model call
(``self.store``, ``self.passes``, ``self.pool``, ``self.kv_geometry``, ``self.lora``, ``self._call_model``,
``self._scratch_block``, ``self._packed_tokens``,
``self._wait_for_pools``, ``self._compiled_decode``) and is used by the runner's
forward pass for passes whose every row is a decode row. The pass's slots and block
tables come from the block manager's owner and its arrays from the runner's pass builder
(:mod:`.inputs`), as for every pass; the step only pads them.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..kernels.reference import SharedPrefix
from ..kernels.reference import fusing as exp2_fusing
from ..layers.attention import NO_FLOAT_WINDOW, paged_metadata
from .inputs import (
    _pad_rows,
    _pad_table,
    device_input_ids,
    float_window_metadata,
    shape_bucket,
)
from .protocol import SeqWork

logger = logging.getLogger("mlx_ferrum.runner.llm_runner")

#: traces of the compiled decode step kept per executor and thread (see ``_compiled_step``)
MAX_DECODE_TRACES = 64


def _shared_prefixes(arrays: dict, num_groups: int) -> Optional[list]:
    """Per group, the compiled step's :class:`~mlx_ferrum.kernels.reference.SharedPrefix`
    inputs (``arrays["shared_prefixes"]``) or None."""
    given = arrays.get("shared_prefixes")
    if not given:
        return None
    return [SharedPrefix(*given[str(g)]) if str(g) in given else None for g in range(num_groups)]


class CompiledDecodeStep:
    """The runner's compiled decode step (see the module docstring); a mixin of
    :class:`~mlx_ferrum.runner.LlmRunner`, not used on its own."""

    @staticmethod
    def _is_decode_pass(work: Sequence[SeqWork], kv_pass) -> bool:
        """Every attention row of the pass is a decode row with its logits returned:
        one token per item, or an item laid out as one decode row per token (a draft)."""
        tokens = sum(len(work[i].tokens) for i in kv_pass.items)
        return kv_pass.decode_rows == tokens and all(
            work[i].num_logit_rows == len(work[i].tokens) for i in kv_pass.items
        )

    def _decode_pass(self, work: Sequence[SeqWork], kv_pass, prev: Optional[mx.array]) -> Optional[mx.array]:
        """Run a pure decode pass through the compiled step :meth:`_decode_graph`.

        ``mx.compile`` traces the step once per (sequences, blocks per table) shape and
        replays it afterwards: no Python per layer, and elementwise chains (RoPE, norms,
        SwiGLU, the softmax of decode attention) fused into single kernels. Both sizes
        are padded to :func:`shape_bucket` sizes so that traces repeat: pad rows write
        the pool's scratch block (``self._scratch_block``, never handed out by the
        manager) and have ``context_lens`` 1; pad table columns point at block 0 and are
        masked. The pool arrays go in as inputs and come back as outputs, and the pool
        is rebound to them. Returns the logits ``[B, vocab]`` in ``kv_pass.items``
        order, or None when the model cannot be traced (it reads values on the host):
        the executor then stays eager for good, and the caller runs the pass op by op.
        """
        f = kv_pass.inputs
        n = int(f.num_decode_seqs)
        rows, cols = shape_bucket(n), shape_bucket(f.block_tables[0].shape[1])
        ids = np.zeros(rows, dtype=np.int32)
        patch_at: list[int] = []
        patch_rows: list[int] = []
        r = 0
        for i in kv_pass.items:
            w = work[i]
            ids[r : r + len(w.tokens)] = w.tokens
            r += len(w.tokens)
            if w.prev_row >= 0:
                patch_at.append(r - 1)
                patch_rows.append(w.prev_row)
        if rows == n and len(patch_at) == n and prev is not None and prev.shape[0] == n and patch_rows == patch_at:
            input_ids = prev.astype(mx.int32)  # the steady state: last step's tokens, in order
        else:
            input_ids = device_input_ids(ids, patch_at, patch_rows, prev)
        scratch_slot = self._scratch_block * self.kv_geometry.block_size
        # the step's metadata arrays are inputs of the compiled function (not constants of
        # its trace); the arrays derived from them are built inside it (_decode_graph)
        arrays = {
            "positions": mx.array(_pad_rows(f.positions, rows, 0)),
            "context_lens": mx.array(_pad_rows(f.context_lens, rows, 1)),
            "slot_mappings": [mx.array(_pad_rows(x, rows, scratch_slot)) for x in f.slot_mappings],
            "block_tables": [mx.array(_pad_table(x, rows, cols, self._scratch_block)) for x in f.block_tables],
        }
        shared_shape = ()
        if f.shared_prefixes:
            # a group's shared blocks and each row's tail (reference.SharedPrefix), keyed by
            # group: the groups that have one are part of the trace's key
            arrays["shared_prefixes"] = {}
            for g, plan in enumerate(f.shared_prefixes):
                if plan is not None:
                    tails = _pad_table(plan.tails, rows, shape_bucket(plan.tails.shape[1]), self._scratch_block)
                    # pad rows read the shared blocks and no tail key (context_lens 1)
                    starts = _pad_rows(plan.tail_starts, rows, int(plan.tail_starts.max()))
                    arrays["shared_prefixes"][str(g)] = [mx.array(plan.table), mx.array(tails), mx.array(starts)]
                    shared_shape += ((g, plan.table.shape[0], tails.shape[1]),)
        if f.float_window is not None:
            # pad rows write the scratch window slot and read nothing from floats
            scratch = self.pool.window_slots
            fw = f.float_window
            arrays["float_window"] = {
                "write_slots": mx.array(_pad_rows(fw["write_slots"], rows, scratch)),
                "write_entries": mx.array(_pad_rows(fw["write_entries"], rows, 0)),
                "decode_slots": mx.array(_pad_rows(fw["decode_slots"], rows, scratch)),
                "decode_last": mx.array(_pad_rows(fw["decode_last"], rows, 0)),
                "decode_starts": mx.array(_pad_rows(fw["decode_starts"], rows, NO_FLOAT_WINDOW)),
            }
        if self.lora is not None and any(work[i].lora_slot >= 0 for i in kv_pass.items):
            # one decode row per token: a draft laid out as several rows repeats its slot
            slots = np.full(rows, self.lora.none_slot, dtype=np.int32)
            r = 0
            for i in kv_pass.items:
                w = work[i]
                if w.lora_slot >= 0:
                    slots[r : r + len(w.tokens)] = w.lora_slot
                r += len(w.tokens)
            # inputs of the compiled step, not constants of its trace: the next step's
            # slots (and the stacks, after an adapter is loaded into a slot) differ
            arrays["lora_slots"] = mx.array(slots)
            arrays["lora_weights"] = self.lora.weights()
        pool = self.pool
        if self._wait_for_pools:
            # On the CPU backend a pool still pending from the previous (pipelined) step
            # cannot be updated in place by the compiled step: MLX copies every layer's
            # pool (peak memory + whole pools, tens of ms per step on a large pool). The
            # wait costs little there, as mx.async_eval already waited for all but the
            # previous step's tail. GPU backends skip it, so the host keeps building
            # ahead of the device (unmeasured here: no GPU on this machine).
            mx.eval(pool.arrays())
        try:
            step = self._compiled_step((rows, cols, "lora_slots" in arrays, shared_shape))
            logits, pool_arrays = step(input_ids, arrays, pool.arrays())
        except (ValueError, RuntimeError) as e:  # a host read while tracing (RuntimeError: buffer protocol)
            if "compile" not in str(e) and "transformation" not in str(e):
                raise
            logger.info("decode steps run op by op: the model cannot be compiled (%s)", e)
            self._compiled_decode = None
            return None
        pool.set_arrays(pool_arrays)
        return logits if rows == n else logits[:n]

    def _compiled_step(self, shape: tuple):
        """This thread's ``mx.compile`` of :meth:`_decode_graph` (made on first use).

        ``mx.compile`` keeps one trace per input shape; once more than
        :data:`MAX_DECODE_TRACES` bucketed ``shape`` s (rows, blocks per table, with
        LoRA, and per group with a shared prefix its shared and tail blocks) were seen
        the function is dropped with its traces and compiled anew, so a long-running
        server holds a bounded number of graphs. Steps with and without LoRA slots, and
        with shared prefixes in different groups, get separate functions (their inputs
        differ in structure).
        """
        key = threading.get_ident()
        if len(shape) > 2 and shape[2]:
            key = (key, "lora")
        if len(shape) > 3 and shape[3]:
            key = (key, tuple(g for g, _, _ in shape[3]))
        entry = self._compiled_decode.get(key)
        if entry is None or (shape not in entry[1] and len(entry[1]) >= MAX_DECODE_TRACES):
            entry = self._compiled_decode[key] = (mx.compile(self._decode_graph), set())
        entry[1].add(shape)
        return entry[0]

    def _decode_graph(self, input_ids: mx.array, arrays: dict, pool_arrays: list):
        """The traced body of a compiled decode step: ``input_ids`` ``[B]`` int32, the step's
        metadata arrays, and every pool array (``pool.arrays()``: K/V, or a quantized pool's
        codes, scales and biases) -> ``(logits [B, vocab], the written pool arrays)``.

        The complete metadata (:func:`~mlx_ferrum.layers.attention.paged_metadata`: pool
        indices, decode indices, RoPE tables) is built here from the traced inputs, before
        the model runs, so every replay derives it from that step's arrays. The softmaxes'
        ``2 ** x`` are traced as fusable arithmetic (:func:`~mlx_ferrum.kernels.reference.fusing`)."""
        with exp2_fusing():
            return self._decode_graph_body(input_ids, arrays, pool_arrays)

    def _decode_graph_body(self, input_ids: mx.array, arrays: dict, pool_arrays: list):
        pool = self.pool.with_arrays(pool_arrays)
        store = self.store
        meta = paged_metadata(
            store.backend, pool, arrays["positions"], arrays["context_lens"], input_ids.shape[0],
            store.layer_groups, arrays["slot_mappings"], arrays["block_tables"], ropes=self.passes.ropes,
            shared_prefixes=_shared_prefixes(arrays, len(arrays["block_tables"])),
            float_window=float_window_metadata(arrays["float_window"], pool) if "float_window" in arrays else None,
        )
        meta.lora_slots = arrays.get("lora_slots")
        lora_weights = arrays.get("lora_weights")
        if self._packed_tokens:
            return self._call_model(input_ids, meta, lora_weights), pool.arrays()  # packed [B] tokens -> [B, vocab]
        return self._call_model(input_ids[None], meta, lora_weights)[0], pool.arrays()
