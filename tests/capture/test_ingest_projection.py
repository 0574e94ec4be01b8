"""Projection spec, seeded matrices, factorized/dense projection against explicit Kronecker products."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ingest.capture import CaptureConfig, GradientCapture
from ingest.per_example import choose_route, route_flops
from ingest.projection import ProjectionMismatchError, ProjectionSpec, projection_matrix


def test_projection_matrix_is_deterministic_and_keyed():
    a = projection_matrix(3, "h.0.mlp", "in", 8, 20)
    assert torch.equal(a, projection_matrix(3, "h.0.mlp", "in", 8, 20))
    assert a.shape == (8, 20) and a.dtype == torch.float32
    for other in (
        projection_matrix(4, "h.0.mlp", "in", 8, 20),
        projection_matrix(3, "h.1.mlp", "in", 8, 20),
        projection_matrix(3, "h.0.mlp", "out", 8, 20),
    ):
        assert not torch.allclose(a, other)
    assert projection_matrix(3, "h.0.mlp", "in", 8, 20, dtype=torch.float64).dtype == torch.float64
    big = projection_matrix(0, "x", "in", 64, 4000)
    assert abs(float(big.pow(2).sum(0).mean()) - 1.0) < 0.05  # E ||P e_j||^2 = 1
    with pytest.raises(ValueError):
        projection_matrix(0, "x", "sideways", 2, 2)


def make_capture(model, **kw):
    return GradientCapture(model, lambda b: None, CaptureConfig.from_options(**kw))


def test_spec_round_trip_fingerprint_and_mismatch():
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 5), nn.Linear(5, 2, bias=False))
    spec = make_capture(model, k_in=4, k_out=3).spec
    assert spec.dim == 12 + 12 + 4 * 2 and [s.offset for s in spec.layers] == [0, 12, 24]  # k_out capped at 2
    again = ProjectionSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.fingerprint() == spec.fingerprint()
    spec.check_matches(again)
    with pytest.raises(ProjectionMismatchError, match="seed"):
        spec.check_matches(make_capture(model, k_in=4, k_out=3, seed=1).spec)
    with pytest.raises(ProjectionMismatchError, match="k_in"):
        spec.check_matches(make_capture(model, k_in=5, k_out=3).spec)
    with pytest.raises(ProjectionMismatchError, match="layers differ"):
        spec.check_matches(make_capture(model, k_in=4, k_out=3, exclude="^0$").spec)
    exact = make_capture(model, projection=None).spec
    assert [(s.k_out, s.k_in) for s in exact.layers] == [(6, 10), (5, 7), (2, 5)]
    assert exact.kind == "none" and exact.dim == 60 + 35 + 10


def test_cost_rule():
    # Large layer, long sequence: projecting the tokens is cheaper.
    assert choose_route(128, 257, 768, 16, 16) == "project"
    # Tiny layer: materialising the 4 x 5 gradient is cheaper than projecting every token.
    assert choose_route(64, 5, 4, 16, 16) == "materialize"
    assert route_flops("project", 2, 3, 4, 5, 6) == 2 * (3 * 5 + 4 * 6 + 6 * 5)
    assert route_flops("materialize", 2, 3, 4, 5, 6) == 2 * 3 * 4 + 4 * 3 * 5 + 6 * 4 * 5


class SeqModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 5)

    def forward(self, ids):
        return self.lin(self.emb(ids))


def exact_and_projected(route: str, projection: str = "factorized"):
    torch.manual_seed(0)
    model = SeqModel()
    ids = torch.randint(0, 11, (3, 7))
    rows = {}
    for proj in (None, projection):
        out = []
        cfg = CaptureConfig.from_options(projection=proj, k_in=4, k_out=3, seed=5, route=route, loss_reduction="sum")
        with GradientCapture(model, out.append, cfg) as cap:
            model(ids).pow(2).sum().backward()
        rows[proj] = (cap.spec, out[0].grads)
    return rows[None], rows[projection]


@pytest.mark.parametrize("route", ["project", "materialize", "auto"])
def test_factorized_equals_explicit_kronecker(route):
    (exact_spec, exact), (spec, proj) = exact_and_projected(route)
    for s in spec.layers:
        e = exact_spec.slot(s.name)
        vec_g = exact[:, e.offset : e.offset + e.size].double()
        p_in = projection_matrix(5, s.name, "in", s.k_in, s.d_in_eff).double()
        p_out = projection_matrix(5, s.name, "out", s.k_out, s.d_out).double()
        expected = vec_g @ torch.kron(p_out, p_in).T
        got = proj[:, s.offset : s.offset + s.size].double()
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), s.name


def test_dense_equals_explicit_matrix():
    (exact_spec, exact), (spec, proj) = exact_and_projected("auto", projection="dense")
    assert spec.kind == "dense" and all(s.k_in is None and s.size == 12 for s in spec.layers)
    for s in spec.layers:
        e = exact_spec.slot(s.name)
        p = projection_matrix(5, s.name, "dense", s.size, s.d_out * s.d_in_eff).double()
        expected = exact[:, e.offset : e.offset + e.size].double() @ p.T
        assert torch.allclose(proj[:, s.offset : s.offset + s.size].double(), expected, rtol=1e-5, atol=1e-6)


def test_dense_refuses_huge_layers():
    with pytest.raises(ValueError, match="factorized"):
        make_capture(nn.Linear(4096, 4096), projection="dense")
