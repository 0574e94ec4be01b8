"""The int8 encoding (unit rows in blocks of 32 entries, each block int8 values times one power-of-two exponent, +
float32 norm, decoded as ``norm * v / ||v||``): the round-trip bound of :mod:`gradstore.core.vectors`, small
blocks keeping their own precision, NaN/Inf/zero rows, tables of the per-row format before the blocks, exact top-k
on the stored rows, recall against a float32 scan on rows with a decaying spectrum, fisher/kfac, SQL, verify,
reopening, bytes on disk."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from tiny_models import tiny_mlp
from torch import nn

import gradstore
from gradstore.core import schema as S
from gradstore.core.stored_rows import stored_blocks
from gradstore.core.vectors import (
    decode,
    encode,
    encode_rows,
    int8_scales,
    int8_unit_rows,
    storage_dtype_of,
    stored_unit_rows,
)
from gradstore.errors import StoreCorruptError
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
    values, norms, exponents = encode_rows(vectors, "int8")
    assert values.dtype == np.int8 and exponents.dtype == np.int8 and exponents.shape == (40, 8)
    peaks = np.abs(values.astype(np.int32)).reshape(40, 8, 32).max(axis=2)
    assert ((peaks >= 64) & (peaks <= 127)).all()  # each block's scale within 2x of its peak's
    encoded = encode(vectors, "int8")
    assert encoded[S.VECTOR_COLUMN].type == pa.list_(pa.int8(), 256)
    assert encoded[S.EXPONENT_COLUMN].type == pa.list_(pa.int8(), 8)
    decoded = decode(encoded, "int8")
    assert decoded.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), norms, rtol=1e-5)  # the true norm is kept
    unit = vectors / norms[:, None]
    stored_rows, unit_norms = int8_unit_rows(values, exponents)
    stored = stored_rows.double().numpy()
    np.testing.assert_allclose(unit_norms, np.linalg.norm(stored, axis=1), rtol=1e-6)
    half, _ = int8_unit_rows(values, exponents, torch.bfloat16)
    assert torch.equal(half.float(), stored_rows)  # exact in bf16
    block_peaks = np.abs(unit).reshape(40, 8, 32).max(axis=2)
    assert (np.abs(stored - unit).reshape(40, 8, 32) <= block_peaks[:, :, None] / 127 + 1e-12).all()
    error = np.linalg.norm(decoded / norms[:, None] - unit, axis=1)
    assert (error <= 2 * np.sqrt(256) * np.abs(unit).max(axis=1) / 127).all()  # the worst case, renormalised
    queries = _rows(500, 256, seed=1)
    exact = queries.astype(np.float64) @ unit.T.astype(np.float64)
    got = queries.astype(np.float64) @ (decoded / norms[:, None]).T
    relative = np.abs(got - exact) / np.linalg.norm(queries, axis=1)[:, None]
    assert relative.max() <= 8e-3  # unrelated queries: the errors mostly cancel
    shared, shared_norms = stored_unit_rows(encoded, "int8")
    assert torch.equal(shared, stored_rows) and np.array_equal(shared_norms, unit_norms)
    scales = int8_scales(shared.numpy(), norms.astype(np.float32), shared_norms)
    np.testing.assert_allclose(shared.numpy() * scales[:, None], decoded)
    np.testing.assert_allclose(int8_scales(shared.numpy(), norms.astype(np.float32)), scales, rtol=1e-6)


def test_a_small_block_keeps_its_own_precision() -> None:
    """One row's entries 1,000x apart in two halves (a small layer beside a large one): each half is rounded at its
    own scale, where one scale per row rounded the small half to nothing."""
    vectors = _rows(8, 128, seed=5)
    vectors[:, 64:] *= 1e-3
    decoded = decode(encode(vectors, "int8"), "int8")
    small = np.linalg.norm(decoded[:, 64:] - vectors[:, 64:], axis=1) / np.linalg.norm(vectors[:, 64:], axis=1)
    assert small.max() < 0.02, small
    tiny = vectors[:2].copy()
    tiny[:, 96:] *= 1e-35  # blocks below float32's normal range, relative to the row
    back = decode(encode(tiny, "int8"), "int8")
    assert np.isfinite(back).all() and np.abs(back[:, 96:]).max() <= 2 * np.abs(tiny[:, 96:]).max()
    for part in (slice(0, 64), slice(64, 96)):  # the other blocks within their own bound
        np.testing.assert_allclose(back[:, part], tiny[:, part], atol=np.abs(tiny[:, part]).max() / 60)
    per_row = decode(encode(vectors, "int8", blocks=False), "int8")
    lost = np.linalg.norm(per_row[:, 64:] - vectors[:, 64:], axis=1) / np.linalg.norm(vectors[:, 64:], axis=1)
    assert lost.min() > 0.5, lost  # the per-row format's error there, for contrast


def test_an_int8_layout_contradicting_its_tag_is_refused_not_misread() -> None:
    """Rows tagged as blocks without their exponents (or per-row rows beside exponents) would decode at the wrong
    scales: a StoreCorruptError, never wrong vectors."""
    vectors = _rows(4, 64, seed=7)
    blocked = pa.table(encode(vectors, "int8"), schema=pa.schema(list(S.gradients_schema(64, "int8"))[-3:]))
    assert blocked.schema.field(S.VECTOR_COLUMN).metadata[b"gradstore.encoding"] == b"int8-blocks"
    np.testing.assert_allclose(decode(blocked, "int8"), decode(encode(vectors, "int8"), "int8"))
    with pytest.raises(StoreCorruptError, match="contradicts its encoding"):
        decode(blocked.drop_columns([S.EXPONENT_COLUMN]), "int8")
    per_row = S.gradients_schema(64, "int8", int8_blocks=False)
    tagged = pa.table(encode(vectors, "int8", blocks=False), schema=pa.schema(list(per_row)[-2:]))
    with pytest.raises(StoreCorruptError, match="contradicts its encoding"):
        decode(tagged.append_column(blocked.schema.field(S.EXPONENT_COLUMN), blocked[S.EXPONENT_COLUMN]), "int8")


def test_an_int8_table_of_the_per_row_format_keeps_reading_and_appending(tmp_path, monkeypatch) -> None:
    """A store written before the block format (no ``grad_exponents`` column) reads as it was written and takes
    appends in its own format."""
    vectors = _rows(300, 64, seed=6)
    blocked = S.gradients_schema

    def per_row_schema(dim: int, dtype: str, **_: object) -> pa.Schema:
        return blocked(dim, dtype, int8_blocks=False)

    monkeypatch.setattr(S, "gradients_schema", per_row_schema)
    store = gradstore.open(tmp_path / "old", storage_dtype="int8")
    _write(store, "r", vectors[:200])
    monkeypatch.undo()
    old = gradstore.open(tmp_path / "old")
    assert S.EXPONENT_COLUMN not in old.core.table(S.GRADIENTS).schema.names
    with old.writer("r") as writer:
        writer.append(vectors[200:], [f"late{i}" for i in range(100)], checkpoint="c", split="train")
    read = old.read_gradients("r", columns=()).vectors
    expected = decode(encode(vectors, "int8", blocks=False), "int8")
    np.testing.assert_array_equal(np.sort(read, axis=0), np.sort(expected, axis=0))
    scores, _ = old.build_index("r", checkpoint="c", method="grad-dot").search(vectors[:3], 1)
    np.testing.assert_allclose(scores[:, 0], np.max(vectors[:3].astype(np.float64) @ expected.T, axis=1), rtol=1e-4)
    assert old.verify().problems == []


def test_int8_zero_nan_and_inf_rows_decode_as_other_dtypes_do() -> None:
    vectors = _rows(4, 16, seed=2)
    vectors[1] = 0.0
    vectors[2, 3] = np.nan
    vectors[3, 0] = np.inf
    for dtype in ("float16", "int8"):
        decoded = decode(encode(vectors, dtype), dtype)
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
    assert all(block[1].dtype == torch.bfloat16 and len(block) == 3 for block in blocks)  # exact unit rows
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


@pytest.mark.parametrize("storage_dtype", ["int8", "float16", "float32"])
def test_read_metadata_holds_what_was_asked_for_and_no_vector_column(tmp_path, storage_dtype) -> None:
    """An int8 table's blocks carried its raw int8 ``grad`` column among their metadata (the metadata was the
    scanned columns less the last two, and int8 tables have three vector columns); asking for ``grad_norm`` (a
    column of every gradient table) was a Lance "Duplicate column name" error."""
    store = gradstore.open(tmp_path / "store", storage_dtype=storage_dtype)
    vectors = _rows(70, 64, seed=3)
    _write(store, "r", vectors)
    assert store.read_gradients("r").metadata.column_names == ["example_id"]
    blocks = list(store.iter_gradients("r", columns=("example_id", "step"), block_rows=32))
    assert [b.metadata.column_names for b in blocks] == [["example_id", "step"]] * 3
    block = store.read_gradients("r", columns=("example_id", "grad_norm", "example_id"))
    assert block.metadata.column_names == ["example_id", "grad_norm"]
    order = [int(e[1:]) for e in block.metadata.column("example_id").to_pylist()]
    np.testing.assert_allclose(
        block.metadata.column("grad_norm").to_numpy(), np.linalg.norm(vectors[order], axis=1), rtol=1e-6
    )


def test_decoded_int8_entries_are_within_the_documented_renormalised_bound() -> None:
    """The per-entry bound ``max|u_b| / 127`` is the stored unit row's; the decoded row is divided by ``||v||`` too,
    which adds ``|u_i| ||v - u||`` (over ``||v||``): the bound gradstore/core/vectors.py gives for it holds, and the
    stored one alone does not (rows whose second half is 100x smaller)."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((500, 512)).astype(np.float32)
    vectors[:, 256:] *= 0.01
    values, norms, exponents = encode_rows(vectors, "int8")
    stored_rows, unit_norms = int8_unit_rows(values, exponents)
    stored = stored_rows.double().numpy()
    unit = vectors.astype(np.float64) / np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    stored_bound = np.repeat(np.abs(unit).reshape(500, 16, 32).max(axis=2), 32, axis=1) / 127
    assert (np.abs(stored - unit) <= stored_bound + 1e-12).all()
    decoded = decode(encode(vectors, "int8"), "int8").astype(np.float64) / norms[:, None]
    error = np.linalg.norm(stored - unit, axis=1, keepdims=True)
    bound = (stored_bound + np.abs(unit) * error) / unit_norms[:, None]
    assert (np.abs(decoded - unit) <= bound * (1 + 1e-6) + 1e-12).all()
    assert (np.abs(decoded - unit) / stored_bound).max() > 1.05  # beyond the stored rows' bound
