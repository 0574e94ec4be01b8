"""Manifests: the description of the data an index was built from, and how to compare two of them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from indexers.search_errors import IndexMismatchError


def normalize_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest as it reads back from JSON (tuples become lists, keys become strings)."""
    return json.loads(json.dumps(dict(manifest), sort_keys=True, default=str))


def manifest_diff(expected: Mapping[str, Any], found: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two manifests, as ``{key: (expected, found)}``.

    A key present on one side only counts as differing (its missing value is ``None``)."""
    exp, got = normalize_manifest(expected), normalize_manifest(found)
    return {
        key: (exp.get(key), got.get(key)) for key in sorted(exp.keys() | got.keys()) if exp.get(key) != got.get(key)
    }


def check_manifest(expected: Mapping[str, Any], found: Mapping[str, Any]) -> None:
    """Raise :class:`IndexMismatchError` naming every differing key, or return if the manifests agree."""
    differences = manifest_diff(expected, found)
    if differences:
        raise IndexMismatchError(differences)
