"""The adapters a model runner serves: registered names, loaded adapters, resident slots.

Three tiers, as in vLLM and S-LoRA:

- **registered**: name -> folder (any number; nothing in memory for an evicted one);
- **loaded**: up to ``max_cpu_loras`` adapters' factors in memory, least recently used
  dropped first (and re-read from their folder on the next use);
- **resident**: up to ``max_loras`` adapters copied into the slots of every adapted
  projection's stacks (``A`` ``[max_loras + 1, in, max_lora_rank]``, ``B``
  ``[max_loras + 1, max_lora_rank, out]``, in the model's dtype; the last slot stays
  zero for tokens without an adapter). A slot held by a running request (a pin) is
  never evicted; among free slots the least recently used is reused.

Only projections some registered adapter touches get stacks, so an adapter of q and v
costs nothing in the MLP.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import LoraError, UnknownLoraError
from ..layers.lora import ADAPTABLE_TYPES, LoraContext, adapt_module, check_adaptable
from ..layers.quantized16 import QuantizedLinear16
from .formats import LoraAdapter, LoraModule, load_adapter

#: fused projections some checkpoints (Phi-3) ship and the models split at load:
#: a LoRA on the fused module is split the same way (``A`` shared, ``B`` by output rows)
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def module_dims(module: nn.Module) -> tuple[int, int]:
    """``(in, out)`` features of an ``nn.Linear``, ``nn.QuantizedLinear`` or ``QuantizedLinear16``."""
    out_dims, packed = module.weight.shape
    if isinstance(module, (nn.QuantizedLinear, QuantizedLinear16)):
        return packed * 32 // module.bits, out_dims
    return packed, out_dims


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of the decoder layers a LoRA may sit beside (linear, float or quantized),
    by path (``model.layers.0.self_attn.q_proj``)."""
    return {path: m for path, m in model.named_modules()
            if isinstance(m, ADAPTABLE_TYPES) and ".layers." in f".{path}"}


def match_adapter(adapter: LoraAdapter, model: nn.Module, max_rank: int,
                  targets: Optional[dict[str, nn.Module]] = None) -> dict[str, LoraModule]:
    """Check ``adapter`` against ``model`` and return its modules under the model's paths
    (fused ``qkv_proj`` / ``gate_up_proj`` factors split into the model's projections).

    Raises:
        LoraError: rank above ``max_rank``; a module the model lacks (another
            architecture), or one that is not a linear projection of a decoder layer
            (mixture-of-experts weights, embeddings, LM head); a factor whose shape
            disagrees with the module. The message names the adapter, the module and
            both shapes.
    """
    if adapter.rank > max_rank:
        raise LoraError(f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank={max_rank}: raise "
                        "max_lora_rank (FERRUM_MAX_LORA_RANK, --max-lora-rank)")
    targets = adaptable_modules(model) if targets is None else targets
    every = dict(model.named_modules())
    out: dict[str, LoraModule] = {}
    for path, lora in adapter.modules.items():
        parent, _, leaf = path.rpartition(".")
        parts = FUSED_PROJECTIONS.get(leaf)
        if path not in every and parts and all(f"{parent}.{p}" in targets for p in parts):
            start = 0
            for part in parts:
                sub = f"{parent}.{part}"
                width = module_dims(targets[sub])[1]
                out[sub] = LoraModule(lora.a, lora.b[:, start : start + width], lora.scale)
                start += width
            if start != lora.b.shape[1]:
                raise LoraError(f"adapter {adapter.name!r}: {path} has {lora.b.shape[1]} output features, the "
                                f"model's {'/'.join(parts)} have {start} together: the adapter is for another model")
            continue
        if path not in every:
            raise LoraError(f"adapter {adapter.name!r} adapts {path!r}, which this model does not have: the adapter "
                            "was trained for another architecture or layer count")
        if path not in targets:
            check_adaptable(every[path], path)  # the named refusal for its type
            raise LoraError(f"adapter {adapter.name!r} adapts {path!r}, which is outside the decoder layers: only "
                            "the decoder layers' linear projections are served")
        out[path] = lora
    for path, lora in out.items():
        fan_in, fan_out = module_dims(targets[path])
        if lora.a.shape[0] != fan_in or lora.b.shape[1] != fan_out:
            raise LoraError(
                f"adapter {adapter.name!r}: {path} expects A [{fan_in}, r] and B [r, {fan_out}] (in, out of the base "
                f"projection), the adapter has A {list(lora.a.shape)} and B {list(lora.b.shape)}: the adapter is for "
                "another model"
            )
    return out


@dataclass
class _Entry:
    path: str
    requests: int = 0


class LoraRegistry:
    """Registered, loaded and resident adapters of one model (see the module docstring).

    Args:
        model: the base model; its decoder layers' linear projections are switched to
            their LoRA variants (:func:`~mlx_ferrum.layers.lora.adapt_module`), which are
            exactly the base until a pass binds adapter slots.
        max_loras: resident slots. max_lora_rank: slot width. max_cpu_loras: loaded adapters.
        dtype: the stacks' dtype (the model's activation dtype).

    Thread-safe (one lock); the model runner calls it while it builds passes.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int, dtype: mx.Dtype):
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.dtype = dtype
        self.model = model
        self.context: LoraContext = getattr(model, "_lora_context", None) or LoraContext()
        model._lora_context = self.context  # one context per model, shared by its runners
        self.targets = adaptable_modules(model)
        self._index = {path: i for i, path in enumerate(sorted(self.targets))}
        for path, module in self.targets.items():
            adapt_module(module, path, self._index[path], self.context)
        self._lock = threading.RLock()
        self._registered: dict[str, _Entry] = {}
        self._loaded: "OrderedDict[str, dict[str, LoraModule]]" = OrderedDict()  # LRU: oldest first
        self._slot_of: dict[str, int] = {}
        self._slots: list[Optional[str]] = [None] * max_loras
        self._slot_used = [0] * max_loras  # last-use tick, for LRU among unpinned slots
        self._pins: dict[int, set] = {s: set() for s in range(max_loras)}
        self._owner_slot: dict[object, int] = {}
        self._tick = 0
        self._stacks: dict[int, tuple[mx.array, mx.array]] = {}
        self.counters = {"loads": 0, "cpu_evictions": 0, "slot_loads": 0, "slot_evictions": 0}

    # ------------------------------------------------------------- names
    @property
    def none_slot(self) -> int:
        """The all-zero slot of tokens without an adapter (``max_loras``)."""
        return self.max_loras

    def add(self, name: str, path: str) -> LoraAdapter:
        """Register ``name`` for the adapter at ``path`` (a folder or hub id), loading and
        checking it now so that a bad adapter fails here, not in a request.

        Raises:
            LoraError: ``name`` is empty or already registered with another path, or the
                adapter is refused (:func:`~mlx_ferrum.lora.formats.load_adapter`,
                :func:`match_adapter`).
        """
        if not isinstance(name, str) or not name.strip():
            raise LoraError(f"an adapter name must be a non-empty string, got {name!r}")
        adapter = load_adapter(path, name)
        modules = match_adapter(adapter, self.model, self.max_rank, self.targets)
        with self._lock:
            old = self._registered.get(name)
            if old is not None and old.path != str(path):
                raise LoraError(f"adapter {name!r} is already registered from {old.path}: remove it first "
                                "(remove_lora) or pick another name")
            self._registered[name] = old or _Entry(str(path))
            self._remember(name, modules)
            self.counters["loads"] += 1
        return adapter

    def remove(self, name: str) -> None:
        """Unregister ``name`` and free its slot.

        Raises:
            UnknownLoraError: ``name`` is not registered.
            LoraError: a running request still uses it.
        """
        with self._lock:
            self._check_known(name)
            slot = self._slot_of.get(name)
            if slot is not None and self._pins[slot]:
                raise LoraError(f"adapter {name!r} is used by {len(self._pins[slot])} running request(s): remove it "
                                "once they finish")
            if slot is not None:
                self._clear_slot(slot)
            self._loaded.pop(name, None)
            del self._registered[name]

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        with self._lock:
            return list(self._registered)

    def has(self, name: str) -> bool:
        """True when ``name`` is registered."""
        with self._lock:
            return name in self._registered

    def path_of(self, name: str) -> str:
        """The folder or hub id ``name`` was registered from.

        Raises:
            UnknownLoraError: ``name`` is not registered."""
        with self._lock:
            self._check_known(name)
            return self._registered[name].path

    def _check_known(self, name: str) -> None:
        if name not in self._registered:
            known = ", ".join(repr(n) for n in self._registered) or "none"
            raise UnknownLoraError(f"unknown LoRA adapter {name!r}; registered adapters: {known} (add it with "
                                   "add_lora(name, path), or --lora-modules name=path)")

    # ------------------------------------------------------------- slots
    def acquire(self, name: str, owner: object) -> Optional[int]:
        """The slot of adapter ``name`` for ``owner`` (a request), made resident if needed
        and pinned until :meth:`release`; the same slot again for an owner holding it.

        Returns:
            The slot index, or None when every slot is pinned by other adapters' requests
            (the caller waits for one to finish).

        Raises:
            UnknownLoraError: ``name`` is not registered. LoraError: its folder can no
            longer be read.
        """
        with self._lock:
            self._check_known(name)
            held = self._owner_slot.get(owner)
            if held is not None:
                if self._slots[held] == name:
                    self._touch(held)
                    return held
                self.release(owner)
            slot = self._slot_of.get(name)
            if slot is None:
                slot = self._free_slot()
                if slot is None:
                    return None
                self._load_slot(slot, name)
            self._pins[slot].add(owner)
            self._owner_slot[owner] = slot
            self._registered[name].requests += 1
            self._touch(slot)
            return slot

    def release(self, owner: object) -> None:
        """Unpin ``owner``'s slot (a no-op for an owner holding none)."""
        with self._lock:
            slot = self._owner_slot.pop(owner, None)
            if slot is not None:
                self._pins[slot].discard(owner)

    def can_acquire(self, name: Optional[str]) -> bool:
        """True when :meth:`acquire` of ``name`` would get a slot now (None: no adapter)."""
        if name is None:
            return True
        with self._lock:
            return name in self._slot_of or any(not self._pins[s] for s in range(self.max_loras))

    def slot_name(self, slot: int) -> Optional[str]:
        """The adapter resident in ``slot``, or None."""
        return self._slots[slot] if 0 <= slot < self.max_loras else None

    def weights(self) -> dict[str, tuple[mx.array, mx.array]]:
        """The stacks of every projection some resident or loaded adapter touches:
        ``{str(index): (A [S + 1, in, R], B [S + 1, R, out])}`` (string keys: a pytree
        ``mx.compile`` takes as an input)."""
        with self._lock:
            return {str(i): ab for i, ab in self._stacks.items()}

    def _touch(self, slot: int) -> None:
        self._tick += 1
        self._slot_used[slot] = self._tick
        name = self._slots[slot]
        if name in self._loaded:
            self._loaded.move_to_end(name)

    def _free_slot(self) -> Optional[int]:
        empty = [s for s in range(self.max_loras) if self._slots[s] is None]
        if empty:
            return empty[0]
        free = [s for s in range(self.max_loras) if not self._pins[s]]
        if not free:
            return None
        slot = min(free, key=lambda s: self._slot_used[s])
        self._clear_slot(slot)
        self.counters["slot_evictions"] += 1
        return slot

    def _clear_slot(self, slot: int) -> None:
        name = self._slots[slot]
        if name is not None:
            del self._slot_of[name]
        self._slots[slot] = None

    def _modules_of(self, name: str) -> dict[str, LoraModule]:
        modules = self._loaded.get(name)
        if modules is None:  # dropped from memory: read it again
            adapter = load_adapter(self._registered[name].path, name)
            modules = match_adapter(adapter, self.model, self.max_rank, self.targets)
            self._remember(name, modules)
            self.counters["loads"] += 1
        return modules

    def _remember(self, name: str, modules: dict[str, LoraModule]) -> None:
        self._loaded[name] = modules
        self._loaded.move_to_end(name)
        for path in modules:
            self._ensure_stack(path)
        while len(self._loaded) > self.max_cpu_loras:
            victim = next((n for n in self._loaded if n not in self._slot_of), None)
            if victim is None:
                break
            del self._loaded[victim]
            self.counters["cpu_evictions"] += 1

    def _ensure_stack(self, path: str) -> None:
        index = self._index[path]
        if index in self._stacks:
            return
        fan_in, fan_out = module_dims(self.targets[path])
        slots = self.max_loras + 1
        a = mx.zeros((slots, fan_in, self.max_rank), dtype=self.dtype)
        b = mx.zeros((slots, self.max_rank, fan_out), dtype=self.dtype)
        # an adapter resident before this projection got its stack does not touch it: zeros are right
        mx.eval(a, b)
        self._stacks[index] = (a, b)

    def _load_slot(self, slot: int, name: str) -> None:
        modules = self._modules_of(name)
        by_index = {self._index[p]: m for p, m in modules.items()}
        updated = []
        for index, (a, b) in self._stacks.items():
            lora = by_index.get(index)
            if lora is None:
                a[slot] = 0
                b[slot] = 0
            else:
                r = lora.rank
                a[slot] = 0
                b[slot] = 0
                a[slot, :, :r] = lora.a.astype(self.dtype)
                b[slot, :r, :] = lora.b.astype(self.dtype)
            updated.extend((a, b))
        mx.eval(updated)
        self._slots[slot] = name
        self._slot_of[name] = slot
        self.counters["slot_loads"] += 1

    # ------------------------------------------------------------ reports
    def metrics(self) -> dict:
        """``registered``, ``loaded`` (in memory) and ``resident`` (``{name: slot}``) adapters,
        ``requests`` per adapter, ``pinned`` slots, and the load/eviction counters."""
        with self._lock:
            return {
                "registered": list(self._registered),
                "loaded": list(self._loaded),
                "resident": dict(self._slot_of),
                "max_loras": self.max_loras,
                "max_lora_rank": self.max_rank,
                "max_cpu_loras": self.max_cpu_loras,
                "requests": {n: e.requests for n, e in self._registered.items()},
                "pinned_slots": sum(1 for s in range(self.max_loras) if self._pins[s]),
                "stack_bytes": sum(a.nbytes + b.nbytes for a, b in self._stacks.values()),
                **self.counters,
            }


def prefix_salt(name: str) -> int:
    """A nonzero 31-bit number for adapter ``name``, from SHA-256: the prefix-cache salt of
    its sequences (see :func:`salt_token_ids`)."""
    import hashlib

    return (int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:4], "little") & 0x7FFFFFFF) | 1


def salt_token_ids(token_ids, salt: int) -> list[int]:
    """The ids the prefix cache keys a sequence's blocks by: each known id plus
    ``salt << 32`` (unknown ids, ``< 0``, stay as they are); ``salt`` 0 changes nothing.

    The KV of a token depends on the adapter when k/v (or anything below them) are
    adapted, so two sequences with the same prompt but different adapters must not share
    blocks. Salting the ids enters the adapter into every block's SHA-256 chain digest
    (``block_digest`` packs ids as int64; vocabularies are far below ``2**32``) and into
    the token comparison that guards against digest collisions, with no change to the
    KV manager.
    """
    if not salt:
        return list(token_ids)
    offset = salt << 32
    return [t + offset if t >= 0 else t for t in token_ids]
