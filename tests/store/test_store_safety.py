"""A store opened from someone else runs nothing it names, and no name reaches outside the store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lance
import numpy as np
import pytest
import torch
from torch import nn

import gradstore


def _small_store(path: Path) -> gradstore.GradStore:
    store = gradstore.open(path)
    store.create_run("r", dim=4)
    rng = np.random.default_rng(0)
    with store.writer("r") as writer:
        writer.append(rng.normal(size=(6, 4)), [f"e{i}" for i in range(6)], split="train", checkpoint="train")
        writer.append(rng.normal(size=(2, 4)), ["q0", "q1"], split="query", checkpoint="train")
    return store


def _plant_embedding_function(store_root: Path, table: str, marker: Path) -> None:
    """Give ``table`` an ``embedding_functions`` entry: LanceDB's ``huggingface`` function loading a model
    directory inside the store with ``trust_remote_code``, whose code creates ``marker`` when imported."""
    model = store_root / "planted_model"
    model.mkdir(exist_ok=True)
    (model / "modeling_planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel\n"
        "class PlantedModel(PreTrainedModel):\n    config_class = PretrainedConfig\n"
    )
    (model / "config.json").write_text(
        json.dumps({"model_type": "bert", "auto_map": {"AutoModel": "modeling_planted.PlantedModel"}})
    )
    (model / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    dataset = lance.dataset(str(store_root / f"{table}.lance"))
    metadata = {k.decode(): v.decode() for k, v in (dataset.schema.metadata or {}).items()}
    metadata["embedding_functions"] = json.dumps(
        [
            {
                "name": "huggingface",
                "source_column": "query_id",
                "vector_column": "method",
                "model": {"name": str(model), "trust_remote_code": True},
            }
        ]
    )
    dataset.update_schema_metadata(metadata, replace=True)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # where transformers would copy remote code
    return tmp_path / "store", tmp_path / "MARKER"


def test_a_planted_embedding_function_is_never_run_by_a_fresh_open(planted):
    root, marker = planted
    _small_store(root)
    _plant_embedding_function(root, "scores", marker)
    store = gradstore.open(root)
    with pytest.raises(gradstore.StoreCorruptError, match="embedding_functions"):
        store.attribute(run="r", k=2, method="grad-dot")
    assert not marker.exists()
    # what does not touch the planted table still works
    assert store.read_gradients("r").vectors.shape == (8, 4)


def test_a_planted_embedding_function_is_never_run_by_an_open_store(planted):
    """Metadata planted after the table was opened: writes go through Lance, which interprets none."""
    root, marker = planted
    store = _small_store(root)
    store.attribute(run="r", k=2, method="grad-dot")
    _plant_embedding_function(root, "scores", marker)
    before = store.count("scores")
    result = store.attribute(run="r", k=2, method="grad-dot")
    assert store.count("scores") == before + result.num_rows
    store.add_examples([{"example_id": "e0", "text": "a"}])
    _plant_embedding_function(root, "examples", marker)
    store.add_examples([{"example_id": "e1", "text": "b"}])
    assert store.count("examples") == 2
    assert not marker.exists()


def _files_outside(tmp_path: Path, root: Path) -> set[Path]:
    return {p for p in tmp_path.rglob("*") if root not in p.parents and p != root}


def test_index_names_cannot_escape_the_store(tmp_path):
    root = tmp_path / "stores" / "store"
    store = _small_store(root)
    outside = _files_outside(tmp_path, root)
    for name in ("../..", "..", "../x", "a/b", "/abs", ".hidden", ""):
        with pytest.raises(gradstore.InvalidNameError):
            store.build_index("r", name=name, method="grad-dot")
        with pytest.raises(gradstore.InvalidNameError):
            store.index(name)
    assert root.is_dir() and store.count("gradients") == 8
    assert _files_outside(tmp_path, root) == outside


def test_a_planted_index_manifest_cannot_write_outside_the_store(tmp_path):
    root = tmp_path / "stores" / "store"
    store = _small_store(root)
    index = store.build_index("r", kind="Flat", method="grad-dot")
    key = ("indexes", index.name, "manifest.json")
    manifest = json.loads(store.core.files.read_bytes(*key))
    manifest["name"] = "../../../escaped"
    store.core.files.write_bytes(json.dumps(manifest).encode(), *key)  # planted with a matching checksum
    outside = _files_outside(tmp_path, root)
    with pytest.raises(gradstore.IndexMismatchError):
        store.index(index.name)
    with pytest.raises(gradstore.IndexMismatchError):
        store.attribute(run="r", k=2, kind="Flat", method="grad-dot")
    assert _files_outside(tmp_path, root) == outside
    assert store.attribute(run="r", k=2, method="grad-dot").num_rows == 4  # exact search builds no side file


def test_a_planted_lock_directory_link_cannot_create_files_outside_the_store(tmp_path):
    """``_gradstore/locks`` planted as a link to a directory outside the store: saving and reading fits and indexes
    (which take the writers' lock) create nothing there, and attribution still works."""
    root = tmp_path / "stores" / "store"
    _small_store(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "_gradstore").mkdir(exist_ok=True)
    (root / "_gradstore" / "locks").symlink_to(elsewhere, target_is_directory=True)
    again = gradstore.open(root)
    assert again.attribute(run="r", k=2, method="fisher", write=False).num_rows == 4
    assert again.attribute(run="r", k=2, kind="Flat", write=False, method="grad-dot").num_rows == 4
    assert list(elsewhere.iterdir()) == []


def test_a_store_this_process_cannot_lock_is_still_read(tmp_path, monkeypatch):
    """Where the lock file cannot be made (a read-only store), fits and indexes are read without it."""
    store = _small_store(tmp_path / "store")
    expected = store.attribute(run="r", k=2, method="fisher", write=False)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(os, "open", read_only)
    again = gradstore.open(tmp_path / "store")
    found = again.attribute(run="r", k=2, method="fisher", write=False)
    assert found.column("grad_id").to_pylist() == expected.column("grad_id").to_pylist()


def test_a_run_name_with_dots_keeps_its_curvature_inside_the_store(tmp_path):
    root = tmp_path / "stores" / "store"
    store = gradstore.open(root)
    outside = _files_outside(tmp_path, root)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    run = "../../x"
    with store.capture(model, run, projection=None, curvature=True) as cap:
        cap.set_ids([f"e{i}" for i in range(5)])
        nn.functional.cross_entropy(model(torch.randn(5, 3)), torch.randint(0, 2, (5,))).backward()
    assert _files_outside(tmp_path, root) == outside
    assert set(store.core.load_curvature(run, "train")) == {"0", "2"}
    assert store.count("gradients", f"run_id = {gradstore.core.sql_literal(run)}") == 5
    assert not any(".." in part for p in root.rglob("*") for part in p.relative_to(root).parts)
    assert os.listdir(tmp_path) == ["stores"]


def test_examples_are_upserted_by_id(tmp_path):
    store = _small_store(tmp_path / "store")
    assert store.add_examples([{"example_id": "e0", "source": "a"}, {"example_id": "e1", "source": "b"}]) == 2
    assert (
        store.add_examples(
            [
                {"example_id": "e1", "source": "B"},
                {"example_id": "e2", "source": "c"},
                {"example_id": "e2", "source": "C"},
            ]
        )
        == 2
    )
    rows = store.sql("select example_id, source from examples order by 1").fetchall()
    assert rows == [("e0", "a"), ("e1", "B"), ("e2", "C")]
    store.attribute(run="r", k=6, method="grad-dot")
    joined = store.sql(
        "select count(*) from scores s join examples e using (example_id) where s.query_id = 'q0'"
    ).fetchall()
    assert joined == [(3,)]  # of the 6 proponents of q0, the 3 with examples, each once
