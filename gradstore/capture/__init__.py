"""Capture into the store: ``store.capture`` over an unchanged training loop (:mod:`.session`), resumable runs
(:mod:`.resume`) and online data selection in the step (:mod:`.online`). The torch side (hooks, per-example
math, projections) is the ``ingest`` package; this stage writes what it computes into store runs."""
