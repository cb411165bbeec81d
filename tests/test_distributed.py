"""Tensor parallelism over 2 processes (``mlx.launch``, ring backend, loopback) against one
process: the same greedy and seeded tokens, two ``all_sum`` per layer per forward pass,
one broadcast per engine step, and at most 0.55x of the weight bytes per rank.

The one-process reference is a plain ``Engine`` over the unsharded model in this
process; the 2-process figures come from each rank's own result file
(tests/support/distributed_worker.py), since ``mlx.launch`` exits 0 when a rank fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.distributed import one_process_tokens, run_ranks

PROMPTS_FEW = 4


def _prompts(vocab: int, n: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(low, vocab, int(rng.integers(3, 24)))] for _ in range(n)]


def _cases(vocab: int, n: int, max_tokens: int = 12) -> list[dict]:
    prompts = _prompts(vocab, n)
    greedy = [dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * n
    seeded = [dict(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(n)]
    return [
        dict(layout="contiguous", prompts=prompts, params=greedy),
        dict(layout="paged", prompts=prompts, params=greedy),
        # a pool of 6 blocks of 16 tokens for 4+ sequences of up to ~36 tokens: preemption
        dict(layout="paged", prompts=prompts, params=seeded, max_num_blocks=6),
    ]


def _check_identity(results: list[dict], model, cases: list[dict]) -> None:
    for index, case in enumerate(cases):
        expected = one_process_tokens(model, case)
        driver = results[0]["cases"][index]
        got = [driver["tokens"][rid] for rid in driver["order"]]
        assert got == expected, f"case {index} ({case['layout']}): parallel tokens differ from one process"
        for other in results[1:]:
            assert other["cases"][index]["tokens"] == driver["tokens"], f"case {index}: ranks disagree"
            assert other["cases"][index]["num_steps"] == driver["num_steps"]
            assert other["cases"][index]["lockstep_steps"] == driver["lockstep_steps"]


def _check_steps(results: list[dict]) -> None:
    for res in results:
        for case in res["cases"]:
            # one broadcast per engine step, plus rank 0's idle heartbeats and the final stop
            assert case["broadcasts"] == case["lockstep_steps"] + case["heartbeats"] + 1, case
            assert case["collectives"] == case["broadcasts"], case  # no step needed a second all_sum


def _check_traffic(results: list[dict], num_layers: int, vocabulary_parallel: bool = True) -> None:
    _check_steps(results)
    for res in results:
        counts = res["forward_collectives"]
        # two per layer (o_proj, down_proj / the MoE block), one for the embedding lookup
        assert counts["all_sum"] == 2 * num_layers + (1 if vocabulary_parallel else 0), counts
        assert counts["all_gather"] == (1 if vocabulary_parallel else 0), counts


def _one_process_bytes(model) -> int:
    from mlx_ferrum.distributed.sharding import weight_bytes

    return weight_bytes(model)


def test_tensor_parallel_stories260k_matches_one_process(stories_path, tmp_path):
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    cases = _cases(model.args.vocab_size, PROMPTS_FEW)
    # prompt-lookup speculation: deterministic on every rank, so it runs in lockstep too
    cases.append(dict(layout="paged", prompts=cases[0]["prompts"][:2], speculative="ngram",
                      speculative_disable_by_batch_size=1 << 20,
                      params=[dict(temperature=0.0, max_tokens=40, ignore_eos=True)] * 2))
    # quantized KV caches hold only the rank's KV heads too, in both layouts
    cases += [dict(case, kv_cache_dtype=dtype) for case, dtype in ((cases[1], "int8"), (cases[0], "int4"))]
    results = run_ranks({"model": str(stories_path), "mode": "tensor", "size": 2, "cases": cases}, tmp_path)
    _check_identity(results, model, cases)
    assert results[0]["cases"][3]["spec_accepted_tokens"] > 0
    _check_traffic(results, model.args.num_hidden_layers)
    full = _one_process_bytes(model)
    for res in results:
        assert res["capabilities"] == {"supports_tensor_parallelism": True, "supports_pipeline_parallelism": False,
                                       "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                       "supports_speculative_decoding": True}
        assert res["local_num_kv_heads"] == model.args.num_key_value_heads // 2
        assert res["weight_bytes"] <= 0.55 * full, (res["weight_bytes"], full)
    assert results[0]["cases"][2]["num_preemptions"] > 0  # the small pool did preempt


def test_tensor_parallel_tiny_dense_sharded_checkpoint(tmp_path):
    """A Qwen3-style checkpoint (q/k norms, head_dim != hidden/heads, untied head) written as
    two safetensors shards with an index."""
    from support.checkpoints import cached_checkpoint
    from mlx_ferrum.models.loader import load_model

    folder = cached_checkpoint("qwen3", sharded=True)
    model, _, _ = load_model(folder)
    cases = _cases(model.args.vocab_size, 3, max_tokens=8)[:2]
    results = run_ranks({"model": str(folder), "mode": "tensor", "size": 2, "cases": cases}, tmp_path)
    _check_identity(results, model, cases)
    _check_traffic(results, model.args.num_hidden_layers)
    full = _one_process_bytes(model)
    assert all(res["weight_bytes"] <= 0.55 * full for res in results)


@pytest.mark.slow
def test_tensor_parallel_quantized_checkpoint(tmp_path):
    """mlx-lm's 4-bit affine conversion (one module at 8 bits, one left float): the
    quantized projections are split with mlx's QuantizedAllToSharded/ShardedToAll layers;
    the quantized embedding stays replicated."""
    from support.checkpoints import cached_checkpoint
    from mlx_ferrum.models.loader import load_model

    folder = cached_checkpoint("llama2", quantized=True)
    model, _, _ = load_model(folder)
    cases = _cases(model.args.vocab_size, 3, max_tokens=8)[:2]
    results = run_ranks({"model": str(folder), "mode": "tensor", "size": 2, "cases": cases}, tmp_path)
    _check_identity(results, model, cases)
    _check_traffic(results, model.args.num_hidden_layers, vocabulary_parallel=False)


@pytest.mark.slow
def test_tensor_parallel_stories260k_fifty_prompts(stories_path, tmp_path):
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    cases = _cases(model.args.vocab_size, 50, max_tokens=24)
    cases[2]["max_num_blocks"] = 40
    results = run_ranks({"model": str(stories_path), "mode": "tensor", "size": 2, "cases": cases}, tmp_path,
                        timeout=900)
    _check_identity(results, model, cases)


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    "gpt_oss",  # attention sinks, sliding and full layers, biased experts sharded across ranks
    "qwen3_moe",  # experts sharded, one dense layer
    "gemma3_text",  # sliding windows, scaled tied embedding
    "phi3",  # fused qkv and gate_up in the checkpoint, split at load
])
def test_tensor_parallel_other_families_match_one_process(family, tmp_path):
    """Tiny random checkpoints written by transformers' save_pretrained; windows of 6
    tokens so the prompts and outputs cross them."""
    hf_reference = pytest.importorskip("support.hf_reference")
    from mlx_ferrum.models.loader import load_model

    folder = tmp_path / family
    hf_reference.make_checkpoint(family, folder, window=6)
    model, _, _ = load_model(folder)
    cases = _cases(model.args.vocab_size, 3, max_tokens=10)[:2]
    results = run_ranks({"model": str(folder), "mode": "tensor", "size": 2, "cases": cases}, tmp_path)
    _check_identity(results, model, cases)
    _check_traffic(results, model.args.num_hidden_layers)
    full = _one_process_bytes(model)
    assert all(res["weight_bytes"] <= 0.55 * full for res in results), ([r["weight_bytes"] for r in results], full)


def _check_pipeline_traffic(results: list[dict]) -> None:
    _check_steps(results)
    size = len(results)
    for rank, res in enumerate(results):
        counts = res["forward_collectives"]
        # activations rank r -> r+1, then the last rank's logits summed with zeros
        assert counts["send"] == (1 if rank < size - 1 else 0), counts
        assert counts["recv_like"] == (1 if rank > 0 else 0), counts
        assert counts["all_sum"] == 1 and counts["all_gather"] == 0, counts


def test_pipeline_parallel_stories260k_matches_one_process(stories_path, tmp_path):
    """5 layers on 2 ranks, split 2,3 (the tied embedding is on both ends)."""
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    cases = _cases(model.args.vocab_size, PROMPTS_FEW)
    cases.append(dict(layout="contiguous", prompts=cases[0]["prompts"][:2], speculative="ngram",
                      speculative_disable_by_batch_size=1 << 20,
                      params=[dict(temperature=0.0, max_tokens=40, ignore_eos=True)] * 2))
    # every step with 2+ sequences split into 2 micro-batches (the default floor of 32
    # tokens per micro-batch lowered to 1, so decode steps split too)
    for case in cases:
        case["micro_batch_min_tokens"] = 1
    # one pass at a time (no micro-batches), for comparison
    cases.append(dict(cases[0], pipeline_micro_batches=1))
    # the defaults (2 micro-batches of at least 32 tokens): only the prompt steps split
    cases.append(dict(cases[1], prompts=[p * 4 for p in cases[1]["prompts"]], micro_batch_min_tokens=None))
    results = run_ranks({"model": str(stories_path), "mode": "pipeline", "size": 2, "cases": cases,
                         "pipeline_split": "2,3"}, tmp_path)
    _check_identity(results, model, cases)
    assert results[0]["cases"][3]["spec_accepted_tokens"] > 0
    _check_pipeline_traffic(results)
    for res in results:
        # 4 requests per step: split into 2 micro-batches in flight (default), or not at all
        assert all(case["micro_batched_steps"] > 0 for case in res["cases"][:3]), res["cases"]
        assert res["cases"][4]["micro_batched_steps"] == 0
        assert 0 < res["cases"][5]["micro_batched_steps"] < res["cases"][5]["num_steps"] / 2
    assert [res["num_layers"] for res in results] == [2, 3]
    for res in results:
        assert res["capabilities"] == {"supports_tensor_parallelism": False, "supports_pipeline_parallelism": True,
                                       "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
                                       "supports_speculative_decoding": True}


@pytest.mark.slow
def test_pipeline_parallel_sharded_checkpoint_reads_only_its_shards(tmp_path):
    """Two layers, two safetensors shards (embedding + layer 0; layer 1 + norm + head):
    each rank opens only its own shard and holds about half of the weights."""
    from support.checkpoints import cached_checkpoint
    from mlx_ferrum.models.loader import load_model

    folder = cached_checkpoint("qwen3", sharded=True)
    model, _, _ = load_model(folder)
    cases = _cases(model.args.vocab_size, 3, max_tokens=8)
    results = run_ranks({"model": str(folder), "mode": "pipeline", "size": 2, "cases": cases}, tmp_path)
    _check_identity(results, model, cases)
    _check_pipeline_traffic(results)
    assert results[0]["opened_files"] == ["model-00001-of-00002.safetensors"]
    assert results[1]["opened_files"] == ["model-00002-of-00002.safetensors"]
    full = _one_process_bytes(model)
    assert all(res["weight_bytes"] <= 0.55 * full for res in results), ([r["weight_bytes"] for r in results], full)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text", "qwen3_moe", "phi3"])
def test_pipeline_parallel_other_families_match_one_process(family, tmp_path):
    hf_reference = pytest.importorskip("support.hf_reference")
    from mlx_ferrum.models.loader import load_model

    folder = tmp_path / family
    hf_reference.make_checkpoint(family, folder, window=6)
    model, _, _ = load_model(folder)
    cases = _cases(model.args.vocab_size, 3, max_tokens=10)[:2]
    cases[1]["micro_batch_min_tokens"] = 1  # every step of 2+ sequences in 2 micro-batches
    results = run_ranks({"model": str(folder), "mode": "pipeline", "size": 2, "cases": cases}, tmp_path)
    _check_identity(results, model, cases)
    _check_pipeline_traffic(results)
    assert results[0]["cases"][1]["micro_batched_steps"] > 0


@pytest.mark.slow
def test_pipeline_parallel_stories260k_fifty_prompts(stories_path, tmp_path):
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    cases = _cases(model.args.vocab_size, 50, max_tokens=24)
    cases[2]["max_num_blocks"] = 40
    results = run_ranks({"model": str(stories_path), "mode": "pipeline", "size": 2, "cases": cases}, tmp_path,
                        timeout=900)
    _check_identity(results, model, cases)


@pytest.mark.slow
def test_a_rank_that_vanishes_makes_the_others_exit_with_a_named_error(stories_path, tmp_path):
    """Rank 1 leaves mid-generation (exit 0, so mlx.launch does not stop rank 0 itself):
    rank 0 exits within the 5 s watchdog bound plus start-up, naming the error, and
    writes no result (it never finished)."""
    import time

    from support.distributed import launch_ranks

    spec = {"model": str(stories_path), "mode": "tensor", "size": 2, "timeout": 5, "die_after_steps": 3,
            "cases": [dict(layout="paged", prompts=[[1, 5, 6, 7]],
                           params=[dict(temperature=0.0, max_tokens=300, ignore_eos=True)])]}
    start = time.monotonic()
    proc, out = launch_ranks(spec, tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert not (out / "rank0.json").exists() and not (out / "rank1.json").exists()
    assert ("DistributedPeerLostError: rank 0" in proc.stderr or "DistributedTimeoutError: rank 0" in proc.stderr), \
        proc.stderr[-2000:]
    assert elapsed < 60


@pytest.mark.slow
def test_serve_on_two_ranks_answers_like_one_process_and_stops_on_ctrl_c(stories_path, tmp_path):
    """``mlx-ferrum serve --tensor-parallel-size 2`` under mlx.launch: only rank 0 listens,
    a greedy completion equals the one-process engine's tokens, and SIGINT to the launch's
    process group (what Ctrl-C in a terminal sends) ends every rank."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    from mlx_ferrum.api import load
    from mlx_ferrum.engine import Engine
    from mlx_ferrum.engine.sampling import SamplingParams
    from support.distributed import ROOT, mlx_launch

    launcher = mlx_launch()
    if launcher is None:
        pytest.skip("mlx.launch is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [launcher, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--", sys.executable, "-m",
           "mlx_ferrum", "serve", "--model", str(stories_path), "--port", str(port), "--tensor-parallel-size", "2",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.5)
        body = {"model": str(stories_path), "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
        text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        model, tokenizer = load(str(stories_path))
        expected = Engine(model, tokenizer).generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0))
        assert text == expected[0].text
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            pytest.fail(f"the ranks did not stop within 30 s of Ctrl-C; their stderr:\n{stderr[-4000:]}")
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
        assert not left, f"ranks still running after Ctrl-C: {left}"
        # mlx.launch names every rank that exited non-zero: a follower leaving at the first
        # Ctrl-C (code 130) strands rank 0 in its next broadcast (code 3, or a hang)
        failed = [line for line in stderr.splitlines() if "Node with rank" in line]
        assert not failed, f"a rank did not stop cleanly on Ctrl-C: {failed}\n{stderr[-4000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_endurance_random_arrivals_aborts_and_preemption_under_tensor_parallelism(stories_path, tmp_path):
    """Every 100 steps each rank records a CRC of all outputs so far (request, new tokens,
    finish reason): the ranks never diverge and nothing hangs. 2,000 steps (about 3
    minutes on 2 busy cores); ``FERRUM_ENDURANCE_STEPS=10000`` runs the full target (passed in
    891 s on the 2-core EPYC, 2026-11-25)."""
    import os

    steps = int(os.environ.get("FERRUM_ENDURANCE_STEPS", "2000"))
    spec = {"model": str(stories_path), "mode": "tensor", "size": 2,
            "endurance": {"steps": steps, "every": 100, "seed": 3, "max_num_blocks": 24}}
    results = run_ranks(spec, tmp_path, timeout=3000)
    first, second = results[0]["endurance"], results[1]["endurance"]
    assert len(first["checksums"]) == steps // 100
    assert first["checksums"] == second["checksums"]
    assert first["lockstep_steps"] == second["lockstep_steps"] >= steps
    assert first["preemptions"] > 0 and first["generated_tokens"] > steps


@pytest.mark.slow
def test_readme_multiple_macs_python_snippet_runs_under_mlx_launch(stories_path, tmp_path):
    """README's "Multiple Macs" Python snippet, with its model path set to stories260K,
    under mlx.launch: rank 0 prints the one-process greedy completion."""
    import os
    import re
    import subprocess
    import sys

    from mlx_ferrum.api import load
    from mlx_ferrum.engine import Engine
    from mlx_ferrum.engine.sampling import SamplingParams
    from support.distributed import ROOT, mlx_launch

    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Multiple Macs", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0].replace("path/to/model", str(stories_path))
    script = tmp_path / "script.py"
    script.write_text(code)
    proc = subprocess.run([mlx_launch(), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--", sys.executable,
                           str(script)], cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=240)
    model, tokenizer = load(str(stories_path))
    expected = Engine(model, tokenizer).generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
    assert expected[0].text in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_tensor_and_pipeline_combined_greedy_on_four_ranks(stories_path, tmp_path):
    """The default suite's short form of the test below: TP=2 x PP=2, one paged greedy case."""
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    cases = [_cases(model.args.vocab_size, 2, max_tokens=6)[1]]
    results = run_ranks({"model": str(stories_path), "sizes": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                         "cases": cases}, tmp_path, size=4)
    _check_identity(results, model, cases)
    assert [res["num_layers"] for res in results] == [3, 3, 2, 2]


@pytest.mark.slow  # 4 processes on 2 cores: about 30 s
def test_tensor_and_pipeline_combined_on_four_ranks_matches_one_process(stories_path, tmp_path):
    """TP=2 x PP=2 on 4 ranks (world ranks 0, 1: layers 0-2; ranks 2, 3: layers 3-4, each
    stage's heads split across its 2 ranks). MLX's ring backend has no sub-groups, so the
    layer sums and the stage boundaries run over all 4 ranks, the other stage adding zeros
    (see mlx_ferrum.distributed.pipeline): the same greedy and seeded tokens as one
    process, and every rank runs the same collective sequence."""
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    layers = model.args.num_hidden_layers
    cases = _cases(model.args.vocab_size, 3, max_tokens=8)
    cases.append(dict(cases[1], kv_cache_dtype="int8"))  # the rank's KV heads of its layers, quantized
    results = run_ranks({"model": str(stories_path), "sizes": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                         "cases": cases}, tmp_path, size=4)
    _check_identity(results, model, cases)
    _check_steps(results)
    assert [res["num_layers"] for res in results] == [3, 3, 2, 2]
    for res in results:
        counts = res["forward_collectives"]
        # two sums per layer of the whole model, one stage boundary, the logits; no send/recv
        assert counts == {"all_sum": 2 * layers + 1 + 1, "all_gather": 0, "send": 0, "recv_like": 0}, counts
        assert res["local_num_kv_heads"] == model.args.num_key_value_heads // 2
        assert res["capabilities"] == {"supports_tensor_parallelism": True, "supports_pipeline_parallelism": True,
                                       "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                       "supports_speculative_decoding": True}
    full = _one_process_bytes(model)
    # the embedding is replicated within a stage (tied: on the first and the last stage)
    assert all(res["weight_bytes"] <= 0.45 * full for res in results), ([r["weight_bytes"] for r in results], full)


@pytest.mark.slow
def test_pipeline_parallel_three_stages_with_micro_batches(stories_path, tmp_path):
    """5 layers on 3 ranks (2, 2, 1): a middle stage receives and sends; every step of 2+
    sequences in 2 micro-batches (floor 1 token), in both layouts."""
    from mlx_ferrum.api import load

    model, _ = load(str(stories_path))
    cases = [dict(case, micro_batch_min_tokens=1) for case in _cases(model.args.vocab_size, 4, max_tokens=8)]
    results = run_ranks({"model": str(stories_path), "mode": "pipeline", "size": 3, "cases": cases}, tmp_path, size=3)
    _check_identity(results, model, cases)
    _check_pipeline_traffic(results)
    assert [res["num_layers"] for res in results] == [2, 2, 1]
    assert all(case["micro_batched_steps"] > 0 for res in results for case in res["cases"])
