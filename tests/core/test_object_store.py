"""A store on S3-compatible object storage (a local moto server): the whole path, tables and side files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from local_s3 import s3_client
from torch import nn

import gradstore

pytest.importorskip("boto3")

N_TRAIN, N_QUERY = 24, 3


def _capture(store: gradstore.GradStore) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_TRAIN, 5, generator=generator), torch.randint(0, 3, (N_TRAIN,), generator=generator)
    with store.capture(
        model, "run", projection="factorized", k_in=4, k_out=2, curvature=True, checkpoint="c0", learning_rate=0.1
    ) as cap:
        for start in range(0, N_TRAIN, 8):
            cap.set_ids([f"x{i}" for i in range(start, start + 8)])
            nn.functional.cross_entropy(model(x[start : start + 8]), y[start : start + 8]).backward()
            model.zero_grad()
        cap.set_split("query")
        cap.set_ids([f"q{i}" for i in range(N_QUERY)])
        nn.functional.cross_entropy(model(x[:N_QUERY] + 0.1), y[:N_QUERY]).backward()
        model.zero_grad()


def _objects(options: dict, bucket: str) -> list[str]:
    pages = s3_client(options["aws_endpoint"]).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def test_the_whole_path_on_object_storage_equals_a_local_store(s3_bucket, tmp_path, monkeypatch):
    bucket, options = s3_bucket
    monkeypatch.chdir(tmp_path)  # nothing may land on local disk under a relative "s3:" path
    remote = gradstore.open(f"s3://{bucket}/store", storage_options=options)
    local = gradstore.open(tmp_path / "local")
    for store in (remote, local):
        _capture(store)
        store.add_examples([{"example_id": f"x{i}", "source": f"s{i % 2}"} for i in range(N_TRAIN)])
    assert remote.count() == local.count() == N_TRAIN + N_QUERY

    exact = {s: s.attribute(run="run", k=5, method="fisher") for s in (remote, local)}
    flat = {s: s.attribute(run="run", k=5, method="grad-dot", kind="Flat") for s in (remote, local)}
    kfac = {s: s.attribute(run="run", k=5, method="kfac") for s in (remote, local)}  # uses the saved curvature
    for results in (exact, flat, kfac):
        got, want = (results[s].sort_by([("query_id", "ascending"), ("rank", "ascending")]) for s in (remote, local))
        assert got.column("example_id").to_pylist() == want.column("example_id").to_pylist()
        np.testing.assert_allclose(got.column("score").to_numpy(), want.column("score").to_numpy(), rtol=1e-5)

    index = remote.build_index("run", method="fisher", kind="Flat", name="shared-flat")
    assert (
        gradstore.open(f"s3://{bucket}/store", storage_options=options).index("shared-flat").manifest["rows"]
        == index.manifest["rows"]
        == N_TRAIN
    )
    influence = {s: s.self_influence(run="run") for s in (remote, local)}
    np.testing.assert_allclose(
        influence[remote].column("self_influence").to_numpy(),
        influence[local].column("self_influence").to_numpy(),
        rtol=1e-5,
    )
    selected = {s: s.select(run="run", budget=5) for s in (remote, local)}
    assert selected[remote].column("example_id").to_pylist() == selected[local].column("example_id").to_pylist()
    query = "select e.source, count(*) from scores s join examples e using (example_id) group by 1 order by 1"
    assert remote.sql(query).fetchall() == local.sql(query).fetchall()

    with remote.writer("run") as writer:
        writer.append(np.ones((2, remote.dim)), ["late0", "late1"], checkpoint="c0", split="train")
    assert set(remote.compact().values()) <= {0, 1}
    info = remote.info()
    assert info["uri"] == f"s3://{bucket}/store" and info["tables"]["gradients"]["rows"] == N_TRAIN + N_QUERY + 2
    assert info["bytes_on_disk"] > 0

    keys = _objects(options, bucket)
    assert any(k.startswith("store/_gradstore/indexes/shared-flat/") for k in keys)
    assert any(k.startswith("store/_gradstore/fits/") for k in keys)
    assert any(k.startswith("store/_gradstore/curvature/") for k in keys)
    assert os.listdir(tmp_path) == ["local"]


def test_credentials_and_endpoint_come_from_the_aws_environment(s3_bucket, monkeypatch):
    bucket, options = s3_bucket
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["aws_endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    store = gradstore.open(f"s3://{bucket}/env-store")
    store.create_run("r", dim=3)
    with store.writer("r") as writer:
        writer.append(np.eye(3), ["a", "b", "c"], checkpoint="train", split="train")
        writer.append(np.ones((1, 3)), ["q"], checkpoint="train", split="query")
    assert store.attribute(run="r", k=1, kind="Flat", method="grad-dot").column("example_id").to_pylist() == ["a"]
    assert any(k.startswith("env-store/_gradstore/indexes/") for k in _objects(options, bucket))


def test_storage_options_on_a_local_path_are_refused(tmp_path):
    with pytest.raises(gradstore.InvalidArgumentError):
        gradstore.open(tmp_path / "store", storage_options={"aws_region": "us-east-1"})


def test_a_new_process_maps_the_row_file_of_a_store_on_object_storage(s3_bucket, tmp_path, monkeypatch):
    """Row files live on local disk whatever the store: a second handle (as a new process) searches the rows an
    earlier search of the S3 store prepared without reading them from the bucket, and finds the same."""
    import gradstore.search.index
    from gradstore.core.row_cache import RowFiles

    bucket, options = s3_bucket
    uri = f"s3://{bucket}/store"
    first = gradstore.open(uri, storage_options=options, row_files=RowFiles(tmp_path / "cache", min_bytes=0))
    _capture(first)
    expected = first.attribute(run="run", k=5, method="fisher", write=False)
    first.core.row_files.wait()
    assert len(first.core.row_files.entries()) == 1
    assert not any("rows.pt" in key for key in _objects(options, bucket))  # nothing derived lands in the bucket

    def refuse(*args, **kwargs):
        raise AssertionError("the stored rows were read from the bucket")

    monkeypatch.setattr(gradstore.search.index, "stored_blocks", refuse)
    again = gradstore.open(uri, storage_options=options, row_files=RowFiles(tmp_path / "cache", min_bytes=0))
    found = again.attribute(run="run", k=5, method="fisher", write=False)
    assert found.column("grad_id").to_pylist() == expected.column("grad_id").to_pylist()
    np.testing.assert_array_equal(found.column("score").to_numpy(), expected.column("score").to_numpy())
