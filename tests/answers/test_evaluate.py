"""Built-in LDS: equals a hand computation (scipy Spearman over numpy scores), deterministic given seeds,
noise ceiling from two seed groups, written to the evaluations table. Built-in QLD: equals a closed-form
reference (a mean estimator, and the ridge fit on the store), seeded same-size random control, one train_fn
call per seed, rows with metric='qld', the CLI, argument errors."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torch import nn

import gradstore
from gradstore.answers.evaluate import average_ranks, lds, qld, qld_of_scores, retrain, scores_by_example
from gradstore.answers.report.data import ReportOptions
from gradstore.errors import InvalidArgumentError, MissingIdsError, UnknownRunError

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


def write_toy_train(path: Path) -> None:
    """A retraining module for the CLI: ``train_fn`` with losses a deterministic function of the subset ids."""
    path.write_text(
        "import numpy as np\n\n"
        "def train_fn(subsets, queries, seed):\n"
        "    weight = {q: i + 1 for i, q in enumerate(queries)}\n"
        "    return np.array([[sum(int(e[1:]) % 7 for e in s) * weight[q] + seed for q in queries]"
        " for s in subsets], float)\n"
    )


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
    stored = store.sql("SELECT label, value FROM evaluations WHERE metric = 'lds' ORDER BY label").fetchall()
    assert [(label, pytest.approx(value)) for label, value in stored] == [
        ("gd", rows["gd"]["value"]),
        ("if", rows["if"]["value"]),
    ]
    # a subset of the evaluated queries reuses the retraining
    again, _ = lds(store, "run", queries=queries[:3], truth=truth, methods={"gd": {"method": "grad-dot"}}, write=False)
    assert again.column("value")[0].as_py() == pytest.approx(hand_lds(store, truth, queries[:3]).mean(), abs=1e-9)
    assert store.sql("SELECT count(*) FROM evaluations WHERE metric = 'lds'").fetchall()[0][0] == 2


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

    write_toy_train(tmp_path / "lds_toy_train.py")
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
    written = store.sql("SELECT value, noise_ceiling FROM evaluations WHERE metric = 'lds' AND subsets = 12").fetchall()
    assert written == [
        (pytest.approx(expected.column("value")[0].as_py()), pytest.approx(expected.column("noise_ceiling")[0].as_py()))
    ]
    bad = CliRunner().invoke(app, ["evaluate", "lds", store.uri, "--run", "run", "--train", "nocolon"])
    assert bad.exit_code == 1 and "module:function" in bad.output


def test_average_ranks_equal_scipy():
    from scipy.stats import rankdata

    x = np.array([[3.0, 1.0], [1.0, 1.0], [2.0, 5.0], [3.0, 1.0], [0.5, 2.0]])
    np.testing.assert_array_equal(average_ranks(x), np.apply_along_axis(rankdata, 0, x))


# ------------------------------------------------------------------------------------------------ QLD
MEAN_N, MEAN_Q = 30, 5


def mean_problem() -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """Scalar training targets; the model is their mean, a query's loss (mean - target_q)^2 (a closed form)."""
    rng = np.random.default_rng(7)
    return (
        rng.normal(size=MEAN_N),
        rng.normal(scale=1.5, size=MEAN_Q),
        [f"t{i:02d}" for i in range(MEAN_N)],
        [f"m{j}" for j in range(MEAN_Q)],
    )


def mean_loss(y: np.ndarray, target: float, kept: np.ndarray, seed: int, noise: float) -> float:
    """The mean estimator's query loss on the kept positions, with a seed- and subset-dependent offset."""
    return float((y[kept].mean() + noise * seed * (kept.sum() % 5) - target) ** 2)


def make_mean_train_fn(noise: float = 0.0):
    y, targets, ids, queries_all = mean_problem()
    position = {e: i for i, e in enumerate(ids)}
    column = {q: j for j, q in enumerate(queries_all)}
    calls = []

    def train_fn(subsets: list[list[str]], queries: list[str], seed: int) -> np.ndarray:
        calls.append(([list(s) for s in subsets], list(queries), seed))
        out = np.empty((len(subsets), len(queries)))
        for row, subset in enumerate(subsets):
            kept = np.array([position[e] for e in subset])
            out[row] = [mean_loss(y, targets[column[q]], kept, seed, noise) for q in queries]
        return out

    return train_fn, calls


def loo_scores() -> np.ndarray:
    """Exact leave-one-out influence of the mean estimator: loss without i - loss with all (> 0: i helps)."""
    y, targets, _, _ = mean_problem()
    loo_mean = (y.sum() - y) / (len(y) - 1)
    return (loo_mean[None, :] - targets[:, None]) ** 2 - (y.mean() - targets[:, None]) ** 2


def reference_qld(scores, queries, *, fraction, seeds, seed, draws, noise):
    """Per-query QLD by hand: the top-k by a Python sort, the documented random draws, the closed-form losses."""
    y, targets, _, queries_all = mean_problem()
    n = len(y)
    k = max(1, round(fraction * n))
    everyone = np.arange(n)
    out, tops, randoms = [], [], []
    for j, q in enumerate(queries):
        target = targets[queries_all.index(q)]
        top = sorted(range(n), key=lambda i: -scores[j, i])[:k]
        rng = np.random.default_rng([seed, zlib.crc32(q.encode())])
        drawn = [np.sort(rng.choice(n, size=k, replace=False)) for _ in range(draws)]
        without = np.mean([mean_loss(y, target, np.setdiff1d(everyone, top), s, noise) for s in seeds])
        control = np.mean([mean_loss(y, target, np.setdiff1d(everyone, r), s, noise) for r in drawn for s in seeds])
        out.append(without - control)
        tops.append(top)
        randoms.append(drawn)
    return np.array(out), np.array(tops), np.array(randoms)


def test_qld_of_scores_equals_the_closed_form_reference():
    train_fn, calls = make_mean_train_fn(noise=0.01)
    _, _, ids, queries = mean_problem()
    scores = {"loo": loo_scores(), "anti": -loo_scores(), "noise": np.random.default_rng(1).normal(size=(5, 30))}
    kwargs = dict(fraction=0.2, seeds=(0, 1, 2), seed=11, draws=3)
    results = qld_of_scores(scores, train_fn, ids, queries=queries, **kwargs)
    for label, matrix in scores.items():
        per_query, tops, randoms = reference_qld(matrix, queries, noise=0.01, **kwargs)
        result = results[label]
        np.testing.assert_allclose(result.per_query, per_query, rtol=0, atol=1e-12)
        assert result.value == pytest.approx(per_query.mean(), abs=1e-12)
        assert result.stderr == pytest.approx(per_query.std(ddof=1) / np.sqrt(MEAN_Q), abs=1e-12)
        np.testing.assert_array_equal(result.removed, tops)
        np.testing.assert_array_equal(result.random, randoms)
        np.testing.assert_allclose(result.proponent_loss - result.random_loss, per_query, atol=1e-12)
        assert (result.fraction, result.seed, result.seeds) == (0.2, 11, (0, 1, 2))
    # removing what truly supports a query raises its loss more than chance; removing its opponents lowers it
    assert results["loo"].value > 0.1 > -0.1 > results["anti"].value
    # one train_fn call per seed holding every removal of every query and method, all of the same size
    assert [seed for _, _, seed in calls] == [0, 1, 2]
    subsets, passed_queries, _ = calls[0]
    assert passed_queries == queries and all(call[0] == subsets for call in calls)
    assert {len(s) for s in subsets} == {MEAN_N - 6} and all(s == sorted(s) for s in subsets)
    assert len({tuple(s) for s in subsets}) == len(subsets) <= MEAN_Q * (3 + 3)
    for result in results.values():  # identical removals are retrained once (the LOO proponents of like queries)
        removals = {tuple(sorted(r)) for r in result.removed} | {tuple(r) for r in result.random.reshape(-1, 6)}
        assert result.subsets == len(removals)
    assert len(subsets) == len(set.union(*({tuple(sorted(r)) for r in x.removed} for x in results.values()))) + 15
    # a bare matrix is labelled "scores"
    alone = qld_of_scores(loo_scores(), train_fn, ids, queries=queries, **kwargs)
    assert list(alone) == ["scores"] and alone["scores"].value == results["loo"].value


def test_qld_random_control_is_seeded_same_size_and_independent_of_methods_and_other_queries():
    train_fn, calls = make_mean_train_fn()
    _, _, ids, queries = mean_problem()
    both = qld_of_scores({"loo": loo_scores(), "anti": -loo_scores()}, train_fn, ids, queries=queries, seed=4)
    alone = qld_of_scores({"anti": -loo_scores()}, train_fn, ids, queries=queries, seed=4)
    first_two = qld_of_scores(loo_scores()[:2], train_fn, ids, queries=queries[:2], seed=4)["scores"]
    other = qld_of_scores(loo_scores(), train_fn, ids, queries=queries, seed=5)["scores"]
    control = both["loo"].random
    assert control.shape == (MEAN_Q, 3, 3)  # default 3 draws of round(0.1 * 30) = 3 examples
    assert all(len(set(draw)) == 3 for per_query in control for draw in per_query)
    np.testing.assert_array_equal(both["anti"].random, control)
    np.testing.assert_array_equal(alone["anti"].random, control)
    np.testing.assert_array_equal(alone["anti"].per_query, both["anti"].per_query)
    np.testing.assert_array_equal(first_two.random, control[:2])
    np.testing.assert_array_equal(first_two.per_query, both["loo"].per_query[:2])
    assert not np.array_equal(other.random, control)
    np.testing.assert_array_equal(other.removed, both["loo"].removed)  # the proponents do not depend on the seed
    # batch splits the retrainings into calls of at most that many, same result
    calls.clear()
    batched = qld_of_scores(loo_scores(), train_fn, ids, queries=queries, seed=4, batch=7)["scores"]
    assert batched.subsets == 17  # 15 random sets and the 2 distinct LOO proponent sets of 5 queries
    assert [len(c[0]) for c in calls] == [7, 7, 3]
    np.testing.assert_array_equal(batched.per_query, both["loo"].per_query)


def hand_grad_dot(store, train_ids: list[str], queries: list[str]) -> np.ndarray:
    """grad-dot scores ``[queries, train]`` from the stored vectors, in float64."""
    train = store.read_gradients("run", split="train")
    query = store.read_gradients("run", split="query")
    t_pos = {e: i for i, e in enumerate(train.metadata.column("example_id").to_pylist())}
    q_pos = {e: i for i, e in enumerate(query.metadata.column("example_id").to_pylist())}
    g_train = train.vectors[[t_pos[e] for e in train_ids]].astype(np.float64)
    g_query = query.vectors[[q_pos[q] for q in queries]].astype(np.float64)
    return g_query @ g_train.T


def test_qld_on_the_store_equals_the_ridge_reference_and_is_written(store):
    train_fn, calls = make_train_fn()
    queries = [f"q{i}" for i in range(N_QUERY)]
    methods = {"gd": {"method": "grad-dot"}, "if": {"method": "fisher", "damping": 1e-3}}
    table = qld(store, "run", train_fn, queries=queries, methods=methods, fraction=0.1, seeds=(2,), seed=9, draws=2)
    assert [c[2] for c in calls] == [2]  # one call for every removal of both methods
    train_ids = sorted(f"x{i}" for i in range(N_TRAIN))
    x, y, xq, yq = problem()
    scores = hand_grad_dot(store, train_ids, queries)

    def loss(removed, j: int) -> float:
        kept = [int(e[1:]) for i, e in enumerate(train_ids) if i not in set(removed)]
        w = fit(x[kept], y[kept])
        return float((xq[j] @ w - yq[j]) ** 2)

    expected = []
    for j, q in enumerate(queries):
        top = np.argsort(-scores[j], kind="stable")[:4]
        rng = np.random.default_rng([9, zlib.crc32(q.encode())])
        control = np.mean([loss(rng.choice(N_TRAIN, size=4, replace=False), j) for _ in range(2)])
        expected.append(loss(top, j) - control)
    expected = np.array(expected)
    rows = {r["label"]: r for r in table.to_pylist()}
    assert rows["gd"]["value"] == pytest.approx(expected.mean(), abs=1e-9)
    assert rows["gd"]["stderr"] == pytest.approx(expected.std(ddof=1) / np.sqrt(N_QUERY), abs=1e-9)
    assert rows["if"]["value"] > 0  # influence on exact ridge gradients finds what supports each query
    for label, row in rows.items():
        assert (row["metric"], row["method"], row["run_id"]) == ("qld", methods[label]["method"], "run")
        assert (row["fraction"], row["seed"], row["seeds"], row["queries"]) == (0.1, 9, "[2]", N_QUERY)
        assert row["noise_ceiling"] is None and row["subsets"] <= N_QUERY * 3
    assert rows["gd"]["subsets"] == N_QUERY * 3  # proponent removals + 2 random controls per query, all distinct
    stored = store.sql(
        "SELECT label, value FROM evaluations WHERE metric = 'qld' AND seed = 9 ORDER BY label"
    ).fetchall()
    assert stored == [("gd", pytest.approx(rows["gd"]["value"])), ("if", pytest.approx(rows["if"]["value"]))]
    # the same numbers from precomputed scores
    again = qld_of_scores(
        {label: scores_by_example(store, "run", queries, train_ids, **options) for label, options in methods.items()},
        train_fn,
        train_ids,
        queries=queries,
        fraction=0.1,
        seeds=(2,),
        seed=9,
        draws=2,
    )
    assert {label: r.value for label, r in again.items()} == {
        label: pytest.approx(row["value"], abs=1e-12) for label, row in rows.items()
    }
    unwritten = qld(store, "run", train_fn, queries=queries[:2], methods={"gd": methods["gd"]}, seed=9, write=False)
    assert unwritten.num_rows == 1
    assert store.sql("SELECT count(*) FROM evaluations WHERE metric = 'qld' AND seed = 9").fetchall()[0][0] == 2


def test_qld_errors_say_what_to_do_and_retrain_nothing(store):
    train_fn, calls = make_train_fn()
    queries = [f"q{i}" for i in range(N_QUERY)]
    gd = {"gd": {"method": "grad-dot"}}
    for kwargs, message in (
        ({"fraction": 0.0}, r"fraction must be a number in \(0, 1\)"),
        ({"fraction": 1.0}, "fraction must be"),
        ({"fraction": "0.1"}, "fraction must be"),
        ({"fraction": 0.99}, "removes all 40 training examples; pass a smaller fraction"),
        ({"queries": []}, "queries is empty"),
        ({"queries": "q0"}, "list of query example ids"),
        ({"queries": ["q0", "q1", "q0"]}, r"\['q0'\] more than once"),
        ({"seeds": ()}, "seeds must be a non-empty list"),
        ({"seeds": (1, 1)}, "more than once"),
        ({"seeds": (0.5,)}, "seeds must be integers"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"draws": 0}, "draws must be a whole number >= 1"),
        ({"batch": 0}, "batch must be a whole number >= 1"),
        ({"methods": {}}, "methods must be a non-empty mapping"),
        ({"methods": {"gd": {"method": "grad-dot", "k": 3}}}, r"sets \['k'\]"),
        ({"methods": {"x": {"method": "nope"}}}, "unknown attribution method 'nope'"),
        ({"methods": {"gd": {"method": "grad-dot", "damping": 0.1}}}, "does not use damping"),
    ):
        arguments = {"queries": queries, "methods": gd, **kwargs}
        with pytest.raises(InvalidArgumentError, match=message):
            qld(store, "run", train_fn, **arguments)
    with pytest.raises(MissingIdsError, match="nope"):
        qld(store, "run", train_fn, queries=["q0", "nope"], methods=gd)
    with pytest.raises(InvalidArgumentError, match="qld needs a train_fn"):
        qld(store, "run", queries=queries, methods=gd)
    with pytest.raises(UnknownRunError):
        qld(store, "nope", train_fn, queries=queries, methods=gd)
    assert calls == []  # every argument error comes before any retraining

    def wrong_shape(subsets, queries, seed):
        return np.zeros((len(subsets), len(queries) + 1))

    def diverged(subsets, queries, seed):
        return np.full((len(subsets), len(queries)), np.nan)

    with pytest.raises(InvalidArgumentError, match=r"train_fn returned shape \(\d+, 7\), expected"):
        qld(store, "run", wrong_shape, queries=queries, methods=gd)
    with pytest.raises(InvalidArgumentError, match="NaN or Inf losses"):
        qld(store, "run", diverged, queries=queries, methods=gd)
    _, _, ids, mean_queries = mean_problem()
    with pytest.raises(InvalidArgumentError, match=r"scores\['scores'\] has shape \(5, 29\), expected"):
        qld_of_scores(loo_scores()[:, 1:], train_fn, ids, queries=mean_queries)
    with pytest.raises(InvalidArgumentError, match="NaN or Inf"):
        qld_of_scores(np.full((5, 30), np.nan), train_fn, ids, queries=mean_queries)
    with pytest.raises(InvalidArgumentError, match="train_ids holds an id more than once"):
        qld_of_scores(loo_scores(), train_fn, ids[:-1] + ids[:1], queries=mean_queries)
    with pytest.raises(InvalidArgumentError, match="at least 2 training examples"):
        qld_of_scores(np.ones((5, 1)), train_fn, ids[:1], queries=mean_queries)
    with pytest.raises(InvalidArgumentError, match="train_fn must be your retraining function"):
        qld_of_scores(loo_scores(), None, ids, queries=mean_queries)
    assert store.sql("SELECT count(*) FROM evaluations WHERE metric = 'qld' AND seed = 0").fetchall()[0][0] == 0


def test_cli_evaluate_qld_end_to_end(store, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gradstore.cli import app

    write_toy_train(tmp_path / "qld_toy_train.py")
    monkeypatch.chdir(tmp_path)
    arguments = ["evaluate", "qld", store.uri, "--run", "run", "--train", "qld_toy_train:train_fn"]
    options = ["--methods", "grad-dot,fisher", "--damping", "0.01", "--fraction", "0.2", "--seeds", "0,1"]
    result = CliRunner().invoke(app, [*arguments, *options, "--seed", "21", "--draws", "2", "--queries", "q1,q3"])
    assert result.exit_code == 0, result.output
    import qld_toy_train

    expected = qld(
        store,
        "run",
        qld_toy_train.train_fn,
        queries=["q1", "q3"],
        methods={"grad-dot": {"method": "grad-dot"}, "fisher": {"method": "fisher", "damping": 0.01}},
        fraction=0.2,
        seeds=(0, 1),
        seed=21,
        draws=2,
        write=False,
    )
    lines = result.output.splitlines()
    assert lines[0].split() == ["label", "value", "stderr", "queries", "subsets", "fraction", "seeds"]
    for line, row in zip(lines[1:], expected.to_pylist(), strict=True):
        label, value = line.split()[:2]
        assert (label, float(value)) == (row["label"], pytest.approx(row["value"], rel=1e-5, abs=1e-6))
    written = store.sql(
        "SELECT label, value, fraction, seeds FROM evaluations WHERE metric = 'qld' AND seed = 21 ORDER BY label"
    ).fetchall()
    assert written == [
        (row["label"], pytest.approx(row["value"]), 0.2, "[0, 1]")
        for row in sorted(expected.to_pylist(), key=lambda r: r["label"])
    ]
    # every query row of the run by default; --checkpoint reaches only the methods that use it
    default = CliRunner().invoke(app, [*arguments, "--methods", "grad-dot", "--seed", "22", "--checkpoint", "train"])
    assert default.exit_code == 0, default.output
    assert store.sql("SELECT queries FROM evaluations WHERE seed = 22").fetchall() == [(N_QUERY,)]
    for extra, message in (
        (["--fraction", "1.5"], "fraction must be a number in (0, 1)"),
        (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
        (["--methods", "nope"], "unknown attribution method 'nope'"),
        (["--methods", ","], "--methods ',' names nothing"),
        (["--queries", "q0,nope"], "nope"),
        (["--draws", "0"], "draws must be a whole number >= 1"),
    ):
        bad = CliRunner().invoke(app, [*arguments, *extra])
        assert bad.exit_code == 1 and message in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1 and "Traceback" not in bad.output
    empty = gradstore.open(tmp_path / "empty")
    empty.create_run("r", dim=2)
    with empty.writer("r") as writer:
        writer.append(np.ones((2, 2)), ["a", "b"])
    no_queries = CliRunner().invoke(
        app, ["evaluate", "qld", empty.uri, "--run", "r", "--train", "qld_toy_train:train_fn"]
    )
    assert no_queries.exit_code == 1 and "has no query rows: pass --queries" in no_queries.output


@pytest.fixture(scope="module")
def evaluated(store):
    """The store with one LDS and one QLD evaluation of the same two labels (whatever else tests wrote)."""
    train_fn, _ = make_train_fn()
    queries = [f"q{i}" for i in range(N_QUERY)]
    methods = {"grad-dot": {"method": "grad-dot"}, "fisher": {"method": "fisher", "damping": 1e-3}}
    lds_rows, _ = lds(store, "run", train_fn, queries=queries, methods=methods, subsets=10, seeds=(0, 1), seed=31)
    qld_rows = qld(store, "run", train_fn, queries=queries, methods=methods, seed=31)
    return store, lds_rows, qld_rows


def test_report_data_puts_qld_beside_lds(evaluated):
    from gradstore.answers.report.data import gather

    store, lds_rows, qld_rows = evaluated
    evaluations = gather(store.core).evaluations
    assert evaluations["columns"][:5] == ["metric", "run_id", "label", "method", "value"]
    assert "evaluation_id" not in evaluations["columns"]
    assert {"lds", "qld"} <= {row[0] for row in evaluations["rows"]}
    summary = evaluations["summary"]
    assert summary["columns"] == [
        "run", "label", "method", "LDS", "LDS stderr", "LDS noise ceiling", "QLD", "QLD stderr"
    ]  # fmt: skip
    by_label = {row[1]: row for row in summary["rows"]}
    for lds_row, qld_row in zip(lds_rows.to_pylist(), qld_rows.to_pylist(), strict=True):
        assert by_label[lds_row["label"]][:3] == ["run", lds_row["label"], lds_row["method"]]
        assert by_label[lds_row["label"]][3:] == [
            pytest.approx(lds_row["value"]),
            pytest.approx(lds_row["stderr"]),
            pytest.approx(lds_row["noise_ceiling"]),
            pytest.approx(qld_row["value"]),
            pytest.approx(qld_row["stderr"]),
        ]
    store.create_run("other", dim=DIM, exist_ok=True)
    assert gather(store.core, ReportOptions(run="other")).evaluations is None  # rows of another run are not shown


def test_report_shows_qld_beside_lds_in_the_browser(browser, evaluated, tmp_path):
    store, lds_rows, qld_rows = evaluated
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(store.report(tmp_path / "report.html").resolve().as_uri())
    summary = page.locator("#evaluations table.evaluation-summary")
    assert summary.locator("th").all_inner_texts()[3:8] == [
        "LDS",
        "LDS stderr",
        "LDS noise ceiling",
        "QLD",
        "QLD stderr",
    ]
    fisher = [row for row in summary.locator("tbody tr").all() if row.locator("td").nth(1).inner_text() == "fisher"]
    cells = fisher[0].locator("td").all_inner_texts()
    assert float(cells[3]) == pytest.approx(lds_rows.column("value")[1].as_py(), abs=1e-4)
    assert float(cells[6]) == pytest.approx(qld_rows.column("value")[1].as_py(), abs=1e-4)
    metrics = page.locator("#evaluations table.evaluation-rows tbody tr td:first-child").all_inner_texts()
    assert {"lds", "qld"} <= set(metrics)
    assert errors == []
