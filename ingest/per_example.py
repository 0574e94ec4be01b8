"""Per-example gradient algebra for linear maps and embeddings (pure functions, no hooks).

Shapes: ``x`` is ``[B, T, d_in]`` (inputs), ``dy`` is ``[B, T, d_out]`` (gradients of the loss with
respect to the outputs), ``idx`` is ``[B, T]`` (embedding indices). Results are ``[B, rows, cols]``
matrices in the ``[out, in]`` orientation described in :mod:`ingest.projection`. Everything is
batched matmul/scatter: no Python loop over examples or tokens.
"""

from __future__ import annotations

import torch

ROUTES = ("project", "materialize")


def tokens_view(t: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Reshape ``[B, *, d]`` to ``[B, T, d]`` (``T`` = product of the middle dims, 1 if none)."""
    return t.reshape(batch_size, -1, t.shape[-1])


def route_flops(route: str, tokens: int, d_in_eff: int, d_out: int, k_in: int, k_out: int) -> int:
    """Multiply-adds per example of one factorized route (the documented cost rule).

    * ``project``: project every token's input and output gradient, then contract over tokens:
      ``T * (d_in_eff * k_in + d_out * k_out + k_out * k_in)``.
    * ``materialize``: form ``G = sum_t dy_t x_t^T`` then project both sides:
      ``T * d_in_eff * d_out + d_out * d_in_eff * k_in + k_out * d_out * k_in``.
    """
    if route == "project":
        return tokens * (d_in_eff * k_in + d_out * k_out + k_out * k_in)
    if route == "materialize":
        return tokens * d_in_eff * d_out + d_out * d_in_eff * k_in + k_out * d_out * k_in
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def choose_route(tokens: int, d_in_eff: int, d_out: int, k_in: int, k_out: int) -> str:
    """The cheaper factorized route by :func:`route_flops` (ties go to ``project``)."""
    project = route_flops("project", tokens, d_in_eff, d_out, k_in, k_out)
    materialize = route_flops("materialize", tokens, d_in_eff, d_out, k_in, k_out)
    return "materialize" if materialize < project else "project"


def input_operands(p_in: torch.Tensor, d_in: int, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``P_in`` split for :func:`project_tokens`: ``(P_in[:, :d_in]^T`` contiguous ``[d_in, k_in]``, the bias
    column ``[k_in]`` or None``)``. Contiguous ``[d, k]`` operands make the skinny GEMM a plain ``mm``/``addmm``."""
    return p_in[:, :d_in].T.contiguous(), p_in[:, d_in].contiguous() if has_bias else None


def project_tokens(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` over the last dim as one 2-D GEMM (bias fused into ``addmm``): ``[..., k]``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out.view(*x.shape[:-1], weight_t.shape[1])


def project_inputs(x: torch.Tensor, p_in: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """``[x, 1] @ P_in^T`` without building the augmented input: ``[B, T, k_in]``."""
    return project_tokens(x, *input_operands(p_in, x.shape[-1], has_bias))


def embedding_project_inputs(idx: torch.Tensor, p_in: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """``P_in`` applied to one-hot rows = a column gather of ``P_in``: ``[B, T, k_in]``.

    Tokens equal to ``padding_idx`` get zeros (their embedding row receives no gradient).
    """
    out = p_in.T[idx]
    if padding_idx is not None:
        out = out * (idx != padding_idx).unsqueeze(-1).to(out.dtype)
    return out


def contract_tokens(x_p: torch.Tensor, dy_p: torch.Tensor) -> torch.Tensor:
    """``sum_t dy_p[b, t] x_p[b, t]^T`` in float32: ``[B, k_out, k_in]``."""
    return torch.bmm(dy_p.float().transpose(1, 2), x_p.float())


def linear_exact(x: torch.Tensor, dy: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """Exact per-example gradient ``[B, d_out, d_in (+1)]``; the last column is the bias gradient."""
    grad = torch.bmm(dy.transpose(1, 2), x).float()
    if has_bias:
        grad = torch.cat([grad, dy.sum(dim=1, dtype=torch.float32).unsqueeze(-1)], dim=-1)
    return grad


def embedding_exact(idx: torch.Tensor, dy: torch.Tensor, num_embeddings: int, padding_idx: int | None) -> torch.Tensor:
    """Exact per-example embedding gradient in ``[dim, num_embeddings]`` orientation (= ``weight.grad.T``)."""
    batch, _, dim = dy.shape
    dy = dy.float()
    if padding_idx is not None:
        dy = dy * (idx != padding_idx).unsqueeze(-1).to(dy.dtype)
    rows = torch.zeros(batch, num_embeddings, dim, dtype=dy.dtype, device=dy.device)
    rows.scatter_add_(1, idx.unsqueeze(-1).expand(-1, -1, dim), dy)
    return rows.transpose(1, 2)


def project_gradient(grad: torch.Tensor, p_in: torch.Tensor, p_out: torch.Tensor) -> torch.Tensor:
    """``P_out G P_in^T`` for a batch of materialised gradients: ``[B, k_out, k_in]``."""
    return torch.matmul(p_out.float(), torch.matmul(grad, p_in.float().T))


def dense_project(grad: torch.Tensor, p_dense: torch.Tensor) -> torch.Tensor:
    """``P vec(G)`` (row-major ``vec``) for a batch: ``[B, k]``."""
    return torch.matmul(grad.flatten(1), p_dense.float().T)
