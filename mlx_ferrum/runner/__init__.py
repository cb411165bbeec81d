"""The model runner: what the engine calls to run the model over its KV store.

- :mod:`.protocol`: :class:`ModelRunner` (the contract the engine, the draft proposer
  and readers of ``engine.runner`` use), :class:`SeqWork` (one sequence's new tokens in
  a batch) and :class:`ModelInfo`.
- :mod:`.llm_runner`: :class:`LlmRunner`, the implementation: the model, the KV store
  (built once by :func:`mlx_ferrum.kv_cache.factory.build_kv_store`) and the forward
  pass, in parts: :mod:`.inputs` (each pass's layout and typed attention metadata, from
  the step's rows; bucketed shapes, padded metadata arrays, token ids and LoRA slots on
  the device),
  :mod:`.compiled_decode` (the ``mx.compile``'d decode step) and :mod:`.model_facts`
  (dtype, rope tables and layer windows read off the loaded model).

The runner never allocates KV blocks: the scheduler owns the block manager and hands
each paged pass its rows' slots and block tables (``SchedulerOutput.kv``).

The ferrum-compatible executor surface (``LlmExecutor``: prefill/decode/handles) sits
beside the engine as a thin adapter over a runner, in :mod:`mlx_ferrum.executor`.
"""

from .llm_runner import MAX_DECODE_TRACES, LlmRunner, layer_windows, model_dtype, shape_bucket
from .protocol import ModelInfo, ModelRunner, SeqWork

__all__ = ["LlmRunner", "MAX_DECODE_TRACES", "ModelInfo", "ModelRunner", "SeqWork", "layer_windows", "model_dtype",
           "shape_bucket"]
