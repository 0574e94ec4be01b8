"""A checkpoint's Kronecker factors add up over its captures (``curvature=True``).

Two captures of one checkpoint (halves of its batches, of training and of true-Fisher rows) save the factors of one
capture over all the batches, and ``kfac``/``ekfac`` score alike; rows added without ``curvature=True`` leave the
factors stale, warned (``StaleCurvatureWarning``) at that capture and when ``kfac``/``ekfac`` fit them; a resumed
capture (``resume=True``) that replays committed rows counts none of them twice.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradstore
from gradstore.core.curvature_files import merged
from gradstore.errors import StaleCurvatureWarning
from ingest.curvature import CURVATURE_SPLITS, TRUE_FISHER_SPLIT

RUN, CHECKPOINT = "r", "ck"
BATCHES, BATCH, TOKENS = 6, 5, 3
OPTIONS = {"checkpoint": CHECKPOINT, "k_in": 4, "k_out": 3, "loss_reduction": "sum"}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * BATCH + 2, TOKENS, 6, generator=generator)
    x[BATCHES * BATCH // 2 :] += 2.0  # the halves differ: factors of one half are not those of both
    return x, torch.randint(0, 3, (BATCHES * BATCH + 2, TOKENS), generator=generator)


def _batches(model, cap, x, y, batches, *, true_fisher=True) -> None:
    """Training rows of ``batches`` (observed labels) and, apart, true-Fisher rows of the same examples."""
    for b in batches:
        rows = slice(b * BATCH, (b + 1) * BATCH)
        ids = [f"x{i:02d}" for i in range(rows.start, rows.stop)]
        cap.set_split("train")
        cap.set_ids(ids)
        F.cross_entropy(model(x[rows]).reshape(-1, 3), y[rows].reshape(-1), reduction="sum").backward()
        if true_fisher:
            cap.set_split(TRUE_FISHER_SPLIT)
            cap.set_ids(ids)
            logits = model(x[rows])
            labels = gradstore.sample_labels(logits, generator=torch.Generator().manual_seed(b))
            F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1), reduction="sum").backward()
        model.zero_grad()


def _queries(store, model, x, y) -> None:
    with store.capture(model, RUN, split="query", **OPTIONS) as cap:
        cap.set_ids(["q0", "q1"])
        F.cross_entropy(model(x[-2:]).reshape(-1, 3), y[-2:].reshape(-1), reduction="sum").backward()
        model.zero_grad()


def _store(path, parts, *, true_fisher=True) -> gradstore.GradStore:
    """A float32 store whose checkpoint is captured with curvature=True in one capture per part of the batches."""
    store = gradstore.open(path, storage_dtype="float32")
    model, (x, y) = _model(), _data()
    for part in parts:
        with store.capture(model, RUN, curvature=True, **OPTIONS) as cap:
            _batches(model, cap, x, y, part, true_fisher=true_fisher)
    _queries(store, model, x, y)
    return store


def _assert_same_factors(store, reference, splits=CURVATURE_SPLITS, tokens=BATCHES * BATCH * TOKENS) -> None:
    for split in splits:
        got = store.core.load_curvature(RUN, CHECKPOINT, split)
        want = reference.core.load_curvature(RUN, CHECKPOINT, split)
        assert sorted(got) == sorted(want) == ["0", "2"]
        for layer, (a, s, count) in want.items():
            assert got[layer][2] == count == tokens
            np.testing.assert_allclose(got[layer][0], a, rtol=1e-6, atol=1e-7 * np.abs(a).max())
            np.testing.assert_allclose(got[layer][1], s, rtol=1e-6, atol=1e-7 * np.abs(s).max())


def _scores(store, method):
    matrix = store.score_matrix(run=RUN, queries=["q0", "q1"], method=method)
    order = np.argsort(matrix.example_ids)
    return np.asarray(matrix.example_ids)[order], matrix.scores[:, order]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return _store(tmp_path_factory.mktemp("whole") / "store", [range(BATCHES)])


def test_two_captures_of_a_checkpoint_save_the_factors_of_one_capture_over_all_its_batches(tmp_path, whole):
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        halves = _store(tmp_path / "store", [range(BATCHES // 2), range(BATCHES // 2, BATCHES)])
        _assert_same_factors(halves, whole)
        first = _store(tmp_path / "first", [range(BATCHES // 2)])
        a_first = first.core.load_curvature(RUN, CHECKPOINT)["0"][0]
        assert not np.allclose(a_first, whole.core.load_curvature(RUN, CHECKPOINT)["0"][0], rtol=0.05)
        for method in ("kfac", "ekfac"):
            (ids, scores), (want_ids, want) = _scores(halves, method), _scores(whole, method)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert halves.count(where=f"checkpoint = '{CHECKPOINT}' AND split = 'train'") == BATCHES * BATCH


def test_true_fisher_rows_captured_on_their_own_keep_their_factors(tmp_path):
    """A capture of a checkpoint's true-Fisher rows alone (no training rows) saves their factors too."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model, (x, y) = _model(), _data()
    with store.capture(model, RUN, curvature=True, **OPTIONS) as cap:
        _batches(model, cap, x, y, range(2), true_fisher=False)
    with store.capture(model, RUN, curvature=True, split=TRUE_FISHER_SPLIT, **OPTIONS) as cap:
        for b in range(2):
            cap.set_ids([f"x{i:02d}" for i in range(b * BATCH, (b + 1) * BATCH)])
            logits = model(x[b * BATCH : (b + 1) * BATCH])
            F.cross_entropy(logits.reshape(-1, 3), gradstore.sample_labels(logits).reshape(-1)).backward()
            model.zero_grad()
    counts = {n for _, _, n in store.core.load_curvature(RUN, CHECKPOINT, TRUE_FISHER_SPLIT).values()}
    assert counts == {2 * BATCH * TOKENS}


def test_merged_adds_sums_not_means_in_the_wider_dtype():
    rng = np.random.default_rng(0)
    a1, a2 = rng.standard_normal((2, 4, 3))
    s1, s2 = rng.standard_normal((2, 2, 5))
    saved = {"l": ((a1.T @ a1 / 4).astype(np.float32), (s1.T @ s1 / 2).astype(np.float32), 4), "only": (a1, s1, 1)}
    added = {"l": (a2.T @ a2 / 4, s2.T @ s2 / 2, 2), "new": (a2, s2, 3)}
    out = merged(saved, added)
    a, s, n = out["l"]
    assert n == 6 and a.dtype == np.float64
    np.testing.assert_allclose(a, (a1.T @ a1 + a2.T @ a2 / 2) / 6, rtol=1e-6)
    np.testing.assert_allclose(s, (s1.T @ s1 * 2 + s2.T @ s2) / 6, rtol=1e-6)
    assert out["only"][2] == 1 and out["new"][2] == 3


# ------------------------------------------------------------------------------------- rows without curvature


def test_training_rows_added_without_curvature_warn_at_the_capture_and_at_the_fit(tmp_path):
    """(Without true-Fisher rows: kfac/ekfac fit the training rows' factors.)"""
    store = _store(tmp_path / "store", [range(2)], true_fisher=False)
    model, (x, y) = _model(), _data()
    added = "train rows were added without curvature=True.*saved when it held 10 train rows.* its 20 train rows"
    with pytest.warns(StaleCurvatureWarning, match=added), store.capture(model, RUN, **OPTIONS) as cap:
        _batches(model, cap, x, y, range(2, 4), true_fisher=False)  # curvature=False: its rows have no factors
    assert store.core.curvature.read(RUN, CHECKPOINT).stale
    for method in ("kfac", "ekfac"):
        with pytest.warns(StaleCurvatureWarning, match="kfac/ekfac score every row with them as they are"):
            store.score_matrix(run=RUN, queries=["q0"], method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        _queries(store, model, x, y)  # query rows describe no curvature: nothing to warn
    with store.capture(model, RUN, curvature=True, **OPTIONS) as cap:  # later factors add up, stale they stay
        _batches(model, cap, x, y, range(4, 6), true_fisher=False)
    assert store.core.curvature.read(RUN, CHECKPOINT).stale
    with pytest.warns(StaleCurvatureWarning):
        store.core.load_curvature(RUN, CHECKPOINT)
    store.core.curvature.remove(RUN, CHECKPOINT)  # the way out: factors estimated from every row
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        store.score_matrix(run=RUN, queries=["q0"], method="kfac")


def test_true_fisher_rows_added_without_curvature_warn_and_leave_the_training_factors_as_they_are(tmp_path):
    store = _store(tmp_path / "store", [range(2)])
    model, (x, _) = _model(), _data()
    added = "split 'true-fisher': true-fisher rows were added.*saved when it held 10 true-fisher rows"
    capture = store.capture(model, RUN, split=TRUE_FISHER_SPLIT, **OPTIONS)
    with pytest.warns(StaleCurvatureWarning, match=added), capture as cap:
        cap.set_ids(["x20", "x21"])
        logits = model(x[20:22])
        F.cross_entropy(logits.reshape(-1, 3), gradstore.sample_labels(logits).reshape(-1)).backward()
        model.zero_grad()
    assert store.core.curvature.read(RUN, CHECKPOINT, TRUE_FISHER_SPLIT).stale
    assert not store.core.curvature.read(RUN, CHECKPOINT).stale  # its rows did not change
    with pytest.warns(StaleCurvatureWarning, match="split 'true-fisher'"):
        store.score_matrix(run=RUN, queries=["q0"], method="kfac")  # the true-Fisher factors it fits


def test_rows_appended_by_hand_are_caught_when_the_factors_are_loaded(tmp_path):
    store = _store(tmp_path / "store", [range(2)])
    dim = store.core.run_dim(RUN)
    with store.writer(RUN) as writer:
        writer.append(np.ones((3, dim), np.float32), ["h0", "h1", "h2"], checkpoint=CHECKPOINT, split="train")
    with pytest.warns(StaleCurvatureWarning, match="saved when it held 10 train rows, it holds 13 now"):
        store.core.load_curvature(RUN, CHECKPOINT)


# ------------------------------------------------------------------------------------------------- resume


def test_a_checkpoint_pass_resumed_after_a_crash_counts_no_row_twice(tmp_path, whole):
    """A pass stopped by an error after two batches (their rows and factors saved), restarted from its first batch
    with resume=True: it skips the committed rows and saves the factors of all of them, once."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model, (x, y) = _model(), _data()
    with pytest.raises(RuntimeError, match="crash"), store.capture(model, RUN, curvature=True, **OPTIONS) as cap:
        _batches(model, cap, x, y, range(2))
        cap.flush()
        raise RuntimeError("crash")
    assert {n for _, _, n in store.core.load_curvature(RUN, CHECKPOINT).values()} == {2 * BATCH * TOKENS}
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        with store.capture(model, RUN, curvature=True, resume=True, **OPTIONS) as cap:
            _batches(model, cap, x, y, range(BATCHES))
        assert cap.rows_skipped == 2 * 2 * BATCH  # training and true-Fisher rows of the first two batches
        _queries(store, model, x, y)
        _assert_same_factors(store, whole)
        for method in ("kfac", "ekfac"):
            (ids, scores), (want_ids, want) = _scores(store, method), _scores(whole, method)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_a_resumed_capture_that_replays_nothing_adds_its_factors(tmp_path, whole):
    """resume=True over batches none of whose rows are committed is an append: the factors add up."""
    store = _store(tmp_path / "store", [range(BATCHES // 2)])
    model, (x, y) = _model(), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        with store.capture(model, RUN, curvature=True, resume=True, **OPTIONS) as cap:
            _batches(model, cap, x, y, range(BATCHES // 2, BATCHES))
        assert cap.rows_skipped == 0
        _assert_same_factors(store, whole)


def _steps(model, optimizer, cap, x, y, first, last) -> None:
    """Training steps ``first`` to ``last - 1``, one batch each."""
    cap.set_step(first)
    for step in range(first, last):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        cap.set_ids([f"x{i:02d}" for i in range(rows.start, rows.stop)])
        F.cross_entropy(model(x[rows]).reshape(-1, 3), y[rows].reshape(-1), reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_training_job_resumed_after_a_crash_lost_its_factors_counts_every_step_once(tmp_path):
    """Steps 0-1 captured with their factors, steps 2-3 committed by a job killed before it saved its factors (rows
    written by hand here), the job resumed from step 2: the replay re-ran exactly the rows without factors, so its
    factors are added: those of one capture of steps 0-5."""
    reference = gradstore.open(tmp_path / "reference", storage_dtype="float32")
    model, (x, y) = _model(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with reference.capture(model, RUN, optimizer=optimizer, curvature=True, **OPTIONS) as cap:
        _steps(model, optimizer, cap, x, y, 0, 6)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model, (x, y) = _model(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with store.capture(model, RUN, optimizer=optimizer, curvature=True, **OPTIONS) as cap:
        _steps(model, optimizer, cap, x, y, 0, 2)
    with store.writer(RUN) as writer:  # the killed job's committed rows (their values do not matter here)
        for step in (2, 3):
            ids = [f"x{i:02d}" for i in range(step * BATCH, (step + 1) * BATCH)]
            vectors = np.ones((BATCH, store.core.run_dim(RUN)), np.float32)
            writer.append(vectors, ids, checkpoint=CHECKPOINT, step=step, split="train")
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        with store.capture(model, RUN, optimizer=optimizer, curvature=True, resume=True, **OPTIONS) as cap:
            _steps(model, optimizer, cap, x, y, 2, 6)
        assert cap.rows_skipped == 2 * BATCH
        _assert_same_factors(store, reference, splits=["train"], tokens=6 * BATCH * TOKENS)
    assert not store.core.curvature.read(RUN, CHECKPOINT).stale


def test_a_training_job_resumed_mid_checkpoint_warns_that_earlier_rows_have_no_factors(tmp_path):
    """Steps 0-3 captured with their factors, the job resumed from step 2 (steps 2-3 replayed): adding its factors
    would count steps 2-3 twice, replacing leaves steps 0-1 out; either misdescribes 10 rows: stale, warned."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model, (x, y) = _model(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with store.capture(model, RUN, optimizer=optimizer, curvature=True, **OPTIONS) as cap:
        _steps(model, optimizer, cap, x, y, 0, 4)
    replayed = "replayed 10 of the 20 train rows committed before it, 0 of them without saved factors.*in place"
    resumed = store.capture(model, RUN, optimizer=optimizer, curvature=True, resume=True, **OPTIONS)
    with pytest.warns(StaleCurvatureWarning, match=replayed), resumed as cap:
        _steps(model, optimizer, cap, x, y, 2, 6)
    saved = store.core.curvature.read(RUN, CHECKPOINT)
    assert saved.stale and saved.tokens == 4 * BATCH * TOKENS  # steps 2-5, each once
    assert store.count(where="split = 'train'") == 6 * BATCH
    _queries(store, model, x, y)
    with pytest.warns(StaleCurvatureWarning, match="describe only part of its 30 train rows"):
        store.score_matrix(run=RUN, queries=["q0"], method="kfac")
