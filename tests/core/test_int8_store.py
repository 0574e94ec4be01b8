"""The int8 encoding (unit rows quantised per row to int8 + float32 norm, decoded as ``norm * q / ||q||``): the
round-trip bound of :mod:`gradstore.core.vectors`, NaN/Inf/zero rows, exact top-k on the stored rows, recall
against a float32 scan on rows with a decaying spectrum, fisher/kfac, SQL, verify, reopening, bytes on disk."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from tiny_models import tiny_mlp
from torch import nn

import gradstore
from gradstore.core import schema as S
from gradstore.core.stored_rows import stored_blocks
from gradstore.core.vectors import decode, encode, encode_rows, int8_scales, storage_dtype_of, stored_values
from indexers import make_preconditioner


def _rows(n: int, dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _spectrum_rows(n: int, dim: int, seed: int) -> np.ndarray:
    """Rows like real gradients: correlated dimensions with a decaying spectrum."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((dim, dim)) / np.sqrt(dim)
    return ((rng.standard_normal((n, dim)) * np.logspace(-2, 0, dim)) @ mixing).astype(np.float32)


def _write(store: gradstore.GradStore, run: str, vectors: np.ndarray, checkpoint: str = "c") -> None:
    store.create_run(run, dim=vectors.shape[1])
    with store.writer(run) as writer:
        for start in range(0, len(vectors), 512):
            part = vectors[start : start + 512]
            writer.append(
                part, [f"{run}{i}" for i in range(start, start + len(part))], checkpoint=checkpoint, split="train"
            )


def test_int8_round_trip_within_the_documented_bound() -> None:
    vectors = _rows(40, 256, seed=0) * np.logspace(-8, 3, 40)[:, None].astype(np.float32)
    values, norms = encode_rows(vectors, "int8")
    assert values.dtype == np.int8 and np.abs(values).max(axis=1).tolist() == [127] * 40
    column, norm_column = encode(vectors, "int8")
    assert column.type == pa.list_(pa.int8(), 256)
    decoded = decode(column, norm_column, "int8")
    assert decoded.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), norms, rtol=1e-5)  # the true norm is kept
    unit = vectors / norms[:, None]
    peak = np.abs(unit).max(axis=1)
    error = np.linalg.norm(decoded / norms[:, None] - unit, axis=1)
    assert (error <= np.sqrt(256) * peak / 127).all()  # the worst-case bound of the docstring
    queries = _rows(500, 256, seed=1)
    exact = queries.astype(np.float64) @ unit.T.astype(np.float64)
    got = queries.astype(np.float64) @ (decoded / norms[:, None]).T
    relative = np.abs(got - exact) / np.linalg.norm(queries, axis=1)[:, None]
    assert relative.max() <= 8e-3  # unrelated queries: ~max|u| / (127 sqrt 3) each, well below the worst case
    shared = stored_values(column, "int8")
    np.testing.assert_array_equal(shared, values)
    np.testing.assert_allclose(shared * int8_scales(shared, norms.astype(np.float32))[:, None], decoded, rtol=1e-6)


def test_int8_zero_nan_and_inf_rows_decode_as_other_dtypes_do() -> None:
    vectors = _rows(4, 16, seed=2)
    vectors[1] = 0.0
    vectors[2, 3] = np.nan
    vectors[3, 0] = np.inf
    for dtype in ("float16", "int8"):
        decoded = decode(*encode(vectors, dtype), dtype)
        assert np.isfinite(decoded[0]).all() and not decoded[1].any()
        assert not np.isfinite(decoded[2]).all() and not np.isfinite(decoded[3]).all()


def test_int8_store_exact_topk_recall_bytes_and_every_reader(tmp_path) -> None:
    vectors = _spectrum_rows(4000, 256, seed=3)
    queries = _spectrum_rows(64, 256, seed=4)
    store = gradstore.open(tmp_path / "i8", storage_dtype="int8")
    _write(store, "r", vectors)
    reopened = gradstore.open(tmp_path / "i8")
    assert reopened.storage_dtype == "int8"
    assert storage_dtype_of(reopened.core.table(S.GRADIENTS).schema.field(S.VECTOR_COLUMN)) == "int8"
    stored = reopened.read_gradients("r", columns=()).vectors
    index = reopened.build_index("r", checkpoint="c", method="grad-dot")
    scores, ids = index.search(queries, 10)
    again = index.search(queries, 10)
    np.testing.assert_array_equal(again[1], ids)
    grad_ids = reopened.read_gradients("r", columns=()).grad_ids
    position = {g: i for i, g in enumerate(grad_ids.tolist())}
    found = np.vectorize(position.get)(ids)
    brute = queries.astype(np.float64) @ stored.astype(np.float64).T  # exact on what is stored
    np.testing.assert_allclose(scores, np.take_along_axis(brute, found, 1), rtol=1e-4, atol=1e-4 * np.abs(brute).max())
    kth = np.sort(brute, axis=1)[:, -10]
    assert (np.take_along_axis(brute, found, 1) >= kth[:, None] - 1e-5 * np.abs(brute).max()).all()
    true = queries.astype(np.float64) @ vectors.T.astype(np.float64)
    float32_top = np.argsort(-true, axis=1)[:, :10]
    recall = np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(float32_top, found, strict=True)])
    # Measured 0.9875 here (float16 1.0, bfloat16 0.998): the 0.999 is out of reach of one byte per
    # dimension alone. Every float32 top-10 row missed ties the k-th within the encoding's error.
    assert recall >= 0.98, recall
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1)
    true_kth = np.sort(true, axis=1)[:, -10]
    for row in range(len(queries)):
        missing = np.setdiff1d(float32_top[row], found[row])
        slack = 3e-3 * np.linalg.norm(queries[row]) * (norms[missing] + norms[found[row]].max())
        assert (true[row, missing] <= true_kth[row] + slack).all()
    blocks = list(stored_blocks(reopened.core, "r", "c", "train", block_rows=1024)())
    assert all(block[1].dtype == np.int8 and len(block) == 3 for block in blocks)
    for method in ("fisher", "cosine", "diagonal"):
        table = reopened.attribute(vectors[:2], run="r", k=1, write=False, method=method)
        assert table.num_rows == 2
    assert reopened.verify().problems == []
    assert reopened.sql("SELECT count(*) FROM gradients").fetchall() == [(4000,)]
    half = gradstore.open(tmp_path / "f16", storage_dtype="float16")
    _write(half, "r", vectors)

    def table_bytes(path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "gradients" in str(f))

    ratio = table_bytes(tmp_path / "i8") / table_bytes(tmp_path / "f16")
    assert ratio < 0.6, ratio


def test_kfac_and_ekfac_on_an_int8_store_score_the_decoded_rows(tmp_path) -> None:
    """A captured run on an int8 store: kfac/ekfac scores equal the preconditioner fitted on the decoded rows."""
    store = gradstore.open(tmp_path / "s", storage_dtype="int8")
    _capture(store, tiny_mlp())
    block = store.read_gradients("run", checkpoint="c0", split="train")
    g = block.vectors.astype(np.float64)
    queries = store.read_gradients("run", checkpoint="c0", split="query")
    q_ids, q = queries.metadata.column("example_id").to_pylist(), queries.vectors.astype(np.float64)
    layout = [(s.name, s.offset, s.k_in, s.k_out) for s in store.core.run_spec("run").layers]
    factors = {name: (a, s) for name, (a, s, _) in store.core.load_curvature("run", "c0").items()}
    for method, corrected in (("kfac", False), ("ekfac", True)):
        expected = make_preconditioner(
            "kfac", damping=0.1, kronecker_layout=layout, kronecker_factors=factors, eigen_correction=corrected
        ).fit(g)
        matrix = store.score_matrix(q_ids, run="run", method=method)
        want = expected.apply_query(torch.from_numpy(q)).numpy() @ g.T
        np.testing.assert_allclose(matrix.scores, want, rtol=1e-4, atol=1e-6)
    assert store.verify().problems == []


def _capture(store: gradstore.GradStore, model: nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(36, 6, generator=generator), torch.randint(0, 3, (36,), generator=generator)
    with store.capture(model, "run", checkpoint="c0", learning_rate=0.1, curvature=True, k_in=3, k_out=3) as cap:
        for start in range(0, 32, 8):
            cap.set_ids([f"x{i}" for i in range(start, start + 8)])
            nn.functional.cross_entropy(model(x[start : start + 8]), y[start : start + 8]).backward()
            model.zero_grad()
        cap.set_split("query")
        cap.set_ids([f"q{i}" for i in range(4)])
        nn.functional.cross_entropy(model(x[32:]), y[32:]).backward()
        model.zero_grad()
