"""Per-token projected gradients: each token's share of an example's row (for per-token attribution).

A captured layer's per-example gradient is a sum over the positions its input passed through,
``G = sum_t dy_t x_t^T`` (an embedding's likewise, one one-hot ``x_t`` per position), so the projected row is
``sum_t P_out dy_t x_t^T P_in^T`` and the term of position ``t`` is that token's share. :class:`TokenGradientCapture`
records those terms with the capture's own projection matrices (seeded or a fixed basis), normaliser and
loss scaling: the token rows of an example sum to the row :class:`~ingest.capture.GradientCapture` records for it
(up to float rounding). Memory: ``B x T x dim`` float32 per batch, so use it for a few examples at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ingest.capture import CaptureConfig, GradientCapture
from ingest.hooks import ActiveBatch, LayerHook
from ingest.ids import content_hashes, find_inputs
from ingest.per_example import tokens_view


@dataclass
class TokenRows:
    """Per-token rows of one batch."""

    example_ids: list[str]
    rows: torch.Tensor  # float32 [B, T, dim], CPU; rows[b].sum(0) is example b's captured row
    inputs: torch.Tensor | None  # [B, T] token ids (the model's input), CPU
    mask: torch.Tensor | None  # [B, T] bool, the positions that are tokens (attention mask), CPU


class TokenLayerHook(LayerHook):
    """A layer hook that keeps each position's term of the layer's block instead of their sum."""

    FUSABLE = False  # per-token blocks need each position's projected input and gradient: the hooks' route
    PER_POSITION = True

    def add_rows(
        self, generation: int, x: torch.Tensor, dy: torch.Tensor, owner: torch.Tensor, bias: bool = True
    ) -> None:
        """Rows that mix the examples (a MoE layer's routed tokens) have no per-position split here."""
        raise ValueError(
            f"per-token capture: layer {self.slot.name!r} sees tokens gathered across the batch (a MoE layer); "
            "exclude it"
        )

    def add_gradient(self, generation: int, grad: torch.Tensor, positions: int | None = None) -> None:
        """A use captured at its op (:mod:`ingest.uses`) as materialised gradients per example and position
        ``[B x T, d_out, d_in (+1)]``."""
        batch = self.live_batch(generation)
        if batch is None:
            return
        if positions is None:
            raise ValueError(
                f"per-token capture: layer {self.slot.name!r} is used in a way that has no per-position split "
                "(e.g. a grouped convolution); exclude it"
            )
        with torch.no_grad():
            block = self.gradient_block(grad.float())
            rows = self.owner.token_rows(batch, positions, block.device, self.slot.name)
            rows[:, :, self.slot.offset : self.slot.offset + self.slot.size] += block.view(batch.size, positions, -1)
        self.owner.gradient_arrived(batch)

    def _backward(self, generation: int, route: str, saved: torch.Tensor, dy: torch.Tensor) -> None:
        batch = self.live_batch(generation)
        if batch is None:
            return
        with torch.no_grad():
            dy = tokens_view(dy.detach(), batch.size)
            size, length = dy.shape[:2]
            # every position as its own one-token "example": the layer's block of that token alone
            block = self._block(
                route, saved.reshape(size * length, 1, *saved.shape[2:]), dy.reshape(size * length, 1, dy.shape[-1])
            )
            rows = self.owner.token_rows(batch, length, block.device, self.slot.name)
            rows[:, :, self.slot.offset : self.slot.offset + self.slot.size] += block.view(size, length, -1)
        self.owner.gradient_arrived(batch)


class TokenGradientCapture(GradientCapture):
    """A :class:`~ingest.capture.GradientCapture` whose backwards yield per-token rows (:attr:`results`).

    Every captured layer must see the same positions (a sequence model's tokens); curvature statistics are not
    collected.
    """

    hook_class = TokenLayerHook

    def __init__(
        self,
        model: nn.Module,
        config: CaptureConfig,
        optimizer: torch.optim.Optimizer | None = None,
        grad_scaler: Any | None = None,
    ) -> None:
        if config.curvature:
            raise ValueError("per-token capture collects no curvature statistics (curvature=False)")
        super().__init__(model, lambda batch: None, config, optimizer=optimizer, grad_scaler=grad_scaler)
        self.results: list[TokenRows] = []

    def token_rows(self, batch: ActiveBatch, length: int, device: torch.device, layer: str) -> torch.Tensor:
        """The batch's ``[B, T, dim]`` buffer (zeros at first use); a layer seeing another ``T`` is refused."""
        if batch.rows is None:
            batch.rows = torch.zeros(batch.size, length, self.spec.dim, dtype=torch.float32, device=device)
        elif batch.rows.shape[1] != length:
            raise ValueError(
                f"per-token capture: layer {layer!r} sees {length} positions per example, other layers "
                f"{batch.rows.shape[1]}; exclude the layers that do not run once per token"
            )
        return batch.rows

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        previous = self.batch
        args, kwargs = super()._before_forward(module, args, kwargs)
        if self.batch is not None and self.batch is not previous:
            inputs = find_inputs(args, kwargs)
            self.batch.meta["inputs"] = None if inputs is None else inputs.detach().cpu()
        return args, kwargs

    def _finish(self, batch: ActiveBatch) -> None:
        if self.batch is batch:
            self.batch = None
        if batch.rows is None:
            return
        rows = batch.rows * batch.scales.to(batch.rows.device).view(-1, 1, 1)
        if self.grad_scaler is not None:
            rows = rows / float(self.grad_scaler.get_scale())
        ids = batch.meta["ids"]
        if ids is None:
            ids = content_hashes(*batch.meta["hash_source"])
        mask = batch.token_mask
        if mask is not None and tuple(mask.shape) != tuple(rows.shape[:2]):
            mask = None
        self.results.append(
            TokenRows(list(ids), rows.cpu(), batch.meta.get("inputs"), None if mask is None else mask.cpu())
        )
