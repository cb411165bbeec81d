"""``mlx-ferrum bench`` (``mlx_ferrum.cli.bench``): a fast smoke run on a tiny
checkpoint (also without mlx-lm importable), the figures' definitions on hand-made
timings, the errors for bad arguments, and mlx-lm's side (``benchmarks/mlx_lm_side.py``)
on the same burst."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from support.checkpoints import cached_checkpoint
from mlx_ferrum.cli import bench, main
from mlx_ferrum.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mlx_lm_side  # noqa: E402


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables in ``text``: each a list of rows of cells (header first, rule dropped)."""
    tables, cur = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= {"-"} for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    if cur:
        tables.append(cur)
    return tables


@pytest.fixture(scope="module")
def qwen2_path():
    return cached_checkpoint("qwen2")


def test_cli_bench_prints_the_engine_table(qwen2_path, capsys):
    rc = main(["bench", "--model", str(qwen2_path), "--concurrency", "1,2", "--max-tokens", "4",
               "--prompt-tokens", "8"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    tables = _tables(out.out)
    assert len(tables) == 1, out.out
    assert tables[0][0] == bench.TABLE_HEADERS
    rows = tables[0][1:]
    assert [(r[0], r[1]) for r in rows] == [("1", "mlx_ferrum"), ("2", "mlx_ferrum")]
    for r in rows:
        nums = [float(x) for x in r[2:]]
        assert all(math.isfinite(x) and x > 0 for x in nums), r


def test_cli_bench_without_compare_has_only_ferrum_rows(qwen2_path, capsys):
    rc = main(["bench", "--model", str(qwen2_path), "--concurrency", "3", "--max-tokens", "3", "--prompt-tokens", "5"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    tables = _tables(out.out)
    assert len(tables) == 1
    assert [(r[0], r[1]) for r in tables[0][1:]] == [("3", "mlx_ferrum")]


def test_both_sides_generate_the_same_greedy_tokens(qwen2_path):
    """Independent check that the timed work is real: the engine's tokens equal mlx-lm's
    BatchGenerator's on the same prompts (float32), and every request ran to max_tokens."""
    import mlx_ferrum as mf

    model, tok = mf.load(str(qwen2_path))
    f = bench.bench_engine(model, tok, 3, 7, 5)
    m = mlx_lm_side.bench_mlx_lm_batch(qwen2_path, 3, 7, 5)
    assert f["generated_tokens"] == m["generated_tokens"] == 15
    assert [len(t) for t in f["tokens"]] == [5, 5, 5]
    assert f["tokens"] == m["tokens"]
    assert f["engine"] == "mlx_ferrum" and m["engine"] == "mlx-lm"
    assert f["ttft_p50"] <= f["wall_s"] and f["output_tps"] == pytest.approx(15 / f["wall_s"])


def test_summarize_follows_the_definitions():
    # two requests submitted at t=0: tokens at 1,2,3 and at 2,4,6; the last first token is at t=2
    r = bench.summarize([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]], t0=0.0, t_end=6.0, prompt_tokens=10, max_tokens=3)
    assert r["concurrency"] == 2 and r["generated_tokens"] == 6 and r["wall_s"] == 6.0
    assert r["ttft_p50"] == pytest.approx(1.5)  # median of 1 and 2
    assert r["ttft_p90"] == pytest.approx(1.9)  # 1 + 0.9 * (2 - 1)
    assert r["itl_p50"] == pytest.approx(1.5)  # gaps 1, 1, 2, 2
    assert r["itl_p99"] == pytest.approx(2.0)
    assert r["decode_tps"] == pytest.approx(3 / 4)  # tokens at 3, 4, 6 over t = 2..6
    assert r["output_tps"] == pytest.approx(1.0)
    assert r["total_tps"] == pytest.approx((6 + 20) / 6)
    one = bench.summarize([[0.5]], 0.0, 0.5, 4, 1)
    assert math.isnan(one["decode_tps"]) and math.isnan(one["itl_p50"])


def test_prompts_are_seeded_and_in_vocab():
    a = bench.make_prompts(50, 4, 9, seed=3)
    assert a == bench.make_prompts(50, 4, 9, seed=3)
    assert a != bench.make_prompts(50, 4, 9, seed=4)
    assert len(a) == 4 and all(len(p) == 9 and all(0 <= t < 50 for t in p) for p in a)


def test_bench_config_is_paged_and_fits_every_request():
    cfg = bench.bench_config(5, 30, 20, block_size=16)
    assert cfg.kv_layout == "paged" and cfg.max_num_seqs == 5
    assert cfg.max_num_blocks >= 5 * 4  # ceil(50 / 16) = 4 blocks per request


@pytest.mark.parametrize("text", ["1,x", "0", "", "-2", ",,"])
def test_bad_concurrency_is_a_configuration_error(text):
    with pytest.raises(ConfigurationError, match="--concurrency"):
        bench.parse_concurrency(text)


def test_cli_reports_bad_concurrency(qwen2_path, capsys):
    rc = main(["bench", "--model", str(qwen2_path), "--concurrency", "1,zero"])
    assert rc == 2
    assert "--concurrency" in capsys.readouterr().err


def test_bench_runs_without_mlx_lm(qwen2_path, monkeypatch, capsys):
    """The runtime's benchmark never imports mlx-lm (a dev-only dependency); only the
    comparison in benchmarks/ needs it, and says how to install it."""
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # makes `import mlx_lm` raise ImportError
    monkeypatch.setitem(sys.modules, "mlx_lm.generate", None)
    rc = main(["bench", "--model", str(qwen2_path), "--concurrency", "1", "--max-tokens", "2"])
    assert rc == 0, capsys.readouterr().err
    with pytest.raises(ConfigurationError, match="pip install mlx-lm"):
        mlx_lm_side.import_mlx_lm()
