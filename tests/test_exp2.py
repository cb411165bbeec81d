"""The softmaxes' ``2 ** x`` (``mlx_ferrum.kernels.reference.exp2``) against numpy in float64."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_ferrum.kernels import reference
from mlx_ferrum.kernels.reference import exp2, fusing


def _inputs() -> np.ndarray:
    return np.concatenate([np.linspace(-130.0, 130.0, 100_001),
                           [-np.inf, np.inf, 0.0, -0.5, 0.5, -126.0, -127.0, 127.0]]).astype(np.float32)


def test_fused_arithmetic_matches_float64_within_float32_rounding():
    x = _inputs()
    with fusing():
        y = np.array(mx.compile(exp2)(mx.array(x)))
    ref = 2.0 ** x.astype(np.float64)
    normal = (x >= -126) & (x <= 127)
    assert np.max(np.abs(y[normal] - ref[normal]) / ref[normal]) < 2e-7
    assert np.all(y[x < -126.5] == 0.0)  # -inf included: a masked score weighs nothing
    assert np.all(np.isposinf(y[x > 127.5]))
    assert y[x == 0.0][0] == 1.0


def test_outside_a_fusing_block_it_is_mx_power():
    x = mx.array(_inputs()[::7])
    assert np.array_equal(np.array(exp2(x)), np.array(mx.power(2.0, x)), equal_nan=True)


def _scores(n: int) -> mx.array:
    # many values, so that the fused arithmetic and mx.power differ in some last bit
    return mx.array(np.random.default_rng(n).uniform(-30.0, 0.0, n).astype(np.float32))


def test_large_inputs_keep_mx_power_even_when_fusing(monkeypatch):
    monkeypatch.setattr(reference, "MAX_FUSED_SIZE", 1000)
    monkeypatch.setattr(reference, "MIN_FUSED_SIZE", 1)
    x = _scores(1001)
    with fusing():
        assert np.array_equal(np.array(exp2(x)), np.array(mx.power(2.0, x)))
        assert not np.array_equal(np.array(exp2(x[:1000])), np.array(mx.power(2.0, x[:1000])))
    assert not getattr(reference._local, "fusing", False)  # the block restores the flag


def test_small_inputs_keep_mx_power_even_when_fusing(monkeypatch):
    monkeypatch.setattr(reference, "MIN_FUSED_SIZE", 1000)
    x = _scores(1000)
    with fusing():
        assert np.array_equal(np.array(exp2(x[:999])), np.array(mx.power(2.0, x[:999])))
        assert not np.array_equal(np.array(exp2(x)), np.array(mx.power(2.0, x)))


def test_the_default_sizes_fuse_decode_scores_of_batches_only():
    """One sequence's decode scores over 200 tokens stay ``mx.power``; 32 sequences of
    340 tokens fuse, and so does the SwiGLU of a 32-row stories260K step (32 x 172)."""
    heads = 8
    values = np.random.default_rng(3).uniform(-30.0, 0.0, 32 * heads * 352).astype(np.float32)
    one = mx.array(values[: heads * 200].reshape(1, heads, 200))
    batch = mx.array(values.reshape(32, heads, 352))
    swiglu = mx.array(values[: 32 * 172].reshape(32, 172))
    with fusing():
        assert not np.array_equal(np.array(exp2(swiglu)), np.array(mx.power(2.0, swiglu)))
    with fusing():
        assert np.array_equal(np.array(exp2(one)), np.array(mx.power(2.0, one)))
        assert not np.array_equal(np.array(exp2(batch)), np.array(mx.power(2.0, batch)))


def test_eager_arithmetic_serves_every_shape_and_matches_float64():
    """``exp2_eager``: one shapeless compiled kernel for inputs of any shape (prompt-tail
    scores differ in every call), within float32 rounding of float64."""
    from mlx_ferrum.kernels.reference import MIN_EAGER_FUSED_SIZE, exp2_eager

    rng = np.random.default_rng(4)
    for shape in [(1, 8, 45, 380), (1, 4, 2, 31, 357), (MIN_EAGER_FUSED_SIZE,)]:
        x = rng.uniform(-120.0, 120.0, size=shape).astype(np.float32)
        y = np.array(exp2_eager(mx.array(x)))
        ref = 2.0 ** x.astype(np.float64)
        assert y.shape == x.shape
        assert np.max(np.abs(y - ref) / ref) < 2e-7
    small = mx.array(np.linspace(-5, 0, 10, dtype=np.float32))
    assert np.array_equal(np.array(exp2_eager(small)), np.array(mx.power(2.0, small)))


def test_eager_arithmetic_runs_on_any_thread():
    """The compiled kernel is per thread: a graph traced on one thread keeps its streams."""
    import threading

    from mlx_ferrum.kernels.reference import exp2_eager

    x = mx.array(np.linspace(-20, 0, 1 << 16, dtype=np.float32))
    results, errors = [], []

    def run():
        try:
            results.append(np.array(exp2_eager(x)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run()
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert not errors, errors
    assert np.array_equal(results[0], results[1])


def test_range_reduction_rounds_to_nearest_even_inside_a_compiled_kernel():
    """``n = round(x)`` comes from adding and taking away 1.5 * 2**23 (so the compiled
    kernel keeps it fused); numpy's ``rint`` (ties to even) is the reference, halves included."""
    x = np.concatenate([np.arange(-127.0, 128.5, 0.5), np.linspace(-127.0, 128.0, 20_001)]).astype(np.float32)
    _, bits = mx.compile(reference._exp2_parts)(mx.array(x))
    whole = (np.array(bits) >> 23) - 127
    assert np.array_equal(whole, np.rint(x).astype(np.int32))
