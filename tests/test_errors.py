"""Every error type is a FerrumError, and every named error is triggered by some test."""

import inspect
import pathlib

import mlx_ferrum.errors as errors

TESTS = pathlib.Path(__file__).parent


def test_every_error_is_a_ferrum_error_and_is_tested():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    corpus = "".join(p.read_text() for p in TESTS.glob("test_*.py") if p.name != "test_errors.py")
    untested = [c.__name__ for c in classes if c is not errors.FerrumError and c.__name__ not in corpus]
    assert all(issubclass(c, errors.FerrumError) for c in classes)
    assert not untested, f"no test names these errors: {untested}"
