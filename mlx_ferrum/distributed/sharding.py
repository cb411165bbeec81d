"""Tensor-parallel sharding plans: split a loaded model's layers across a group.

The plan is Megatron-LM's (Shoeybi et al., "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", 2019), the one mlx-lm's
per-family ``shard()`` methods apply, built on ``mlx.nn.layers.distributed``:

- attention: ``q_proj``, ``k_proj``, ``v_proj`` all-to-sharded (each rank computes its
  ``num_heads / N`` query heads and ``num_kv_heads / N`` KV heads), ``o_proj``
  sharded-to-all (one ``all_sum``); per-head parameters (gpt-oss's ``sinks``) keep the
  rank's heads;
- dense MLP: ``gate_proj``, ``up_proj`` all-to-sharded, ``down_proj`` sharded-to-all
  (one ``all_sum``);
- mixture of experts (Qwen3-MoE, gpt-oss): every expert's ``gate``/``up`` rows and
  ``down`` columns are split the same way in place (each rank holds ``1/N`` of every
  expert), the router stays whole, and the block's output is summed across ranks once
  (one ``all_sum``); an expert's ``down`` bias is kept by rank 0 only, so the sum
  counts it once.

So a layer costs exactly two ``all_sum`` per forward pass. The vocabulary is split
too (Megatron-LM's vocabulary-parallel embedding): each rank holds ``vocab_size / N``
rows of the (float) embedding and of an untied LM head; the lookup is one more
``all_sum`` per pass (a token's row is non-zero on one rank only, so the sum is
exact) and the logits one ``all_gather`` (an exact concatenation), so every rank
holds the same full logits and samples the same tokens without further traffic. A
vocabulary not divisible by N, or a quantized embedding, stays replicated. The norms
are replicated. Heads are never replicated: a head count
not divisible by the group size is refused with :class:`~mlx_ferrum.errors.ShardingError`.

After sharding, ``model.args`` carries the per-rank ``num_attention_heads`` and
``num_key_value_heads``, so the runner's KV store (both layouts) holds only the
rank's KV heads, and the attention kernels see only the local heads.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
    shard_inplace,
    shard_linear,
)
from mlx.utils import tree_flatten

from ..errors import ShardingError
from ..layers.quantized16 import QuantizedEmbedding16, QuantizedLinear16


_UNITS = {
    "num_attention_heads": "query heads",
    "num_key_value_heads": "KV heads (they are not replicated)",
    "intermediate_size": "MLP columns, split evenly",
    "moe_intermediate_size": "expert columns, split evenly",
}


def _check_divisible(what: str, count: int, size: int) -> None:
    if count % size:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ShardingError(
            f"{what}={count} is not divisible by tensor_parallel_size={size}: each rank must hold the same number "
            f"of {_UNITS[what]}; use a tensor_parallel_size among {divisors}"
        )


def check_shardable(args, size: int) -> None:
    """Refuse a model whose heads or MLP width cannot be split evenly into ``size`` parts.

    Raises:
        ShardingError: ``num_attention_heads``, ``num_key_value_heads``,
            ``intermediate_size`` (or ``moe_intermediate_size``) not divisible by ``size``;
            the message lists the sizes that divide.
    """
    _check_divisible("num_attention_heads", args.num_attention_heads, size)
    _check_divisible("num_key_value_heads", args.num_key_value_heads, size)
    _check_divisible("intermediate_size", args.intermediate_size, size)
    if getattr(args, "moe_intermediate_size", None):
        _check_divisible("moe_intermediate_size", args.moe_intermediate_size, size)


class SumAcrossRanks(nn.Module):
    """``all_sum(block(x))``: the one collective of a mixture-of-experts block whose
    experts were split across ranks (each rank's output is a partial sum).

    Args:
        block: the MoE block (its experts sharded in place).
        group: the ``mx.distributed`` group.
    """

    def __init__(self, block: nn.Module, group):
        super().__init__()
        self.block = block
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        """``[..., hidden] -> [..., hidden]``, identical on every rank."""
        return mx.distributed.all_sum(self.block(x), group=self.group)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + vocab_size / N)`` of an embedding (and of the
    tied LM head), Megatron-LM's vocabulary-parallel embedding.

    Args:
        weight: the rank's rows, ``[vocab_size / N, hidden]``.
        start: the first row's token id.
        group: the ``mx.distributed`` group.
    """

    def __init__(self, weight: mx.array, start: int, group):
        super().__init__()
        self.weight = weight
        self.start = start
        self.group = group

    def __call__(self, input_ids: mx.array) -> mx.array:
        """``[...] int -> [..., hidden]``: the rows, summed across ranks (one ``all_sum``)."""
        rows = self.weight.shape[0]
        local = input_ids - self.start
        inside = (local >= 0) & (local < rows)
        h = self.weight[mx.where(inside, local, 0)] * inside[..., None].astype(self.weight.dtype)
        return mx.distributed.all_sum(h, group=self.group)

    def as_linear(self, h: mx.array) -> mx.array:
        """``[..., hidden] -> [..., vocab_size]``: the rank's logit columns, gathered (one ``all_gather``)."""
        return gather_last_axis(h @ self.weight.T, self.group)


class VocabParallelHead(nn.Module):
    """This rank's rows of an untied LM head (``lm_head.weight``), logits gathered.

    Args:
        weight: ``[vocab_size / N, hidden]``. group: the ``mx.distributed`` group.
    """

    def __init__(self, weight: mx.array, group):
        super().__init__()
        self.weight = weight
        self.group = group

    def __call__(self, h: mx.array) -> mx.array:
        """``[..., hidden] -> [..., vocab_size]`` (one ``all_gather``)."""
        return gather_last_axis(h @ self.weight.T, self.group)


def gather_last_axis(x: mx.array, group) -> mx.array:
    """Concatenate every rank's ``x`` ``[..., n]`` on the last axis, in rank order:
    ``[..., n * N]`` (``all_gather`` concatenates on the first axis)."""
    moved = mx.moveaxis(x, -1, 0)
    return mx.moveaxis(mx.distributed.all_gather(moved, group=group), 0, -1)


def _rows(weight: mx.array, rank: int, size: int) -> tuple[mx.array, int]:
    rows = weight.shape[0] // size
    return mx.contiguous(weight[rank * rows : (rank + 1) * rows]), rank * rows


def _shard_vocabulary(model: nn.Module, group, rank: int, size: int) -> bool:
    """Split the embedding and an untied head by vocabulary rows; False when left replicated."""
    backbone = model.model
    embed = backbone.embed_tokens
    head = model["lm_head"] if "lm_head" in model else None
    if type(embed) is not nn.Embedding or embed.weight.shape[0] % size:
        return False
    if head is not None and (not isinstance(head, nn.Linear) or "bias" in head):
        return False
    weight, start = _rows(embed.weight, rank, size)
    backbone.embed_tokens = VocabParallelEmbedding(weight, start, group)
    if head is not None:
        model.lm_head = VocabParallelHead(_rows(head.weight, rank, size)[0], group)
    return True


def _shard_attention(attn: nn.Module, group, size: int) -> None:
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    if "sinks" in attn:
        # one sink logit per query head: keep this rank's heads, in order
        shard_inplace(attn, lambda path, w: 0 if path == "sinks" else None, group=group)
    attn.n_heads //= size
    attn.n_kv_heads //= size


def _is_moe(mlp: nn.Module) -> bool:
    return "experts" in mlp or "switch_mlp" in mlp


def _shard_moe(mlp: nn.Module, group, rank: int) -> nn.Module:
    experts = mlp["experts"] if "experts" in mlp else mlp["switch_mlp"]
    shard_inplace(experts.gate_proj, "all-to-sharded", group=group)
    shard_inplace(experts.up_proj, "all-to-sharded", group=group)
    shard_inplace(experts.down_proj, "sharded-to-all", group=group)
    if "bias" in experts.down_proj and rank != 0:
        # the output is linear in the bias: kept on one rank, the sum adds it once
        experts.down_proj.bias = mx.zeros_like(experts.down_proj.bias)
    return SumAcrossRanks(mlp, group)


def _shard_dense_mlp(mlp: nn.Module, group) -> None:
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


class SliceGroup:
    """The ``size()`` / ``rank()`` of a group that only decides how weights are sliced.

    Combined tensor + pipeline parallelism slices a stage's layers by the tensor rank
    within the stage, while its sums run over the whole group (see
    :mod:`~mlx_ferrum.distributed.pipeline`): MLX's ring backend has no sub-groups.

    Args:
        size, rank: the tensor-parallel size and this rank's place in it.
    """

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


_COLLECTIVE_LAYERS = (AllToShardedLinear, ShardedToAllLinear, QuantizedAllToShardedLinear,
                      QuantizedShardedToAllLinear)


def _sum_over(module: nn.Module, group) -> None:
    """Point every sharded linear layer (and MoE sum) under ``module`` at ``group``."""
    for sub in module.modules():
        if isinstance(sub, _COLLECTIVE_LAYERS + (SumAcrossRanks,)):
            object.__setattr__(sub, "group", group)


def shard_model(model: nn.Module, group, sum_group=None, vocabulary: bool = True) -> nn.Module:
    """Split ``model`` (any registered family) across ``group`` for tensor parallelism, in place.

    Call it on a loaded model before its parameters are evaluated (``load_model`` does,
    when given a group), so each rank materializes only its slices.

    Args:
        model: a loaded model whose layers have ``self_attn`` (q/k/v/o projections,
            ``n_heads``, ``n_kv_heads``) and ``mlp`` (gate/up/down, or an MoE block with
            ``experts``).
        group: the ``mx.distributed`` group; its size is the tensor-parallel size.
        sum_group: the group the sums run over, when it is not ``group`` (combined tensor +
            pipeline parallelism: ``group`` is then a :class:`SliceGroup` and the other
            stages' ranks add zeros).
        vocabulary: split the embedding and head by vocabulary rows when possible.

    Returns:
        ``model``, with ``model.args`` replaced by a copy holding the per-rank head counts.

    Raises:
        ShardingError: see :func:`check_shardable`, or a layer of an unknown shape, or a
            GGUF layer with 16-weight groups (Q6_K / Q3_K / Q2_K), which MLX's sharded
            layers do not take.
    """
    size, rank = group.size(), group.rank()
    args = model.args
    check_shardable(args, size)
    for path, module in model.named_modules():
        if isinstance(module, (QuantizedLinear16, QuantizedEmbedding16)):
            raise ShardingError(
                f"{path} holds a GGUF tensor with 16-weight groups (Q6_K, Q3_K or Q2_K), which tensor parallelism "
                "does not split yet: run this model in one process, or use a GGUF file without those types (Q8_0, "
                "Q4_K_S, Q5_K_S) or the MLX folder")
    for i, layer in enumerate(model.layers):
        if "self_attn" not in layer or "mlp" not in layer:
            raise ShardingError(f"layer {i} of {args.model_type} has no self_attn/mlp: no tensor-parallel plan for it")
        _shard_attention(layer.self_attn, group, size)
        if _is_moe(layer.mlp):
            layer.mlp = _shard_moe(layer.mlp, group, rank)
        else:
            _shard_dense_mlp(layer.mlp, group)
        if sum_group is not None:
            _sum_over(layer, sum_group)
    model.vocabulary_parallel = vocabulary and _shard_vocabulary(model, group, rank, size)
    model.args = dataclasses.replace(
        args,
        num_attention_heads=args.num_attention_heads // size,
        num_key_value_heads=args.num_key_value_heads // size,
    )
    model.tensor_parallel_size = size
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as loaded on this rank (``sum(a.nbytes)``)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def count_collectives(fn, *args, **kwargs) -> tuple[object, dict]:
    """``(fn(*args, **kwargs), counts)``: the result, and how many ``mx.distributed``
    ``all_sum`` / ``all_gather`` / ``send`` / ``recv_like`` calls building it made (the
    collectives in one forward pass's graph, when ``fn`` runs one eagerly). An
    instrumented wrapper for tests and reports; not thread-safe.
    """
    names = ("all_sum", "all_gather", "send", "recv_like")
    originals = {n: getattr(mx.distributed, n) for n in names}
    counts = dict.fromkeys(names, 0)

    def counted(name):
        def call(*a, **k):
            counts[name] += 1
            return originals[name](*a, **k)

        return call

    for n in names:
        setattr(mx.distributed, n, counted(n))
    try:
        out = fn(*args, **kwargs)
    finally:
        for n in names:
            setattr(mx.distributed, n, originals[n])
    return out, counts
