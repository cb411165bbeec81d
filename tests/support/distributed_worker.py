"""One rank of a 2-process test run (started by ``mlx.launch`` from tests/support/distributed.py).

argv: ``SPEC_JSON OUT_DIR``. The spec names a checkpoint, the parallel mode and a list
of cases (a KV layout, token-id prompts, sampling parameters). Every rank loads its
shard, counts the collectives of one eager forward pass, runs every case through a
:class:`~mlx_ferrum.distributed.lockstep.LockstepEngine` (rank 0 adds the requests;
the others step as rank 0 says and record the tokens they sampled), and writes
``OUT_DIR/rank{r}.json`` with ``ok`` and its figures, or ``ok: false`` and the
traceback: ``mlx.launch`` exits 0 even when a rank fails, so the test reads each
rank's own file.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(spec_path: str, out_dir: str) -> int:
    rank = int(os.environ.get("MLX_RANK", "-1"))
    result: dict = {"rank": rank, "ok": False}
    try:
        _run(json.load(open(spec_path)), result)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported through the file
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # MLX teardown after worker threads may abort on the CPU backend


def _run(spec: dict, result: dict) -> None:
    import mlx.core as mx

    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.distributed import init_group, load_sharded
    from mlx_ferrum.distributed.lockstep import LockstepEngine
    from mlx_ferrum.distributed.sharding import count_collectives, weight_bytes
    from mlx_ferrum.engine.sampling import SamplingParams

    import mlx_ferrum.models.loader as loader

    opened = result["opened_files"] = []
    read = loader._load_safetensors

    def recording(file):
        opened.append(os.path.basename(str(file)))
        return read(file)

    loader._load_safetensors = recording
    sizes = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    if "sizes" in spec:
        sizes.update(spec["sizes"])
    else:
        sizes[f"{spec['mode']}_parallel_size"] = spec["size"]
    group = init_group(RuntimeConfig(distributed_backend="ring", distributed_timeout=spec.get("timeout", 60),
                                     pipeline_split=spec.get("pipeline_split"), **sizes))
    result["world_size"] = group.size
    model, _folder = load_sharded(spec["model"], group)
    result["weight_bytes"] = weight_bytes(model)
    result["num_layers"] = len(model.layers)
    result["local_num_kv_heads"] = model.args.num_key_value_heads
    logits, counts = count_collectives(lambda: model(mx.array([[1, 2, 3, 4]])))
    mx.eval(logits)
    result["forward_collectives"] = counts
    result["logits_shape"] = list(logits.shape)
    from mlx_ferrum.executor import LlmExecutor

    caps = LlmExecutor(model, RuntimeConfig(**sizes)).capabilities()
    result["capabilities"] = {k: getattr(caps, k) for k in (
        "supports_tensor_parallelism", "supports_pipeline_parallelism", "tensor_parallel_size",
        "pipeline_parallel_size", "supports_speculative_decoding")}
    if "endurance" in spec:
        result["endurance"] = _endurance(model, group, sizes, spec["endurance"])
    result["cases"] = []
    for case in spec.get("cases", []):
        config = RuntimeConfig(kv_layout=case["layout"], max_num_seqs=case.get("max_num_seqs", 32),
                               max_num_blocks=case.get("max_num_blocks"), speculative=case.get("speculative"),
                               speculative_disable_by_batch_size=case.get("speculative_disable_by_batch_size"),
                               kv_cache_dtype=case.get("kv_cache_dtype"),
                               pipeline_micro_batches=case.get("pipeline_micro_batches"), **sizes)
        engine = LockstepEngine(model, None, config, group, heartbeat_s=case.get("heartbeat_s", 1.0))
        if getattr(model, "pipeline_stage", None) is not None:
            from mlx_ferrum.distributed.pipeline import MICRO_BATCH_MIN_TOKENS

            model.pipeline_stage.micro_batch_min_tokens = case.get("micro_batch_min_tokens") or MICRO_BATCH_MIN_TOKENS
        params = [SamplingParams(**p) for p in case["params"]]
        tokens: dict[str, list[int]] = {}
        if group.is_driver:
            outs = engine.generate([list(p) for p in case["prompts"]], params)
            for out in outs:
                tokens[out.request_id] = list(out.token_ids)
            order = [out.request_id for out in outs]
            engine.close()
        else:
            die_after = spec.get("die_after_steps")
            while not engine.stopped:
                if die_after is not None and engine.steps_run >= die_after:
                    os._exit(0)  # a rank that vanishes mid-run (exit 0, so mlx.launch leaves rank 0 alone)
                for out in engine.step():
                    if out.finished:
                        tokens[out.request_id] = list(out.token_ids)
            order = None
        stats = engine.stats()
        result["cases"].append({
            "tokens": tokens, "order": order, "num_steps": stats["num_steps"], "lockstep_steps": stats["lockstep_steps"],
            "broadcasts": stats["lockstep_broadcasts"], "collectives": stats["lockstep_collectives"],
            "heartbeats": stats["heartbeats"], "num_preemptions": stats["num_preemptions"],
            "spec_proposed_tokens": stats["spec_proposed_tokens"], "spec_accepted_tokens": stats["spec_accepted_tokens"],
            "micro_batched_steps": stats["pipeline_micro_batched_steps"],
        })


def _endurance(model, group, sizes: dict, spec: dict) -> dict:
    """Random arrivals, aborts and preemption (a small pool) for ``spec["steps"]`` engine
    steps; a CRC of every step's outputs (request, new tokens, finish) is recorded every
    ``spec["every"]`` steps, for the test to compare across ranks."""
    import zlib

    import numpy as np

    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.distributed.lockstep import LockstepEngine
    from mlx_ferrum.engine.sampling import SamplingParams

    config = RuntimeConfig(kv_layout="paged", max_num_seqs=8, max_num_blocks=spec.get("max_num_blocks", 24),
                           **sizes)
    engine = LockstepEngine(model, None, config, group)
    rng = np.random.default_rng(spec.get("seed", 0))
    vocab = model.args.vocab_size
    crc, checksums, live = 0, [], []
    for step in range(spec["steps"]):
        if group.is_driver:
            if rng.random() < spec.get("arrival", 0.3):
                prompt = [1] + [int(t) for t in rng.integers(3, vocab, int(rng.integers(2, 40)))]
                temperature = float(rng.choice([0.0, 0.8]))
                live.append(engine.add_request(prompt, SamplingParams(temperature=temperature,
                                                                      max_tokens=int(rng.integers(1, 48)))))
            if live and rng.random() < spec.get("abort", 0.05):
                victim = live.pop(int(rng.integers(len(live))))
                try:
                    engine.abort(victim)
                except Exception:  # noqa: BLE001 - it finished already
                    pass
        outs = engine.step()
        for out in outs:
            crc = zlib.crc32(repr((out.request_id, out.new_token_ids, out.finish_reason)).encode(), crc)
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        if (step + 1) % spec.get("every", 100) == 0:
            checksums.append(crc)
    if group.is_driver:
        engine.close()
    else:
        engine.follow()
    stats = engine.stats()
    return {"checksums": checksums, "num_steps": stats["num_steps"], "preemptions": stats["num_preemptions"],
            "lockstep_steps": stats["lockstep_steps"], "generated_tokens": stats["generated_tokens"]}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
