"""Pipeline parallelism: the decoder layers split across ranks, activations passed with send/recv.

Rank ``r`` of ``P`` holds a contiguous run of layers (``evenly``: the first
``L mod P`` ranks get one more; or ``RuntimeConfig.pipeline_split``, e.g. ``"3,2"``).
Rank 0 also holds the embedding, the last rank the final norm and the output head (and,
for a tied head, the embedding matrix). A forward pass on rank ``r``:

- ``r > 0``: its first layer replaces its input with ``recv_like`` from rank ``r - 1``
  (the embedding is a zero placeholder of the right shape there);
- ``r < P - 1``: its last layer's output is ``send`` to rank ``r + 1``;
- the logits: the last rank's head output, summed with zeros from the others
  (``all_sum``), so every rank holds the same logits and the lockstep engine samples
  the same tokens everywhere.

So a pass costs ``P - 1`` send/recv pairs of ``[tokens, hidden]`` and one ``all_sum`` of
the logits rows. Within an engine step the runner splits the sequences into
micro-batches (:meth:`PipelineStage.split`, ``RuntimeConfig.pipeline_micro_batches``)
and the logits sums wait until every micro-batch is built
(:meth:`PipelineStage.deferring`), so stage ``r`` computes micro-batch ``k + 1`` while
stage ``r + 1`` computes micro-batch ``k``.

Combined with tensor parallelism (``tensor_parallel_size * pipeline_parallel_size``
ranks; world rank ``w`` is stage ``w // T``, tensor rank ``w % T``): each stage's layers
are split across its ``T`` ranks as in :mod:`~mlx_ferrum.distributed.sharding`. MLX's
ring backend has no sub-groups (``Group.split`` raises "[ring] Group split not
supported.") and its ``send`` reaches only the two ring neighbours, so a stage cannot
sum over its own ranks alone; instead every sum runs over the whole group and the
ranks of the other stages add zeros, which leaves each sum exact. Every rank therefore
runs one collective sequence per pass: for each stage, two ``all_sum`` per layer, then
(between stages) a boundary ``all_sum`` in which the ending stage's tensor rank 0 hands
its activations to every rank; then the logits ``all_sum`` (only the last stage's tensor
rank 0 adds its logits). Each zero contribution depends on the collective before it,
so every rank issues them in the same order. The cost: every rank takes part in every
layer's two sums (``2 L + P`` ``all_sum`` per pass instead of ``2 L / P``), and the
stages still run one after the other.

Loading reads only the tensors of the rank's layers, and with a
``model.safetensors.index.json`` opens only the shards that hold them. The KV cache
of a rank holds its own layers only (``model.args.num_hidden_layers`` is the local
count, the layers renumbered from 0).

The module wrapping is done by swapping each kept module's class for a subclass that
adds the communication (parameter names stay those of the checkpoint). The idea of
mlx-lm's ``PipelineMixin`` (send/recv between consecutive ranks), written here for
every registered family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import ShardingError
from .group import ParallelGroup

#: the fewest new tokens a micro-batch gets (see :meth:`PipelineStage.split`)
MICRO_BATCH_MIN_TOKENS = 32

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def parse_split(text: Optional[str], num_layers: int, size: int) -> list[int]:
    """Layers per rank: ``text`` (``"3,2"``) or an even split (the first ranks take the rest).

    Raises:
        ShardingError: ``text`` is not ``size`` positive integers summing to ``num_layers``,
            or there are fewer layers than ranks.
    """
    if text is None:
        if num_layers < size:
            raise ShardingError(
                f"num_hidden_layers={num_layers} is less than pipeline_parallel_size={size}: every rank needs a "
                f"layer; use at most {num_layers} ranks"
            )
        base, extra = divmod(num_layers, size)
        return [base + (1 if r < extra else 0) for r in range(size)]
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        counts = []
    if len(counts) != size or any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise ShardingError(
            f"pipeline_split={text!r} is not valid for {num_layers} layers on {size} ranks: give {size} positive "
            f"integers separated by commas that sum to {num_layers} (e.g. "
            f"{','.join(map(str, parse_split(None, num_layers, size)))})"
        )
    return counts


def _finish_pass(logits: mx.array) -> mx.array:
    """Evaluate a pass's summed logits now, while the pass is being built.

    Ranks build different graphs (one sends where the next receives), and MLX orders
    the independent branches of a graph by its shape: with several passes in one step
    (prompts of several lengths in the contiguous layout), one rank ran its sends and
    ``all_sum`` s in another order than its peer ran the matching receives, and received
    the wrong activations. Evaluating each pass's last collective before the next pass
    is built gives every rank the same order (measured: wrong tokens without it).
    ``mx.depends`` chains between the passes deadlocked instead. The compiled decode
    step is off for pipeline stages (see ``LockstepEngine``).
    """
    mx.eval(logits)
    return logits


def _sum_or_defer(local: mx.array, stage: Optional["PipelineStage"]) -> mx.array:
    """A pass's logits: ``local`` (this rank's logits, or zeros) summed across ranks now;
    or, while ``stage`` defers (micro-batches in flight), ``local`` evaluated as it is, so
    that this rank's sends happen now and the sums wait for the end of the step
    (:meth:`PipelineStage.sum_logits`)."""
    if stage is not None and stage.deferred:
        mx.eval(local)
        return local
    group = stage.group if stage is not None else None
    return _finish_pass(mx.distributed.all_sum(local, group=group))


class _Receive:
    """Mixin of a stage's first layer: its input comes from the previous rank."""

    def __call__(self, x, meta):
        x = mx.distributed.recv_like(x, self.pipeline_src, group=self.pipeline_group)
        return super().__call__(x, meta)


class _Send:
    """Mixin of a stage's last layer: its output goes to the next rank."""

    def __call__(self, x, meta):
        h = super().__call__(x, meta)
        return mx.distributed.send(h, self.pipeline_dst, group=self.pipeline_group)


def _zeros_after(h: mx.array) -> mx.array:
    """Zeros shaped like ``h`` that depend on ``h`` (so they are built after it)."""
    return mx.depends(mx.zeros_like(h), h)


def _other_stage_layers(h: mx.array, num_layers: int, group) -> mx.array:
    """Another stage's ``num_layers`` layers as seen from this rank: the two ``all_sum`` of
    each, with zeros (the other stage's ranks contribute the partial sums); ``h`` comes
    back unchanged, after them. Each sum depends on the one before, so every rank runs
    the group's collectives in one order."""
    for _ in range(2 * num_layers):
        h = mx.depends(h, mx.distributed.all_sum(_zeros_after(h), group=group))
    return h


def _hand_off(h: mx.array, contributor: int, world_rank: int, group) -> mx.array:
    """A stage boundary: ``all_sum`` of the activations of world rank ``contributor`` (the
    tensor rank 0 of the stage that ends; its tensor ranks hold identical activations)
    with zeros from every other rank, so every rank gets the next stage's input."""
    value = h if world_rank == contributor else _zeros_after(h)
    return mx.distributed.all_sum(value, group=group)


class _CombinedEnter:
    """Mixin of a stage's first layer in combined tensor + pipeline parallelism: before it,
    the earlier stages' layer sums (with zeros) and their boundaries, the last of which
    brings this stage's input."""

    def __call__(self, x, meta):
        tensor, group = self.pipeline_tensor_size, self.pipeline_group
        for stage, count in enumerate(self.pipeline_counts[: self.pipeline_rank]):
            x = _other_stage_layers(x, count, group)
            x = _hand_off(x, stage * tensor, self.pipeline_world_rank, group)
        return super().__call__(x, meta)


class _CombinedExit:
    """Mixin of a stage's last layer in combined tensor + pipeline parallelism: after it,
    this stage's boundary (its tensor rank 0 hands the activations to every rank), then
    the later stages' layer sums (with zeros) and boundaries."""

    def __call__(self, x, meta):
        h = super().__call__(x, meta)
        tensor, group, rank = self.pipeline_tensor_size, self.pipeline_group, self.pipeline_world_rank
        last = len(self.pipeline_counts) - 1
        h = _hand_off(h, self.pipeline_rank * tensor, rank, group)
        for stage in range(self.pipeline_rank + 1, last + 1):
            h = _other_stage_layers(h, self.pipeline_counts[stage], group)
            if stage < last:
                h = _hand_off(h, stage * tensor, rank, group)
        return h


class _Placeholder:
    """Mixin of the embedding on a rank without it: zeros of the embedding's output shape
    (the first layer replaces them with the received activations)."""

    def __call__(self, input_ids):
        return mx.zeros((*input_ids.shape, self.pipeline_hidden), dtype=self.pipeline_dtype)


class _SummedHead:
    """Mixin of the output head: the last rank's logits summed with the other ranks' zeros."""

    def __call__(self, h):
        return self._pipeline_sum(super().__call__(h))

    def as_linear(self, h):
        return self._pipeline_sum(super().as_linear(h))

    def _pipeline_sum(self, logits):
        if not getattr(self, "pipeline_contributes", True):
            logits = _zeros_after(logits)  # a tensor rank > 0 of the last stage: rank 0's logits count once
        return _sum_or_defer(logits, self.pipeline_owner)


class _ZeroHead:
    """Mixin of rank 0's tied embedding when rank 0 is not the last: it embeds, and as
    the head gives zeros (see :class:`ZeroHead`)."""

    def as_linear(self, h):
        zeros = mx.depends(mx.zeros((*h.shape[:-1], self.pipeline_vocab), dtype=self.pipeline_dtype), h)
        return _sum_or_defer(zeros, self.pipeline_owner)


class ZeroHead(nn.Module):
    """The output head of a rank without it: zeros ``[..., vocab_size]`` that depend on the
    hidden state (so the send of this rank's last layer is part of the evaluated graph),
    summed across ranks with the last rank's logits.

    Args:
        vocab_size, hidden_size, dtype: the logits' width, the hidden width and the dtype.
        group: the ``mx.distributed`` group.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype, group, owner: Optional["PipelineStage"] = None):
        super().__init__()
        self.vocab_size, self.hidden_size, self.dtype, self.group = vocab_size, hidden_size, dtype, group
        self.pipeline_owner = owner

    def __call__(self, h: mx.array) -> mx.array:
        return self.as_linear(h)

    def as_linear(self, h: mx.array) -> mx.array:
        """``[..., hidden] -> [..., vocab_size]`` (one ``all_sum``, or deferred: see
        :meth:`PipelineStage.deferring`)."""
        zeros = mx.depends(mx.zeros((*h.shape[:-1], self.vocab_size), dtype=self.dtype), h)
        return _sum_or_defer(zeros, self.pipeline_owner)


class ZeroEmbedding(ZeroHead):
    """The embedding of a middle rank (neither embeds nor holds a tied head)."""

    def __call__(self, input_ids: mx.array) -> mx.array:
        return mx.zeros((*input_ids.shape, self.hidden_size), dtype=self.dtype)


class PassThrough(nn.Module):
    """The final norm of a rank that is not the last: ``x`` unchanged (what it returns
    only feeds that rank's :class:`ZeroHead`)."""

    def __call__(self, x: mx.array) -> mx.array:
        return x


def _retype(module: nn.Module, mixin: type, **attributes) -> None:
    base = type(module)
    module.__class__ = type(f"{mixin.__name__.strip('_')}{base.__name__}", (mixin, base), {})
    for name, value in attributes.items():
        object.__setattr__(module, name, value)


@dataclasses.dataclass
class PipelineStage:
    """This rank's share of the layers, and how to cut a loaded model down to it.

    Attributes:
        rank, size: the pipeline rank and size. start, end: the layers ``[start, end)``.
        tied: the model ties its head to the embedding. group: the ``mx.distributed`` group
            (all ranks).
        tensor_parallel_size, tensor_rank: combined tensor + pipeline parallelism: this
            stage's layers are also split across ``tensor_parallel_size`` ranks (world ranks
            ``rank * tensor_parallel_size + tensor_rank``); 1 and 0 for pipeline only.
        counts: layers per stage (all stages), for the combined mode's collective sequence.
    """

    rank: int
    size: int
    start: int
    end: int
    tied: bool
    group: Any
    tensor_parallel_size: int = 1
    tensor_rank: int = 0
    counts: Optional[list] = None
    micro_batches: int = 1
    micro_batch_min_tokens: int = MICRO_BATCH_MIN_TOKENS
    deferred: bool = False
    #: steps :meth:`split` cut into more than one micro-batch (a statistic)
    split_steps: int = 0

    @property
    def overlaps(self) -> bool:
        """True when passes can be in flight on several stages at once: pipeline only (the
        combined mode's sums take every rank, so no stage runs ahead)."""
        return self.size > 1 and not self.combined

    def split(self, token_counts: list[int]) -> list[list[int]]:
        """The micro-batches of one step: item indices in consecutive groups of about equal
        token counts (each group non-empty), as many as ``micro_batches`` allows while
        every group keeps at least ``micro_batch_min_tokens`` tokens.

        The floor is why decode steps of a few sequences stay whole: a decode row's cost
        is reading the weights, which every micro-batch reads again, so splitting them
        only adds passes (measured: ``benchmarks/bench_parallel.py``, docs/benchmarks.md),
        while prompt tokens are bound by arithmetic, which the stages then share.

        Args:
            token_counts: new tokens of each item of the step, in order.
        """
        total = sum(token_counts)
        groups = max(1, min(self.micro_batches, len(token_counts), total // max(1, self.micro_batch_min_tokens)))
        out: list[list[int]] = [[]]
        seen = 0
        for index, count in enumerate(token_counts):
            left_items = len(token_counts) - index
            need_groups = groups - len(out)
            if out[-1] and need_groups > 0 and (seen >= total * len(out) / groups or left_items <= need_groups):
                out.append([])
            out[-1].append(index)
            seen += count
        self.split_steps += len(out) > 1
        return out

    @contextlib.contextmanager
    def deferring(self):
        """Within: the output head evaluates this rank's part of each pass (its sends go
        out) and returns it unsummed; :meth:`sum_logits` then sums the passes in build
        order. So stage ``r`` computes pass ``k + 1`` while stage ``r + 1`` computes pass
        ``k`` (GPipe's micro-batches: Huang et al., "GPipe: Efficient Training of Giant
        Neural Networks using Pipeline Parallelism", 2019), and every rank still runs its
        sends, receives and sums in one order (each evaluated in turn, see
        :func:`_finish_pass`)."""
        self.deferred = True
        try:
            yield self
        finally:
            self.deferred = False

    def sum_logits(self, pieces: list[mx.array]) -> list[mx.array]:
        """Sum each deferred pass's logits across ranks, in build order (empty ones stay
        as they are: every rank holds the same shapes), each evaluated before the next."""
        return [piece if piece.size == 0 else _finish_pass(mx.distributed.all_sum(piece, group=self.group))
                for piece in pieces]

    @property
    def combined(self) -> bool:
        """True when the stage's layers are split across tensor ranks too."""
        return self.tensor_parallel_size > 1

    @property
    def world_rank(self) -> int:
        return self.rank * self.tensor_parallel_size + self.tensor_rank

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def wants(self, name: str) -> bool:
        """Whether this rank reads the checkpoint tensor ``name``."""
        match = _LAYER.search(name)
        if match is not None:
            return self.start <= int(match.group(1)) < self.end
        if "embed_tokens" in name:
            return self.first or (self.last and self.tied)
        if "lm_head" in name or ".norm." in f".{name}":
            return self.last  # the head and the final norm
        return True  # anything else outside the layers

    def prune(self, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Keep layers ``[start, end)`` (renumbered from 0), put the placeholders and the
        communication in place, and return ``weights`` renamed to the kept layers."""
        from ..runner.llm_runner import model_dtype

        dtype = model_dtype_from(weights) or model_dtype(model)
        args = model.args
        common = dict(pipeline_group=self.group, pipeline_owner=self)
        backbone = model.model
        layers = list(backbone.layers[self.start : self.end])
        for index, layer in enumerate(layers):
            for sub in layer.modules():
                if hasattr(sub, "layer_idx"):
                    sub.layer_idx = index
        if self.combined:
            combined = dict(pipeline_rank=self.rank, pipeline_tensor_size=self.tensor_parallel_size,
                            pipeline_world_rank=self.world_rank, pipeline_counts=list(self.counts), **common)
            if not self.first:
                _retype(layers[0], _CombinedEnter, **combined)
            if not self.last:
                _retype(layers[-1], _CombinedExit, **combined)
        else:
            if not self.first:
                _retype(layers[0], _Receive, pipeline_src=self.rank - 1, **common)
            if not self.last:
                _retype(layers[-1], _Send, pipeline_dst=self.rank + 1, **common)
        backbone.layers = layers
        if not self.last and "norm" in backbone:
            backbone.norm = PassThrough()  # its output only feeds the zero head
        embed = backbone.embed_tokens
        if self.tied:
            if self.last:
                _retype(embed, _SummedHead, pipeline_contributes=self.tensor_rank == 0, **common)
                if not self.first:
                    _retype(embed, _Placeholder, pipeline_hidden=args.hidden_size, pipeline_dtype=dtype)
            elif self.first:
                _retype(embed, _ZeroHead, pipeline_vocab=args.vocab_size, pipeline_dtype=dtype, **common)
            else:
                backbone.embed_tokens = ZeroEmbedding(args.vocab_size, args.hidden_size, dtype, self.group, self)
        else:
            if not self.first:
                backbone.embed_tokens = ZeroEmbedding(args.vocab_size, args.hidden_size, dtype, self.group, self)
            if self.last:
                _retype(model.lm_head, _SummedHead, pipeline_contributes=self.tensor_rank == 0, **common)
            else:
                model.lm_head = ZeroHead(args.vocab_size, args.hidden_size, dtype, self.group, self)
        model.args = _local_args(args, self.start, self.end)
        if getattr(backbone, "args", None) is args:
            backbone.args = model.args
        model.dtype = dtype
        model.pipeline_stage = self
        return _rename(weights, self.start)


def model_dtype_from(weights: dict[str, mx.array]) -> Optional[mx.Dtype]:
    """The float dtype of the stored norms (the activation dtype), if any."""
    for name, value in weights.items():
        if name.endswith("norm.weight") and mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return None


def _local_args(args, start: int, end: int):
    """``args`` with ``num_hidden_layers = end - start`` and every per-layer list sliced."""
    changes = {"num_hidden_layers": end - start}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, list) and len(value) == args.num_hidden_layers:
            changes[f.name] = value[start:end]
    return dataclasses.replace(args, **changes)


def _rename(weights: dict[str, mx.array], start: int) -> dict[str, mx.array]:
    def local(name: str) -> str:
        return _LAYER.sub(lambda m: m.group(0).replace(m.group(1), str(int(m.group(1)) - start)), name, count=1)

    return {local(name) if _LAYER.search(name) else name: value for name, value in weights.items()}


def load_pipeline_stage(path_or_repo_id: Union[str, os.PathLike], parallel: ParallelGroup, dtype: Any = None,
                        split: Optional[str] = None):
    """Load rank ``parallel.rank``'s pipeline stage of a checkpoint: ``(model, folder)``.

    With both sizes above 1, world rank ``w`` holds stage ``w // tensor_parallel_size``,
    split for tensor rank ``w % tensor_parallel_size`` (the module doc's combined mode).

    Raises:
        ShardingError: see :func:`parse_split`.
        ModelLoadError (and subclasses): as :func:`~mlx_ferrum.models.loader.load_model`.
    """
    from ..models.loader import load_config, load_model, resolve_model_path
    from ..models.registry import family

    folder = resolve_model_path(path_or_repo_id)
    config = load_config(folder)
    args = family(config.get("model_type")).ModelArgs.from_dict(config)
    split = split if split is not None else parallel.pipeline_split
    tensor = parallel.tensor_parallel_size
    stages = parallel.pipeline_parallel_size
    counts = parse_split(split, args.num_hidden_layers, stages)
    rank, tensor_rank = divmod(parallel.rank, tensor)
    start = sum(counts[:rank])
    stage = PipelineStage(rank, stages, start, start + counts[rank], bool(getattr(args, "tie_word_embeddings", False)),
                          parallel.group, tensor, tensor_rank, counts)
    shard = None
    if tensor > 1:
        from .sharding import SliceGroup, check_shardable, shard_model

        check_shardable(args, tensor)  # before any tensor is read
        shard = lambda m: shard_model(m, SliceGroup(tensor, tensor_rank), sum_group=parallel.group,  # noqa: E731
                                      vocabulary=False)
    model, _config, folder = load_model(folder, dtype=dtype, stage=stage, shard=shard)
    if dtype is not None:
        from ..models.loader import _resolve_dtype

        model.dtype = _resolve_dtype(dtype)
    return model, folder
