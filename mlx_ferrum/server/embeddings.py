"""OpenAI's embeddings API: ``POST /v1/embeddings``.

Each input (a string, a list of strings, a list of token ids, or a list of such lists)
is tokenized (special tokens added, as the tokenizer's own ``encode`` does) and the
inputs run, batched, through the model's decoder stack once, with no KV cache (``model.model(ids, None)``:
plain causal attention, the final norm applied: what transformers calls
``last_hidden_state``). The hidden states are pooled per input -- ``last`` (the last
token's, the usual choice for decoder models) or ``mean`` (over every token), the
server's ``--pooling`` -- in float32 and L2-normalized (vLLM's pooling names and
defaults for decoder models).

The forward passes run on the engine's stepping thread between two steps
(:meth:`~mlx_ferrum.engine.AsyncEngine.run_between_steps`), so they never overlap a
generation step and leave the engine's state (KV blocks, sequences) untouched.

``encoding_format`` ``float`` gives lists of floats, ``base64`` the little-endian
float32 bytes in base64 (what the official client asks for by default). ``dimensions``
is refused (400): these models have no Matryoshka training, so a truncated vector would
not be a meaningful embedding.
"""

from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from .limits import ServerLimits
from .routing import ApiRouter
from .serving import OpenAIServing, ServingError

__all__ = ["EmbeddingRequest", "EmbeddingsServing", "embeddings_router", "pool", "POOLING"]

POOLING = ("last", "mean")
#: most padded tokens in one embedding forward pass (bounds its activations' memory)
BATCH_TOKENS = 8192


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``; ``input`` is checked by hand (see :meth:`EmbeddingsServing.inputs`)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    input: Any
    encoding_format: str = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """One input's embedding from its hidden states ``hidden`` ``[L, H]`` (float32):
    the last row (``last``) or the mean of the rows (``mean``), divided by its L2 norm.
    Returns ``[H]`` float32."""
    vector = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    vector = vector.astype(np.float32)
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


class EmbeddingsServing:
    """Serves ``/v1/embeddings`` over an :class:`OpenAIServing`'s engine.

    Args:
        serving: the server's :class:`OpenAIServing` (tokenizer, limits, engine).
        pooling: ``last`` or ``mean``.

    Raises:
        ValueError: an unknown ``pooling``.
    """

    def __init__(self, serving: OpenAIServing, pooling: str = "last"):
        if pooling not in POOLING:
            raise ValueError(f"unknown pooling {pooling!r}: use one of {list(POOLING)}")
        self.serving = serving
        self.pooling = pooling

    def inputs(self, raw: Any) -> list[list[int]]:
        """Token ids of every input (blocking: tokenizes; call it in a worker thread).

        Raises:
            ServingError: 400 for an empty input or list, a value that is none of the
                accepted shapes, ids outside the vocabulary, an input as long as the
                context, or more prompts / tokens than the server's limits.
        """
        s = self.serving
        if isinstance(raw, str):
            texts, id_lists = [raw], None
        elif isinstance(raw, list) and raw and all(type(x) is int for x in raw):  # noqa: E721 - bool is no id
            texts, id_lists = None, [raw]
        elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            texts, id_lists = raw, None
        elif isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw):
            texts, id_lists = None, raw
        elif isinstance(raw, list) and not raw:
            raise ServingError(400, "input is an empty list: send at least one string or token id list", param="input")
        else:
            raise ServingError(400, "input must be a string, a list of strings, a list of token ids, or a list of lists "
                               "of token ids", param="input")
        count = len(texts if texts is not None else id_lists)
        if count > s.limits.max_prompts_per_request:
            raise s._over_limit("max_prompts_per_request", count, "the number of inputs", param="input")
        out, total = [], 0
        for i in range(count):
            what = "the input" if count == 1 else f"input {i}"
            if texts is not None:
                if not texts[i]:
                    raise ServingError(400, f"{what} is an empty string: send some text", param="input")
                ids = s._encode(texts[i], param="input")
            else:
                ids = list(id_lists[i])
            total += len(ids)
            s._count_prompt_tokens(total)
            s._check_ids(ids, param="input", what=what)
            if len(ids) > s.max_model_len:
                raise ServingError(400, f"{what} has {len(ids)} tokens and the context holds {s.max_model_len}: shorten it",
                                   param="input", code="context_length_exceeded")
            out.append(ids)
        return out

    def _embed(self, id_lists: list[list[int]]) -> list[np.ndarray]:
        """The pooled, normalized embedding of each id list (on the stepping thread).

        Inputs run as batches of one forward pass each, right-padded to the batch's
        longest input: under causal attention a token never sees the padding after it,
        so each input's rows equal its own run; the padding rows are not pooled. A batch
        holds at most ``BATCH_TOKENS`` padded tokens (inputs sorted by length, so little
        is padding).
        """
        import mlx.core as mx

        backbone = self.serving.engine.model.model
        order = sorted(range(len(id_lists)), key=lambda i: len(id_lists[i]))
        vectors: list = [None] * len(id_lists)
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and len(id_lists[order[end]]) * (end + 1 - start) <= BATCH_TOKENS:
                end += 1
            batch = order[start:end]
            width = len(id_lists[batch[-1]])
            rows = np.zeros((len(batch), width), dtype=np.int32)
            for r, i in enumerate(batch):
                rows[r, : len(id_lists[i])] = id_lists[i]
            hidden = backbone(mx.array(rows), None).astype(mx.float32)
            mx.eval(hidden)
            hidden = np.array(hidden)
            for r, i in enumerate(batch):
                vectors[i] = pool(hidden[r, : len(id_lists[i])], self.pooling)
            start = end
        return vectors

    async def create(self, req: EmbeddingRequest) -> dict:
        """OpenAI's embeddings list: ``data[i].embedding`` per input, ``usage.prompt_tokens``.

        Raises:
            ServingError: 404 unknown model, 400 invalid request (see :meth:`inputs`;
                ``dimensions``, an unknown ``encoding_format``, a LoRA adapter's name),
                503 shutting down.
        """
        s = self.serving
        s.check_alive()
        if s.check_model(req.model) is not None:
            raise ServingError(400, "embeddings are served for the base model only: use a served model name, not a LoRA "
                               "adapter's", param="model")
        if req.encoding_format not in ("float", "base64"):
            raise ServingError(400, f"encoding_format {req.encoding_format!r} is invalid: use \"float\" or \"base64\"",
                               param="encoding_format")
        if req.dimensions is not None:
            raise ServingError(400, "'dimensions' is not supported by this model (it was not trained to shorten its "
                               "embeddings): leave it out", param="dimensions")
        if getattr(s.engine.model, "model", None) is None:
            raise ServingError(400, "this model has no decoder stack to embed with", param="model")
        id_lists = await run_in_threadpool(self.inputs, req.input)
        vectors = await s.async_engine.run_between_steps(lambda: self._embed(id_lists))
        data = []
        for i, v in enumerate(vectors):
            if req.encoding_format == "base64":
                value: Any = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            else:
                value = v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(ids) for ids in id_lists)
        return {"object": "list", "data": data, "model": req.model or s.model_names[0],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def embeddings_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list, pooling: str = "last") -> ApiRouter:
    """The ``POST /v1/embeddings`` route over ``serving``, pooling by ``pooling``.

    Raises:
        ValueError: an unknown ``pooling``.
    """
    router = ApiRouter(limits, dependencies=dependencies)
    router.post_reply("/v1/embeddings", EmbeddingRequest, EmbeddingsServing(serving, pooling).create, name="create_embeddings")
    return router
