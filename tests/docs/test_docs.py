"""Every ```python block of README.md and docs/*.md runs, so the documentation cannot drift from the code.

Conventions (the markers are HTML comments: GitHub does not render them, so a reader sees only the block):

* Blocks of one file run **in order, in one namespace and one working directory** (a fresh temporary
  directory per file); each is reported as its own test, ``README.md#1``, ``docs/sql.md#2`` (1-based: the
  n-th python block of the file). A later block may use what an earlier one defined. Selecting one block
  (``"tests/docs/test_docs.py::test_block[docs/sql.md#2]"``; ``-k`` does not take ``#``, ``-k sql.md`` selects a
  file) runs the earlier blocks of its file first.
* ``<!-- doc-test: setup NAME [NAME ...] -->`` (one line) just before a block's fence runs the named
  preludes of :data:`SETUPS` (below) first. A prelude puts into the namespace what the prose around the
  block assumes the reader already has (their ``model``, ``opt``, ``loader``, a store made by an example ...),
  as small as it can be; it may also map an absolute path written in the block (``/tmp/sql-questions``) to
  the store it built in the test's directory. What the reader sees stays what a user would type.
* ``<!-- doc-test: skip REASON -->``: the block is not run and is reported as skipped with ``REASON``. Only for
  blocks that need what a CPU test cannot have (a GPU, a remote Ray cluster, network, credentials); a block
  that merely needs a model or data gets a prelude instead.
* Several directives can share one comment, separated by ``;``. A ``doc-test`` comment that is not followed
  by a python block, or an unknown directive or prelude, fails :func:`test_markers`.

A block after a failed one still runs (its failure then names the earlier one). Blocks run with one torch
thread (tiny models; a second thread only costs on a shared machine). Tracebacks name the markdown file and
its line numbers.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")


# ---------------------------------------------------------------------------------------------- the blocks
@dataclass
class Block:
    """One python block: its source (dedented), where it starts, and its markers' directives."""

    path: Path
    number: int  # 1-based among the file's python blocks
    line: int  # 1-based line of the block's first source line
    source: str
    setups: list[str] = field(default_factory=list)
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}#{self.number}"

    def add(self, directive: str) -> list[str]:
        """Apply one marker directive; the errors it has (unknown directive or prelude)."""
        verb, _, rest = directive.partition(" ")
        if verb == "setup" and rest.split():
            self.setups += rest.split()
            return [
                f"unknown prelude {name!r} (SETUPS in tests/docs/test_docs.py)"
                for name in rest.split()
                if name not in SETUPS
            ]
        if verb == "skip" and rest.strip():
            self.skip = rest.strip()
            return []
        return [f"unknown doc-test directive {directive!r} (setup NAME ... or skip REASON)"]


@dataclass
class Parsed:
    blocks: list[Block]
    errors: list[str]  # markers that are malformed or attached to nothing


def parse(path: Path) -> Parsed:
    """The python blocks of a markdown file with the directives of the ``doc-test`` comments just before them."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    pending: list[tuple[str, str]] = []  # (where, directive) of the doc-test comments not attached yet

    def stray(why: str) -> None:
        errors.extend(f"{where}: doc-test marker {directive!r} {why}" for where, directive in pending)
        pending.clear()

    i = 0
    while i < len(lines):
        marker, fence = MARKER.match(lines[i]), FENCE.match(lines[i])
        if marker:
            where = f"{path.relative_to(ROOT).as_posix()}:{i + 1}"
            pending += [(where, d.strip()) for d in marker.group("body").split(";") if d.strip()]
        elif fence:
            opener, indent, info = fence.group("fence"), len(fence.group("indent")), fence.group("info").split()
            end = i + 1
            while end < len(lines) and not closes(lines[end], opener):
                end += 1
            if info and info[0].lower() in ("python", "py"):
                body = "\n".join(line[indent:] if not line[:indent].strip() else line for line in lines[i + 1 : end])
                block = Block(path, len(blocks) + 1, i + 2, textwrap.dedent(body) + "\n")
                for where, directive in pending:
                    errors.extend(f"{where}: {error}" for error in block.add(directive))
                blocks.append(block)
                pending.clear()
            else:
                stray(f"precedes a {info[0] if info else 'plain'} block, not a python one")
            i = end
        elif lines[i].strip():
            stray("is not followed by a python block")
        i += 1
    stray("is not followed by a python block")
    return Parsed(blocks, errors)


def closes(line: str, opener: str) -> bool:
    """Whether ``line`` closes a fence opened by ``opener`` (same character, at least as long, no info)."""
    fence = FENCE.match(line)
    return (
        bool(fence)
        and fence.group("fence")[0] == opener[0]
        and len(fence.group("fence")) >= len(opener)
        and (not fence.group("info").strip())
    )


# ---------------------------------------------------------------------------------------------- preludes
@dataclass
class Prelude:
    """What a setup contributes: names for the block's namespace, and absolute paths in the block mapped to
    where the setup put what they name."""

    names: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)


Setup = Callable[[Path, Block], contextlib.AbstractContextManager[Prelude]]
SETUPS: dict[str, Setup] = {}


def prelude(function: Callable[[Path, Block], Iterator[Prelude]]) -> Setup:
    """Register a prelude under its function's name: a generator given the file's working directory and the
    block, that yields a :class:`Prelude` and cleans up after the block has run."""
    SETUPS[function.__name__] = contextlib.contextmanager(function)
    return SETUPS[function.__name__]


def _examples() -> None:
    """Make ``examples/`` importable (its scripts import ``_toy`` as a sibling module)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))


def _lm_batches(n: int, size: int, seed: int, with_ids: bool) -> list[dict[str, Any]]:
    """Random token batches for the tiny GPT-2: ``input_ids``, ``labels`` (and ``example_id``)."""

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for start in range(0, n, size):
        tokens = torch.randint(0, 64, (size, 12), generator=generator)
        batch: dict[str, Any] = {"input_ids": tokens, "labels": tokens}
        if with_ids:
            batch["example_id"] = [f"doc-{i}" for i in range(start, start + size)]
        batches.append(batch)
    return batches


@prelude
def store(work: Path, block: Block) -> Iterator[Prelude]:
    """``store``: a new store in the working directory (``gradstore.open("store")``)."""
    import gradstore

    yield Prelude({"store": gradstore.open(work / "store")})


@prelude
def training_loop(work: Path, block: Block) -> Iterator[Prelude]:
    """What a training script has before its loop: ``model`` (a 2-layer GPT-2 with 32-dim embeddings, whose
    forward returns an output with ``.loss``), ``opt`` (SGD), ``loader`` (4 dict batches of 4 examples:
    ``input_ids``, ``labels``, ``example_id`` "doc-0" ...), ``query_loader`` (one such batch, ids "q-16" ...
    "q-19"), ``batches`` (2 batches without ids), ``sink`` (a list's ``append``; the list is ``captured``) and
    ``my_dataframe`` (pandas: ``id``, ``text`` of the training examples)."""
    import pandas as pd
    from tiny_models import tiny_gpt2

    model = tiny_gpt2()
    loader = _lm_batches(16, 4, seed=0, with_ids=True)
    query_loader = _lm_batches(4, 4, seed=2, with_ids=True)
    query_loader[0]["example_id"] = [f"q-{i}" for i in range(16, 20)]
    captured: list[Any] = []
    yield Prelude(
        {
            "model": model,
            "opt": torch.optim.SGD(model.parameters(), lr=0.01),
            "loader": loader,
            "query_loader": query_loader,
            "batches": _lm_batches(8, 4, seed=1, with_ids=False),
            "sink": captured.append,
            "captured": captured,
            "my_dataframe": pd.DataFrame(
                {"id": [i for b in loader for i in b["example_id"]], "text": [f"text {i}" for i in range(16)]}
            ),
        }
    )


@prelude
def hf_dataset(work: Path, block: Block) -> Iterator[Prelude]:
    """``model`` (tiny GPT-2), ``ds`` (a ``datasets.Dataset`` of 16 rows: ``input_ids``, ``example_id``) and
    ``my_collator`` (stacks ``input_ids`` into ``input_ids`` and ``labels``)."""
    import datasets
    from tiny_models import tiny_gpt2

    def my_collator(features: list[dict]) -> dict[str, torch.Tensor]:
        tokens = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": tokens, "labels": tokens}

    tokens = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0)).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": tokens, "example_id": [f"doc-{i}" for i in range(16)]})
    yield Prelude({"model": tiny_gpt2(), "ds": ds, "my_collator": my_collator})


RANK_1 = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import gradstore

init, store_path, source = sys.argv[1:]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=init, rank=1, world_size=2, timeout=timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
ddp_model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
store = gradstore.open(store_path)
exec(compile(source, "<the block on rank 1>", "exec"), {"ddp_model": ddp_model, "opt": opt, "store": store})
dist.destroy_process_group()
"""


@prelude
def two_ranks(work: Path, block: Block) -> Iterator[Prelude]:
    """A two-process ``torch.distributed`` job (gloo on CPU): this process is rank 0 and a subprocess runs the
    same block as rank 1 with the same names: ``ddp_model`` (a small MLP in ``DistributedDataParallel``), ``opt``
    (SGD) and ``store`` (one store, ``store-ddp`` in the working directory). Rank 1 must succeed too."""
    import subprocess
    from datetime import timedelta

    import torch.distributed as dist

    import gradstore

    path, init = work / "store-ddp", f"file://{work / 'rendezvous'}"
    store = gradstore.open(path)  # created here, before rank 1 opens it
    rank_1 = subprocess.Popen(
        [sys.executable, "-c", RANK_1, init, str(path), block.source],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2, timeout=timedelta(seconds=60))
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            ddp_model = torch.nn.parallel.DistributedDataParallel(model)
            yield Prelude(
                {"ddp_model": ddp_model, "opt": torch.optim.SGD(ddp_model.parameters(), lr=0.1), "store": store}
            )
        finally:
            dist.destroy_process_group()
        output, _ = rank_1.communicate(timeout=60)
        assert rank_1.returncode == 0, f"rank 1 failed:\n{output[-3000:]}"
    finally:
        if rank_1.poll() is None:
            rank_1.kill()
            rank_1.wait()


@prelude
def gradient_rows(work: Path, block: Block) -> Iterator[Prelude]:
    """Stored-gradient-like arrays for ``indexers``: ``n_rows`` = 2048 rows of ``dim`` = 512 (two 256-wide
    layers), ``ids`` int64 and ``vectors`` float32 (numpy), ``source`` (``blocks_from_arrays`` of them),
    ``queries`` (numpy ``[4, 512]``), ``x`` (torch rows ``[8, 512]``), ``shards`` (the rows as two sources),
    ``row_ids``/``unit16``/``norms`` (the rows as the store keeps them: float16 unit rows and their norms),
    ``new_ids``/``new_vectors`` (64 rows appended later); ``np`` and ``torch``."""
    import numpy as np

    from indexers import blocks_from_arrays

    rng = np.random.default_rng(0)
    n_rows, dim = 2048, 512
    vectors = (rng.standard_normal((n_rows, dim)) * np.linspace(2.0, 0.1, dim)).astype(np.float32)
    ids = np.arange(n_rows, dtype=np.int64)
    norms = np.linalg.norm(vectors, axis=1).astype(np.float32)
    half = n_rows // 2
    yield Prelude(
        {
            "np": np,
            "torch": torch,
            "n_rows": n_rows,
            "dim": dim,
            "ids": ids,
            "vectors": vectors,
            "source": blocks_from_arrays(ids, vectors),
            "queries": rng.standard_normal((4, dim)).astype(np.float32),
            "x": torch.from_numpy(vectors[:8]),
            "shards": [blocks_from_arrays(ids[:half], vectors[:half]), blocks_from_arrays(ids[half:], vectors[half:])],
            "row_ids": ids,
            "unit16": (vectors / norms[:, None]).astype(np.float16),
            "norms": norms,
            "new_ids": np.arange(n_rows, n_rows + 64, dtype=np.int64),
            "new_vectors": rng.standard_normal((64, dim)).astype(np.float32),
        }
    )


@prelude
def examples(work: Path, block: Block) -> Iterator[Prelude]:
    """``examples/`` importable, as on a user's path after ``cd examples`` (nothing added to the namespace);
    methods the block registers are forgotten after it."""
    import importlib

    from gradstore.methods.extension import scoped_registry

    _examples()
    with scoped_registry():
        for name in ("custom_method",):  # registers when (re)imported
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        yield Prelude()


@prelude
def checkpoint_pass_store(work: Path, block: Block) -> Iterator[Prelude]:
    """The store of ``python examples/checkpoint_pass.py --store /tmp/checkpoint-pass --quick``, built in the
    working directory; ``/tmp/checkpoint-pass`` in the block names it."""
    _examples()
    import checkpoint_pass

    path = work / "checkpoint-pass"
    with contextlib.redirect_stdout(io.StringIO()):
        checkpoint_pass.main(str(path), n_train=400, epochs=6, pass_every=3)
    yield Prelude(paths={"/tmp/checkpoint-pass": path})


@prelude
def sql_questions_store(work: Path, block: Block) -> Iterator[Prelude]:
    """The store of ``python examples/sql_questions.py --store /tmp/sql-questions --quick``, built in the
    working directory; ``/tmp/sql-questions`` in the block names it."""
    _examples()
    import sql_questions

    path = work / "sql-questions"
    with contextlib.redirect_stdout(io.StringIO()):
        sql_questions.main(str(path), n_train=300, epochs=4)
    yield Prelude(paths={"/tmp/sql-questions": path})


@prelude
def lds_toy(work: Path, block: Block) -> Iterator[Prelude]:
    """An LDS problem small enough to retrain 200 times in seconds: ``store`` with run ``"run"`` (one checkpoint
    pass of the examples' toy MLP over 64 training and 4 query examples, exact gradients), ``query_ids``, and the
    user's code the block names: ``train(subset, seed)`` (the toy MLP trained on those example ids, 30 full-batch
    SGD steps) and ``query_losses(model, queries)`` (numpy losses of those query ids); ``np``."""
    _examples()
    import _toy
    import numpy as np
    from torch.nn import functional as F

    import gradstore

    train_data, query_data = _toy.make_data(64, 4, seed=5)
    row = {i: n for n, i in enumerate(train_data.ids)}
    query_row = {i: n for n, i in enumerate(query_data.ids)}

    def train(subset: list[str], seed: int) -> torch.nn.Module:
        rows = torch.tensor([row[i] for i in subset])
        net = _toy.make_model(seed)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(30):
            F.cross_entropy(net(train_data.x[rows]), train_data.y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
        return net

    def query_losses(net: torch.nn.Module, queries: list[str]) -> np.ndarray:
        rows = torch.tensor([query_row[i] for i in queries])
        with torch.no_grad():
            return F.cross_entropy(net(query_data.x[rows]), query_data.y[rows], reduction="none").numpy()

    store = gradstore.open(work / "lds-store")
    model = train(train_data.ids, 0)  # the model attributed: trained on every example
    _toy.capture_pass(
        store, "run", model, train_data, query_data, checkpoint="final", learning_rate=0.1, step=30, projection=None
    )
    yield Prelude(
        {"store": store, "query_ids": list(query_data.ids), "train": train, "query_losses": query_losses, "np": np}
    )


# ---------------------------------------------------------------------------------------------- running
PARSED = {path: parse(path) for path in DOCS}
BLOCKS = [block for parsed in PARSED.values() for block in parsed.blocks]


@dataclass
class FileRun:
    """The shared state of one markdown file's blocks: namespace, working directory, outcome per block."""

    work: Path
    namespace: dict[str, Any]
    outcome: dict[int, str] = field(default_factory=dict)  # block number -> "passed" / "failed" / "skipped"


RUNS: dict[Path, FileRun] = {}


def execute(block: Block, state: FileRun) -> None:
    """Run the block's preludes, then the block, in the file's namespace (its setups cleaned up afterwards)."""
    with contextlib.ExitStack() as stack:
        source = block.source
        for name in block.setups:
            given = stack.enter_context(SETUPS[name](state.work, block))
            state.namespace.update(given.names)
            for written, actual in given.paths.items():
                assert f'"{written}"' in source, f"prelude {name} maps {written!r}, which {block.id} does not name"
                source = source.replace(f'"{written}"', repr(str(actual)))
        code = compile("\n" * (block.line - 1) + source, str(block.path), "exec")
        exec(code, state.namespace)


@pytest.fixture
def file_run(request, tmp_path_factory, monkeypatch) -> Callable[[Block], FileRun]:
    """``file_run(block)``: the state of the block's file, created on first use; the test runs in its directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "support"))  # tiny_models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only costs (a lot on a shared machine)
    request.addfinalizer(lambda: torch.set_num_threads(threads))

    def get(block: Block) -> FileRun:
        if block.path not in RUNS:
            work = tmp_path_factory.mktemp(block.path.stem)
            RUNS[block.path] = FileRun(work, {"__name__": "__doc_block__"})
        monkeypatch.chdir(RUNS[block.path].work)
        return RUNS[block.path]

    return get


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_block(block: Block, file_run) -> None:
    state = file_run(block)
    for earlier in PARSED[block.path].blocks[: block.number - 1]:
        if earlier.number not in state.outcome and not earlier.skip:  # not run yet: this block was selected alone
            try:
                execute(earlier, state)
                state.outcome[earlier.number] = "passed"
            except Exception:
                state.outcome[earlier.number] = "failed"
                pytest.fail(f"{earlier.id}, which {block.id} continues, failed:\n{traceback.format_exc()}")
    if block.skip:
        state.outcome[block.number] = "skipped"
        pytest.skip(block.skip)
    failed = [PARSED[block.path].blocks[n - 1].id for n, outcome in state.outcome.items() if outcome == "failed"]
    state.outcome[block.number] = "failed"
    try:
        execute(block, state)
    except Exception:
        if not failed:
            raise
        pytest.fail(f"{traceback.format_exc()}\n(earlier blocks this one may continue failed: {', '.join(failed)})")
    state.outcome[block.number] = "passed"


def test_markers() -> None:
    """Every doc-test marker is well formed and attached to a python block; there are blocks to run."""
    errors = [error for parsed in PARSED.values() for error in parsed.errors]
    assert not errors, "\n".join(errors)
    assert len(BLOCKS) >= 10
