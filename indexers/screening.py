"""The bfloat16 scoring kernel of exact search: a bf16 GEMM screens rows, float32 rescoring decides.

Scores from a bf16 GEMM (both operands rounded to bfloat16, products accumulated in float32 and rounded to a
bfloat16 result) differ from the float32 scores by at most a bound known per (row, query) pair:

    |s q.v - s q~.v~|  <=  s (||dq|| ||v|| + ||q~|| ||dv|| + 2 gamma ||q~|| (||v|| + ||dv||) + u |out| / (1 - u))

with ``q~ = bf16(q)``, ``dq = q - q~`` (likewise for the row ``v`` and its scale ``s``), ``u = 2**-8`` the bf16
unit roundoff of the rounded result and ``gamma = d 2**-24`` the worst-case float32 accumulation error (counted
twice: once for the bf16 GEMM, once for the float32 score the result is compared with). Every row whose upper
bound reaches the k-th best lower bound is a candidate and is rescored in float32; all others provably cannot
enter the top-k. So the result equals the float32 kernel's (scores and ids, ties broken by the smaller id), at
close to the cost of the bf16 GEMM when the candidates are few (random 4,096-dim rows: ~50 per query).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BF16_ROUNDOFF = 2.0**-8
SAFETY = 1.01  # covers the float32 rounding of the norms and of the bound itself (relative ~1e-4)
TILE_ELEMENTS = 1 << 22  # float32 elements converted at a time (16 MB: few large ops, good on a busy CPU)
TINY = 2.0**-133  # bf16 rounding error bound of a float32 subnormal, absolute
RESCORE_ELEMENTS = 1 << 24  # float32 elements of candidate rows gathered at a time (64 MB)


def fast_bfloat16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX)."""
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"bfloat16"`` or ``"float32"``: ``"auto"`` picks bfloat16 on a CPU with native bf16 matmul."""
    if kernel not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"kernel must be 'auto', 'bfloat16' or 'float32', got {kernel!r}")
    if kernel == "auto":
        return "bfloat16" if device.type == "cpu" and fast_bfloat16_matmul() else "float32"
    return kernel


@dataclass
class ScreenedBlock:
    """Rows ready for the bf16 kernel: the stored rows (exact), their bf16 copy, and the norms of the bound.

    Row ``i`` is ``scales[i] * exact[i]`` (``scales`` ``None``: 1); ``norms`` are ``||exact[i]||`` and
    ``residuals`` ``||exact[i] - screen[i]||``, both unscaled."""

    ids: torch.Tensor
    exact: torch.Tensor
    scales: torch.Tensor | None
    screen: torch.Tensor
    norms: torch.Tensor
    residuals: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


def screened_block(
    ids: torch.Tensor,
    exact: torch.Tensor,
    scales: torch.Tensor | None,
    screen: torch.Tensor | None = None,
    measure_residuals: bool = True,
) -> ScreenedBlock:
    """Make the bf16 copy (into ``screen`` when given, e.g. a reused buffer) and the norms, one float32 tile at
    a time (converted once, then rounded and measured while it is hot).

    ``measure_residuals=False`` skips measuring ``||v - bf16(v)||`` and uses its a-priori bound
    ``u ||v||`` (round to nearest; bf16 has float32's exponent range), saving two passes per tile at the cost
    of a wider screen (more rows rescored): the choice for blocks scored once."""
    rows = exact.shape[0]
    if exact.dtype == torch.bfloat16:
        norms = torch.linalg.vector_norm(exact, dim=1, dtype=torch.float32)
        return ScreenedBlock(ids, exact, scales, exact, norms, torch.zeros_like(norms))
    screen = torch.empty(exact.shape, dtype=torch.bfloat16, device=exact.device) if screen is None else screen[:rows]
    norms = torch.empty(rows, dtype=torch.float32, device=exact.device)
    residuals = torch.empty_like(norms)
    tile_rows = max(1, TILE_ELEMENTS // max(1, exact.shape[1]))
    tile = torch.empty(min(rows, tile_rows), exact.shape[1], dtype=torch.float32, device=exact.device)
    error = torch.empty_like(tile) if measure_residuals else None
    for start in range(0, rows, tile_rows):
        part = slice(start, start + tile_rows)
        n = min(rows, start + tile_rows) - start
        values = exact[part] if exact.dtype == torch.float32 else tile[:n].copy_(exact[part])
        screen[part].copy_(values)
        torch.linalg.vector_norm(values, dim=1, out=norms[part])
        if error is not None:
            torch.linalg.vector_norm(error[:n].copy_(screen[part]).sub_(values), dim=1, out=residuals[part])
    if error is None:
        torch.mul(norms, BF16_ROUNDOFF, out=residuals).add_(TINY * exact.shape[1] ** 0.5)
    return ScreenedBlock(ids, exact, scales, screen, norms, residuals)


class ScreenedQueries:
    """Signed float32 queries ``[q, d]`` with their bf16 copy and the query side of the bound."""

    def __init__(self, queries: torch.Tensor) -> None:
        self.exact_t = queries.T.contiguous()
        rounded = queries.to(torch.bfloat16)
        self.screen_t = rounded.T.contiguous()
        gamma = 2 * queries.shape[1] * 2.0**-24
        norm = torch.linalg.vector_norm(rounded.double(), dim=1)
        residual = torch.linalg.vector_norm(queries.double() - rounded.double(), dim=1)
        # bound = s * (norms (x) row_factor[0] + residuals (x) row_factor[1]) + u/(1-u) |out| s
        self.factors = (SAFETY * torch.stack([residual + gamma * norm, (1 + gamma) * norm])).to(torch.float32)


def candidate_scores(
    block: ScreenedBlock, queries: ScreenedQueries, floor: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scores and ids of the block's rows that can reach each query's top-k.

    ``floor [q]`` is a lower bound of each query's final k-th best score (``-inf`` when unknown). Returns
    ``(scores [q, m], ids [q, m])``, padded with ``-inf`` scores (and the largest id) where a query has
    fewer than ``m`` candidates, or ``(scores [q, m], ids [m])`` when the queries share most candidates."""
    approx = (block.screen @ queries.screen_t).to(torch.float32)
    bound = torch.stack([block.norms, block.residuals], 1) @ queries.factors
    bound.add_(approx.abs(), alpha=SAFETY * BF16_ROUNDOFF / (1 - BF16_ROUNDOFF))
    if block.scales is not None:
        approx.mul_(block.scales[:, None])
        bound.mul_(block.scales.abs()[:, None])
    if len(block) >= k:
        floor = torch.maximum(floor, (approx - bound).topk(k, dim=0).values[k - 1])
    candidate = approx.add_(bound) >= floor  # [n, q]: upper bound reaches the floor
    query_of, row_of = candidate.T.nonzero().unbind(1)  # grouped by query, rows ascending
    counts = torch.bincount(query_of, minlength=candidate.shape[1])
    shared = candidate.any(dim=1).nonzero().flatten()
    width = int(counts.max()) if len(counts) else 0
    if len(counts) * width > 2 * len(shared):  # queries share candidates: one GEMM over their union
        return _rescored(block, shared, queries.exact_t).T, block.ids[shared]
    rows = torch.full((len(counts), width), -1, dtype=torch.int64, device=approx.device)
    rows[query_of, torch.arange(len(row_of), device=approx.device) - (counts.cumsum(0) - counts)[query_of]] = row_of
    scores = torch.empty(rows.shape, dtype=torch.float32, device=approx.device)
    step = max(1, RESCORE_ELEMENTS // max(1, width * block.exact.shape[1]))
    for start in range(0, len(rows), step):
        gathered = block.exact[rows[start : start + step].clamp(min=0)].to(torch.float32)  # [c, m, d]
        scores[start : start + step] = (gathered @ queries.exact_t.T[start : start + step, :, None])[..., 0]
    if block.scales is not None:
        scores.mul_(block.scales[rows.clamp(min=0)])
    padding = rows < 0
    scores[padding] = -torch.inf
    ids = block.ids[rows.clamp(min=0)]
    ids[padding] = torch.iinfo(torch.int64).max
    return scores, ids


def _rescored(block: ScreenedBlock, rows: torch.Tensor, queries_t: torch.Tensor) -> torch.Tensor:
    """Float32 scores ``[len(rows), q]`` of the block's ``rows``."""
    scores = block.exact[rows].to(torch.float32) @ queries_t
    return scores if block.scales is None else scores.mul_(block.scales[rows, None])


def as_scales(scales: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """A block's scales as a float32 tensor on ``device`` (``None`` stays ``None``)."""
    return None if scales is None else torch.from_numpy(np.asarray(scales, np.float32)).to(device)
