"""Capture behaviour: determinism, batch independence, unchanged training, ids, metadata, curvature."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest
import torch
from exact_grads import SEQS, lm_batch
from tiny_models import tiny_gpt2
from torch import nn

from ingest.capture import CaptureConfig, GradientCapture, nonfinite_rows
from ingest.ids import content_hashes
from ingest.losses import causal_lm_loss
from ingest.projection import projection_matrix

transformers = pytest.importorskip("transformers")


def run_lm(model, batches, config, **kw):
    out = []
    with GradientCapture(model, out.append, config, **kw) as cap:
        for batch in batches:
            model(**batch).loss.backward()
    return cap, out


def by_id(out):
    return {i: row for b in out for i, row in zip(b.example_ids, b.grads)}


def test_batch_composition_and_padding_do_not_change_rows():
    model = tiny_gpt2()
    cfg = CaptureConfig.from_options(loss_reduction="token_mean", seed=7)
    _, whole = run_lm(model, [lm_batch(SEQS)], cfg)
    _, split = run_lm(model, [lm_batch([SEQS[2], SEQS[0]]), lm_batch([SEQS[3], SEQS[1]])], cfg)
    a, b = by_id(whole), by_id(split)
    assert set(a) == set(b) and len(a) == 4  # content hashes ignore padding
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6)
    assert whole[0].example_hash == whole[0].example_ids


def test_same_seed_same_vectors_other_seed_differs():
    runs = [
        run_lm(tiny_gpt2(), [lm_batch(SEQS)], CaptureConfig.from_options(loss_reduction="token_mean", seed=s))[1]
        for s in (3, 3, 4)
    ]
    assert torch.equal(runs[0][0].grads, runs[1][0].grads)
    assert not torch.allclose(runs[0][0].grads, runs[2][0].grads)
    assert runs[0][0].grads.shape == (4, 256 * 11)  # 2 blocks x 4 Conv1D + wte + wpe + lm_head, 16 x 16 each


def train(model, steps, capture: bool):
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []

    def loop():
        for _ in range(steps):
            for half in (SEQS[:2], SEQS[2:]):  # gradient accumulation: two micro-batches per step
                model(**lm_batch(half)).loss.backward()
            opt.step()
            opt.zero_grad()

    if capture:
        with GradientCapture(
            model, out.append, CaptureConfig.from_options(loss_reduction="token_mean", curvature=True)
        ):
            loop()
    else:
        loop()
    return out


def test_capture_does_not_change_training_and_counts_steps():
    plain, captured = tiny_gpt2(dropout=0.1), tiny_gpt2(dropout=0.1)
    train(plain, 3, capture=False)
    out = train(captured, 3, capture=True)
    for (name, p), q in zip(plain.named_parameters(), captured.parameters()):
        assert torch.equal(p, q), name
    assert [b.step for b in out] == [0, 0, 1, 1, 2, 2]  # optimizer found by its step hook
    assert [b.learning_rate for b in out[2:]] == [1e-2] * 4
    assert out[0].learning_rate is None  # not yet found before its first step


def test_ids_from_kwarg_set_ids_and_hash():
    class Net(nn.Module):  # refuses unknown kwargs, so example_id must be removed
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    model, x = Net(), torch.randn(2, 3)
    out = []
    with GradientCapture(model, out.append, CaptureConfig.from_options(projection=None)) as cap:
        model(x, example_id=["a", "b"]).sum().backward()
        cap.set_ids(torch.tensor([7, 8]))
        model(x).sum().backward()
        model(x).sum().backward()
        with torch.no_grad():
            model(x, example_id=["z", "z"])  # ignored, id kwarg still removed
        cap.set_ids(["p", "q"])
        with torch.no_grad():
            model(x)  # a no_grad forward does not consume set_ids
        model(x).sum().backward()
    assert [b.example_ids for b in out[:2]] == [["a", "b"], ["7", "8"]]
    assert out[0].example_hash is None
    assert out[2].example_ids == out[2].example_hash and out[2].example_ids[0].startswith("h:")
    assert out[2].example_ids[0] != out[2].example_ids[1]
    assert out[3].example_ids == ["p", "q"] and len(out) == 4


def test_content_hashes_are_sha256_of_the_dtype_and_the_kept_positions_bytes():
    def expected(dtype: str, values: np.ndarray) -> str:
        return "h:" + hashlib.sha256(dtype.encode() + values.tobytes()).hexdigest()[:32]

    tokens = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    hashes = content_hashes(tokens, mask)
    assert hashes == [expected("torch.int64", np.array(r, np.int64)) for r in ([5, 6, 7], [5, 6, 7, 8, 9])]
    assert content_hashes(tokens[:1, :3], None) == hashes[:1]  # the same tokens, unpadded: the same id
    features = torch.randn(3, 4, 2)[:, ::2]  # non-contiguous float rows
    assert content_hashes(features, None) == [expected("torch.float32", r.contiguous().numpy()) for r in features]
    half = torch.randn(2, 3).bfloat16()  # no numpy dtype: its bytes
    assert content_hashes(half, None) == [expected("torch.bfloat16", r.view(torch.int16).numpy()) for r in half]


def test_nonfinite_rows_flags_nan_inf_and_overflowing_norms():
    rows = torch.randn(6, 50)
    rows[1, 3] = float("nan")
    rows[2, 0] = float("inf")
    rows[3, 7] = -float("inf")
    rows[4] = 3e38  # every entry finite, its float32 norm is not
    rows[5, :2] = 1e38  # large, norm still finite
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        flagged = nonfinite_rows(rows.to(dtype))
        assert flagged.tolist() == [False, True, True, True, True, False], dtype
    assert nonfinite_rows(torch.empty(0, 4)).shape == (0,)


def test_bad_ids_raise_clear_errors():
    model, x = nn.Linear(3, 2), torch.randn(2, 3)
    with GradientCapture(model, lambda b: None, CaptureConfig()) as cap:
        with pytest.raises(ValueError, match="3 example ids for a batch of 2"):
            model(x, example_id=["a", "b", "c"])
        cap.set_ids(["a"])
        with pytest.raises(ValueError, match="1 example ids for a batch of 2"):
            model(x)
        cap.set_ids(["a", "b"])
        with pytest.raises(ValueError, match="both"):
            model(x, example_id=["a", "b"])
        with pytest.raises(ValueError, match="single string"):
            cap.set_ids("ab")


def test_per_example_loss_and_token_counts():
    model = tiny_gpt2()
    _, out = run_lm(
        model,
        [lm_batch(SEQS)],
        CaptureConfig.from_options(loss_reduction="token_mean"),
        per_example_loss=causal_lm_loss,
    )
    alone = torch.stack([model(**lm_batch([s])).loss.detach() for s in SEQS])
    assert torch.allclose(out[0].loss, alone, rtol=1e-5)
    assert out[0].num_tokens.tolist() == [9, 4, 12, 6] and out[0].num_tokens.dtype == torch.int32


def test_curvature_matches_explicit_second_moments():
    torch.manual_seed(0)
    model = nn.Linear(5, 4)
    x = torch.randn(3, 6, 5)
    out = []
    cfg = CaptureConfig.from_options(k_in=3, k_out=2, curvature=True, loss_reduction="sum", seed=2)
    with GradientCapture(model, out.append, cfg) as cap:
        y = model(x)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
    a_cov, s_cov, count = cap.curvature()[""]
    p_in = projection_matrix(2, "", "in", 3, 6).double()
    p_out = projection_matrix(2, "", "out", 2, 4).double()
    a = torch.cat([x, torch.ones(3, 6, 1)], -1).reshape(-1, 6).double() @ p_in.T
    s = dy.reshape(-1, 4).double() @ p_out.T
    assert count == 18
    np.testing.assert_allclose(a_cov, (a.T @ a / 18).numpy(), rtol=1e-6)
    np.testing.assert_allclose(s_cov, (s.T @ s / 18).numpy(), rtol=1e-6)


def test_backpressure_order_pause_and_sink_errors():
    model, x = nn.Linear(3, 2), torch.randn(2, 3)
    seen, lock = [], threading.Lock()

    def slow_sink(batch):
        time.sleep(0.01)
        with lock:
            seen.append((batch.step, threading.current_thread().name))

    with GradientCapture(model, slow_sink, CaptureConfig.from_options(max_pending_batches=1)) as cap:
        for step in range(5):
            cap.set_step(step)
            model(x).sum().backward()
        with cap.paused():
            model(x).sum().backward()
        cap.flush()
        assert [s for s, _ in seen] == [0, 1, 2, 3, 4]
        assert seen[0][1] != threading.current_thread().name

    def failing_sink(batch):
        raise OSError("disk full")

    with (
        pytest.raises(OSError, match="disk full"),
        GradientCapture(model, failing_sink, CaptureConfig()) as cap,
    ):
        model(x).sum().backward()
        cap.flush()


def test_grad_scaler_scale_is_undone():
    model, x = nn.Linear(3, 2), torch.randn(2, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rows = []
    for use_scaler in (False, True):
        out = []
        with GradientCapture(model, out.append, CaptureConfig(), grad_scaler=scaler if use_scaler else None):
            loss = model(x).sum()
            (scaler.scale(loss) if use_scaler else loss).backward()
        rows.append(out[0].grads)
    assert torch.allclose(rows[0], rows[1], rtol=1e-6)


class BareProduct(nn.Module):
    """The weight of ``nn.Linear(5, 4, bias=False)`` as a bare parameter in ``x @ P.T`` (captured at the op)."""

    def __init__(self) -> None:
        super().__init__()
        self.P = nn.Parameter(torch.randn(4, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.P.T


def test_curvature_of_uses_taken_at_their_ops_matches_explicit_second_moments():
    """Uses whose rows the op-level capture forms (a matrix product here; MoE experts, recurrent weights) keep
    Kronecker factors too, each row one token of its example (they were missing: K-FAC failed with a KeyError)."""
    torch.manual_seed(0)
    model, x = BareProduct(), torch.randn(3, 6, 5)
    cfg = CaptureConfig.from_options(k_in=3, k_out=2, curvature=True, loss_reduction="sum", seed=2)
    with GradientCapture(model, lambda batch: None, cfg) as cap:
        y = model(x)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
    a_cov, s_cov, count = cap.curvature()["P"]
    a = x.reshape(-1, 5).double() @ projection_matrix(2, "P", "in", 3, 5).double().T
    s = dy.reshape(-1, 4).double() @ projection_matrix(2, "P", "out", 2, 4).double().T
    assert count == 18
    np.testing.assert_allclose(a_cov, (a.T @ a / 18).numpy(), rtol=1e-6)
    np.testing.assert_allclose(s_cov, (s.T @ s / 18).numpy(), rtol=1e-6)
