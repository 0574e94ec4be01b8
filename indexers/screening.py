"""The bfloat16 scoring kernel of exact search: a bf16 GEMM screens rows, float32 rescoring decides.

The screen multiplies the bf16 rows by bf16 copies of the unit-norm queries ``u = q / ||q||`` (products
accumulated in float32, result rounded to bf16). Its result differs from the true ``v . u`` by at most

    ||du|| ||v|| + ||u~|| ||dv|| + 2 gamma ||u~|| (||v|| + ||dv||) + u_bf16 |out| / (1 - u_bf16)

with ``u~ = bf16(u)``, ``du = u - u~`` (likewise ``dv`` for the row), ``u_bf16 = 2**-8`` the rounding of the
result and ``gamma = d 2**-24`` the worst-case float32 accumulation error (counted twice: for the GEMM and for
the float32 score it is compared with), all times a 1% safety factor. Taking the largest query-side factors
and the row's largest ``|out|`` gives one bound per row, valid for every query. A row (times its scale ``s``)
is rescored in float32 when, for some query, its upper bound reaches that query's floor: the k-th best float32
score known so far (from earlier blocks, and from one dot product each with its ``2k`` best rows of this block on
the screen among the best rows of strided groups). Besides the groups' maxima, only per-row passes (the screen's
row minimum and maximum) run over the whole ``[rows, queries]`` screen; the per-query test runs on the few rows
that pass the per-row one. No row
of the float32 top-k, ties included, can be dropped, so the result equals the float32 kernel's (scores and
ids, ties broken by the smaller id), at close to the cost of the bf16 GEMM when candidates are few. Where they
are many (more than :data:`DENSE_SHARE` of a block: rows whose scores lie within the screen's error of each
other, e.g. a query's cluster), every row of the block is scored in float32 instead: the screen then costs its
GEMM on top of the float32 kernel, never a gather of most of the rows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

BF16_ROUNDOFF = 2.0**-8
SAFETY = 1.01  # covers the float32 rounding of the norms and of the bound itself (relative ~1e-4)
QUERY_CHUNK_BYTES = 128 << 10  # float64 queries prepared at a time (heap-sized temporaries, no page faults)
GATHER_ELEMENTS = 1 << 22  # float32 elements of rows gathered at a time for rescoring pairs (16 MB, reused)
TILE_ELEMENTS = 1 << 20  # float32 elements converted at a time (4 MB: a tile and its error stay in the shared cache)


def fast_bfloat16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX)."""
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"bfloat16"`` or ``"float32"``: ``"auto"`` picks bfloat16 on a CPU with native bf16 matmul.

    The bfloat16 kernel runs on CPUs only: its error bound counts float32 accumulation, which CUDA's bf16
    GEMMs do not promise (cuBLAS may reduce split-K partial sums in bf16)."""
    if kernel not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"kernel must be 'auto', 'bfloat16' or 'float32', got {kernel!r}")
    if kernel == "auto":
        return "bfloat16" if device.type == "cpu" and fast_bfloat16_matmul() else "float32"
    if kernel == "bfloat16" and device.type != "cpu":
        raise ValueError(
            f"the bfloat16 kernel runs on the CPU only (its error bound needs float32 accumulation, which bf16 "
            f"GEMMs on {device.type} do not promise); use kernel='float32' or 'auto' there"
        )
    return kernel


class _OneThread:
    """Torch's CPU operations on one thread while some search is inside; the count before the first entry is
    restored when the last one leaves (safe for nested and concurrent searches)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._restore = 1

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._restore = torch.get_num_threads()
                torch.set_num_threads(1)
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    torch.set_num_threads(self._restore)


one_thread = _OneThread()


class RowPieces:
    """Rows ``[n, d]`` held as consecutive pieces (the buffers of the Lance batches one block was read in) instead
    of being copied into one tensor: float16 rows are read tile by tile once, to make the block's screen, and
    afterwards only a few at a time, for rescoring; bf16 rows are screened one GEMM per piece."""

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        if not pieces or any(piece.ndim != 2 or piece.shape[1] != pieces[0].shape[1] for piece in pieces):
            raise ValueError("row pieces must be one or more [rows, d] tensors of one width")
        self.pieces = pieces
        self.starts = np.cumsum([0] + [len(piece) for piece in pieces]).tolist()
        self.shape = torch.Size((self.starts[-1], pieces[0].shape[1]))
        self.dtype = pieces[0].dtype
        self.device = pieces[0].device

    def __len__(self) -> int:
        return self.shape[0]

    def tiles(self, rows: torch.Tensor, tile_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(where, tile)``: ``tile`` is ``self[rows[where]]`` in float32, at most ``tile_rows`` rows, each piece's
        rows selected at once (``rows`` an int64 tensor of positions, any order, repeats allowed)."""
        ordered, order = rows.sort()
        bounds = torch.searchsorted(ordered, torch.tensor(self.starts, device=rows.device)).tolist()
        for piece, start, low, high in zip(self.pieces, self.starts, bounds, bounds[1:]):
            for first in range(low, high, tile_rows):  # index_select: several times faster than tensor indexing
                part = slice(first, min(high, first + tile_rows))
                yield order[part], piece.index_select(0, ordered[part] - start).to(torch.float32)


Rows = torch.Tensor | RowPieces


class _Scratch(threading.local):
    """Per-thread buffers reused across searches (a fresh multi-megabyte tensor per search costs more in page
    faults than the copies into it), grown as needed, one per use."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, use: str, rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        held = self.buffers.get((use, dtype, device))
        if held is None or held.numel() < rows * dim:
            held = self.buffers[(use, dtype, device)] = torch.empty(rows * dim, dtype=dtype, device=device)
        return held[: rows * dim].view(rows, dim)


_scratch = _Scratch()


def _gathered(rows: Rows, positions: torch.Tensor) -> torch.Tensor:
    """``rows[positions]`` in float32, in a reused buffer (valid until the next call on this thread). Rows kept in
    pieces are read in sorted order, each piece's at once, into the stored dtype, then converted and put back in
    the order asked."""
    count, dim, device = len(positions), rows.shape[1], positions.device
    out = _scratch.get("out", count, dim, torch.float32, device)
    if isinstance(rows, torch.Tensor) and rows.dtype == torch.float32:
        return torch.index_select(rows, 0, positions, out=out)
    stored = _scratch.get("stored", count, dim, rows.dtype, device)
    if isinstance(rows, torch.Tensor):
        return out.copy_(torch.index_select(rows, 0, positions, out=stored))
    ordered, order = positions.sort()
    bounds = torch.searchsorted(ordered, torch.tensor(rows.starts, device=device)).tolist()
    for piece, start, low, high in zip(rows.pieces, rows.starts, bounds, bounds[1:]):
        if high > low:
            torch.index_select(piece, 0, ordered[low:high] - start, out=stored[low:high])
    converted = _scratch.get("converted", count, dim, torch.float32, device).copy_(stored)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(count, device=device))
    return torch.index_select(converted, 0, inverse, out=out)


def gathered_tiles(rows: Rows, positions: torch.Tensor, tile_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(where, tile)``: ``tile`` is ``rows[positions[where]]`` in float32, at most ``tile_rows`` rows, every
    position in one tile: consecutive parts of ``positions`` for a tensor (converted into one reused buffer, valid
    until the next tile), each piece's rows for :class:`RowPieces`. Gathering many rows into one fresh float32
    tensor cost more in page faults than in copying (1,280 x 4,096 rows: 7 ms against 1.6 ms into a buffer
    already touched)."""
    if isinstance(rows, RowPieces):
        yield from rows.tiles(positions, tile_rows)
        return
    buffer = torch.empty(min(len(positions), tile_rows), rows.shape[1], dtype=torch.float32, device=rows.device)
    for start in range(0, len(positions), tile_rows):
        stop = min(start + tile_rows, len(positions))
        where = torch.arange(start, stop, device=positions.device)
        yield where, buffer[: stop - start].copy_(rows.index_select(0, positions[start:stop]))


def row_tiles(rows: Rows, tile_rows: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(positions, tile)``: ``rows`` in consecutive tiles of at most ``tile_rows`` rows, none across two pieces."""
    start = 0
    for piece in rows.pieces if isinstance(rows, RowPieces) else [rows]:
        for offset in range(0, len(piece), tile_rows):
            tile = piece[offset : offset + tile_rows]
            yield slice(start + offset, start + offset + len(tile)), tile
        start += len(piece)


def float32_products(rows: Rows, queries_t: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``scales[:, None] * (rows @ queries_t)`` in float32 (``scales`` ``None``: 1), the scores of a block of
    scaled rows without materialising them. On the CPU, low-precision rows are upcast one cache-sized tile at a
    time into a small reused buffer, each tile multiplied while it is hot: measured on 65,536 float16 rows x
    4,096, 2.4-2.8x faster than upcasting the whole block first (1-64 queries), whose 1 GB float32 copy is
    written to memory and read back. Rows in pieces (:class:`RowPieces`) are read tile by tile the same way."""
    if isinstance(rows, torch.Tensor) and rows.dtype == torch.float32:
        products = rows @ queries_t
    elif isinstance(rows, torch.Tensor) and rows.device.type != "cpu":
        products = rows.to(torch.float32) @ queries_t
    else:
        products = torch.empty(rows.shape[0], queries_t.shape[1], dtype=torch.float32, device=rows.device)
        tile_rows = max(1, TILE_ELEMENTS // max(1, rows.shape[1]))
        tile = torch.empty(min(rows.shape[0], tile_rows), rows.shape[1], dtype=torch.float32, device=rows.device)
        for part, stored in row_tiles(rows, tile_rows):
            values = stored if stored.dtype == torch.float32 else tile[: len(stored)].copy_(stored)
            torch.mm(values, queries_t, out=products[part])
    return products if scales is None else products.mul_(scales[:, None])


@dataclass
class ScreenedBlock:
    """Rows ready for the bf16 kernel: the stored rows (exact), their bf16 copy, and the norms of the bound.

    Row ``i`` is ``scales[i] * exact[i]`` (``scales`` ``None``: 1); ``norms`` are ``||exact[i]||`` and
    ``residuals`` ``||exact[i] - screen[i]||``, both unscaled."""

    ids: torch.Tensor
    exact: Rows
    scales: torch.Tensor | None
    screen: Rows
    norms: torch.Tensor
    residuals: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


def screened_block(
    ids: torch.Tensor, exact: Rows, scales: torch.Tensor | None, max_norm: float | None = None
) -> ScreenedBlock:
    """Make the bf16 copy, the row norms and the rows' bf16 rounding errors, one float32 tile at a time
    (converted once, then rounded and measured while it is hot). bf16 rows are their own screen (no rounding
    error, no copy: rows in pieces stay in them); their norms are measured the same way (torch's bf16 reductions
    are several times slower than converting), or, given ``max_norm`` (an upper bound of every row's norm the
    caller guarantees), not at all: the bound needs no more than an upper bound of each norm."""
    rows, dim = exact.shape
    if exact.dtype == torch.bfloat16:
        if max_norm is not None:
            norms = torch.full((rows,), max_norm, dtype=torch.float32, device=exact.device)
        else:
            norms = _row_norms(exact)
        return ScreenedBlock(ids, exact, scales, exact, norms, torch.zeros_like(norms))
    screen = torch.empty(exact.shape, dtype=torch.bfloat16, device=exact.device)
    norms = torch.empty(rows, dtype=torch.float32, device=exact.device)
    residuals = torch.empty_like(norms)
    tile_rows = max(1, TILE_ELEMENTS // max(1, dim))
    tile = torch.empty(min(rows, tile_rows), dim, dtype=torch.float32, device=exact.device)
    error = torch.empty_like(tile)
    for part, stored in row_tiles(exact, tile_rows):
        n = len(stored)
        values = stored if stored.dtype == torch.float32 else tile[:n].copy_(stored)
        screen[part].copy_(values)
        torch.linalg.vector_norm(values, dim=1, out=norms[part])
        torch.linalg.vector_norm(error[:n].copy_(screen[part]).sub_(values), dim=1, out=residuals[part])
    return ScreenedBlock(ids, exact, scales, screen, norms, residuals)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    """float32 norms of low-precision rows, converted to float32 one tile at a time."""
    norms = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    tile_rows = max(1, TILE_ELEMENTS // max(1, rows.shape[1]))
    tile = torch.empty(min(rows.shape[0], tile_rows), rows.shape[1], dtype=torch.float32, device=rows.device)
    for part, stored in row_tiles(rows, tile_rows):
        torch.linalg.vector_norm(tile[: len(stored)].copy_(stored), dim=1, out=norms[part])
    return norms


class ScreenedQueries:
    """Signed float32 queries ``[q, d]``, and their unit-norm bf16 copy with the query side of the bound.

    Screening with unit queries makes the query side of the bound the same for every query, so one bound per
    row serves all queries (cheap per-row passes instead of per-pair ones)."""

    def __init__(self, queries: torch.Tensor) -> None:
        with one_thread():  # small float64 operations: thread barriers would cost more than they gain
            self._prepare(queries)

    def _prepare(self, queries: torch.Tensor) -> None:
        self.exact = queries.contiguous()
        self.exact_t = queries.T.contiguous()
        count, dim = queries.shape
        screen = torch.empty(count, dim, dtype=torch.bfloat16, device=queries.device)
        norms, rounded_norm, residual = torch.empty(3, count, dtype=torch.float64, device=queries.device)
        per = max(1, QUERY_CHUNK_BYTES // (8 * max(1, dim)))
        for start in range(0, count, per):  # float64 in chunks: whole [q, d] temporaries cost more in page faults
            part = slice(start, start + per)
            unit = queries[part].double()
            norm = torch.linalg.vector_norm(unit, dim=1)
            norms[part] = norm = torch.where(norm > 0, norm, torch.ones_like(norm))
            unit.div_(norm[:, None])
            rounded = screen[part].copy_(unit.to(torch.float32)).double()
            torch.linalg.vector_norm(rounded, dim=1, out=rounded_norm[part])
            torch.linalg.vector_norm(unit.sub_(rounded), dim=1, out=residual[part])
        self.screen_t = screen.T.contiguous()
        self.norms = norms.to(torch.float32)
        gamma = 2 * dim * 2.0**-24
        # row bound = SAFETY * (||v|| * on_norms + ||dv|| * on_residuals + OUT * max_j |out_ij|)
        self.on_norms = SAFETY * float((residual + gamma * rounded_norm).max()) if count else 0.0
        self.on_residuals = SAFETY * float(((1 + gamma) * rounded_norm).max()) if count else 0.0


OUT = SAFETY * BF16_ROUNDOFF / (1 - BF16_ROUNDOFF)  # the bf16 result's rounding, relative to |result|
FLOOR_MARGIN = 2.0**-22  # the float32 division of a floor by a query norm, relative
#: Rows per strided group whose best row per query on the screen may be scored for the query's floor
#: (:func:`_floor_pairs`).
FLOOR_GROUP = 64
#: Beyond this share of a block's rows to rescore, every row is scored in float32 as stored (tiles upcast in
#: order, no gather): rows whose scores lie within the screen's error of each other for many queries (bench/screen.py's
#: clustered rows, before each query had its own floor: 10.7x torch fp32 gathering, 1.9x scoring every row).
DENSE_SHARE = 0.5
#: Below this share of the reaching rows times the queries, the pairs that reach are rescored one query at a time
#: (:func:`_query_products`) instead of by a GEMM of those rows and every query.
PAIR_SHARE = 0.125


def candidate_scores(
    block: ScreenedBlock, queries: ScreenedQueries, floor: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scores ``[q, m]`` of the rows ``ids`` (``[m]``, or ``[q, m]`` one list per query) of the block that
    can reach some query's top-k; a pair scored ``-inf`` is one of no interest (padding, or a row already in the
    query's list).

    ``floor [q]`` is a lower bound of each query's final k-th best float32 score (``-inf`` when unknown). The
    screen works in units of each query's norm: ``out_ij ~ v_i . q_j / ||q_j||``. Each query's floor is raised to
    the k-th best float32 score of its ``2k`` best rows among the winners of strided groups of rows on the screen
    (:func:`_floor_pairs`: one elementwise pass over the screen, then ``2k`` dot products per query). Besides
    that pass only per-row passes (the screen's row minimum and maximum) touch the whole ``[n, q]`` screen; the
    per-query test runs on the rows that pass the per-row one (see :func:`_reaching`). Those passes run on one
    thread: dozens of small operations, each a barrier for every thread, cost more in waits than they gain on a
    busy machine. The pairs that reach are rescored one query at a time (:func:`_query_products`) where they are
    few against the rows times the queries (a row seldom reaches more than one query: on N(0,1) rows 1,572 pairs
    of 1,474 rows, 64 queries), else by a GEMM of the rows that reach and every query, on every thread, or, beyond
    :data:`DENSE_SHARE` of the block, of every row."""
    out = _screen_products(block.screen, queries.screen_t)  # [n, q] bf16
    low, high = out.amin(dim=1), out.amax(dim=1)  # two reductions: 2.2 ms against aminmax's 3.2 on [50k, 64] bf16
    pairs = _floor_pairs(out, block.scales, k) if len(block) >= k else None  # passes over the screen: all threads
    with one_thread():
        pairs, pair_scores, rows, reach = _candidates(block, queries, floor, k, out, low.float(), high.float(), pairs)
        dense = len(rows) > DENSE_SHARE * len(block)  # the screen pruned little: score every row as stored
        if not dense and pairs is not None and int(reach.sum()) < PAIR_SHARE * reach.numel():
            _drop_pairs(reach, rows, pairs, False)
            scores, ids = _reached_scores(block, rows, reach, queries.exact)
            return torch.cat([pair_scores, scores], dim=1), torch.cat([block.ids[pairs], ids], dim=1)
    if dense:
        return float32_products(block.exact, queries.exact_t, block.scales).T, block.ids
    scores = _rescored(block, rows, queries.exact_t).T  # on every thread: a GEMM
    if pairs is None:
        return scores, block.ids[rows]
    _drop_pairs(scores.T, rows, pairs, -torch.inf)
    ids = torch.cat([block.ids[pairs], block.ids[rows].expand(len(pairs), -1)], dim=1)
    return torch.cat([pair_scores, scores], dim=1), ids


def _screen_products(screen: Rows, queries_t: torch.Tensor) -> torch.Tensor:
    """``screen @ queries_t`` (bf16 ``[n, q]``), one GEMM per piece of rows kept in pieces."""
    if isinstance(screen, torch.Tensor):
        return screen @ queries_t
    out = torch.empty(len(screen), queries_t.shape[1], dtype=torch.bfloat16, device=screen.device)
    for piece, start in zip(screen.pieces, screen.starts):
        torch.mm(piece, queries_t, out=out[start : start + len(piece)])
    return out


def _candidates(
    block: ScreenedBlock,
    queries: ScreenedQueries,
    floor: torch.Tensor,
    k: int,
    out: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    pairs: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`candidate_scores` after the screen, its row minimum ``low`` and maximum ``high`` and the rows each
    query's floor is scored on (``pairs [q, f]``, :func:`_floor_pairs`; ``None`` for a block of fewer than ``k``
    rows): those rows and their float32 scores, the rows that can reach some query's top-k and which queries'
    each reaches (``[rows, q]``)."""
    bound = torch.maximum(high, low.neg()).mul_(OUT)
    bound.add_(block.norms, alpha=queries.on_norms).add_(block.residuals, alpha=queries.on_residuals)
    best = high  # each row's largest (scaled) screen value over the queries
    if block.scales is not None:
        best = torch.where(block.scales >= 0, high * block.scales, low * block.scales)
        bound.mul_(block.scales.abs())
    pair_scores = None
    if pairs is not None:  # the float32 scores of each query's best rows on the screen give a tight floor
        counts = torch.full((len(pairs),), pairs.shape[1], dtype=torch.int64)
        pair_scores = _query_products(block, pairs.flatten(), counts, queries.exact).view(pairs.shape)
        floor = torch.maximum(floor, pair_scores.topk(k, dim=1).values[:, k - 1])
    unit_floor = floor / queries.norms
    unit_floor -= unit_floor.abs() * FLOOR_MARGIN
    return pairs, pair_scores, *_reaching(out, block.scales, best, bound, unit_floor)


def _floor_pairs(out: torch.Tensor, scales: torch.Tensor | None, k: int) -> torch.Tensor:
    """Rows ``[q, f]`` (``f = min(2k, groups)``, distinct per query) among each query's best on the (scaled)
    screen, whose float32 scores give its floor: the rows are cut into strided groups of about
    :data:`FLOOR_GROUP` (rows ``g``, ``g + m``, ``g + 2m``, ... for ``m`` groups: neighbouring similar rows fall
    into different groups), each group's best row per query is found in one elementwise pass over the screen, and
    each query keeps its ``2k`` best groups' rows (a query's top rows are in distinct groups but for chance
    collisions). ``2k`` so that bf16's ties and the rounding of the scaled values cost the floor little (with
    ``k``, bench/screen.py's clustered rows rescored 1.15x torch fp32 against 0.96x). Which rows it picks only
    sets how tight the floor is, never whether it holds (their float32 scores are exact). A per-query top-2k over
    the transposed screen found slightly better rows at four times the cost."""
    groups = max(k, len(out) // FLOOR_GROUP)
    members = len(out) // groups
    screen = out[: members * groups]
    if scales is not None:
        screen = screen * scales[: len(screen), None].to(out.dtype)
    grid = screen.view(members, groups, -1)  # grid[m, g] is row m * groups + g
    chosen = grid.amax(dim=0).topk(min(2 * k, groups), dim=0).indices  # [f, q]: each query's best groups
    # which member holds a chosen group's best, from the members of the chosen (group, query) pairs alone
    member = grid.gather(1, chosen.expand(members, -1, -1)).argmax(dim=0)  # [f, q]
    return member.mul_(groups).add_(chosen).T.contiguous()


def _query_products(block: ScreenedBlock, positions: torch.Tensor, counts: torch.Tensor, queries: torch.Tensor):
    """Float32 scores ``[P]`` of the block's rows ``positions`` (grouped by query: ``counts[j]`` rows of query ``j``,
    in order) with their queries (``queries [q, d]``), scaled: the rows gathered once (each piece of rows kept in
    pieces read once) into a reused float32 buffer, then one GEMV per query over its own rows (not every query's
    rows with every query, nor a gathered copy of the queries)."""
    scores = torch.empty(len(positions), dtype=torch.float32, device=positions.device)
    budget = max(1, GATHER_ELEMENTS // max(1, queries.shape[1]))  # rows gathered at a time
    pieces = []  # (query, first pair, pairs): each query's pairs cut to the budget
    for j, (first, size) in enumerate(zip((counts.cumsum(0) - counts).tolist(), counts.tolist())):
        pieces += [(j, at, min(budget, first + size - at)) for at in range(first, first + size, budget)]
    while pieces:  # consecutive pieces within the budget, their rows gathered at once
        taken, total = 1, pieces[0][2]
        while taken < len(pieces) and total + pieces[taken][2] <= budget:
            total, taken = total + pieces[taken][2], taken + 1
        start = pieces[0][1]
        rows = _gathered(block.exact, positions[start : start + total])
        for j, at, size in pieces[:taken]:
            torch.mv(rows[at - start : at - start + size], queries[j], out=scores[at : at + size])
        pieces = pieces[taken:]
    return scores if block.scales is None else scores.mul_(block.scales[positions])


def _reached_scores(
    block: ScreenedBlock, rows: torch.Tensor, reach: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scores and ids ``[q, m]`` of the pairs ``reach [rows, q]`` marks, each query's list padded to the
    longest with ``-inf``."""
    query_of, row_of = reach.T.nonzero(as_tuple=True)  # grouped by query
    counts = torch.bincount(query_of, minlength=reach.shape[1])
    positions = rows[row_of]
    values = _query_products(block, positions, counts, queries)
    width = max(1, int(counts.max()))
    column = torch.arange(len(positions), device=positions.device) - (counts.cumsum(0) - counts)[query_of]
    scores = torch.full((reach.shape[1], width), -torch.inf, dtype=torch.float32, device=values.device)
    ids = block.ids[:1].expand(reach.shape[1], width).clone()
    scores[query_of, column] = values
    ids[query_of, column] = block.ids[positions]
    return scores, ids


def _drop_pairs(table: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor, fill: float | bool) -> None:
    """Set ``table[i, j]`` (``[rows, q]``: the mask of the pairs that reach, or a view of the scores) to ``fill``
    where ``rows[i]`` (sorted) is one of ``pairs[j]``: the pair is already scored among the floor's pairs (each id
    once per query)."""
    if not len(rows):
        return
    at = torch.searchsorted(rows, pairs).clamp_(max=len(rows) - 1)
    present = rows[at] == pairs
    table[at[present], present.nonzero()[:, 0]] = fill


def _reaching(
    out: torch.Tensor, scales: torch.Tensor | None, best: torch.Tensor, bound: torch.Tensor, unit_floor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (sorted) whose upper bound ``scales * out_ij + bound_i`` reaches ``unit_floor_j`` for some query
    ``j``, and for which queries (``[rows, q]``). A row whose best value misses the lowest floor misses every
    query's (float32 rounding is monotone, so this per-row test never drops a row the per-query one keeps); the
    rest are tested per query."""
    rows = (best.sub(unit_floor.min()).add_(bound) >= 0).nonzero().flatten()
    values = out[rows].to(torch.float32)
    if scales is not None:
        values.mul_(scales[rows, None])
    reach = values.sub_(unit_floor).add_(bound[rows, None]) >= 0
    kept = reach.any(dim=1)
    return rows[kept], reach[kept]


def _rescored(block: ScreenedBlock, rows: torch.Tensor, queries_t: torch.Tensor) -> torch.Tensor:
    """Float32 scores ``[len(rows), q]`` of the block's ``rows``, a tile of rows at a time."""
    scores = torch.empty(len(rows), queries_t.shape[1], dtype=torch.float32, device=queries_t.device)
    for where, tile in gathered_tiles(block.exact, rows, max(1, TILE_ELEMENTS // max(1, queries_t.shape[0]))):
        scores.index_copy_(0, where, tile @ queries_t)
    return scores if block.scales is None else scores.mul_(block.scales[rows, None])


def as_scales(scales: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """A block's scales as a float32 tensor on ``device`` (``None`` stays ``None``)."""
    return None if scales is None else torch.from_numpy(np.asarray(scales, np.float32)).to(device)
