"""What the peer benches (``capture_peers.py``, ``capture_loop_peers.py``) print last: each arm's figures and the
comparison of gradstore's arm with a peer's."""

from __future__ import annotations

import statistics

TARGET = 1.0  # issue 12: capture below every peer


def report_against_peer(medians: dict[str, list[float]], ours: str, peer: str, result: str, complete: bool) -> None:
    """Print each arm's captured / plain medians (one per repeat) and ``ours`` over ``peer`` per repeat, then
    ``RESULT <result>=<median of those> target<=1.0 PASS|MISS`` (a MISS too when ``complete`` is false: a run's
    rows, or another of the script's checks, failed)."""
    for arm, per_repeat in medians.items():
        figures = ", ".join(f"{m:.3f}" for m in per_repeat)
        print(f"{arm} captured / plain: {figures} (median {statistics.median(per_repeat):.3f})")
    versus = [o / p for o, p in zip(medians[ours], medians[peer])]
    ratio = statistics.median(versus)
    print(f"{ours} / {peer} per repeat: {[round(x, 3) for x in versus]}; checks passed: {complete}")
    ok = ratio <= TARGET and complete
    print(f"RESULT {result}={ratio:.3f} target<={TARGET} {'PASS' if ok else 'MISS'}")
