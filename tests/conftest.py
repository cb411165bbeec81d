"""Shared pytest fixtures: paths to the real checkpoints in ../shared/models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = Path(os.environ.get("FERRUM_SHARED_MODELS", REPO.parent / "shared" / "models"))
STORIES = SHARED_MODELS / "stories260K"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (run in CI when time allows)")
    config.addinivalue_line("markers", "harness: runs Metal kernel sources in the CPU harness (needs clang-19)")


@pytest.fixture(scope="session")
def stories_path() -> Path:
    """Folder of the real stories260K checkpoint; skips when ../shared is absent."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES} (set FERRUM_SHARED_MODELS)")
    return STORIES


@pytest.fixture(scope="session")
def stories_expected(stories_path):
    """The recorded greedy outputs: {'bos': {...}, 'once': {...}} as stored in the json files."""
    out = {}
    for key, name in (("bos", "greedy_bos.json"), ("once", "greedy_once_upon_a_time.json")):
        out[key] = json.loads((stories_path / name).read_text())
    return out
