"""A ``tokenizers.Tokenizer`` built from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two tokenizer models are read (llama.cpp's ``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE from ``tokens`` and ``merges``, with the pre-tokenizer
  ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`; the regular expressions are the
  ones the models' own ``tokenizer.json`` files use, as llama.cpp's ``llama-vocab.cpp``
  lists them per name);
- ``llama``: a SentencePiece BPE vocabulary with ``scores`` and byte fallback. The
  merges are derived from the scores the way SentencePiece ranks them: a merge's rank
  is the score of the piece it produces (higher first), so that BPE over the merges
  reproduces SentencePiece's greedy highest-score pair merging.

Token types (``tokenizer.ggml.token_type``, llama.cpp's ``TokenType``) 2 (unknown) and 3
(control) become special added tokens, 4 (user-defined) plain added tokens. The
result is wrapped by :class:`mlx_ferrum.tokenizer.Tokenizer` with a config built from
the BOS/EOS/UNK/padding ids, ``add_bos_token`` / ``add_eos_token`` and
``tokenizer.chat_template``.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from ...errors import TokenizerError

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_regex(pattern: str) -> Any:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


#: tokenizer.ggml.pre -> pre-tokenizer factory
PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
    "llama-bpe": lambda: _byte_level_regex(_LLAMA3_REGEX),
    "llama3": lambda: _byte_level_regex(_LLAMA3_REGEX),
    "qwen2": lambda: _byte_level_regex(_QWEN2_REGEX),
}

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


def _id(metadata: dict, key: str, size: int) -> Optional[int]:
    value = metadata.get(key)
    return value if isinstance(value, int) and 0 <= value < size else None


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    added = []
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED):
            special = kind != _USER_DEFINED
            added.append((token_id, AddedToken(token, special=special, normalized=not special)))
    return [token for _, token in sorted(added, key=lambda item: item[0])]


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: for each piece, every split
    into two pieces of the vocabulary, ranked by the piece's score (higher first),
    then by the ids of the left and right parts."""
    vocab = dict(zip(tokens, range(len(tokens))))
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_ignored, left, right in ranked]


#: tokenizers built ahead by :func:`prebuild`, keyed by ``id(metadata)`` (with the
#: metadata itself, so a recycled id never matches), each handed out once
_PREBUILT: dict[int, tuple[dict[str, Any], HFTokenizer]] = {}


def prebuild(metadata: dict[str, Any]) -> None:
    """Build the tokenizer of ``metadata`` now, for the next :func:`build_backend` of the
    same metadata object to return.

    The GGUF loader calls it on its own thread while worker threads convert the tensors
    (numpy work that releases the GIL): the tokenizer is built in time the loading
    thread would otherwise spend waiting. The reader caches a file's parsed header, so
    the tokenizer later built for the same file receives the same dict. A failure is
    not raised here: :func:`build_backend` raises it when the tokenizer is asked for.
    Only the latest prebuilt tokenizer is kept.
    """
    try:
        backend = _build(metadata)
    except Exception:  # raised again, with its message, by build_backend
        return
    _PREBUILT.clear()
    _PREBUILT[id(metadata)] = (metadata, backend)


def build_backend(metadata: dict[str, Any]) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` a GGUF file's metadata describes (the one
    :func:`prebuild` made for this metadata object, if any, else a new one).

    Args:
        metadata: the file's metadata (``tokenizer.ggml.*`` keys).

    Raises:
        TokenizerError: the tokenizer metadata is missing (tokens, model, merges), or
            names a tokenizer model or pre-tokenizer this builder does not know (the
            message lists the supported ones).
    """
    prebuilt = _PREBUILT.get(id(metadata))
    if prebuilt is not None and prebuilt[0] is metadata:
        del _PREBUILT[id(metadata)]
        return prebuilt[1]
    return _build(metadata)


def _build(metadata: dict[str, Any]) -> HFTokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not isinstance(tokens, list) or not tokens:
        raise TokenizerError(
            "the GGUF file has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens): "
            "use a complete GGUF file, or load the model's Hugging Face folder"
        )
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = dict(zip(tokens, range(len(tokens))))
    if kind == "gpt2":
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, list):
            raise TokenizerError("the GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
                f"{', '.join(PRE_TOKENIZERS)}"
            )
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                         ignore_merges=pre in ("llama-bpe", "llama3")))
        backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk = _id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
        backend = HFTokenizer(models.BPE(vocab, _sentencepiece_merges(tokens, scores),
                                         unk_token=tokens[unk] if unk is not None else None,
                                         fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        if metadata.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("\u2581"))
        backend.normalizer = normalizers.Sequence(steps)
        backend.decoder = decoders.Sequence([
            decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if metadata.get("tokenizer.ggml.add_space_prefix", True) else []),
        ])
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; supported: gpt2, llama"
        )
    backend.add_tokens(_added_tokens(tokens, types))
    return backend


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` equivalent of a GGUF file: special tokens by name,
    ``add_bos_token`` / ``add_eos_token`` (llama.cpp's defaults when absent: BOS added
    for ``llama`` SentencePiece files, not for ``gpt2`` ones), and the chat template."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        token_id = _id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens))
        if token_id is not None:
            config[name] = tokens[token_id]
    kind = metadata.get("tokenizer.ggml.model")
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def end_token_ids(metadata: dict[str, Any]) -> list[int]:
    """Every id that ends a reply: EOS, and llama.cpp's end-of-turn / end-of-message ids
    (``tokenizer.ggml.eot_token_id``, ``eom_token_id``; Llama 3's ``<|eot_id|>``), as a
    ``generation_config.json`` ``eos_token_id`` list."""
    size = len(metadata.get("tokenizer.ggml.tokens") or [])
    ids = [_id(metadata, f"tokenizer.ggml.{key}_token_id", size) for key in ("eos", "eot", "eom")]
    return sorted({i for i in ids if i is not None})


__all__ = ["PRE_TOKENIZERS", "build_backend", "end_token_ids", "tokenizer_config"]
