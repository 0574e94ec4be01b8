"""Shared fixtures: a fresh store directory per test, deterministic torch settings."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LANCE_LOG", "error")


@pytest.fixture
def store_path(tmp_path):
    """A path for a new store (not created yet)."""
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    """A new, empty store."""
    import gradstore

    return gradstore.open(store_path)
