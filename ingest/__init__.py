"""Capture side of gradstore: hooks on modules, per-example gradient math, random projection, ids.

Produces :class:`CapturedBatch` rows for a sink; imports neither ``gradstore`` nor ``indexers``.

>>> from ingest import CaptureConfig, GradientCapture
>>> with GradientCapture(model, sink, CaptureConfig(ProjectionConfig(k_in=16, k_out=16))) as capture:
...     model(**batch).loss.backward()      # sink receives one CapturedBatch per backward
"""

from ingest.capture import CaptureConfig, CapturedBatch, CaptureLabels, GradientCapture, ProjectionConfig, build_spec
from ingest.curvature import CurvatureStats
from ingest.hooks import RecomputationError
from ingest.layers import LayerInfo, select_layers
from ingest.misuse import CaptureUsageError
from ingest.projection import LayerSlot, ProjectionMismatchError, ProjectionSpec, projection_matrix

__all__ = [
    "CaptureConfig",
    "CaptureLabels",
    "CaptureUsageError",
    "CapturedBatch",
    "CurvatureStats",
    "GradientCapture",
    "LayerInfo",
    "LayerSlot",
    "ProjectionConfig",
    "ProjectionMismatchError",
    "ProjectionSpec",
    "RecomputationError",
    "build_spec",
    "projection_matrix",
    "select_layers",
]
