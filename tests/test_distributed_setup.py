"""Start-up checks of parallel runs, in one process: configuration, the strict group
check, sharding refusals, the broadcast framing, the watchdog and the CLI flags."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.distributed.group import ParallelGroup, Watchdog, init_group
from mlx_ferrum.errors import (
    ConfigurationError,
    DistributedConfigurationError,
    DistributedTimeoutError,
    ShardingError,
)


class _Group:
    """A stand-in for ``mx.distributed.Group`` of a given size."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_parallel_sizes_from_environment_and_arguments(monkeypatch):
    monkeypatch.setenv("FERRUM_TENSOR_PARALLEL_SIZE", "2")
    config = RuntimeConfig()
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.parallel) == (2, 1, "tensor")
    assert RuntimeConfig(tensor_parallel_size=1, pipeline_parallel_size=4).parallel == "pipeline"
    assert RuntimeConfig(tensor_parallel_size=1).parallel == "none"
    monkeypatch.setenv("FERRUM_PIPELINE_PARALLEL_SIZE", "zero")
    with pytest.raises(ConfigurationError, match="FERRUM_PIPELINE_PARALLEL_SIZE"):
        RuntimeConfig()
    with pytest.raises(ConfigurationError, match="tensor_parallel_size"):
        RuntimeConfig(tensor_parallel_size=0, pipeline_parallel_size=1)
    with pytest.raises(ConfigurationError, match="distributed_backend"):
        RuntimeConfig(distributed_backend="tcp", pipeline_parallel_size=1)


@pytest.mark.parametrize("spelling, sizes", [
    ("tensor=2", (2, 1)), ("pipeline=3", (1, 3)), ("tensor=2,pipeline=2", (2, 2)),
    (" Pipeline=2 , tensor=4 ", (4, 2)), ("none", (1, 1)),
])
def test_ferrum_parallel_spells_both_sizes(monkeypatch, spelling, sizes):
    monkeypatch.delenv("FERRUM_TENSOR_PARALLEL_SIZE", raising=False)
    monkeypatch.delenv("FERRUM_PIPELINE_PARALLEL_SIZE", raising=False)
    monkeypatch.setenv("FERRUM_PARALLEL", spelling)
    config = RuntimeConfig()
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == sizes
    expected_mode = "+".join(m for m, n in zip(("tensor", "pipeline"), sizes) if n > 1) or "none"
    assert config.parallel == expected_mode and config.world_size == sizes[0] * sizes[1]
    # an explicit field beats the environment, as for every other field
    assert RuntimeConfig(tensor_parallel_size=8).tensor_parallel_size == 8


@pytest.mark.parametrize("spelling", ["tensor", "tensor=0", "tensor=two", "data=2", "tensor=2,tensor=2",
                                      "none,tensor=2", "tensor=2;pipeline=2", ""])
def test_malformed_ferrum_parallel_is_a_named_error(monkeypatch, spelling):
    monkeypatch.setenv("FERRUM_PARALLEL", spelling)
    with pytest.raises(ConfigurationError, match="FERRUM_PARALLEL=.*tensor=N,pipeline=M"):
        RuntimeConfig()


def test_ferrum_parallel_against_the_size_variables(monkeypatch):
    monkeypatch.setenv("FERRUM_PARALLEL", "tensor=2")
    monkeypatch.setenv("FERRUM_TENSOR_PARALLEL_SIZE", "4")
    with pytest.raises(ConfigurationError, match="FERRUM_PARALLEL='tensor=2' sets tensor_parallel_size=2 but "
                                                 "FERRUM_TENSOR_PARALLEL_SIZE='4' disagrees"):
        RuntimeConfig()
    # a mode the spelling leaves out is 1: a pipeline size variable of 2 disagrees too
    monkeypatch.setenv("FERRUM_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("FERRUM_PIPELINE_PARALLEL_SIZE", "2")
    with pytest.raises(ConfigurationError, match="pipeline_parallel_size=1 but FERRUM_PIPELINE_PARALLEL_SIZE"):
        RuntimeConfig()
    monkeypatch.setenv("FERRUM_PIPELINE_PARALLEL_SIZE", "1")
    assert RuntimeConfig().world_size == 2  # agreeing spellings are fine
    # an explicit field is not checked against the environment (it wins over both)
    assert RuntimeConfig(pipeline_parallel_size=2).parallel == "tensor+pipeline"


def test_no_launcher_is_a_named_error_never_a_group_of_one():
    # this test process was not started by mlx.launch: strict init finds no backend
    with pytest.raises(DistributedConfigurationError, match="mlx.launch"):
        init_group(RuntimeConfig(tensor_parallel_size=2, pipeline_parallel_size=1))


def test_group_size_must_equal_the_product_of_the_sizes():
    config = RuntimeConfig(tensor_parallel_size=4, pipeline_parallel_size=1)
    with pytest.raises(DistributedConfigurationError, match="needs a group of 4 ranks, but mlx.launch started 2"):
        init_group(config, init=lambda **kw: _Group(2))
    seen = {}

    def strict_init(**kwargs):
        seen.update(kwargs)
        return _Group(4, 3)

    group = init_group(config, init=strict_init)
    assert seen["strict"] is True and (group.rank, group.size, group.mode) == (3, 4, "tensor")
    assert init_group(RuntimeConfig(tensor_parallel_size=1, pipeline_parallel_size=1)) is None
    # both sizes: world rank 3 of 2 x 2 is stage 1's tensor rank 1
    combined = init_group(RuntimeConfig(tensor_parallel_size=2, pipeline_parallel_size=2),
                          init=lambda **kw: _Group(4, 3))
    assert (combined.mode, combined.pipeline_rank, combined.tensor_rank) == ("tensor+pipeline", 1, 1)
    with pytest.raises(DistributedConfigurationError, match="needs a group of 4 ranks, but mlx.launch started 2"):
        init_group(RuntimeConfig(tensor_parallel_size=2, pipeline_parallel_size=2), init=lambda **kw: _Group(2))


def test_heads_not_divisible_by_the_group_are_refused():
    from support.tiny_models import tiny_model

    from mlx_ferrum.distributed.sharding import shard_model

    model = tiny_model("llama")  # 4 heads, 2 KV heads
    with pytest.raises(ShardingError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        shard_model(model, _Group(3))
    with pytest.raises(ShardingError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        shard_model(model, _Group(4))


def test_lockstep_refuses_lora_and_speculation():
    from mlx_ferrum.distributed.lockstep import check_lockstep_config

    with pytest.raises(DistributedConfigurationError, match="LoRA"):
        check_lockstep_config(RuntimeConfig(enable_lora=True))
    with pytest.raises(DistributedConfigurationError, match="draft-model speculative decoding"):
        check_lockstep_config(RuntimeConfig(speculative="path/to/draft"))
    check_lockstep_config(RuntimeConfig(enable_lora=False, speculative=None))
    check_lockstep_config(RuntimeConfig(enable_lora=False, speculative="ngram"))


@pytest.mark.parametrize("size, collectives", [(10, 1), (5000, 2)])
def test_broadcast_framing_one_collective_unless_the_message_is_long(size, collectives):
    """Rank 0's buffers, summed with the zeros of the other ranks (an all_sum), decode to
    its message on a receiving rank; a message past the header takes a second all_sum."""
    import numpy as np

    from mlx_ferrum.distributed.lockstep import Broadcaster

    sent = []

    class Sender(Broadcaster):
        def _all_sum(self, buffer):
            self.collectives += 1
            sent.append(buffer.copy())
            return bytes(buffer)

    class Receiver(Broadcaster):
        def _all_sum(self, buffer):
            self.collectives += 1
            assert not buffer.any()  # a receiving rank contributes zeros
            return bytes(sent[self.collectives - 1] + buffer)

    message = {"kind": "step", "commands": [("add", "req-1", list(range(size)), None)]}
    sender = Sender(ParallelGroup(None, 0, 2, 2, 1))
    receiver = Receiver(ParallelGroup(None, 1, 2, 2, 1))
    assert sender.exchange(message) == message
    assert receiver.exchange() == message
    assert sender.collectives == receiver.collectives == collectives
    assert sender.messages == receiver.messages == 1
    assert all(b.dtype == np.uint8 for b in sent)


def test_broadcast_over_a_real_group_of_one():
    from mlx_ferrum.distributed.lockstep import Broadcaster

    group = mx.distributed.init()  # not strict: this process alone
    broadcaster = Broadcaster(ParallelGroup(group, 0, 1, 1, 1))
    assert broadcaster.exchange({"kind": "stop"}) == {"kind": "stop"}


def test_watchdog_fires_on_a_stalled_step_and_not_on_a_finished_one():
    fired = []
    done = threading.Event()
    dog = Watchdog(rank=1, timeout_s=0.2, on_timeout=lambda e: (fired.append(e), done.set()))
    dog.arm("engine step 1")
    time.sleep(0.05)
    dog.disarm()
    time.sleep(0.3)
    assert not fired
    dog.arm("engine step 2")
    assert done.wait(2.0)
    assert isinstance(fired[0], DistributedTimeoutError) and "rank 1: engine step 2" in str(fired[0])


def test_cli_parallel_flags_and_their_defaults_in_help(capsys):
    from mlx_ferrum.cli import build_parser

    for command in ("generate", "chat", "bench", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--tensor-parallel-size" in text and "--pipeline-parallel-size" in text, command
        assert "$FERRUM_TENSOR_PARALLEL_SIZE, else 1" in text, command


def test_cli_generate_without_launcher_fails_with_the_launch_command(stories_path, capsys):
    from mlx_ferrum.cli import main

    code = main(["generate", "--model", str(stories_path), "--prompt", "Hi", "--tensor-parallel-size", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "DistributedConfigurationError" not in err and "mlx.launch --backend ring -n 2" in err


def test_capabilities_of_one_process_report_no_parallelism():
    from support.tiny_models import tiny_model

    from mlx_ferrum.executor import LlmExecutor

    caps = LlmExecutor(tiny_model("llama"), RuntimeConfig(tensor_parallel_size=1, pipeline_parallel_size=1)).capabilities()
    assert (caps.supports_tensor_parallelism, caps.supports_pipeline_parallelism) == (False, False)
    assert (caps.tensor_parallel_size, caps.pipeline_parallel_size) == (1, 1)


def _lockstep(rank: int, **kwargs):
    from support.tiny_models import tiny_model

    from mlx_ferrum.distributed.lockstep import LockstepEngine

    group = ParallelGroup(None, rank, 2, 2, 1)
    config = RuntimeConfig(kv_layout="paged", tensor_parallel_size=1, pipeline_parallel_size=1)
    return LockstepEngine(tiny_model("llama"), None, config, group, heartbeat_s=0, watchdog=False, **kwargs)


def test_only_rank_zero_takes_requests_and_refusals_come_before_any_broadcast():
    from mlx_ferrum.engine.sampling import SamplingParams
    from mlx_ferrum.errors import DistributedError, RequestError

    with pytest.raises(DistributedError, match="rank 1 takes no requests"):
        _lockstep(1).add_request([1, 2, 3])
    engine = _lockstep(0)
    with pytest.raises(DistributedConfigurationError, match="structured output"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs={"regex": "a+"}))
    with pytest.raises(DistributedConfigurationError, match="LoRA"):
        engine.add_request([1, 2, 3], lora="adapter")
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0.8))
    queued = engine._commands[-1]
    assert queued[:3] == ("add", rid, [1, 2, 3]) and queued[3].seed is not None  # the seed every rank uses
    with pytest.raises(RequestError, match="in use"):
        engine.add_request([4, 5], request_id=rid)
    with pytest.raises(RequestError, match="unknown request"):
        engine.abort("nobody")
    engine.abort(rid)  # queued for the next step, with the addition
    assert [c[0] for c in engine._commands] == ["add", "abort"]


def test_a_broken_broadcast_is_a_named_error():
    from mlx_ferrum.errors import DistributedPeerLostError

    engine = _lockstep(0, exit_on_peer_loss=False)

    def lost(buffer):
        raise RuntimeError("[ring] connection to a peer was lost")

    engine.broadcaster._all_sum = lost
    with pytest.raises(DistributedPeerLostError, match="rank 0: engine step 0's broadcast failed"):
        engine.step()
    assert engine.stopped


def test_a_launched_rank_without_parallel_sizes_is_refused(monkeypatch):
    monkeypatch.setenv("MLX_RANK", "1")
    with pytest.raises(DistributedConfigurationError, match="every rank would run the whole model alone"):
        init_group(RuntimeConfig(tensor_parallel_size=1, pipeline_parallel_size=1))


def test_pipeline_split_is_checked_against_the_layers(monkeypatch):
    from mlx_ferrum.distributed.pipeline import parse_split

    assert parse_split(None, 5, 2) == [3, 2] and parse_split("1,4", 5, 2) == [1, 4]
    with pytest.raises(ShardingError, match="sum to 5"):
        parse_split("4,4", 5, 2)
    with pytest.raises(ShardingError, match="use at most 2 ranks"):
        parse_split(None, 2, 3)
    monkeypatch.setenv("FERRUM_PIPELINE_SPLIT", "3,x")
    with pytest.raises(ConfigurationError, match="FERRUM_PIPELINE_SPLIT"):
        RuntimeConfig()


def test_pipeline_micro_batches_split_a_step_by_tokens():
    from mlx_ferrum.distributed.pipeline import PipelineStage

    stage = PipelineStage(0, 2, 0, 2, False, None, micro_batches=2, micro_batch_min_tokens=1)
    assert stage.overlaps
    assert stage.split([1] * 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage.split([30, 1, 1, 1]) == [[0], [1, 2, 3]]  # balanced by tokens, never an empty group
    assert stage.split([1, 1, 30]) == [[0, 1], [2]]
    assert stage.split([5]) == [[0]]
    stage.micro_batches = 3
    assert stage.split([1] * 7) == [[0, 1, 2], [3, 4], [5, 6]]
    assert sorted(i for group in stage.split([3, 9, 1, 4, 4]) for i in group) == list(range(5))
    stage.micro_batches = 1
    assert stage.split([1] * 4) == [[0, 1, 2, 3]]
    # by default a micro-batch needs 32 tokens: a decode step of 8 sequences stays whole
    stage = PipelineStage(0, 2, 0, 2, False, None, micro_batches=2)
    assert stage.split([1] * 8) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert stage.split([32] * 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage.split([40, 20, 1]) == [[0, 1, 2]]  # 61 tokens: one group of 32 would be left short
    # the combined mode's sums take every rank: no overlap, no split
    assert not PipelineStage(0, 2, 0, 2, False, None, tensor_parallel_size=2).overlaps
    with pytest.raises(ConfigurationError, match="pipeline_micro_batches"):
        RuntimeConfig(pipeline_micro_batches=0)
