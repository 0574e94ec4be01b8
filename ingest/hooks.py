"""Module hooks: keep (projected) inputs in the forward, turn output gradients into row slices.

A forward hook on each captured module saves what the backward will need (projected inputs for
the ``project`` route, raw inputs/indices otherwise) and registers a tensor hook on the module's
output. When autograd delivers the output gradient ``dy`` the hook computes the layer's block of
every example's row and *adds* it into the batch's row buffer, so a module used several times in
one forward sums its uses (the gradient of a shared weight is the sum over uses). Gradients are
only read, never modified, so training is unchanged.

Forwards under ``no_grad`` (or whose output does not require grad) are ignored. A forward that runs
*during* a backward is a gradient-checkpointing recomputation: with non-reentrant checkpointing
(``use_reentrant=False``, the Hugging Face default) the original forward's hooks already receive the
gradients and the recomputation is skipped; with reentrant checkpointing the recomputed graph is
backpropagated in a nested backward, which is refused with a clear error.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ingest.bags import PackedBags
from ingest.curvature import CurvatureStats
from ingest.fused import FUSED_MARK, FusedGemm, fusable
from ingest.misuse import CaptureUsageError
from ingest.output_hooks import on_gradient
from ingest.per_example import (
    choose_route,
    contract_tokens,
    dense_project,
    embedding_exact,
    embedding_project_inputs,
    input_operands,
    linear_exact,
    project_gradient,
    project_inputs,
    project_tokens,
    tokens_view,
)
from ingest.projection import LayerSlot, projection_matrix

#: Set by the op-level capture (:mod:`ingest.uses`) on a hooked module's output whose use it captured itself.
log = logging.getLogger(__name__)

TAKEN_MARK = "_gradstore_taken"


class RecomputationError(RuntimeError):
    """A captured module was recomputed and backpropagated inside a backward (reentrant checkpointing)."""


def guarded(backward: Callable[..., None]) -> Callable[..., None]:
    """``backward`` (an output-gradient hook forming a use's per-example gradient) made unable to stop training: an
    error in it turns the slots it feeds "not captured" (warned when the backward ends) instead of raising out of
    the user's ``backward()``; a refused recomputation still raises."""

    @functools.wraps(backward)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            backward(*args, **kwargs)
        except RecomputationError:
            raise
        except Exception as error:
            hooks = list(dict.fromkeys(_hooks_in(args)))
            if not hooks:
                raise
            log.warning("capture: %s failed; its slots turn not captured", backward.__name__, exc_info=True)
            how = f"forming its per-example gradient failed ({type(error).__name__}: {error}; please report it)"
            for hook in hooks:
                hook.owner.missed(hook, how)

    return run


def _hooks_in(values: Any) -> Iterator[LayerHook]:
    """The layer hooks among a backward's arguments (inside lists, tuples and dicts too)."""
    for value in values:
        if isinstance(value, LayerHook):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _hooks_in(value)
        elif isinstance(value, dict):
            yield from _hooks_in(value.values())


@dataclass
class ActiveBatch:
    """State of the micro-batch between its forward and the end of its backward."""

    generation: int
    size: int
    scales: torch.Tensor  # [B] float32, per-example scale (see ingest.scaling)
    token_mask: torch.Tensor | None  # [B, T] bool, excludes padding from curvature
    bags: PackedBags | None = None  # a batch of packed bags (flat ids and offsets: ingest.bags)
    meta: dict[str, Any] = field(default_factory=dict)
    rows: torch.Tensor | None = None  # [B, dim] float32, allocated at the first gradient
    finalize_queued: bool = False
    output_reached: bool = False  # a backward reached the model's output (rows expected)


class GemmOperands(NamedTuple):
    """A factorized layer's projection operands, laid out for one 2-D GEMM per side."""

    in_t: torch.Tensor  # [d_in, k_in] = P_in[:, :d_in]^T
    in_bias: torch.Tensor | None  # [k_in] = P_in[:, d_in] (bias column), None without bias
    out_t: torch.Tensor  # [d_out, k_out] = P_out^T


def _owned_block(size: int, x: torch.Tensor, dy: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``[size, out x in]``: each example's sum of its rows' outer products ``dy x^T`` (``owner [N]`` the example of
    each row of ``x [N, in]`` and ``dy [N, out]``)."""
    terms = (dy.unsqueeze(2) * x.unsqueeze(1)).flatten(1)
    return terms.new_zeros(size, terms.shape[1]).index_add_(0, owner, terms)


def in_backward() -> bool:
    """True while the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


_PEEK_TRANSFORMS = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def in_functorch() -> bool:
    """True inside a ``torch.func`` transform (``vmap``, ``grad``, ...): its forwards and backwards are not the
    training loop's, and their tensors are batched or wrapped per level, so capture leaves them alone."""
    return _PEEK_TRANSFORMS is not None and _PEEK_TRANSFORMS() is not None


class HookOwner(Protocol):
    """What a layer hook needs from the capture that owns it."""

    batch: ActiveBatch | None
    is_paused: bool
    route: str
    fused: bool

    def rows(self, batch: ActiveBatch, device: torch.device) -> torch.Tensor: ...

    def curvature_stats(self) -> CurvatureStats | None: ...

    def gradient_arrived(self, batch: ActiveBatch) -> None: ...

    def missed(self, hook: LayerHook, how: str) -> None: ...


class LayerHook:
    """Capture of one module into its :class:`LayerSlot` of the row."""

    #: Whether this hook may fuse the projections into the module's GEMMs (``owner.fused``, see :mod:`ingest.fused`).
    FUSABLE = True
    #: Whether this hook keeps each position's share of a block (per-token capture) instead of their sum.
    PER_POSITION = False

    def __init__(
        self,
        slot: LayerSlot,
        module: nn.Module,
        owner: HookOwner,
        seed: int,
        fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
        parameters: tuple[nn.Parameter, nn.Parameter | None] | None = None,
    ) -> None:
        self.slot = slot
        self.module = module
        self.index: int | None = None  # the slice of a stacked parameter this slot is (ingest.layers.stacked_info)
        # the slot's (weight, bias): the module's own unless given (an attention in_proj, a bare parameter)
        self.parameter, self.bias = (
            parameters
            if parameters is not None
            else (
                module.weight,
                getattr(module, "bias", None) if slot.has_bias else None,
            )
        )
        self.owner = owner
        self.seed = seed
        self.fixed = fixed  # (P_in, P_out) of a ProjectionBasis, used instead of the seeded matrices
        self.padding_idx = getattr(module, "padding_idx", None) if slot.kind == "embedding" else None
        self._matrices: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
        self._scaled: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
        self._operands: dict[tuple[torch.device, torch.dtype], GemmOperands] = {}
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None  # (out [d_out], in [d_in_eff]) normaliser
        self.fusion_checks: dict[tuple, bool] = {}  # see ingest.fused.FusedGemm

    def set_scales(self, scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Diagonal factors ``(D_out, D_in)`` applied as ``D_out G D_in`` before projection (see
        :mod:`ingest.normalizers`); ``None`` removes them."""
        self.scales = scales
        self._scaled = {}
        self._operands = {}

    def attach(self) -> Attachment:
        """Register the forward hook on the module and, for a fused capture of a Linear or Conv1D slot of the
        factorized kind, put the fused forward (:mod:`ingest.fused`) in place of the module's own."""
        handle = self.module.register_forward_hook(self._forward)
        fuse = self.FUSABLE and self.owner.fused and self.slot.mode == "factorized"
        return Attachment(handle, self.module, self._fused_forward if fuse and self.slot.kind != "embedding" else None)

    def _fused_forward(self, x: torch.Tensor, *args: Any, original: Any, **kwargs: Any) -> Any:
        """The module's forward with the projections in its GEMMs where :func:`~ingest.fused.fusable`, else its
        own forward (whose output the forward hook then captures)."""
        s = self.slot
        if args or kwargs or not fusable(self.module, s.kind, x, self.owner.route, s.k_in, s.k_out):
            return original(x, *args, **kwargs)
        batch = self.owner.batch
        capture = None
        if batch is not None and not self.owner.is_paused and torch.is_grad_enabled() and not in_backward():
            if x.shape[0] != batch.size:  # broadcast or not batch-first: the forward hook deals with it
                return original(x)
            capture = (batch.generation, batch.size)
        weight, bias = self.module.weight, self.module.bias
        x2d = x.reshape(-1, x.shape[-1])
        out = FusedGemm.apply(x2d, weight, bias, s.kind == "linear", self, capture)
        out = out.view(*x.shape[:-1], out.shape[-1])
        setattr(out, FUSED_MARK, True)
        return out

    def matrix(self, side: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """This layer's projection matrix for ``side`` (cached per device and dtype), with the normaliser's
        diagonal factor folded in (``P_in D_in``, ``P_out D_out``) when one is set."""
        base = self._base_matrix(side, device, dtype)
        if self.scales is None or side == "dense":
            return base
        key = (side, device, dtype)
        if key not in self._scaled:
            factor = self.scales[1] if side == "in" else self.scales[0]
            self._scaled[key] = base * factor.to(device=device, dtype=dtype)
        return self._scaled[key]

    def operands(self, device: torch.device, dtype: torch.dtype) -> GemmOperands:
        """The factorized route's GEMM operands (from :meth:`matrix`, cached per device and dtype):
        ``P_in[:, :d_in]^T``, its bias column and ``P_out^T``, each contiguous."""
        key = (device, dtype)
        if key not in self._operands:
            weight_t, bias = input_operands(self.matrix("in", device, dtype), self.slot.d_in, self.slot.has_bias)
            out_t = self.matrix("out", device, dtype).T.contiguous()
            self._operands[key] = GemmOperands(weight_t, bias, out_t)
        return self._operands[key]

    def _base_matrix(self, side: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (side, device, dtype)
        if key not in self._matrices:
            s = self.slot
            if self.fixed is not None and side != "dense":
                fixed = self.fixed[0] if side == "in" else self.fixed[1]
                self._matrices[key] = fixed.to(device=device, dtype=dtype)
                return self._matrices[key]
            if side == "in":
                k, d = s.k_in, s.d_in_eff
            elif side == "out":
                k, d = s.k_out, s.d_out
            else:
                k, d = s.size, s.d_out * s.d_in_eff
            self._matrices[key] = projection_matrix(self.seed, s.name, side, k, d, device, dtype)
        return self._matrices[key]

    # forward -----------------------------------------------------------------------------------

    def _forward(self, module: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
        batch = self.owner.batch
        if self.owner.is_paused or batch is None or not torch.is_grad_enabled() or in_functorch():
            return None
        if not isinstance(output, torch.Tensor):
            return None
        frozen_leaf = False
        if not output.requires_grad:
            if self.module.weight.requires_grad or not output.is_floating_point():
                return None
            # a frozen layer kept on purpose (include_frozen) whose input needs no gradient either (e.g. the
            # first base layer of a LoRA model): make its output a leaf so the hook still gets dL/d(output)
            output, frozen_leaf = output.detach().requires_grad_(True), True
        if getattr(output, FUSED_MARK, False) or getattr(output, TAKEN_MARK, False):
            return None  # the fused GEMMs hand this output's projections to add_projected / captured at its op
        x = args[0].detach()
        # A batch-1 input in a B-example forward is broadcast later (e.g. position embeddings): expand
        # the output (a view) so autograd hands us per-example gradients. Expand's backward is the
        # same sum_to reduction the broadcast would do, so parameter gradients are bit-identical.
        broadcast = x.shape[0] == 1 and batch.size > 1 and output.shape[0] == 1
        if broadcast:
            x = x.expand(batch.size, *x.shape[1:])
            output = output.expand(batch.size, *output.shape[1:])
        replaced = output if broadcast or frozen_leaf else None
        if in_backward():
            on_gradient(output, self._refuse_recomputation)
            return replaced
        if x.shape[0] != batch.size:
            raise CaptureUsageError(
                f"capture: layer {self.slot.name!r} got a batch of {x.shape[0]} for a forward of "
                f"{batch.size} examples; capture needs batch-first inputs"
            )
        route, saved = self._save(x, batch.size)
        on_gradient(output, functools.partial(self._backward, batch.generation, route, saved))
        return replaced

    def _save(self, x: torch.Tensor, batch_size: int) -> tuple[str, torch.Tensor]:
        s = self.slot
        if s.kind == "embedding":
            idx = x.reshape(batch_size, -1)
            if s.mode == "factorized":
                return "project", embedding_project_inputs(
                    idx, self.matrix("in", x.device, torch.float32), self.padding_idx
                )
            return "materialize", idx
        x = tokens_view(x, batch_size)
        if s.mode != "factorized":
            return "materialize", x
        route = self.owner.route
        if route == "auto":
            route = choose_route(x.shape[1], s.d_in_eff, s.d_out, s.k_in, s.k_out)
        if route == "project":
            ops = self.operands(x.device, x.dtype)
            return route, project_tokens(x, ops.in_t, ops.in_bias)
        return route, x

    def _refuse_recomputation(self, grad: torch.Tensor) -> None:
        raise RecomputationError(
            f"capture: module {self.slot.name!r} was recomputed and backpropagated inside backward "
            "(reentrant gradient checkpointing, reversible layers such as Reformer's, or a custom autograd.Function "
            "that reruns it in its backward). Use non-reentrant checkpointing (use_reentrant=False, e.g. "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), disable "
            "gradient checkpointing while capturing, or leave the module out of the capture (exclude=...: "
            "reversible layers recompute their forward in backward by design)."
        )

    # backward ----------------------------------------------------------------------------------

    def live_batch(self, generation: int) -> ActiveBatch | None:
        """The batch an output gradient of the forward ``generation`` belongs to, None when it adds no rows.

        Reported to the coverage (its slot's rows miss a part of the gradient), never dropped without a word: a
        gradient of an *earlier* forward arriving while a later one's batch is open (two forwards, one backward:
        a siamese pair, a discriminator on real and fake), and a backward with ``create_graph=True`` (a gradient
        penalty, MAML: the gradient's own graph uses the weights, a use no rule splits), and a second backward
        through an already finished batch's graph (``retain_graph=True``: its gradient reaches the parameters, not
        the rows)."""
        batch = self.owner.batch
        if batch is None:
            self.owner.missed(
                self,
                "a second backward through a finished batch's graph (retain_graph=True: the rows hold the first "
                "backward's gradient only; backward the summed losses once)",
            )
            return None
        if batch.generation != generation:
            if generation < batch.generation:
                self.owner.missed(
                    self,
                    "a backward through an earlier forward's graph (two forwards, one backward: rows are those of "
                    "the last forward; run one forward per backward, e.g. concatenate the inputs into one batch)",
                )
            return None
        if torch.is_grad_enabled():  # the engine runs hooks with grad mode on only when create_graph=True
            self.owner.missed(self, "a backward with create_graph=True (double backward, e.g. a gradient penalty)")
        return batch

    @guarded
    def _backward(self, generation: int, route: str, saved: torch.Tensor, dy: torch.Tensor) -> None:
        batch = self.live_batch(generation)
        if batch is None:
            return  # a second backward through an already captured graph
        with torch.no_grad():
            dy = tokens_view(dy.detach(), batch.size)
            if saved.is_floating_point() and saved.dtype != dy.dtype:  # autocast: e.g. float32 input, fp16 dy
                dtype = torch.promote_types(saved.dtype, dy.dtype)
                saved, dy = saved.to(dtype), dy.to(dtype)
            self._add_block(batch, self._block(route, saved, dy))
            stats = self.owner.curvature_stats()
            if stats is not None:
                self._add_curvature(stats, batch, route, saved, dy)
        self.owner.gradient_arrived(batch)

    def add_projected(self, generation: int, inputs: torch.Tensor, gradients: torch.Tensor) -> None:
        """Take one use's projected inputs ``[B, T, k_in]`` and output gradients ``[B, T, k_out]`` from the
        fused GEMMs (:mod:`ingest.fused`): the ``project`` route's block and curvature terms without projecting."""
        batch = self.live_batch(generation)
        if batch is None:
            return  # a second backward through an already captured graph
        with torch.no_grad():
            self._add_block(batch, contract_tokens(inputs, gradients).flatten(1))
            stats = self.owner.curvature_stats()
            if stats is not None:
                self._record_curvature(stats, batch, inputs, gradients)
        self.owner.gradient_arrived(batch)

    def _add_block(self, batch: ActiveBatch, block: torch.Tensor) -> None:
        """Add this layer's block ``[B, size]`` into the batch's rows."""
        rows = self.owner.rows(batch, block.device)
        rows[:, self.slot.offset : self.slot.offset + self.slot.size] += block

    def _block(self, route: str, saved: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        s = self.slot
        if route == "project":
            dy_p = project_tokens(dy, self.operands(dy.device, dy.dtype).out_t)
            return contract_tokens(saved, dy_p).flatten(1)
        if s.kind == "embedding":
            grad = embedding_exact(saved, dy, s.d_in, self.padding_idx)
        else:
            grad = linear_exact(saved, dy, s.has_bias)
        return self.gradient_block(grad)

    def add_gradient(self, generation: int, grad: torch.Tensor, positions: int | None = None) -> None:
        """Add one use's materialised per-example gradients ``[B, d_out, d_in (+1)]`` (this slot's orientation)
        into the batch's rows (the op-level capture of :mod:`ingest.uses` for uses it cannot factor).
        ``positions``: only for hooks that keep each position's share (:attr:`PER_POSITION`)."""
        batch = self.live_batch(generation)
        if batch is None:
            return
        with torch.no_grad():
            self._add_block(batch, self.gradient_block(grad.float()))
        self.owner.gradient_arrived(batch)

    def add_rows(
        self, generation: int, x: torch.Tensor, dy: torch.Tensor, owner: torch.Tensor, bias: bool = True
    ) -> None:
        """Add one use whose rows mix the examples (tokens flattened across the batch, then gathered, as a MoE
        layer routes them): ``x [N, d_in]``, ``dy [N, d_out]``, ``owner [N]`` the example of each row. Each
        example's block is the sum of its rows' ``dy x^T`` (projected first on a factorized slot). ``bias``:
        whether this use adds the slot's bias (a use of the weight alone, e.g. ``x @ W``, does not)."""
        batch = self.live_batch(generation)
        if batch is None:
            return
        s = self.slot
        with torch.no_grad():
            x, dy = x.float(), dy.detach().float()
            if s.mode == "factorized":
                ops = self.operands(dy.device, torch.float32)
                x_p = project_tokens(x, ops.in_t, ops.in_bias if bias else None)
                dy_p = project_tokens(dy, ops.out_t)
                block = _owned_block(batch.size, x_p, dy_p, owner)
            else:
                if s.has_bias:
                    x = torch.cat([x, x.new_full((x.shape[0], 1), 1.0 if bias else 0.0)], dim=1)
                x_p, dy_p = x, dy
                # each example's sum of its rows' dy x^T as one product of its rows (not [N, d_out, d_in] first)
                order = torch.argsort(owner, stable=True)
                counts = torch.bincount(owner, minlength=batch.size).tolist()
                pairs = zip(dy[order].split(counts), x[order].split(counts))
                grad = torch.stack([d.T @ rows for d, rows in pairs])
                block = self.gradient_block(grad)
            self._add_block(batch, block)
            if s.mode != "dense" and not (s.mode == "exact" and s.kind == "embedding"):
                self._add_row_curvature(batch, x_p, dy_p, owner)
        self.owner.gradient_arrived(batch)

    def add_lookup(
        self, generation: int, index: torch.Tensor, values: torch.Tensor, owner: torch.Tensor, rows: bool
    ) -> None:
        """Add one lookup in this slot's bare parameter used as a table (``P[ids]`` with the batch's ids): lookup
        ``r`` of example ``owner[r]`` read entry ``index[r]`` and got the output gradient ``values[r]``. ``rows``:
        ``P`` is ``[d_out, d_in]`` and each lookup a row of it (``values [N, d_in]``), else ``P`` is ``[d_in]`` (a
        ``[1, d_in]`` slot) and each lookup one entry (``values [N]``). Each example's gradient holds its values
        at the entries it read (summed where read twice); on a factorized slot its block is formed from the
        projections' rows at those entries, never the ``[d_out, d_in]`` gradient."""
        batch = self.live_batch(generation)
        if batch is None:
            return
        s = self.slot
        with torch.no_grad():
            values = values.detach().float()
            if s.mode == "factorized":
                ops = self.operands(values.device, torch.float32)
                if rows:
                    x_p, dy_p = project_tokens(values, ops.in_t), ops.out_t.index_select(0, index)
                else:
                    x_p = ops.in_t.index_select(0, index) * values.unsqueeze(1)
                    dy_p = ops.out_t.expand(len(index), -1)
                block = _owned_block(batch.size, x_p, dy_p, owner)
            else:
                grad = values.new_zeros(batch.size, s.d_out, s.d_in)
                at = (owner, index) if rows else (owner, torch.zeros_like(index), index)
                grad.index_put_(at, values, accumulate=True)
                block = self.gradient_block(grad)
            self._add_block(batch, block)
            if s.mode == "factorized":  # exact: the lookups' one-hot side is never formed
                self._add_row_curvature(batch, x_p, dy_p, owner)
        self.owner.gradient_arrived(batch)

    def _add_row_curvature(self, batch: ActiveBatch, x: torch.Tensor, dy: torch.Tensor, owner: torch.Tensor) -> None:
        """Record one use's rows ``x [N, in]``, ``dy [N, out]`` (``owner [N]`` their examples) in the Kronecker
        statistics, when the capture keeps them: every row is a token of its example."""
        stats = self.owner.curvature_stats()
        if stats is not None:
            scales = batch.scales.to(dy.device, dy.dtype)[owner]
            stats.add(self.slot.name, x.unsqueeze(1), (dy * scales.unsqueeze(1)).unsqueeze(1), None)

    def gradient_block(self, grad: torch.Tensor) -> torch.Tensor:
        """This slot's block ``[B, size]`` of materialised per-example gradients ``[B, d_out, d_in (+1)]``:
        normalised, then kept (exact) or projected."""
        s = self.slot
        if self.scales is not None and s.mode != "factorized":  # factorized: folded into the matrices
            out_scale, in_scale = (f.to(grad.device) for f in self.scales)
            grad = grad * (out_scale.unsqueeze(1) * in_scale.unsqueeze(0))
        if s.mode == "exact":
            return grad.flatten(1)
        if s.mode == "dense":
            return dense_project(grad, self.matrix("dense", grad.device, torch.float32))
        p_in = self.matrix("in", grad.device, torch.float32)
        return project_gradient(grad, p_in, self.matrix("out", grad.device, torch.float32)).flatten(1)

    def _add_curvature(
        self, stats: CurvatureStats, batch: ActiveBatch, route: str, saved: torch.Tensor, dy: torch.Tensor
    ) -> None:
        s = self.slot
        if s.mode == "dense" or (s.mode == "exact" and s.kind == "embedding"):
            return  # no Kronecker structure / one-hot inputs: not collected (see docs/capture.md)
        if s.mode == "exact":
            ones = torch.ones(*saved.shape[:2], 1, dtype=saved.dtype, device=saved.device)
            x_p = torch.cat([saved, ones], dim=-1) if s.has_bias else saved
            dy_p = dy
        else:
            x_p = (
                saved
                if route == "project"
                else project_inputs(saved, self.matrix("in", saved.device, saved.dtype), s.has_bias)
            )
            dy_p = project_tokens(dy, self.operands(dy.device, dy.dtype).out_t)
        self._record_curvature(stats, batch, x_p, dy_p)

    def _record_curvature(
        self, stats: CurvatureStats, batch: ActiveBatch, x_p: torch.Tensor, dy_p: torch.Tensor
    ) -> None:
        """Add ``a a^T`` and ``s s^T`` of every (unpadded) token: ``a`` the (projected) input, ``s`` the
        (projected) output gradient times the example's scale."""
        dy_p = dy_p * batch.scales.to(dy_p.device, dy_p.dtype).view(-1, 1, 1)
        mask = batch.token_mask
        if mask is not None and tuple(mask.shape) != tuple(x_p.shape[:2]):
            mask = None
        stats.add(self.slot.name, x_p, dy_p, mask)


class Attachment:
    """A layer hook's hold on its module: the forward hook, and the fused forward put in place of the module's own
    (``fused``: a callable taking the original forward as ``original=``), both undone by :meth:`remove`."""

    def __init__(self, handle: torch.utils.hooks.RemovableHandle, module: nn.Module, fused: Any | None = None) -> None:
        self.handle = handle
        self.module = module
        self._previous = module.__dict__.get("forward")  # an instance-level forward someone else set, if any
        self._fused = fused is not None
        if fused is not None:
            module.forward = functools.partial(fused, original=module.forward)

    def remove(self) -> None:
        """Remove the forward hook and give the module its forward back."""
        self.handle.remove()
        if self._fused:
            if self._previous is None:
                del self.module.forward
            else:
                self.module.forward = self._previous
            self._fused = False
