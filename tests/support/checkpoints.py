"""Tiny checkpoints in the real Hugging Face layout, for every test module.

``make_checkpoint(folder, family)`` writes what a hub repo of that family holds:
``config.json`` (the keys and conventions the family's hub configs use, including
``architectures`` and ``torch_dtype``), ``generation_config.json``, safetensors
weights under the Hugging Face parameter names (single file, or shards with a
``model.safetensors.index.json``), ``tokenizer.json`` (a byte-fallback
SentencePiece-style BPE for Llama-2/Mistral, a byte-level BPE for Llama-3/Qwen,
trained here with the ``tokenizers`` library), ``tokenizer_config.json`` with the
special tokens and a chat template in the family's format, and
``special_tokens_map.json``.

Other tools write two variants:
- ``quantized=True``: the float checkpoint converted by mlx-lm's own
  ``mlx_lm.convert`` (4-bit affine, group 32, with per-module overrides), so the
  quantized format is produced by the reference implementation, not by us.
- ``style="transformers"``: ``config.json``, ``generation_config.json`` and the
  tokenizer files written by ``transformers``' ``save_pretrained`` (transformers
  >= 5 nests ``rope_theta``/``rope_scaling`` under ``rope_parameters`` and writes
  ``dtype``). transformers cannot write model weights without PyTorch, which is
  not installed, so the weights are the same safetensors in both styles.

Weights are random (fixed seed per family), with small scales so that logits are
O(1) and greedy decoding is not decided by float rounding.

``cached_checkpoint(family, **kw)`` builds each variant once per test process.
"""

from __future__ import annotations

import atexit
import json
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

FAMILIES = ("llama2", "llama3", "llama_linear", "mistral", "qwen2", "qwen3")
"""Families ``make_checkpoint`` can write (and that ``quantized=True`` accepts)."""

QUANT_GROUP_SIZE = 32
QUANT_BITS = 4
# Per-module choices passed to mlx-lm's converter: one module at 8 bits (recorded in
# config["quantization"] by mlx-lm) and one left in float (no scales stored).
QUANT_OVERRIDE_8BIT = "model.layers.0.mlp.down_proj"
QUANT_KEPT_FLOAT = "model.layers.1.self_attn.v_proj"

_CORPUS = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her red ball.",
    "One day, she saw a big dog and said hello to it.",
    "The dog was happy and they played together all day long.",
    "Tom had a small boat. He liked to sail it on the lake.",
    "The sun is bright, the sky is blue, and the birds sing.",
    "Café au lait, naïve façade, 東京, and a smile 😊 are fine too.",
    "1 + 2 = 3, and 10 * 10 = 100.",
]


@dataclass(frozen=True)
class _Spec:
    """Shape and convention choices of one family (hub-config values, scaled down)."""

    model_type: str
    architecture: str
    tokenizer: str  # "sp" (Llama-2 / Mistral SentencePiece BPE) | "llama3" | "qwen"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # written to config.json only when set
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    inv_freq_buffers: bool = False  # old Llama-2 exports store rotary_emb.inv_freq
    vocab_multiple: int = 1  # Qwen pads the embedding past the tokenizer's size
    extra: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


_SPECS = {
    # Llama-2-7b-hf: MHA, no head_dim key, untied, theta 1e4, inv_freq buffers in old exports.
    "llama2": _Spec(
        "llama", "LlamaForCausalLM", "sp", num_key_value_heads=4, inv_freq_buffers=True,
        extra={"pretraining_tp": 1, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0},
        seed=1,
    ),
    # Llama-3.2-1B: GQA, explicit head_dim, tied, llama3 rope scaling.
    "llama3": _Spec(
        "llama", "LlamaForCausalLM", "llama3", head_dim=16, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        max_position_embeddings=131072, tie_word_embeddings=True,
        extra={"pretraining_tp": 1, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0},
        seed=2,
    ),
    # Long-context Llama-2 fine-tunes (LongChat, Vicuna-16k): old-style {"type": "linear"}.
    "llama_linear": _Spec(
        "llama", "LlamaForCausalLM", "sp", rope_scaling={"type": "linear", "factor": 4.0},
        max_position_embeddings=16384, extra={"pretraining_tp": 1}, seed=3,
    ),
    # Mistral-7B-v0.3: GQA, theta 1e6, no sliding window.
    "mistral": _Spec(
        "mistral", "MistralForCausalLM", "sp", rope_theta=1000000.0, max_position_embeddings=32768,
        extra={"sliding_window": None, "attention_dropout": 0.0}, seed=4,
    ),
    # Qwen2.5-0.5B: q/k/v bias (no attention_bias key), tied, eps 1e-6, padded vocab.
    "qwen2": _Spec(
        "qwen2", "Qwen2ForCausalLM", "qwen", rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, vocab_multiple=64,
        extra={"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 2,
               "attention_dropout": 0.0},
        seed=5,
    ),
    # Qwen3-8B-like: q/k RMSNorm, head_dim (32) != hidden/heads (16), untied.
    "qwen3": _Spec(
        "qwen3", "Qwen3ForCausalLM", "qwen", head_dim=32, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, qk_norm=True, vocab_multiple=64,
        extra={"attention_bias": False, "sliding_window": None, "use_sliding_window": False,
               "max_window_layers": 2, "attention_dropout": 0.0},
        seed=6,
    ),
}

# ----------------------------------------------------------------------------- tokenizers

_TOKENIZER_CACHE: dict[str, str] = {}


def _train_bpe(pre_tokenizer, corpus, vocab_size, alphabet=()) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a BPE on ``corpus``; return (tokens in id order, merges)."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=list(alphabet), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return tokens, merges


def _sp_tokenizer():
    """Llama-2 / Mistral style: BPE over '▁'-joined text with byte fallback.

    ids 0-2 are <unk>, <s>, </s>; 3-258 the byte tokens <0x00>..<0xFF>; then the
    learned pieces. The post-processor prepends <s> (``add_bos_token``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # Metaspace splitting while training keeps merges inside words, like SentencePiece.
    pieces, merges = _train_bpe(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        _CORPUS, vocab_size=100,
    )
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_tokenizer(kind: str):
    """Llama-3 / Qwen style byte-level BPE; special tokens get the ids after the vocab."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokens, merges = _train_bpe(pre, _CORPUS, vocab_size=256 + 40, alphabet=pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=kind == "llama3"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    if kind == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
    else:
        tok.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
        )
        # Qwen3's think markers are added but not special: they survive decoding.
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tokenizer(kind: str):
    """A fresh ``tokenizers.Tokenizer`` of the given kind (``"sp"``, ``"llama3"`` or ``"qwen"``)."""
    from tokenizers import Tokenizer

    if kind not in _TOKENIZER_CACHE:
        tok = _sp_tokenizer() if kind == "sp" else _byte_level_tokenizer(kind)
        _TOKENIZER_CACHE[kind] = tok.to_str()
    return Tokenizer.from_str(_TOKENIZER_CACHE[kind])


# ----------------------------------------------------------------------------- chat templates

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}"
    "{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% else %}{% set rest = messages %}{% set sys = '' %}{% endif %}"
    "{% for m in rest %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}\n"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}\n"
)

# ----------------------------------------------------------------------------- json files


def _added_tokens_decoder(tok) -> dict:
    out = {}
    for entry in json.loads(tok.to_str())["added_tokens"]:
        out[str(entry["id"])] = {
            k: entry[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        }
    return out


def _tokenizer_files(family: str, tok) -> dict[str, object]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json contents."""
    spec = _SPECS[family]
    dec = _added_tokens_decoder(tok)
    tid = tok.token_to_id
    if spec.tokenizer == "sp":
        tcfg = {
            "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": dec,
            "bos_token": "<s>", "clean_up_tokenization_spaces": False, "eos_token": "</s>",
            "legacy": False, "model_max_length": 1000000000000000019884624838656, "pad_token": None,
            "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
            "use_default_system_prompt": False,
        }
        smap = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        gen = {"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.42.0"}
        if family == "llama_linear":
            # The list-of-named-templates form that tokenizer_config.json also allows.
            tcfg["chat_template"] = [
                {"name": "default", "template": LLAMA2_TEMPLATE},
                {"name": "plain", "template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"},
            ]
        else:
            tcfg["chat_template"] = LLAMA2_TEMPLATE if family == "llama2" else MISTRAL_TEMPLATE
        if family == "llama2":
            gen.update({"pad_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_length": 4096})
    elif spec.tokenizer == "llama3":
        tcfg = {
            "added_tokens_decoder": dec, "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE,
            "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        smap = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        gen = {
            "bos_token_id": tid("<|begin_of_text|>"),
            "do_sample": True,
            "eos_token_id": [tid("<|end_of_text|>"), tid("<|eot_id|>")],
            "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0.dev0",
        }
    else:
        tcfg = {
            "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": dec,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
            "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": spec.max_position_embeddings, "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
        }
        if family == "qwen2":
            tcfg["chat_template"] = CHATML_TEMPLATE  # qwen3 ships chat_template.jinja instead
        smap = {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False},
            "pad_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False},
        }
        eot = tid("<|endoftext|>")
        gen = {
            "bos_token_id": eot, "do_sample": True, "eos_token_id": [tid("<|im_end|>"), eot],
            "pad_token_id": eot, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
            "transformers_version": "4.51.0",
        }
    return {"tokenizer_config.json": tcfg, "special_tokens_map.json": smap, "generation_config.json": gen}


def _config(family: str, vocab_size: int, tok, dtype: str) -> dict:
    """config.json in the hub's (transformers 4.x) convention for the family."""
    s = _SPECS[family]
    if s.tokenizer == "sp":
        bos, eos = 1, 2
    elif s.tokenizer == "llama3":
        bos, eos = tok.token_to_id("<|begin_of_text|>"), [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    else:
        bos, eos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    cfg = {
        "architectures": [s.architecture],
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": s.max_position_embeddings,
        "model_type": s.model_type,
        "num_attention_heads": s.num_attention_heads,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_scaling": s.rope_scaling,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": s.tie_word_embeddings,
        "torch_dtype": dtype,
        "transformers_version": "4.46.0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if s.head_dim is not None:
        cfg["head_dim"] = s.head_dim
    cfg.update(s.extra)
    return dict(sorted(cfg.items()))


# ----------------------------------------------------------------------------- weights


def random_weights(family: str, vocab_size: int) -> dict[str, np.ndarray]:
    """float32 weights under the Hugging Face names of the family, fixed seed.

    Linear weights ~ N(0, 0.15^2), embeddings and lm_head ~ N(0, 0.1^2), norm
    weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.05^2): logits come out O(1), and the
    layers outweigh the embedding in the residual stream, so tied-embedding models
    do not simply repeat their input token under greedy decoding.
    """
    s = _SPECS[family]
    rng = np.random.default_rng(1000 + s.seed)
    h, hd, inter = s.hidden_size, s.dim_per_head, s.intermediate_size
    nq, nkv = s.num_attention_heads * hd, s.num_key_value_heads * hd

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n):
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((vocab_size, h), 0.1)}
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(h)
        w[f"{p}.self_attn.q_proj.weight"] = normal((nq, h), 0.15)
        w[f"{p}.self_attn.k_proj.weight"] = normal((nkv, h), 0.15)
        w[f"{p}.self_attn.v_proj.weight"] = normal((nkv, h), 0.15)
        w[f"{p}.self_attn.o_proj.weight"] = normal((h, nq), 0.15)
        if s.qkv_bias:
            w[f"{p}.self_attn.q_proj.bias"] = normal((nq,), 0.05)
            w[f"{p}.self_attn.k_proj.bias"] = normal((nkv,), 0.05)
            w[f"{p}.self_attn.v_proj.bias"] = normal((nkv,), 0.05)
        if s.qk_norm:
            w[f"{p}.self_attn.q_norm.weight"] = norm(hd)
            w[f"{p}.self_attn.k_norm.weight"] = norm(hd)
        if s.inv_freq_buffers:
            w[f"{p}.self_attn.rotary_emb.inv_freq"] = (
                1.0 / s.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
            ).astype(np.float32)
        w[f"{p}.post_attention_layernorm.weight"] = norm(h)
        w[f"{p}.mlp.gate_proj.weight"] = normal((inter, h), 0.15)
        w[f"{p}.mlp.up_proj.weight"] = normal((inter, h), 0.15)
        w[f"{p}.mlp.down_proj.weight"] = normal((h, inter), 0.15)
    w["model.norm.weight"] = norm(h)
    if not s.tie_word_embeddings:
        w["lm_head.weight"] = normal((vocab_size, h), 0.1)
    return w


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write float32 numpy tensors as ``dtype`` with HF's ``{"format": "pt"}`` metadata.

    float32/float16 go through ``safetensors.numpy.save_file``. numpy has no
    bfloat16, so bf16 files are written directly in the safetensors layout (u64
    little-endian header length, json header, raw little-endian data).
    """
    if dtype != "bfloat16":
        from safetensors.numpy import save_file

        cast = np.float16 if dtype == "float16" else np.float32
        save_file({k: np.ascontiguousarray(v.astype(cast)) for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})
        return
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        data = _to_bf16_bits(tensors[name]).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def _shard_plan(names: list[str], num_layers: int) -> list[list[str]]:
    """HF-like split: embeddings + first half of the layers, then the rest + norm + lm_head."""
    half = max(num_layers // 2, 1)

    def layer(n):
        return int(n.split(".")[2]) if n.startswith("model.layers.") else None

    first = [n for n in names if n == "model.embed_tokens.weight" or (layer(n) is not None and layer(n) < half)]
    second = [n for n in names if n not in first]
    return [first, second]


def _write_weights(folder: Path, weights: dict[str, np.ndarray], dtype: str, sharded: bool, num_layers: int):
    if not sharded:
        write_safetensors(folder / "model.safetensors", weights, dtype)
        return
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    plan = _shard_plan(sorted(weights), num_layers)
    weight_map, total = {}, 0
    for i, names in enumerate(plan, start=1):
        fname = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        write_safetensors(folder / fname, {n: weights[n] for n in names}, dtype)
        for n in names:
            weight_map[n] = fname
            total += weights[n].size * itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- entry points


def vocab_size_of(family: str) -> int:
    """The config ``vocab_size`` of a family: the tokenizer's size, padded for Qwen."""
    s = _SPECS[family]
    n = build_tokenizer(s.tokenizer).get_vocab_size(with_added_tokens=True)
    return -(-n // s.vocab_multiple) * s.vocab_multiple


def make_checkpoint(
    folder,
    family: str,
    *,
    quantized: bool = False,
    sharded: bool = False,
    dtype: str = "float32",
    style: str = "hub",
) -> Path:
    """Write a tiny checkpoint of ``family`` into ``folder`` (created; must be empty or absent).

    Args:
        folder: destination folder.
        family: one of :data:`FAMILIES`.
        quantized: convert with ``mlx_lm.convert`` to 4-bit affine (group 32), with
            :data:`QUANT_OVERRIDE_8BIT` at 8 bits and :data:`QUANT_KEPT_FLOAT` in float.
        sharded: two safetensors shards and an index (float checkpoints only).
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (stored dtype, and ``torch_dtype``).
        style: ``"hub"`` (json as found on the hub, transformers 4.x conventions) or
            ``"transformers"`` (json written by the installed transformers' ``save_pretrained``).

    Returns:
        ``Path(folder)``.
    """
    if family not in _SPECS:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_ST_DTYPES)}, got {dtype!r}")
    folder = Path(folder)
    if quantized:
        if sharded or style != "hub":
            raise ValueError("quantized checkpoints are written by mlx-lm: no sharded/style options")
        return _make_quantized(folder, family, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    spec = _SPECS[family]
    tok = build_tokenizer(spec.tokenizer)
    vocab = vocab_size_of(family)
    _write_weights(folder, random_weights(family, vocab), dtype, sharded, spec.num_hidden_layers)
    if style == "transformers":
        _write_json_with_transformers(folder, family, tok, vocab, dtype)
        return folder
    if style != "hub":
        raise ValueError(f"style must be 'hub' or 'transformers', got {style!r}")
    _dump(folder / "config.json", _config(family, vocab, tok, dtype))
    tok.save(str(folder / "tokenizer.json"))
    for name, obj in _tokenizer_files(family, tok).items():
        _dump(folder / name, obj)
    if family == "qwen3":
        (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE, encoding="utf-8")
    return folder


def _write_json_with_transformers(folder: Path, family: str, tok, vocab: int, dtype: str) -> None:
    """config / generation config / tokenizer files from transformers' own writers."""
    import transformers

    cfg = _config(family, vocab, tok, dtype)
    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "transformers_version")}
    kwargs["torch_dtype"] = kwargs.pop("torch_dtype")
    config = getattr(transformers, cls[cfg["model_type"]])(architectures=cfg["architectures"], **kwargs)
    config.save_pretrained(str(folder))
    files = _tokenizer_files(family, tok)
    gen = {k: v for k, v in files["generation_config.json"].items() if k != "transformers_version"}
    transformers.GenerationConfig(**gen).save_pretrained(str(folder))
    tcfg = files["tokenizer_config.json"]
    template = tcfg.get("chat_template") or QWEN3_TEMPLATE
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tcfg.get("bos_token"),
        eos_token=tcfg.get("eos_token"),
        unk_token=tcfg.get("unk_token"),
        pad_token=tcfg.get("pad_token"),
        chat_template=template,
    )
    fast.save_pretrained(str(folder))


def _make_quantized(folder: Path, family: str, dtype: str) -> Path:
    """Float checkpoint -> ``mlx_lm.convert(quantize=True)`` -> ``folder``."""
    from mlx_lm.convert import convert

    def predicate(path, module):
        if path == QUANT_KEPT_FLOAT:
            return False
        if path == QUANT_OVERRIDE_8BIT:
            return {"group_size": QUANT_GROUP_SIZE, "bits": 8}
        return True

    with tempfile.TemporaryDirectory(prefix="ferrum-src-") as tmp:
        src = make_checkpoint(Path(tmp) / "src", family, dtype=dtype)
        out = Path(tmp) / "out"
        convert(str(src), str(out), quantize=True, q_group_size=QUANT_GROUP_SIZE, q_bits=QUANT_BITS,
                quant_predicate=predicate)
        folder.mkdir(parents=True, exist_ok=True)
        for f in out.iterdir():
            shutil.move(str(f), folder / f.name)
    return folder


_CACHE_ROOT: Optional[Path] = None
_CACHE: dict[tuple, Path] = {}


def cached_checkpoint(family: str, **kwargs) -> Path:
    """``make_checkpoint`` into a per-process temp folder, built once per argument set.

    The folder is removed when the process exits; callers must not modify it.
    """
    global _CACHE_ROOT
    key = (family, tuple(sorted(kwargs.items())))
    if key not in _CACHE:
        if _CACHE_ROOT is None:
            _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="ferrum-ckpt-"))
            atexit.register(shutil.rmtree, _CACHE_ROOT, True)
        name = "-".join([family] + [f"{k}={v}" for k, v in key[1]])
        _CACHE[key] = make_checkpoint(_CACHE_ROOT / name, family, **kwargs)
    return _CACHE[key]
