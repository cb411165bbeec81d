"""GGUF metadata -> a Hugging Face style ``config.json`` dict, and llama.cpp tensor
names -> the model's parameter names.

The keys are llama.cpp's (``{arch}.block_count``, ``{arch}.attention.head_count`` ...,
``gguf-py/gguf/constants.py`` ``Keys``), and so are the tensor names (``token_embd``,
``blk.N.attn_q`` ..., ``MODEL_TENSORS``; the per-layer roles of ``tensor_mapping.py``).
Qwen3-MoE files store each layer's experts stacked (``ffn_{gate,up,down}_exps``,
``[experts, out, in]``, the layout of the model's ``switch_mlp``); Phi-3 files keep the
fused ``attn_qkv`` (q, k, v rows) and ``ffn_up`` (gate rows, then up rows), split here
by :func:`fused_parts`. Gemma 3 files store every norm weight as ``1 + w``; the
checkpoint loader subtracts the 1 (:data:`NORM_SHIFTED_ARCHITECTURES`).
llama.cpp's converter permutes the rows of
Llama-style q/k projections into its interleaved RoPE order (``LlamaModel.permute`` in
``convert_hf_to_gguf.py``); :func:`unpermute_rows` undoes it so the rotate-half RoPE
of :mod:`mlx_ferrum.models.llama` applies.
"""

from __future__ import annotations

from typing import Any, Optional

from ...errors import GGUFFormatError, UnsupportedArchitectureError

#: general.architecture -> model_type of the family that runs it
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
                 "gemma3": "gemma3_text"}

#: architectures whose q/k rows llama.cpp's converter permutes (its ``LlamaModel``
#: subclasses; the Qwen and Phi-3 converters store Hugging Face's row order)
PERMUTED_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
#: per-architecture roles that differ from the Llama ones: Gemma 3's sandwich norms
#: (llama.cpp's ``ffn_norm`` is its pre-feed-forward norm there)
_ARCH_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
#: architectures whose norm weights llama.cpp's converter stores as ``1 + w`` (Gemma's
#: ``(1 + w)`` RMSNorm folded in; ``norm_shift`` in ``convert_hf_to_gguf.py``): the
#: loader subtracts 1 from every ``*norm.weight`` tensor
NORM_SHIFTED_ARCHITECTURES = ("gemma3",)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: tensors llama.cpp stores that the model computes itself
_IGNORED = ("rope_freqs.weight",)


def hf_name(name: str, architecture: Optional[str] = None) -> Optional[str]:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for an
    unknown name. ``architecture`` (``general.architecture``) picks the roles that
    differ per family (Gemma 3's norms); None means the Llama roles."""
    module, _, kind = name.rpartition(".")
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{kind}"
    parts = module.split(".")
    roles = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture or "", {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in roles:
        return f"model.layers.{parts[1]}.{roles[parts[2]]}.{kind}"
    return None


def fused_parts(name: str, config: dict[str, Any], architecture: Optional[str] = None
                ) -> Optional[list[tuple[str, int]]]:
    """The pieces of a fused llama.cpp tensor: ``[(Hugging Face name, rows), ...]`` in
    row order, or None when ``name`` is not fused.

    ``blk.N.attn_qkv`` holds q, k, v rows (Phi-3's ``qkv_proj``); Phi-3's
    ``blk.N.ffn_up`` holds the gate rows, then the up rows (its ``gate_up_proj``; the
    model's SwiGLU splits it in halves, gate first). Splitting rows keeps quantized
    blocks intact: they run along the input axis.
    """
    target = hf_name(name, architecture)
    if target is None:
        return None
    module, _, kind = target.rpartition(".")
    stem = module.rpartition(".")[0]
    if module.endswith("self_attn.qkv_proj"):
        q = config["num_attention_heads"] * config["head_dim"]
        kv = config["num_key_value_heads"] * config["head_dim"]
        return [(f"{stem}.q_proj.{kind}", q), (f"{stem}.k_proj.{kind}", kv), (f"{stem}.v_proj.{kind}", kv)]
    if config["model_type"] == "phi3" and module.endswith("mlp.up_proj"):
        ffn = config["intermediate_size"]
        return [(f"{stem}.gate_proj.{kind}", ffn), (f"{stem}.up_proj.{kind}", ffn)]
    return None


def _get(metadata: dict, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
    if key not in metadata:
        if required:
            raise GGUFFormatError(f"GGUF metadata lacks {key!r}; the file is incomplete or not a model file")
        return default
    value = metadata[key]
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise GGUFFormatError(f"GGUF metadata {key!r} = {value!r} is not a {kind.__name__}") from None


def _rope_scaling(metadata: dict[str, Any], prefix: str, head_dim: int, context: int,
                  rope_freqs: Optional[list[float]]) -> Optional[dict[str, Any]]:
    """The Hugging Face ``rope_scaling`` of a GGUF file, or None for plain RoPE.

    - ``rope_freqs`` (llama.cpp's converter writes Llama 3.1's ``llama3`` scaling as this
      tensor: one factor per rotated pair, each pair's angle divided by its factor) maps
      exactly onto the per-frequency factors of the ``longrope`` variant of
      :class:`~mlx_ferrum.layers.rope.Rope` (wavelength ``factor * base**(2i/d)``),
      with the long factors never switched in and no attention scaling.
    - ``{arch}.rope.scaling.type = yarn``: ``factor`` and ``original_context_length``,
      and ``yarn_beta_fast`` / ``yarn_beta_slow`` when present, are Hugging Face's
      ``yarn`` parameters; its default attention factor ``0.1 ln(factor) + 1`` and
      rounded correction range are llama.cpp's too. A file that also sets a YaRN
      attention factor, extrapolation mix or log multiplier other than llama.cpp's
      defaults is refused: those have no single Hugging Face equivalent here.
    - ``linear`` with a factor other than 1: Hugging Face's ``linear``.

    Raises:
        UnsupportedArchitectureError: a scaling type or YaRN setting not mapped.
        GGUFFormatError: ``rope_freqs`` has the wrong length, or YaRN lacks its
            original context length.
    """
    if rope_freqs is not None:
        if len(rope_freqs) != head_dim // 2:
            raise GGUFFormatError(
                f"rope_freqs has {len(rope_freqs)} factors; head_dim {head_dim} rotates {head_dim // 2} pairs"
            )
        factors = [float(f) for f in rope_freqs]
        return {"rope_type": "longrope", "type": "longrope", "short_factor": factors, "long_factor": factors,
                "original_max_position_embeddings": context, "factor": 1.0, "attention_factor": 1.0}
    scaling = metadata.get(prefix + "rope.scaling.type")
    factor = _get(metadata, prefix + "rope.scaling.factor", float, 1.0)
    if scaling in (None, "none") or (scaling in ("linear", "yarn") and factor == 1.0):
        return None
    if scaling == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": factor}
    if scaling == "yarn":
        defaults = {"rope.scaling.yarn_attn_factor": 1.0, "rope.scaling.attn_factor": 1.0,
                    "rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_log_multiplier": 0.0}
        odd = [f"{prefix}{key} = {metadata[prefix + key]!r}" for key, default in defaults.items()
               if prefix + key in metadata and _get(metadata, prefix + key, float) != default]
        if odd:
            raise UnsupportedArchitectureError(
                f"this GGUF file's YaRN RoPE sets {', '.join(odd)}, which this loader does not map "
                "(only factor, original context length and beta_fast/beta_slow); use the Hugging Face checkpoint"
            )
        original = _get(metadata, prefix + "rope.scaling.original_context_length", int, required=True)
        out = {"type": "yarn", "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if prefix + "rope.scaling." + key in metadata:
                out[name] = _get(metadata, prefix + "rope.scaling." + key, float)
        return out
    raise UnsupportedArchitectureError(
        f"GGUF RoPE scaling {scaling!r} ({prefix}rope.scaling.type) is not supported; supported: linear, yarn, "
        "and llama3's rope_freqs factors"
    )


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str],
                         rope_freqs: Optional[list[float]] = None) -> dict[str, Any]:
    """Build the ``config.json`` dict of the model a GGUF file describes.

    Args:
        metadata: the file's metadata (``{key: value}``).
        tensor_names: llama.cpp names of its tensors (decides tied embeddings and
            Qwen2's q/k/v bias).
        rope_freqs: the values of the ``rope_freqs.weight`` tensor when the file has
            one (see :func:`_rope_scaling`).

    Returns:
        A config dict for the family :data:`ARCHITECTURES` names (no ``quantization``
        entry).

    Raises:
        UnsupportedArchitectureError: ``general.architecture`` is not in
            :data:`ARCHITECTURES` (the message lists them), or the file uses a RoPE
            scaling this loader cannot express (see :func:`_rope_scaling`), or
            ``rope_freqs.weight`` is in ``tensor_names`` but ``rope_freqs`` is not given.
        GGUFFormatError: a required key is missing or has the wrong type.
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF general.architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensor_names and rope_freqs is None:
        raise UnsupportedArchitectureError(
            "this GGUF file carries per-frequency RoPE factors (rope_freqs, Llama 3.1+ long-context scaling), "
            "which this loader does not map yet; use the Hugging Face checkpoint of the model"
        )
    prefix = f"{arch}."
    hidden = _get(metadata, prefix + "embedding_length", int, required=True)
    heads = _get(metadata, prefix + "attention.head_count", int, required=True)
    kv_heads = _get(metadata, prefix + "attention.head_count_kv", int, heads)
    head_dim = _get(metadata, prefix + "attention.key_length", int, None) or hidden // heads
    vocab = _get(metadata, prefix + "vocab_size", int, None)
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise GGUFFormatError(f"GGUF metadata lacks {prefix}vocab_size and tokenizer.ggml.tokens")
        vocab = len(tokens)
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": _get(metadata, prefix + "block_count", int, required=True),
        "intermediate_size": _get(metadata, prefix + "feed_forward_length", int,
                                  _get(metadata, prefix + "expert_feed_forward_length", int),
                                  required=arch != "qwen3moe"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": _get(metadata, prefix + "attention.layer_norm_rms_epsilon", float, 1e-5),
        "rope_theta": _get(metadata, prefix + "rope.freq_base", float, 10000.0),
        "max_position_embeddings": _get(metadata, prefix + "context_length", int, 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if arch == "qwen3moe":
        config.update(_moe_config(metadata, prefix, config, tensor_names))
    if arch == "phi3":
        if any(n.startswith("rope_factors_") for n in tensor_names):
            raise UnsupportedArchitectureError(
                "this Phi-3 GGUF file carries LongRoPE factors (rope_factors_long / rope_factors_short), which this "
                "loader does not map yet; use the Hugging Face checkpoint of the model"
            )
        rotary = _get(metadata, prefix + "rope.dimension_count", int, head_dim)
        if rotary != head_dim:
            config["partial_rotary_factor"] = rotary / head_dim
    if arch == "gemma3":
        config.update(_gemma3_config(metadata, prefix, config))
    scaling = _rope_scaling(metadata, prefix, head_dim, config["max_position_embeddings"], rope_freqs)
    if scaling is not None:
        config["rope_scaling"] = scaling
    window = _get(metadata, prefix + "attention.sliding_window", int, None)
    if window:
        config["sliding_window"] = window
        if arch != "llama":
            config["use_sliding_window"] = True
    return config


def _gemma3_config(metadata: dict[str, Any], prefix: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's settings that llama.cpp does not store but fixes in code (its
    ``llama-model.cpp``): every 6th layer global, local layers' RoPE base 10000, and the
    attention scale ``1/sqrt(head_dim)``, except ``1/sqrt(hidden / heads)`` for the
    62-layer (27B) model. Gemma's defaults (norm epsilon 1e-6, RoPE base 1e6) fill
    keys a file lacks."""
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    return {
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"],
        "rms_norm_eps": _get(metadata, prefix + "attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": _get(metadata, prefix + "rope.freq_base", float, 1_000_000.0),
    }


def _moe_config(metadata: dict[str, Any], prefix: str, config: dict[str, Any],
                tensor_names: set[str]) -> dict[str, Any]:
    """Qwen3-MoE's expert keys: ``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``; llama.cpp renormalizes the chosen experts' weights
    for qwen3moe (``expert_weights_norm`` when a file sets it) and routes by softmax.
    A layer without a router (``ffn_gate_inp``) is dense (``mlp_only_layers``).

    Raises:
        GGUFFormatError: an expert key is missing.
        UnsupportedArchitectureError: a gating function other than softmax.
    """
    gating = _get(metadata, prefix + "expert_gating_func", int, 1)
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedArchitectureError(
            f"{prefix}expert_gating_func = {gating}: only softmax routing (1) is supported for qwen3moe"
        )
    experts = _get(metadata, prefix + "expert_count", int, required=True)
    layers = config["num_hidden_layers"]
    return {
        "num_experts": experts,
        "num_experts_per_tok": _get(metadata, prefix + "expert_used_count", int, required=True),
        "moe_intermediate_size": _get(metadata, prefix + "expert_feed_forward_length", int, required=True),
        "norm_topk_prob": bool(metadata.get(prefix + "expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


def unpermute_rows(rows: Any, heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp reorders each head's rows ``[0, 2, 4, ..., 1, 3, 5, ...]``-wise (its RoPE
    rotates adjacent pairs; Hugging Face's rotates halves): rows of head ``h``, viewed
    as ``[2, head_dim/2]``, were transposed to ``[head_dim/2, 2]``. Transposing back
    restores them. Works on any array whose first axis is the output rows (packed codes,
    scales and biases alike).

    Args:
        rows: ``[heads * head_dim, ...]``, a numpy or MLX array.
        heads: attention heads of the projection (KV heads for k).
    """
    shape = tuple(rows.shape)
    return rows.reshape((heads, shape[0] // heads // 2, 2) + shape[1:]).swapaxes(1, 2).reshape(shape)


__all__ = ["ARCHITECTURES", "NORM_SHIFTED_ARCHITECTURES", "PERMUTED_ARCHITECTURES", "config_from_metadata",
           "fused_parts", "hf_name", "unpermute_rows"]
