"""LoRA beside a model's projections, with a different adapter per token.

Low-rank adaptation (Hu et al., "LoRA", 2021) adds ``scale * (x @ A) @ B`` to a frozen
projection ``base(x)``. To serve many adapters in one batch (Punica, Chen et al. 2023;
S-LoRA, Sheng et al. 2023), every adapted projection sees the adapters stacked in
*slots*: ``A`` ``[S + 1, in, r]`` and ``B`` ``[S + 1, r, out]`` (``scale`` already
folded into ``B``), where the last slot is all zeros and serves tokens without an
adapter. Each token names its slot, so one forward pass computes

    ``y[t] = base(x[t]) + (x[t] @ A[slot[t]]) @ B[slot[t]]``

The base may be ``nn.Linear`` or ``nn.QuantizedLinear``: the LoRA product runs beside
the base matmul (never fused into the weights, so one base serves every adapter).

How the slots reach the layers: the model never sees requests. A :class:`LoraContext`
is shared by every adapted projection of a model; the model runner binds the pass's
per-token slots and the stacked weights to it (:meth:`LoraContext.bound`) while it
builds the pass's graph, and the projections read them. Outside a binding (or for a
pass without adapter tokens) the projections are exactly their base.

The product is ``mx.gather_mm`` with per-token ``rhs_indices`` (BGMV): it was faster
than a sort-by-adapter segmented product on this machine's CPU at every batch size
measured (``benchmarks/bench_lora_products.py``, ``docs/benchmarks.md``), needs no
host knowledge of the batch's composition (so it runs inside the compiled decode
step with the slots as an input) and computes each token on its own, so a row's
result does not depend on which other adapters share its batch.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import LoraError
from .dense import Linear
from .quantized16 import QuantizedLinear16

#: module types a LoRA can sit beside
ADAPTABLE_TYPES = (nn.Linear, nn.QuantizedLinear, QuantizedLinear16)


def lora_delta_gather(x: mx.array, a: mx.array, b: mx.array, slots: mx.array) -> mx.array:
    """``(x[t] @ a[slots[t]]) @ b[slots[t]]`` for every token, with two ``mx.gather_mm``.

    Args:
        x: ``[N, in]`` activations.
        a: ``[S, in, r]`` stacked A matrices; b: ``[S, r, out]`` stacked B matrices.
        slots: ``[N]`` int32 slot of each token, in ``[0, S)``.

    Returns:
        ``[N, out]`` in the promoted dtype of ``x`` and the stacks.
    """
    h = mx.gather_mm(x[:, None, :], a, rhs_indices=slots)
    return mx.gather_mm(h, b, rhs_indices=slots)[:, 0, :]


class LoraContext:
    """The adapter state of the pass being built, shared by a model's adapted projections.

    Per thread (two model runners over one model may build passes in two threads).
    ``token_slots`` is ``[N]`` int32 over the pass's flattened tokens (``N`` = batch rows
    times tokens per row, or the packed tokens of a paged pass); ``weights`` maps a
    projection's index (as a string: a pytree key ``mx.compile`` accepts) to its ``(A [S + 1, in, r], B [S + 1, r, out])`` stacks; a
    projection absent from it has no adapter among the resident ones.
    """

    def __init__(self):
        self._local = threading.local()

    @property
    def token_slots(self) -> Optional[mx.array]:
        """The bound ``[N]`` int32 slots, or None outside a binding."""
        return getattr(self._local, "token_slots", None)

    def weights_of(self, index: int) -> Optional[tuple[mx.array, mx.array]]:
        """The bound ``(A, B)`` stacks of projection ``index``, or None."""
        weights = getattr(self._local, "weights", None)
        return None if weights is None else weights.get(str(index))

    @contextmanager
    def bound(self, token_slots: Optional[mx.array], weights: Optional[dict]) -> Iterator[None]:
        """Bind ``token_slots`` ``[N]`` int32 and ``weights`` (``{str(index): (A, B)}``) for the
        graph built inside the ``with`` block; ``token_slots=None`` binds nothing."""
        previous = (self.token_slots, getattr(self._local, "weights", None))
        self._local.token_slots, self._local.weights = (token_slots, weights) if token_slots is not None else (None, None)
        try:
            yield
        finally:
            self._local.token_slots, self._local.weights = previous


class _LoraMixin:
    """``base(x) + lora(x)``; the base class's parameters stay where they were (same names)."""

    lora_index: int
    lora_context: LoraContext
    lora_path: str

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        slots = self.lora_context.token_slots
        if slots is None:
            return y
        stacks = self.lora_context.weights_of(self.lora_index)
        if stacks is None:
            return y
        a, b = stacks
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != slots.shape[0]:
            raise LoraError(
                f"{self.lora_path}: the pass binds {slots.shape[0]} adapter slots for {flat.shape[0]} tokens; "
                "a LoRA projection must see every token of the pass (one slot per token)"
            )
        delta = lora_delta_gather(flat.astype(a.dtype), a, b, slots)
        return y + delta.astype(y.dtype).reshape(y.shape)


class LoraLinear(_LoraMixin, Linear):
    """A :class:`~mlx_ferrum.layers.dense.Linear` (an ``nn.Linear``) with per-token LoRA
    slots (see the module docstring)."""


class LoraQuantizedLinear(_LoraMixin, nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` with per-token LoRA slots; the LoRA product stays in float."""


class LoraQuantizedLinear16(_LoraMixin, QuantizedLinear16):
    """A :class:`~mlx_ferrum.layers.quantized16.QuantizedLinear16` (GGUF's 16-weight groups)
    with per-token LoRA slots; the LoRA product stays in float."""


_LORA_CLASS = {nn.Linear: LoraLinear, Linear: LoraLinear, nn.QuantizedLinear: LoraQuantizedLinear,
               QuantizedLinear16: LoraQuantizedLinear16}
#: the class each LoRA variant came from (``restore_module``)
_BASE_CLASS = {LoraLinear: Linear, LoraQuantizedLinear: nn.QuantizedLinear, LoraQuantizedLinear16: QuantizedLinear16}


def check_adaptable(module: nn.Module, path: str) -> None:
    """Refuse a module no LoRA may sit beside.

    Raises:
        LoraError: ``module`` is neither ``nn.Linear`` nor ``nn.QuantizedLinear`` (mixture-
            of-experts ``SwitchLinear``, embeddings, norms ...): the message names ``path``
            and the type.
    """
    if not isinstance(module, _LoraMixin) and type(module) not in _LORA_CLASS:
        raise LoraError(
            f"LoRA on {path} ({type(module).__name__}) is not supported: adapters may target the linear "
            "projections of the decoder layers (q/k/v/o, gate/up/down, fused qkv/gate_up), not mixture-of-"
            "experts weights, embeddings or the LM head"
        )


def adapt_module(module: nn.Module, path: str, index: int, context: LoraContext) -> nn.Module:
    """Turn ``module`` (at ``path`` in its model) into its LoRA variant in place.

    The class of the object is swapped rather than the object wrapped, so its
    parameters keep their names (``...q_proj.weight``) and every reference to it stays
    valid. A module already adapted is left as it is.

    Raises:
        LoraError: see :func:`check_adaptable`.
    """
    check_adaptable(module, path)
    if isinstance(module, _LoraMixin):
        return module
    module.__class__ = _LORA_CLASS[type(module)]
    module.lora_index = index
    module.lora_context = context
    module.lora_path = path
    return module


def restore_module(module: nn.Module) -> None:
    """Undo :func:`adapt_module`: the module becomes an ``nn.QuantizedLinear``, a
    ``QuantizedLinear16`` or a :class:`~mlx_ferrum.layers.dense.Linear` again."""
    if isinstance(module, _LoraMixin):
        module.__class__ = _BASE_CLASS[type(module)]
