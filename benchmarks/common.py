"""Shared helpers of the benchmarks: machine description, OpenBLAS detection, timing,
and a random-weight checkpoint in the real Hugging Face layout.

Every benchmark prints :func:`machine_info` first, so a recorded figure always says
where it came from (CPU, cores, OS, MLX version and backend, whether OpenBLAS was
preloaded over the reference BLAS that the ``mlx[cpu]`` wheel bundles).

The random checkpoint follows the layout ``transformers``' ``save_pretrained``
writes for Qwen2 (``config.json`` with Qwen2.5-0.5B's published shapes, one
``model.safetensors`` under the Hugging Face parameter names) plus a word-level
``tokenizer.json`` whose tokens are ``t0 .. t{vocab-1}`` (or, with
``tokenizer_kind="bpe"``, a byte-level BPE that transformers reads alike, for runs
against mlx_lm.server), so that ``mf.load`` and ``mf.stream_generate`` run unchanged. Its outputs are meaningless; only the shapes
and dtypes matter for speed.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

#: Qwen2.5-0.5B's ``config.json`` (hub repo ``Qwen/Qwen2.5-0.5B``): the shapes the
#: default benchmark checkpoint copies. head_dim = 896 / 14 = 64.
QWEN25_05B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
"""Where Debian's ``libopenblas0-pthread`` puts the library (``dpkg -L libopenblas0-pthread``)."""

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_dtype(name: str) -> mx.Dtype:
    """``"bfloat16"`` / ``"float16"`` / ``"float32"`` (or ``bf16``/``fp16``/``fp32``) -> ``mx.Dtype``.

    Raises:
        ValueError: an unknown name.
    """
    alias = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32"}
    key = alias.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


# --------------------------------------------------------------------------- machine
def openblas_preloaded() -> bool:
    """True when an OpenBLAS library is mapped into this process (``/proc/self/maps``).

    The ``mlx[cpu]`` wheel bundles the netlib reference BLAS; running with
    ``LD_PRELOAD=<libopenblas.so.0>`` makes MLX's ``cblas_sgemm`` calls resolve to
    OpenBLAS instead. False where ``/proc`` is absent (macOS).
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libopenblas" in f.read()
    except OSError:
        return False


def openblas_threads() -> Optional[str]:
    """Threads OpenBLAS was told to use (``OPENBLAS_NUM_THREADS``, read when it loads), or
    ``"default (N cores)"``; None without OpenBLAS.

    Read from the environment, never from OpenBLAS itself: calling
    ``openblas_get_num_threads`` through ctypes before the run made mlx_ferrum's
    single-stream decode three times slower with two threads (and left mlx-lm's as it
    was), so the figures of a script that asked were wrong.

    On the 2-core test machine ``OPENBLAS_NUM_THREADS=1`` made both sides of
    ``bench_throughput.py`` faster on stories260K (measured in the history of docs/benchmarks.md): MLX's CPU
    backend already keeps two threads busy (the one that queues ops and the stream's
    worker), and OpenBLAS's second thread spins between the many small products of a
    decode step, taking a core from them. The compute-bound Qwen-shaped run is faster
    with OpenBLAS's default.
    """
    if not openblas_preloaded():
        return None
    return os.environ.get("OPENBLAS_NUM_THREADS") or f"default ({os.cpu_count()} cores)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _os_name() -> str:
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return f"{line.split('=', 1)[1].strip().strip(chr(34))} ({platform.system()} {platform.release()})"
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}"


def machine_info() -> dict:
    """Where a figure was measured.

    Returns:
        ``{"date", "cpu", "cores", "os", "python", "mlx", "mlx_lm", "backend",
        "openblas_preloaded", "openblas_threads", "load_avg"}``; ``backend`` is ``"gpu (metal)"`` or ``"cpu"``,
        ``load_avg`` the 1-minute load average at the start (other processes skew timings).
    """
    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # noqa: BLE001 - the mlx-lm side is optional for some runs
        mlx_lm_version = "absent"
    try:
        metal = mx.metal.is_available()
    except Exception:  # noqa: BLE001
        metal = False
    try:
        load = f"{os.getloadavg()[0]:.2f}"
    except OSError:
        load = "?"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "os": _os_name(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "backend": "gpu (metal)" if metal else "cpu",
        "openblas_preloaded": openblas_preloaded(),
        "openblas_threads": openblas_threads(),
        "load_avg": load,
    }


def print_header(title: str, extra: Optional[dict] = None) -> dict:
    """Print ``title``, :func:`machine_info` and ``extra`` settings; return the info dict."""
    info = machine_info()
    print(f"== {title}")
    for k, v in info.items():
        print(f"   {k:<19} {v}")
    for k, v in (extra or {}).items():
        print(f"   {k:<19} {v}")
    print("   note: timings are wall-clock medians; on a shared 2-core machine they are noisy (+-10-20%).")
    return info


# --------------------------------------------------------------------------- timing
def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs.

    ``fn`` must finish its own work (evaluate its MLX arrays) before returning.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def fmt_bytes(n: float) -> str:
    """``n`` bytes as KiB/MiB/GiB with 1 decimal."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    """Print a Markdown table (so it can be pasted into ``docs/benchmarks.md``)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print(line(r))


# --------------------------------------------------------------------------- checkpoint
def scaled_config(base: dict, **overrides) -> dict:
    """A copy of ``base`` with ``overrides`` (e.g. ``num_hidden_layers=4`` for a quick run)."""
    cfg = dict(base)
    cfg.update(overrides)
    return cfg


def _qwen2_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen2 checkpoint."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.q_proj.bias": (nh * hd,),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.k_proj.bias": (nkv * hd,),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.bias": (nkv * hd,),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    return shapes


def _write_wordlevel_tokenizer(folder: Path, vocab_size: int) -> None:
    """``tokenizer.json`` with tokens ``t0 .. t{vocab-1}`` split on whitespace, and its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "t1", "add_bos_token": False}, indent=2)
    )


#: Special tokens of :func:`write_bpe_tokenizer`, at ids 0, 1, 2 (the trainer puts them first).
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A ChatML template (Qwen2's chat format, without its tool-calling branches), stored in the
#: byte-level BPE checkpoint's ``tokenizer_config.json``.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _bpe_training_text(seed: int, num_words: int = 400_000) -> list[str]:
    """Deterministic English-like text: pseudo-words drawn from a fixed syllable set by a
    seeded ``random.Random``, so the trained merges are the same on every machine."""
    import random

    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "wh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "x"]
    lines, words = [], []
    for _ in range(num_words):
        word = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.08:
            word = word.capitalize()
        words.append(word + rng.choice(["", "", "", "", "", "", ",", ".", "?", "!", ":", "'s"]))
        if len(words) >= 16:
            lines.append(" ".join(words))
            words = []
    return lines


def write_bpe_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """Train a byte-level BPE ``tokenizer.json`` of exactly ``vocab_size`` ids on
    :func:`_bpe_training_text` and write it with a ``tokenizer_config.json`` that names
    ``PreTrainedTokenizerFast`` (so transformers reads the file as written instead of
    substituting the model family's tokenizer class), a ChatML chat template, and
    ``<|endoftext|>`` (id 0) as the end-of-sequence token.

    Ids: 0-2 are :data:`BPE_SPECIAL_TOKENS`, 3-258 the 256 byte symbols, the rest merges.
    Algorithm: GPT-2's byte-level BPE (Radford et al. 2019) as the ``tokenizers`` library
    implements it (``BpeTrainer``, ``ByteLevel`` pre-tokenizer and decoder).

    Raises:
        ValueError: the training text yields fewer than ``vocab_size`` ids (pick a smaller one).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=list(BPE_SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_bpe_training_text(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE training reached {tok.get_vocab_size()} ids, not {vocab_size}: use a smaller vocab_size")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": BPE_SPECIAL_TOKENS[0], "pad_token": BPE_SPECIAL_TOKENS[0],
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))


def build_random_checkpoint(
    folder: Path, config: dict = QWEN25_05B_CONFIG, dtype: str = "bfloat16", seed: int = 0, tokenizer: bool = True,
    tokenizer_kind: str = "wordlevel",
) -> Path:
    """Write a random-weight Qwen2 checkpoint in the Hugging Face layout to ``folder``.

    Args:
        folder: created if absent.
        config: a Qwen2 ``config.json`` (default: Qwen2.5-0.5B's shapes).
        dtype: stored dtype of every tensor (``torch_dtype`` is set to it).
        seed: ``mx.random`` seed.
        tokenizer: also write a ``tokenizer.json`` so that ``mf.load`` finds a tokenizer.
        tokenizer_kind: ``"wordlevel"`` (tokens ``t0``..., read alike only by the
            ``tokenizers`` library: transformers substitutes the Qwen2 class) or ``"bpe"``
            (:func:`write_bpe_tokenizer`, read alike by mlx-ferrum and transformers;
            ``config["vocab_size"]`` must be one it can train to, and ``eos_token_id`` 0).

    Weights are ``N(0, 0.02)`` (``initializer_range``), biases ``N(0, 0.02)``, norms 1,
    so activations stay O(1) in bf16 over 24 layers.

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config, torch_dtype=dtype)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}, indent=2)
    )
    mx.random.seed(seed)
    dt = parse_dtype(dtype)
    std = cfg.get("initializer_range", 0.02)
    weights = {}
    for name, shape in _qwen2_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(shape, dtype=dt)
        else:
            weights[name] = (std * mx.random.normal(shape)).astype(dt)
    mx.eval(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    del weights
    if tokenizer and tokenizer_kind == "bpe":
        write_bpe_tokenizer(folder, cfg["vocab_size"], seed)
    elif tokenizer:
        _write_wordlevel_tokenizer(folder, cfg["vocab_size"])
    return folder


def cached_random_checkpoint(
    name: str, config: dict, dtype: str, rebuild: bool = False, tokenizer_kind: str = "wordlevel"
) -> Path:
    """:func:`build_random_checkpoint` into ``$TMPDIR/mlx_ferrum_bench/<name>-<dtype>``, reused
    across runs (a ``.complete`` marker with the config guards against a half-written folder)."""
    folder = Path(tempfile.gettempdir()) / "mlx_ferrum_bench" / f"{name}-{dtype}"
    marker = folder / ".complete"
    stamp = json.dumps(config, sort_keys=True) + ("" if tokenizer_kind == "wordlevel" else f" tokenizer={tokenizer_kind}")
    if not rebuild and marker.is_file() and marker.read_text() == stamp:
        return folder
    t0 = time.perf_counter()
    build_random_checkpoint(folder, config, dtype, tokenizer_kind=tokenizer_kind)
    marker.write_text(stamp)
    print(f"   built random checkpoint {folder} in {time.perf_counter() - t0:.1f} s")
    return folder
