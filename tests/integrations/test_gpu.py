"""CUDA: capture and exact search on a GPU give what torch.func, the CPU and numpy give.

Every test here is marked ``gpu`` and skipped without CUDA (CI never has a GPU; ``bench/gpu_check.sh`` runs
them). They need torch, numpy, transformers and hypothesis only, except the store test (skipped without LanceDB), so
they also run where the store's own dependencies are not installed. ``GRADSTORE_GPU_TEST_DEVICE=cpu`` runs the same
checks on the CPU, to check the tests themselves on a machine without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from brute_force import brute_force, integer_data
from exact_grads import gpt2_reference, linear_reference, padded_batch, rel_err, slot_matrix
from tiny_models import tiny_gpt2
from torch import nn

from indexers import ExactIndex, blocks_from_arrays
from ingest.capture import CaptureConfig, GradientCapture

DEVICE = torch.device(os.environ.get("GRADSTORE_GPU_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
transformers = pytest.importorskip("transformers")


def on_device(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in batch)


def captured(model: nn.Module, batch: tuple[torch.Tensor, ...], config: CaptureConfig) -> tuple[GradientCapture, list]:
    """One captured forward + backward of ``model`` on ``(input_ids, attention_mask, labels)``."""
    ids, mask, labels = batch
    out: list = []
    with GradientCapture(model, out.append, config) as cap:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return cap, out


def test_exact_rows_on_the_device_match_torch_func() -> None:
    """Every layer's per-example gradient (projection=None) equals torch.func's on the same device, and the
    rows arrive on the host (the delivery's asynchronous device-to-host copy)."""
    model = tiny_gpt2(attention="eager").to(DEVICE)
    batch = on_device(padded_batch())
    cap, out = captured(model, batch, CaptureConfig.from_options(projection=None, loss_reduction="token_mean"))
    rows = out[0].grads
    assert rows.device.type == "cpu" and torch.isfinite(rows).all()
    reference = {name: g.cpu() for name, g in gpt2_reference(model, *batch).items()}
    for slot in cap.spec.layers:
        if slot.name in ("lm_head", "transformer.wte"):
            continue  # tied weights, checked below
        expected = linear_reference(reference, slot.name, transpose=slot.kind in ("conv1d", "embedding"))
        assert rel_err(slot_matrix(cap.spec, rows, slot.name), expected) < 1e-5, slot.name
    tied = slot_matrix(cap.spec, rows, "lm_head") + slot_matrix(cap.spec, rows, "transformer.wte").transpose(1, 2)
    assert rel_err(tied, reference["transformer.wte.weight"]) < 1e-5


def test_projected_rows_and_curvature_on_the_device_equal_the_cpu_capture() -> None:
    """The default factorized projection (matrices drawn on the CPU, then moved) and the Kronecker-factor
    statistics give the CPU capture's values."""
    config = CaptureConfig.from_options(loss_reduction="token_mean", curvature=True, seed=3)
    results = []
    for device in (torch.device("cpu"), DEVICE):
        model = tiny_gpt2(attention="eager").to(device)
        cap, out = captured(model, tuple(t.to(device) for t in padded_batch()), config)
        results.append((out[0], cap.curvature()))
    (cpu_rows, cpu_curvature), (rows, curvature) = results
    assert rows.example_ids == cpu_rows.example_ids
    assert rel_err(rows.grads, cpu_rows.grads) < 1e-5
    assert curvature.keys() == cpu_curvature.keys()
    for layer, (a, s, n) in curvature.items():
        a_cpu, s_cpu, n_cpu = cpu_curvature[layer]
        assert n == n_cpu
        np.testing.assert_allclose(a, a_cpu, rtol=1e-5, atol=1e-12 * np.abs(a_cpu).max(), err_msg=layer)
        np.testing.assert_allclose(s, s_cpu, rtol=1e-5, atol=1e-12 * np.abs(s_cpu).max(), err_msg=layer)


def train(model: nn.Module, steps: int, capture: bool) -> list:
    """``steps`` AdamW steps of two micro-batches each (gradient accumulation), dropout drawn from one seed."""
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask, labels = on_device(padded_batch())
    out: list = []

    def loop() -> None:
        for _ in range(steps):
            for half in (slice(0, 2), slice(2, 4)):
                model(input_ids=ids[half], attention_mask=mask[half], labels=labels[half]).loss.backward()
            opt.step()
            opt.zero_grad()

    if capture:
        config = CaptureConfig.from_options(loss_reduction="token_mean", include=r"transformer\.h\.")
        with GradientCapture(model, out.append, config, optimizer=opt):
            loop()
    else:
        loop()
    return out


def test_fused_capture_on_the_device_gives_the_hooks_rows() -> None:
    """``fused=True`` (projections inside the layers' GEMMs) gives the hooks' rows on the device, and the same
    parameter gradients bit for bit."""
    batch = on_device(padded_batch())
    results = {}
    for fused in (False, True):
        model = tiny_gpt2(attention="eager").to(DEVICE)
        config = CaptureConfig.from_options(loss_reduction="token_mean", fused=fused)
        _, out = captured(model, batch, config)
        results[fused] = (out[0].grads, [p.grad for p in model.parameters()])
    assert rel_err(results[True][0], results[False][0]) < 1e-6
    assert all(torch.equal(p, q) for p, q in zip(results[False][1], results[True][1]))


def test_capture_does_not_change_training_on_the_device() -> None:
    """Weights after steps with AdamW, dropout and accumulation are bit-identical with and without capture
    (where training on this device is bit-reproducible at all), and steps are counted."""
    runs = [tiny_gpt2(dropout=0.1).to(DEVICE) for _ in range(3)]
    train(runs[0], 3, capture=False)
    train(runs[1], 3, capture=False)
    if not all(torch.equal(p, q) for p, q in zip(runs[0].parameters(), runs[1].parameters())):
        pytest.skip(f"training on {DEVICE} is not bit-reproducible here, so bit-identity cannot be checked")
    out = train(runs[2], 3, capture=True)
    for (name, p), q in zip(runs[0].named_parameters(), runs[2].parameters()):
        assert torch.equal(p, q), name
    assert [batch.step for batch in out] == [0, 0, 1, 1, 2, 2]
    assert all(torch.isfinite(batch.grads).all() for batch in out)


def test_grad_scaler_scale_is_undone_on_the_device() -> None:
    model, x = nn.Linear(3, 2).to(DEVICE), torch.randn(2, 3, device=DEVICE)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=1024.0)
    rows = []
    for scaled in (False, True):
        out: list = []
        with GradientCapture(model, out.append, CaptureConfig(), grad_scaler=scaler if scaled else None):
            loss = model(x).sum()
            (scaler.scale(loss) if scaled else loss).backward()
        rows.append(out[0].grads)
    assert torch.allclose(rows[0], rows[1], rtol=1e-6)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("block_rows", [7, 1000])
def test_exact_index_on_the_device_matches_brute_force(block_rows: int, largest: bool) -> None:
    """Integer data (float32 sums exact, ties frequent): ids and scores equal numpy's bit for bit, streamed,
    prepared, and from float16 blocks."""
    queries, vectors, ids = integer_data(0, 300, 24, 5)
    index = ExactIndex(device=DEVICE, block_rows=block_rows)
    if DEVICE.type == "cuda":
        assert index.kernel == "float32"  # the bfloat16 kernel is a CPU kernel
    expected_scores, expected_ids = brute_force(queries, vectors, ids, 10, largest)
    sources = {
        "streamed": blocks_from_arrays(ids, vectors, block_rows=50),
        "prepared": index.prepare(ids, torch.from_numpy(vectors).to(DEVICE)),
        "float16 blocks": blocks_from_arrays(ids, vectors.astype(np.float16), block_rows=50),
    }
    for name, source in sources.items():
        scores, found = index.search(queries, source, 10, largest=largest)
        np.testing.assert_array_equal(found, expected_ids, err_msg=name)
        np.testing.assert_array_equal(scores, expected_scores.astype(np.float32), err_msg=name)


def store_with_rows(path, rows: int, dim: int, seed: int):
    """A store at ``path`` with ``rows`` random training rows of run ``r``, and 4 random queries."""
    pytest.importorskip("lancedb")
    import gradstore

    rng = np.random.default_rng(seed)
    vectors, queries = rng.standard_normal((rows, dim)).astype(np.float32), rng.standard_normal((4, dim))
    store = gradstore.open(path)
    store.create_run("r", dim=dim)
    with store.writer("r") as writer:
        writer.append(vectors, [f"e{i}" for i in range(rows)], checkpoint="c", split="train")
    return store, queries.astype(np.float32)


def test_store_attribute_searches_on_the_device(tmp_path) -> None:
    """A store's exact search prepares its row cache on the device (ExactIndex's default where torch sees a
    GPU) and returns numpy's top-k of the stored rows."""
    store, queries = store_with_rows(tmp_path / "store", 500, 32, seed=0)
    blocks = list(store.iter_gradients("r"))
    grad_ids, stored = np.concatenate([b.grad_ids for b in blocks]), np.concatenate([b.vectors for b in blocks])
    result = store.attribute(queries, run="r", k=5, write=False, method="grad-dot")
    _, expected_ids = brute_force(queries, stored, grad_ids, 5)
    np.testing.assert_array_equal(result.column("grad_id").to_numpy().reshape(4, 5), expected_ids)
    prepared = store.build_index("r", method="grad-dot").cached_rows()
    block = next(iter(prepared))
    rows = block[1] if isinstance(block, tuple) else block.exact
    assert rows.device.type == DEVICE.type


def test_rows_larger_than_the_gpu_allows_are_streamed_to_it(tmp_path, monkeypatch) -> None:
    """Where the prepared rows exceed the device's share of free memory, the store streams them to the device
    block by block instead of caching them there, with the same result."""
    if DEVICE.type != "cuda":
        pytest.skip("the device's free memory only limits the row cache on CUDA")
    store, queries = store_with_rows(tmp_path / "store", 300, 16, seed=1)
    cached = store.attribute(queries, run="r", k=4, write=False, method="grad-dot")
    assert store.build_index("r", method="grad-dot").cached_rows() is not None
    store.core.row_cache.clear()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1024, 80 << 30))
    streamed = store.attribute(queries, run="r", k=4, write=False, method="grad-dot")
    assert store.build_index("r", method="grad-dot").cached_rows() is None
    assert streamed.column("grad_id").to_pylist() == cached.column("grad_id").to_pylist()
