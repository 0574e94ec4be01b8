"""Built-in LDS: equals a hand computation (scipy Spearman over numpy scores), deterministic given seeds,
noise ceiling from two seed groups, written to the evaluations table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torch import nn

import gradstore
from gradstore.evaluate import average_ranks, lds, retrain

N_TRAIN, N_QUERY, DIM, RIDGE = 40, 6, 5, 1e-1


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(DIM, generator=g)
    x = torch.randn(N_TRAIN + N_QUERY, DIM, generator=g, dtype=torch.float64)
    y = x @ w.double() + 0.5 * torch.randn(N_TRAIN + N_QUERY, generator=g, dtype=torch.float64)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def fit(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Ridge regression without bias, closed form."""
    return torch.linalg.solve(x.T @ x + RIDGE * torch.eye(DIM, dtype=x.dtype), x.T @ y)


def make_train_fn(noise: float = 0.0):
    x, y, xq, yq = problem()
    calls = []

    def train_fn(subsets: list[list[str]], queries: list[str], seed: int) -> np.ndarray:
        calls.append((len(subsets), tuple(queries), seed))
        rng = np.random.default_rng(seed)
        out = np.zeros((len(subsets), len(queries)))
        for row, ids in enumerate(subsets):
            members = [int(i[1:]) for i in ids]
            w = fit(x[members], y[members])
            columns = [int(q[1:]) for q in queries]
            out[row] = ((xq[columns] @ w - yq[columns]) ** 2).numpy() + noise * rng.standard_normal(len(queries))
        return out

    return train_fn, calls


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Exact gradients of the squared loss at the full-data ridge fit, float32 storage."""
    store = gradstore.open(tmp_path_factory.mktemp("lds") / "store", storage_dtype="float32")
    x, y, xq, yq = problem()
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(fit(x, y).float().unsqueeze(0))
    with store.capture(model, "run", projection=None, loss_reduction="sum") as cap:
        for split, prefix, inputs, targets in (("train", "x", x, y), ("query", "q", xq, yq)):
            cap.set_split(split)
            cap.set_ids([f"{prefix}{i}" for i in range(len(inputs))])
            ((model(inputs.float()).squeeze(1) - targets.float()) ** 2).sum().backward()
            model.zero_grad()
    return store


def hand_lds(store, truth, queries: list[str]) -> np.ndarray:
    """grad-dot scores from the stored vectors and scipy's Spearman, query by query."""
    train = store.read_gradients("run", split="train")
    query = store.read_gradients("run", split="query")
    t_pos = {e: i for i, e in enumerate(train.metadata.column("example_id").to_pylist())}
    q_pos = {e: i for i, e in enumerate(query.metadata.column("example_id").to_pylist())}
    g_train = train.vectors[[t_pos[e] for e in truth.train_ids]].astype(np.float64)
    g_query = query.vectors[[q_pos[q] for q in queries]].astype(np.float64)
    predicted = truth.masks @ (g_query @ g_train.T).T
    actual = -truth.losses.mean(0)[:, [truth.queries.index(q) for q in queries]]
    return np.array([spearmanr(predicted[:, j], actual[:, j])[0] for j in range(len(queries))])


def test_lds_equals_hand_computation_and_is_written(store):
    train_fn, calls = make_train_fn()
    queries = [f"q{i}" for i in range(N_QUERY)]
    table, truth = lds(
        store,
        "run",
        train_fn,
        queries=queries,
        subsets=30,
        seed=3,
        methods={"gd": {"method": "grad-dot"}, "if": {"method": "fisher", "damping": 1e-3}},
    )
    assert calls == [(30, tuple(queries), 0)]
    assert truth.masks.shape == (30, N_TRAIN) and set(truth.masks.sum(1)) == {N_TRAIN // 2}
    assert truth.train_ids == sorted(f"x{i}" for i in range(N_TRAIN))
    rows = {r["label"]: r for r in table.to_pylist()}
    per_query = hand_lds(store, truth, queries)
    assert rows["gd"]["value"] == pytest.approx(per_query.mean(), abs=1e-9)
    assert rows["gd"]["stderr"] == pytest.approx(per_query.std(ddof=1) / np.sqrt(N_QUERY), abs=1e-9)
    assert rows["if"]["value"] > 0.5  # influence on exact ridge gradients predicts ridge retraining well
    assert rows["gd"]["noise_ceiling"] is None  # one seed
    stored = store.sql("SELECT label, value FROM evaluations ORDER BY label").fetchall()
    assert [(label, pytest.approx(value)) for label, value in stored] == [
        ("gd", rows["gd"]["value"]),
        ("if", rows["if"]["value"]),
    ]
    # a subset of the evaluated queries reuses the retraining
    again, _ = lds(store, "run", queries=queries[:3], truth=truth, methods={"gd": {"method": "grad-dot"}}, write=False)
    assert again.column("value")[0].as_py() == pytest.approx(hand_lds(store, truth, queries[:3]).mean(), abs=1e-9)
    assert store.sql("SELECT count(*) FROM evaluations").fetchall()[0][0] == 2


def test_lds_is_deterministic_given_seeds_and_has_a_noise_ceiling(store):
    queries = [f"q{i}" for i in range(N_QUERY)]
    train_fn, calls = make_train_fn(noise=0.05)
    kwargs = dict(
        queries=queries, subsets=20, seeds=(4, 5, 6, 7), seed=1, write=False, methods={"gd": {"method": "grad-dot"}}
    )
    first, truth = lds(store, "run", train_fn, **kwargs)
    second, truth2 = lds(store, "run", train_fn, **kwargs)
    assert [c[2] for c in calls] == [4, 5, 6, 7, 4, 5, 6, 7]
    np.testing.assert_array_equal(truth.masks, truth2.masks)
    assert first.column("value").to_pylist() == second.column("value").to_pylist()
    a, b = -truth.losses[:2].mean(0), -truth.losses[2:].mean(0)
    ceiling = np.mean([spearmanr(a[:, j], b[:, j])[0] for j in range(N_QUERY)])
    assert first.column("noise_ceiling")[0].as_py() == pytest.approx(ceiling, abs=1e-9)
    assert first.column("value")[0].as_py() == pytest.approx(hand_lds(store, truth, queries).mean(), abs=1e-9)
    other = retrain(train_fn, truth.train_ids, queries=queries, subsets=20, seeds=(4,), seed=2)
    assert not np.array_equal(other.masks, truth.masks)


def test_lds_errors(store):
    def wrong(subsets, queries, seed):
        return np.zeros((len(subsets), len(queries) + 1))

    with pytest.raises(ValueError, match="shape"):
        lds(store, "run", wrong, queries=["q0"], subsets=4)
    with pytest.raises(ValueError, match="train_fn"):
        lds(store, "run", queries=["q0"])
    with pytest.raises(ValueError, match="fraction"):
        retrain(wrong, ["x0", "x1"], queries=["q0"], fraction=1.0)


def test_cli_evaluate_lds_imports_the_training_function(store, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gradstore.cli import app

    (tmp_path / "lds_toy_train.py").write_text(
        "import numpy as np\n\n"
        "def train_fn(subsets, queries, seed):\n"
        "    weight = {q: i + 1 for i, q in enumerate(queries)}\n"
        "    return np.array([[sum(int(e[1:]) % 7 for e in s) * weight[q] + seed for q in queries]"
        " for s in subsets], float)\n"
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app,
        [
            "evaluate",
            "lds",
            store.uri,
            "--run",
            "run",
            "--train",
            "lds_toy_train:train_fn",
            "--methods",
            "grad-dot",
            "--subsets",
            "12",
            "--seeds",
            "0,1",
            "--seed",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    import lds_toy_train

    expected, _ = lds(
        store,
        "run",
        lds_toy_train.train_fn,
        queries=[f"q{i}" for i in range(N_QUERY)],
        methods={"grad-dot": {"method": "grad-dot"}},
        subsets=12,
        seeds=(0, 1),
        seed=5,
        write=False,
    )
    assert f"{expected.column('value')[0].as_py():.4g}"[:5] in result.output
    written = store.sql("SELECT value, noise_ceiling FROM evaluations WHERE subsets = 12").fetchall()
    assert written == [
        (pytest.approx(expected.column("value")[0].as_py()), pytest.approx(expected.column("noise_ceiling")[0].as_py()))
    ]
    bad = CliRunner().invoke(app, ["evaluate", "lds", store.uri, "--run", "run", "--train", "nocolon"])
    assert bad.exit_code == 1 and "module:function" in bad.output


def test_average_ranks_equal_scipy():
    from scipy.stats import rankdata

    x = np.array([[3.0, 1.0], [1.0, 1.0], [2.0, 5.0], [3.0, 1.0], [0.5, 2.0]])
    np.testing.assert_array_equal(average_ranks(x), np.apply_along_axis(rankdata, 0, x))
