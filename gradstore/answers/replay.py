"""Exact replay (MAGIC-style metagradients): the effect of up-weighting every training example on each query's
final loss, computed by differentiating through the recorded training run itself.

The store knows the run's order and schedule: its rows captured during training (:func:`recorded_steps` of the
in-loop label) give, per optimizer step ``t``, the example ids of the batch (in the order captured) and the learning
rate ``lr_t``. The user gives what the store cannot hold: ``model_fn()`` (the model at the weights of the first
recorded step, the same seed as the recorded run), ``batch_fn(example_ids)`` (the batch of those examples, for
training and query ids alike), ``loss_fn(model, batch)`` (the per-example losses ``[B]``) and the optimizer
(:class:`Optimizer`: SGD with momentum, dampening, Nesterov and weight decay; Adam; AdamW; written out below as
pure tensor updates equal to ``torch.optim``'s formulas, so autograd differentiates through them).

Step ``t`` of the replay minimises ``reduce_b(eps_b * loss_b)`` over its batch (``reduction`` ``"mean"``, as a
training loop's ``loss.mean()``, or ``"sum"``) with every ``eps = 1``: the recorded run. The metagradient of query
``q`` is ``d L_q(theta_T) / d eps_z`` for every example ``z`` (one weight per example, shared by every step that
drew it), the score ``-d L_q / d eps_z`` (positive: up-weighting ``z`` lowers the query's loss).

``weight`` moves the point where the derivative is taken: every ``eps = weight`` (the run replayed with each
example's loss scaled by it; ``reduction="mean"`` still divides by the batch's size). A first-order prediction of
the runs that leave out a random share of the data is exact to second order when taken at the mean of their weights
(the share kept, e.g. 0.5 for halves), where the derivative at ``eps = 1`` carries the curvature between the full
run and the removals as an error; where a run is nonlinear in the weights (long training from scratch) this is
what decides a counterfactual prediction's quality (bench/fidelity.py, docs/benchmarks.md). At 1 (the default) the
replay is the recorded run and its final weights are the training's; elsewhere they are the reweighted run's.

Reverse mode through the unrolled run, checkpointed: the forward replay keeps the parameters and optimizer state at
the start of each of ``segments`` segments (default ``ceil(sqrt(T))``); the backward pass goes over the segments
last to first, recomputes each one's states from its checkpoint, and runs one vector-Jacobian product per step and
query (:func:`torch.func.vjp` of the step ``(theta_t, state_t, eps_batch) -> (theta_{t+1}, state_{t+1})``, whose
inner gradient is :func:`torch.func.grad`: second order), accumulating ``d L_q / d eps_b`` into the examples'
entries. The step's graph is built once per step and shared by the queries: the adjoints of all queries go back
together, the product vectorised over them with :func:`torch.func.vmap` (one query after another where an
operation of the model has no batching rule). States held at once: ``segments + ceil(T / segments)`` (about
``2 sqrt(T)``; reported as :attr:`Replay.peak_states`), each the model's parameters and the optimizer's state;
besides them the adjoints, one parameters-and-state per query.

Exact up to float rounding when the loss is a deterministic function of the parameters and the batch (no dropout,
no BatchNorm running statistics that change during training: buffers are taken as the model's, constant) and
every optimizer step was captured (``span`` 1). The query losses ``loss_fn(model, batch_fn(query_ids))`` are taken
at the final weights of the replay. What the replay cannot reproduce, capture's record of the steps
(``optimizer_steps``) makes it refuse: parameter groups that differ in a hyper-parameter (the learning rate
included), and gradients changed between the backward and the optimizer step (clipping that cut the norm, other
rescaling; a GradScaler's unscaling only is the backward's gradient); see
:class:`gradstore.capture.optimizer_state.StepGradients`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc
import torch
from torch import nn

from gradstore.capture.optimizer_state import group_differences
from gradstore.capture.session import model_fingerprint
from gradstore.core import StoreCore, gradient_filter, sql_literal
from gradstore.core import schema as S
from gradstore.errors import GradstoreError, InvalidArgumentError, MissingIdsError
from gradstore.methods import replay as stored
from gradstore.methods.trajectory import in_loop_checkpoint, recorded_steps

Reduction = Literal["mean", "sum"]
Tensors = tuple[torch.Tensor, ...]


# ---------------------------------------------------------------------------------------------- optimizers
@dataclass(frozen=True)
class Optimizer:
    """An optimizer as pure tensor updates (:meth:`step`) equal to ``torch.optim``'s (single-tensor) formulas:

    * ``"sgd"`` (``torch.optim.SGD``): ``g <- g + wd p``; with ``momentum``: ``b <- g`` at the first step, else
      ``b <- momentum b + (1 - dampening) g``, and ``g <- g + momentum b`` (``nesterov``) or ``g <- b``;
      ``p <- p - lr g``;
    * ``"adam"`` (``torch.optim.Adam``, L2 weight decay ``g <- g + wd p``) and ``"adamw"`` (``torch.optim.AdamW``,
      decoupled: ``p <- p (1 - lr wd)``): ``m <- m + (1 - beta1)(g - m)``, ``v <- beta2 v + (1 - beta2) g^2``,
      ``p <- p - lr / (1 - beta1^k) m / (sqrt(v) / sqrt(1 - beta2^k) + eps)`` at the ``k``-th step. The square
      root's derivative is taken as 0 where ``v = 0`` (a coordinate with no gradient yet).

    The learning rate of each step is the recorded one. Build one with its keywords, or from the
    ``torch.optim`` optimizer of the run (:meth:`of`)."""

    kind: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in ("sgd", "adam", "adamw"):
            raise InvalidArgumentError(f"replay optimizers are 'sgd', 'adam' and 'adamw', got {self.kind!r}")
        if not isinstance(self.nesterov, bool):
            raise InvalidArgumentError(f"nesterov is True or False, got {self.nesterov!r}")
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise InvalidArgumentError(f"betas is a pair (beta1, beta2), each in [0, 1), got {betas!r}")
        ranges = {  # as torch.optim checks them, and finite
            "momentum": (self.momentum, 0.0, math.inf, "a finite number >= 0"),
            "dampening": (self.dampening, -math.inf, math.inf, "a finite number"),
            "weight_decay": (self.weight_decay, 0.0, math.inf, "a finite number >= 0"),
            "eps": (self.eps, 0.0, math.inf, "a finite number >= 0"),
            "betas[0]": (betas[0], 0.0, 1.0, "in [0, 1)"),
            "betas[1]": (betas[1], 0.0, 1.0, "in [0, 1)"),
        }
        for name, (value, low, high, valid) in ranges.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not (low <= value < high and math.isfinite(value)):
                raise InvalidArgumentError(f"the replay optimizer's {name} must be {valid}, got {value!r}")
        if self.kind == "sgd" and self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError("nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)")
        for name in ("momentum", "dampening", "weight_decay", "eps"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))

    @classmethod
    def of(cls, optimizer: Any, **hyper: Any) -> Optimizer:
        """The :class:`Optimizer` of ``optimizer``: an :class:`Optimizer`, a name (``"sgd"``, ``"adam"``,
        ``"adamw"``) with ``hyper``-parameters, a ``torch.optim`` class (``SGD``, ``Adam``, ``AdamW``) with
        ``hyper``-parameters (its own defaults otherwise), or an instance of one (its hyper-parameters, one
        parameter group). ``lr`` is ignored (each step's is the recorded one)."""
        if isinstance(optimizer, cls):
            if hyper:
                raise InvalidArgumentError("an Optimizer carries its hyper-parameters: give no keywords with it")
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            differ = group_differences(optimizer)
            if differ is not None:
                raise InvalidArgumentError(
                    f"the optimizer's parameter groups differ in {differ}; the replay applies one learning rate (each "
                    "step's recorded one) and one set of hyper-parameters to every parameter, so it cannot reproduce "
                    "this training: replay a run whose optimizer has one parameter group (or groups with the same "
                    "hyper-parameters)"
                )
            group = {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "lr", "initial_lr")}
            return cls.of(type(optimizer), **{**group, **hyper})
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            names = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
            if optimizer not in names:
                raise InvalidArgumentError(
                    f"replay implements torch.optim.SGD, Adam and AdamW, not {optimizer.__name__}: give one of them"
                )
            defaults = {"sgd": {}, "adam": {"weight_decay": 0.0}, "adamw": {"weight_decay": 1e-2}}[names[optimizer]]
            return cls.of(names[optimizer], **{**defaults, **hyper})
        if not isinstance(optimizer, str):
            raise InvalidArgumentError(
                "optimizer= is 'sgd', 'adam', 'adamw', a gradstore.answers.replay.Optimizer, or a torch.optim "
                f"SGD/Adam/AdamW (class or instance), got {type(optimizer).__name__}"
            )
        kind = optimizer.lower()
        if kind == "adamw" and "weight_decay" not in hyper:
            hyper = {**hyper, "weight_decay": 1e-2}  # torch.optim.AdamW's default
        return cls(kind, **_hyper(kind, hyper))  # type: ignore[arg-type]

    def describe(self) -> str:
        """A one-line description (kept with the stored replay)."""
        if self.kind == "sgd":
            return (
                f"sgd(momentum={self.momentum}, dampening={self.dampening}, nesterov={self.nesterov}, "
                f"weight_decay={self.weight_decay})"
            )
        return f"{self.kind}(betas={self.betas}, eps={self.eps}, weight_decay={self.weight_decay})"

    def init(self, params: Tensors) -> Tensors:
        """The optimizer's state before the first step (one flat tuple of tensors)."""
        if self.kind == "sgd":
            return tuple(torch.zeros_like(p) for p in params) if self.momentum else ()
        return tuple(torch.zeros_like(p) for p in params) + tuple(torch.zeros_like(p) for p in params)  # m, v

    def step(self, params: Tensors, state: Tensors, grads: Tensors, lr: float, index: int) -> tuple[Tensors, Tensors]:
        """The parameters and state after the step of 0-based ``index`` with gradients ``grads``."""
        if self.kind == "sgd":
            return self._sgd(params, state, grads, lr, index)
        return self._adam(params, state, grads, lr, index)

    def _sgd(self, params: Tensors, state: Tensors, grads: Tensors, lr: float, index: int) -> tuple[Tensors, Tensors]:
        new_params, buffers = [], []
        for i, (p, g) in enumerate(zip(params, grads)):
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                b = g if index == 0 else self.momentum * state[i] + (1 - self.dampening) * g
                buffers.append(b)
                g = g + self.momentum * b if self.nesterov else b
            new_params.append(p - lr * g)
        return tuple(new_params), tuple(buffers)

    def _adam(self, params: Tensors, state: Tensors, grads: Tensors, lr: float, index: int) -> tuple[Tensors, Tensors]:
        n = len(params)
        beta1, beta2 = self.betas
        count = float(index + 1)
        step_size = lr / (1 - beta1**count)
        root = (1 - beta2**count) ** 0.5
        new_params, ms, vs = [], [], []
        for p, g, m, v in zip(params, grads, state[:n], state[n:]):
            if self.weight_decay:
                if self.kind == "adamw":
                    p = p * (1 - lr * self.weight_decay)
                else:
                    g = g + self.weight_decay * p
            m = m + (1 - beta1) * (g - m)
            v = beta2 * v + (1 - beta2) * g * g
            denom = _sqrt(v) / root + self.eps
            new_params.append(p - step_size * (m / denom))
            ms.append(m)
            vs.append(v)
        return tuple(new_params), tuple(ms) + tuple(vs)


def _hyper(kind: str, hyper: dict[str, Any]) -> dict[str, Any]:
    """``hyper`` checked for ``kind``: what torch.optim would take and replay supports."""
    allowed = {"sgd": {"momentum", "dampening", "nesterov", "weight_decay"}, "adam": {"betas", "eps", "weight_decay"}}
    allowed["adamw"] = allowed["adam"]
    if kind not in allowed:
        raise InvalidArgumentError(f"replay optimizers are 'sgd', 'adam' and 'adamw', got {kind!r}")
    neutral = {"maximize": False, "amsgrad": False, "foreach": None, "fused": None, "capturable": False,
               "differentiable": False, "decoupled_weight_decay": kind == "adamw", "lr": None}  # fmt: skip
    kept = {}
    for name, value in hyper.items():
        if name in allowed[kind]:
            kept[name] = value
        elif name in neutral:
            if name not in ("lr", "foreach", "fused", "capturable", "differentiable") and value != neutral[name]:
                raise InvalidArgumentError(f"replay does not implement {kind} with {name}={value!r}")
        else:
            raise InvalidArgumentError(f"{kind} takes {sorted(allowed[kind])}, not {name}=")
    return kept


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` with derivative 0 where ``v = 0`` (not infinite)."""
    positive = v > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, v, torch.ones_like(v))), torch.zeros_like(v))


# ---------------------------------------------------------------------------------------------- the replay
@dataclass
class Replay:
    """What :func:`replay` computed: ``scores[q, z] = -d L_q(theta_T) / d eps_z`` (float64 numpy ``[queries,
    examples]``, examples in ``example_ids`` order), the query losses at the replay's final weights, the final
    parameters (by name), the segments it was checkpointed in, and the most states (parameters and optimizer
    state, one per step) it held at once."""

    query_ids: list[str]
    example_ids: list[str]
    scores: np.ndarray
    losses: np.ndarray
    final: dict[str, torch.Tensor]
    steps: int
    segments: int
    peak_states: int
    checkpoint: str
    optimizer: Optimizer
    learning_rates: list[float] = field(default_factory=list)
    weight: float = 1.0  # every example's weight where the derivative was taken (1: the recorded run)


class _States:
    """The states held by the replay (counted: what memory grows with)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[Tensors, Tensors]] = {}
        self.peak = 0

    def keep(self, t: int, params: Tensors, state: Tensors) -> None:
        self.held[t] = (params, state)
        self.peak = max(self.peak, len(self.held))

    def pop(self, t: int) -> tuple[Tensors, Tensors]:
        return self.held.pop(t)


class _Objective(nn.Module):
    """``loss_fn(model, batch)`` as a module, so :func:`torch.func.functional_call` can swap its parameters."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def replay(
    store: StoreCore,
    queries: Sequence[str],
    *,
    run: str,
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[list[str]], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: Any,
    checkpoint: str | None = None,
    segments: int | None = None,
    reduction: Reduction | None = None,
    weight: float = 1.0,
    write: bool = True,
) -> Replay:
    """Replay ``run``'s recorded training and compute the exact metagradients of ``queries``' final losses (see
    the module docstring); kept in the store for ``attribute(method="replay")`` unless ``write=False``.
    ``reduction`` ``None``: the ``loss_reduction`` the run's capture was given, else ``"mean"``."""
    query_ids = _query_ids(queries)
    if reduction is not None and reduction not in ("mean", "sum"):
        raise InvalidArgumentError(
            f"reduction is 'mean' or 'sum' (how the training loss reduced its batch), got {reduction!r}"
        )
    reduction = _run_reduction(store, run, reduction)
    weight = _example_weight(weight)
    spec = Optimizer.of(optimizer)
    label = in_loop_checkpoint(store, run, checkpoint)
    _check_not_selected(store, run)
    _check_recorded_optimizer(store, run, label, spec)
    batches, rates = _recorded_batches(store, run, label)
    steps = len(batches)
    if segments is None:
        segments = math.ceil(math.sqrt(steps))
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= steps:
        raise InvalidArgumentError(
            f"segments must be a whole number in [1, {steps}] (the run's steps), got {segments!r}"
        )
    if write:
        store.require_writable("replay with write=True")
    model = _model(store, run, model_fn)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    objective = _Objective(model, loss_fn)
    wrapped = [f"model.{name}" for name in names]
    example_ids = sorted({z for batch in batches for z in batch})
    position = {z: i for i, z in enumerate(example_ids)}
    device = next(iter(model.parameters())).device
    dtype = next(iter(model.parameters())).dtype
    columns = [torch.tensor([position[z] for z in batch], dtype=torch.long, device=device) for batch in batches]
    data = _Batches(batch_fn)

    def losses(params: Tensors, batch: Any, size: int, what: str) -> torch.Tensor:
        try:
            out = torch.func.functional_call(objective, dict(zip(wrapped, params)), (batch,), strict=False)
        except GradstoreError:
            raise
        except Exception as error:
            raise InvalidArgumentError(
                f"loss_fn(model, batch) (or the model's forward inside it) failed on {what} "
                f"({type(error).__name__}: {error}): it must return the per-example losses [B] of the batch that "
                "batch_fn(ids) builds, with the model_fn() model (the same dtype and device)"
            ) from error
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (size,):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise InvalidArgumentError(
                f"loss_fn(model, batch) must return the per-example losses [B] (B={size}) of {what}, got {shape}: "
                "return the unreduced losses (e.g. F.cross_entropy(..., reduction='none'))"
            )
        return out

    def step(t: int, params: Tensors, state: Tensors, weights: torch.Tensor) -> tuple[Tensors, Tensors]:
        batch = data.get(batches[t], f"training step {t}")

        def objective_loss(p: Tensors) -> torch.Tensor:
            weighted = weights * losses(p, batch, len(batches[t]), f"the batch of step {t}")
            return weighted.mean() if reduction == "mean" else weighted.sum()

        grads = torch.func.grad(objective_loss)(params)
        return spec.step(params, state, grads, rates[t], t)

    initial = tuple(dict(model.named_parameters())[n].detach().clone() for n in names)
    length = math.ceil(steps / segments)
    starts = list(range(0, steps, length))
    kept = _States()
    params, state = initial, spec.init(initial)
    at = [torch.full((len(b),), weight, dtype=dtype, device=device) for b in batches]  # every eps where taken
    with torch.no_grad():
        for t in range(steps):  # forward replay: keep each segment's first state
            if t in starts:
                kept.keep(t, params, state)
            params, state = step(t, params, state, at[t])
    final = params
    query_batch = data.get(query_ids, "the queries")
    query_losses, query_vjp = torch.func.vjp(lambda p: losses(p, query_batch, len(query_ids), "the queries"), final)
    eye = torch.eye(len(query_ids), dtype=query_losses.dtype, device=device)
    adjoint = _Adjoint(
        torch.func.vmap(query_vjp)(eye)[0],
        tuple(torch.zeros((len(query_ids), *s.shape), dtype=s.dtype, device=device) for s in state),
    )
    meta = torch.zeros(len(query_ids), len(example_ids), dtype=dtype, device=device)
    for start in reversed(starts):  # backward: segment by segment, last first
        end = min(start + length, steps)
        params, state = kept.pop(start)
        with torch.no_grad():
            for t in range(start, end):  # recompute the segment's states from its checkpoint
                kept.keep(t, params, state)
                if t + 1 < end:
                    params, state = step(t, params, state, at[t])
        for t in reversed(range(start, end)):
            params, state = kept.pop(t)
            _, vjp = torch.func.vjp(lambda p, s, w, t=t: step(t, p, s, w), params, state, at[t])
            meta.index_add_(1, columns[t], adjoint.back(vjp))
    scores = (-meta).detach().cpu().numpy().astype(np.float64)
    result = Replay(
        query_ids,
        example_ids,
        scores,
        query_losses.detach().cpu().numpy().astype(np.float64),
        {n: p.detach() for n, p in zip(names, final)},
        steps,
        len(starts),
        kept.peak,
        label,
        spec,
        rates,
        weight,
    )
    if write:
        stored.save(
            store,
            run,
            stored.ReplayScores(
                query_ids,
                example_ids,
                scores,
                label,
                stored.source_state(store, run, label),
                steps,
                spec.describe(),
                result.losses.tolist(),
                weight,
            ),
        )
    return result


class _Adjoint:
    """The queries' adjoints ``d L_q / d (theta_t, state_t)``, stacked ``[queries, ...]``, carried back one step at
    a time: the step's vector-Jacobian product vectorised over the queries (:func:`torch.func.vmap`), or one query
    after another where an operation of the model has no batching rule."""

    vectorised = True  # until an operation has no batching rule

    def __init__(self, params: Tensors, state: Tensors) -> None:
        self.params, self.state = params, state

    def back(self, vjp: Callable[..., Any]) -> torch.Tensor:
        """Carry the adjoints through one step's ``vjp``; the step's ``d L_q / d eps_b`` ``[queries, B]``."""
        if self.vectorised:
            try:
                self.params, self.state, weights = torch.func.vmap(vjp)((self.params, self.state))
                return weights
            except (RuntimeError, NotImplementedError):  # no batching rule: one query at a time from now on
                self.vectorised = False
        out = [
            vjp((tuple(p[q] for p in self.params), tuple(s[q] for s in self.state))) for q in range(len(self.params[0]))
        ]
        self.params = tuple(torch.stack([o[0][i] for o in out]) for i in range(len(self.params)))
        self.state = tuple(torch.stack([o[1][i] for o in out]) for i in range(len(self.state)))
        return torch.stack([o[2] for o in out])


#: The ``optimizer_steps`` columns a replay's optimizer must agree with.
_RECORDED = ("optimizer", "momentum", "dampening", "nesterov", "weight_decay", "beta2", "eps", "weight_decays")
#: What capture recorded of each step that the replay cannot reproduce (absent in stores of earlier versions).
_STEP_NOTES = ("group_differences", "gradients")


def _check_not_selected(store: StoreCore, run: str) -> None:
    """Refuse a run trained with online data selection (:mod:`gradstore.capture.online`) that dropped or reweighted
    some example: the replay takes every example of every recorded batch at the same weight."""
    if not store.has_table(S.ONLINE_SELECTION):
        return
    where = f"run_id = {sql_literal(run)} AND (weight != 1 OR renormalization != 1)"
    changed = store.scan(S.ONLINE_SELECTION, ["step"], where, cache=False).column("step")
    if len(changed):
        steps = sorted(set(changed.to_pylist()))
        raise InvalidArgumentError(
            f"run {run!r} was trained with online data selection, which dropped or reweighted examples in "
            f"{len(steps)} step(s) (the online_selection table, e.g. step {steps[0]}); the replay takes every example "
            "of every recorded batch at one weight, so it cannot reproduce this training: replay a run trained "
            "without selection"
        )


def _check_recorded_optimizer(store: StoreCore, run: str, label: str, spec: Optimizer) -> None:
    """Refuse an optimizer that contradicts the one capture recorded for the run's steps (``optimizer_steps``:
    kind and hyper-parameters, read from the training's optimizer), and a run whose steps the replay cannot
    reproduce (parameter groups that differ, gradients changed between the backward and the step: :func:`_check_steps`);
    a store without the table is not checked. One exception: a weight decay where none was recorded, for SGD and
    Adam, whose L2 term is the gradient of an objective's ``wd/2 ||theta||^2`` (a penalty of the training loss that
    ``loss_fn``'s per-example losses cannot carry)."""
    if not store.has_table(S.OPTIMIZER_STEPS):
        return
    notes = [c for c in _STEP_NOTES if c in store.dataset(S.OPTIMIZER_STEPS).schema.names]
    columns = [*_RECORDED, *notes, "step"]
    table = store.scan(S.OPTIMIZER_STEPS, columns, gradient_filter(run, label, None), cache=False)
    if table.num_rows == 0:
        return
    _check_steps(run, table.sort_by("step"))
    table = table.drop_columns([*notes, "step"])
    given = f"the replay was given {spec.describe()}"
    if table.column("weight_decays").null_count != table.num_rows:
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer applied different weight decays to its parameter groups; the replay applies "
            "one to every parameter: replay a run trained with one weight decay"
        )
    recorded = {tuple(row.values()) for row in table.drop_columns(["weight_decays"]).to_pylist()}
    if len(recorded) > 1:
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer changed its hyper-parameters (other than the learning rate) during the "
            f"recorded steps ({len(recorded)} different sets); the replay applies one set"
        )
    kind, momentum, dampening, nesterov, decay, beta2, eps = next(iter(recorded))
    if kind not in ("sgd", "adam", "adamw"):
        raise InvalidArgumentError(
            f"run {run!r} was trained with {kind}; the replay implements torch.optim's SGD, Adam and AdamW only"
        )

    def close(a: float, b: float) -> bool:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)

    objective_l2 = decay == 0 and spec.kind in ("sgd", "adam") and kind == spec.kind
    same_decay = close(decay, spec.weight_decay) or objective_l2
    adam_alike = {kind, spec.kind} <= {"adam", "adamw"} and decay == 0 and spec.weight_decay == 0
    if kind != spec.kind and not adam_alike:
        raise InvalidArgumentError(f"run {run!r} was trained with {kind} but {given}: pass the run's optimizer")
    if kind == "sgd":
        found = (momentum, dampening, bool(nesterov))
        wanted = (spec.momentum, spec.dampening, spec.nesterov)
        same = close(found[0], wanted[0]) and close(found[1], wanted[1]) and found[2] == wanted[2]
        recorded_as = f"sgd(momentum={momentum}, dampening={dampening}, nesterov={bool(nesterov)}, "
    else:
        same = close(momentum, spec.betas[0]) and close(beta2, spec.betas[1]) and close(eps, spec.eps)
        recorded_as = f"{kind}(betas=({momentum}, {beta2}), eps={eps}, "
    if not (same and same_decay):
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer was recorded as {recorded_as}weight_decay={decay}) but {given}: pass the "
            "run's optimizer (its torch.optim instance gives the same hyper-parameters)"
        )


def _check_steps(run: str, table: Any) -> None:
    """Refuse a run whose recorded steps the replay cannot reproduce: an optimizer whose parameter groups differ
    (``group_differences``), or steps whose gradients were changed between the backward and the step
    (``gradients == "modified"``: clipping, rescaling). Gradients only unscaled by the capture's GradScaler are
    the backward's."""
    names = table.column_names
    if "group_differences" in names:
        differ = sorted({d for d in table.column("group_differences").to_pylist() if d})
        if differ:
            raise InvalidArgumentError(
                f"run {run!r}'s optimizer had parameter groups that differ in {'; '.join(differ)}; the replay applies "
                "one learning rate (each step's recorded one) and one set of hyper-parameters to every parameter, so "
                "it cannot reproduce this training: replay a run whose optimizer has one parameter group (or groups "
                "with the same hyper-parameters)"
            )
    if "gradients" in names:
        steps = table.column("step").to_pylist()
        outcomes = table.column("gradients").to_pylist()
        modified = [step for step, outcome in zip(steps, outcomes) if outcome == "modified"]
        if modified:
            which = f" (steps {modified[:5]}{', ...' if len(modified) > 5 else ''})"
            raise InvalidArgumentError(
                f"run {run!r}'s optimizer stepped on other gradients than the backward produced in {len(modified)} of "
                f"its {len(outcomes)} recorded steps{which}: gradient clipping that cut the norm (clip_grad_norm_, "
                "the HF Trainer's max_grad_norm), or another rescaling between loss.backward() and optimizer.step() "
                "(a GradScaler not given to capture as grad_scaler=), which the replay cannot reproduce exactly: "
                "replay a run trained without them (e.g. max_grad_norm=None)"
            )


def _run_reduction(store: StoreCore, run: str, reduction: Reduction | None) -> Reduction:
    """The reduction of the replay's steps: ``reduction`` when given, else the ``loss_reduction`` the run's capture
    was explicitly given (``"mean"``, the library's default, otherwise). A ``reduction`` that contradicts the run's
    explicit one is an ``InvalidArgumentError``; a run whose loss was ``"token_mean"`` takes ``"sum"`` only, with
    ``loss_fn`` dividing by the batch's token count."""
    config = store.run_config(run)
    recorded = (config.get("capture") or {}).get("loss_reduction")
    set_options = config.get("explicit_options")  # absent in stores of earlier versions: a non-default was set
    explicit = recorded is not None and (recorded != "mean" if set_options is None else "loss_reduction" in set_options)
    if not explicit or reduction == recorded:
        return reduction or "mean"
    if recorded == "token_mean":
        if reduction == "sum":
            return reduction
        raise InvalidArgumentError(
            f"run {run!r} was captured with loss_reduction='token_mean' (each step's loss the mean over its batch's "
            "tokens), which the replay's 'mean' does not form: return from loss_fn each example's summed token "
            "losses divided by the batch's token count, and pass reduction='sum'"
        )
    if reduction is None:
        return recorded
    raise InvalidArgumentError(
        f"run {run!r} was captured with loss_reduction={recorded!r} (its loop reduced each batch's losses by their "
        f"{recorded}) but the replay was given reduction={reduction!r}, another training: leave reduction= out "
        "(the run's is taken) or pass the run's"
    )


def _example_weight(weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise InvalidArgumentError(
            "weight is every training example's weight where the metagradient is taken: a positive finite number "
            f"(1 the recorded run; the share of the data kept to predict random removals, e.g. 0.5), got {weight!r}"
        )
    return float(weight)


def _query_ids(queries: Sequence[str]) -> list[str]:
    if isinstance(queries, str) or not isinstance(queries, Sequence) or not queries:
        raise InvalidArgumentError(
            "replay takes the query example ids as a non-empty list (batch_fn(ids) builds their batch), "
            f"got {queries!r}"
        )
    ids = [str(q) for q in queries]
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"replay's query ids repeat: {sorted({q for q in ids if ids.count(q) > 1})[:5]}")
    return ids


def _recorded_batches(store: StoreCore, run: str, label: str) -> tuple[list[list[str]], list[float]]:
    """Each recorded step's example ids (in the order captured) and learning rate; every optimizer step must
    have been captured."""
    steps = recorded_steps(store, run, label)
    skipped = [s.step for s in steps[:-1] if s.span != 1]
    if skipped:
        raise InvalidArgumentError(
            f"replay needs every optimizer step of run {run!r}; the rows under {label!r} skip steps after "
            f"{skipped[:5]}: capture every step (the replay does not know the batches in between)"
        )
    table = store.scan(
        store.gradient_table_name(run), ["step", "example_id", "grad_id"], gradient_filter(run, label, "train")
    )
    table = table.sort_by([("step", "ascending"), ("grad_id", "ascending")])
    step_column = table.column("step").to_numpy()
    ids = pc.cast(table.column("example_id"), "string").to_pylist()
    bounds = np.searchsorted(step_column, [s.step for s in steps] + [steps[-1].step + 1])
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])], [s.learning_rate for s in steps]


def _model(store: StoreCore, run: str, model_fn: Callable[[], nn.Module]) -> nn.Module:
    try:
        model = model_fn()
    except GradstoreError:
        raise
    except Exception as error:
        raise InvalidArgumentError(
            f"model_fn() failed ({type(error).__name__}: {error}): give a function of no arguments that returns the "
            "run's model at the weights of its first recorded step"
        ) from error
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"model_fn() must return the model (an nn.Module), got {type(model).__name__}")
    recorded = store.run(run).get("model_fingerprint")
    found = model_fingerprint(model)
    if recorded and found != recorded:
        raise InvalidArgumentError(
            f"model_fn() returned a model of another architecture than run {run!r} captured ({found} "
            f"is not the recorded {recorded}: parameter names, shapes and dtypes differ): give the run's model"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidArgumentError("model_fn() returned a model with no trainable parameter")
    return model


class _Batches:
    """``batch_fn`` with its failures on ids it does not know as ``MissingIdsError``."""

    def __init__(self, batch_fn: Callable[[list[str]], Any]) -> None:
        self.batch_fn = batch_fn

    def get(self, ids: list[str], what: str) -> Any:
        try:
            return self.batch_fn(list(ids))
        except GradstoreError:
            raise
        except (LookupError, ValueError, TypeError) as error:
            raise MissingIdsError(
                f"batch_fn could not build the batch of {what} (example ids {list(ids)[:5]}): "
                f"{type(error).__name__}: {error}; batch_fn(ids) must know every id the run recorded and the queries'"
            ) from error
