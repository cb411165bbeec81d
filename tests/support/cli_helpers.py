"""Helpers for the tests that drive the interactive CLI in-process."""

from __future__ import annotations


def feed(monkeypatch, lines):
    """Make ``input()`` return ``lines`` one by one, then raise EOFError (Ctrl-D)."""
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
