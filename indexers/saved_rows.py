"""Prepared rows as plain tensors and back: what a row file holds (:mod:`gradstore.core.row_cache`).

:class:`~indexers.exact.PreparedRows` are ``ScreenedBlock`` s (bfloat16 kernel) or ``(ids, rows, scales)``
blocks (float32 kernel: the rows as stored, float16, bfloat16 or float32). :func:`rows_state` turns them into a
dict of tensors, lists, strings and ``None`` (what ``torch.save`` writes and ``torch.load(weights_only=True)``
reads without running code); :func:`rows_from_state` checks such a dict from a file before any search trusts it:
every tensor's dtype, rank, width and length, the kernel, and the total row count the caller expects. Rows kept
in pieces stay in pieces (a memory-mapped file's tensors are searched where they lie, never joined into a copy).
"""

from __future__ import annotations

from typing import Any

import torch

from indexers.exact import STORED_ROW_DTYPES, PreparedRows
from indexers.screening import RowPieces, Rows, ScreenedBlock

FORMAT = 1


class SavedRowsError(ValueError):
    """A saved state that is not prepared rows of the expected kind, width and length."""


def rows_state(rows: PreparedRows) -> dict[str, Any]:
    """The complete ``rows`` as a dict of tensors (no copy: the tensors are the prepared ones)."""
    if not rows.complete:
        raise ValueError("only complete prepared rows can be saved")
    return {"format": FORMAT, "kernel": rows.kernel, "blocks": [_block_state(block) for block in rows.blocks]}


def rows_from_state(state: Any, kernel: str, dim: int, n_rows: int) -> PreparedRows:
    """The :class:`PreparedRows` a :func:`rows_state` dict describes, checked to be ``n_rows`` rows of width
    ``dim`` prepared for ``kernel``; :class:`SavedRowsError` says what does not fit."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SavedRowsError(f"not saved prepared rows of format {FORMAT}")
    if state.get("kernel") != kernel:
        raise SavedRowsError(f"rows prepared for the {state.get('kernel')!r} kernel, not {kernel!r}")
    blocks = state.get("blocks")
    if not isinstance(blocks, list):
        raise SavedRowsError("saved rows hold no list of blocks")
    prepared = [(_screened if kernel == "bfloat16" else _float32_kernel_block)(block, dim) for block in blocks]
    found = sum(len(block) if isinstance(block, ScreenedBlock) else len(block[0]) for block in prepared)
    if found != n_rows:
        raise SavedRowsError(f"saved rows hold {found} rows, the selection {n_rows}")
    return PreparedRows(kernel, prepared)


def _block_state(block: ScreenedBlock | tuple) -> dict[str, Any]:
    if isinstance(block, ScreenedBlock):
        return {
            "ids": block.ids,
            "exact": _pieces(block.exact),
            "scales": block.scales,
            "screen": _pieces(block.screen),
            "norms": block.norms,
            "residuals": block.residuals,
        }
    ids, rows, scales = block
    return {"ids": ids, "rows": rows, "scales": scales}


def _pieces(rows: Rows) -> list[torch.Tensor]:
    return list(rows.pieces) if isinstance(rows, RowPieces) else [rows]


def _screened(state: Any, dim: int) -> ScreenedBlock:
    ids = _ids(state)
    n = len(ids)
    exact = _rows(state.get("exact"), "exact", dim, n, STORED_ROW_DTYPES)
    screen = _rows(state.get("screen"), "screen", dim, n, (torch.bfloat16,))
    norms, residuals = _vector(state, "norms", n), _vector(state, "residuals", n)
    return ScreenedBlock(ids, exact, _scales(state, n), screen, norms, residuals)


def _float32_kernel_block(state: Any, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    ids = _ids(state)
    rows = state.get("rows")
    if not _is_matrix(rows, STORED_ROW_DTYPES, dim) or len(rows) != len(ids):
        raise SavedRowsError(f"a block's rows are not [{len(ids)}, {dim}] rows of {STORED_ROW_DTYPES}")
    return ids, rows, _scales(state, len(ids))


def _ids(state: Any) -> torch.Tensor:
    if not isinstance(state, dict):
        raise SavedRowsError("a saved block is not a dict of tensors")
    ids = state.get("ids")
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.ndim != 1 or ids.device.type != "cpu":
        raise SavedRowsError("a block's ids are not a 1-D int64 CPU tensor")
    return ids


def _rows(pieces: Any, name: str, dim: int, n: int, dtypes: tuple[torch.dtype, ...]) -> Rows:
    if not isinstance(pieces, list) or not pieces or not all(_is_matrix(p, dtypes, dim) for p in pieces):
        raise SavedRowsError(f"a block's {name} rows are not [rows, {dim}] tensors of {dtypes}")
    if len({piece.dtype for piece in pieces}) != 1 or sum(len(piece) for piece in pieces) != n:
        raise SavedRowsError(f"a block's {name} rows are not {n} rows of one dtype")
    return pieces[0] if len(pieces) == 1 else RowPieces(pieces)


def _is_matrix(value: Any, dtypes: tuple[torch.dtype, ...], dim: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype in dtypes
        and value.ndim == 2
        and value.shape[1] == dim
        and value.device.type == "cpu"
    )


def _vector(state: dict, name: str, n: int) -> torch.Tensor:
    value = state.get(name)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.shape != (n,):
        raise SavedRowsError(f"a block's {name} are not float32 [{n}]")
    if value.device.type != "cpu":
        raise SavedRowsError(f"a block's {name} are not on the CPU")
    return value


def _scales(state: dict, n: int) -> torch.Tensor | None:
    return None if state.get("scales") is None else _vector(state, "scales", n)
