"""Exact replay (MAGIC-style metagradients): the effect of up-weighting every training example on each query's
final loss, computed by differentiating through the recorded training run itself.

The store knows the run's order and schedule: its rows captured during training (:func:`recorded_steps` of the
in-loop label) give, per optimizer step ``t``, the example ids of the batch (in the order captured) and the learning
rate ``lr_t``. The user gives what the store cannot hold: ``model_fn()`` (the model at the weights of the first
recorded step, the same seed as the recorded run), ``batch_fn(example_ids)`` (the batch of those examples, for
training and query ids alike), ``loss_fn(model, batch)`` (the per-example losses ``[B]``) and the optimizer
(:class:`Optimizer`: SGD with momentum, dampening, Nesterov and weight decay; Adam; AdamW; written out below as
pure tensor updates equal to ``torch.optim``'s formulas, so autograd differentiates through them).

Parameter groups are replayed as capture recorded them (``optimizer_steps.group_parameters``: each group's
parameters by the model's names; ``group_hyperparameters``: each group's hyper-parameters and learning rate per
step): each parameter of ``model_fn()`` is matched by name and updated with its group's; parameters in no group
stay as they are. Where capture's first step is the replay's first, ``model_fn()``'s weights are checked against
the fingerprint it took before that step (``initial_weights``).

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
(``optimizer_steps``) makes it refuse: parameter groups it cannot map by name or whose settings its step does not
implement (or that differ where capture recorded no groups: stores of earlier versions), and gradients changed
between the backward and the optimizer step (clipping that cut the norm, other
rescaling; a GradScaler's unscaling only is the backward's gradient); see
:class:`gradstore.capture.optimizer_state.StepGradients`.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc
import torch
from torch import nn

from gradstore.capture.optimizer_state import NOT_HYPER, group_differences, weights_fingerprint
from gradstore.capture.session import model_fingerprint
from gradstore.core import StoreCore, gradient_filter, sql_literal
from gradstore.core import schema as S
from gradstore.errors import GradstoreError, InvalidArgumentError, MissingIdsError, ReplayMismatchWarning
from gradstore.methods import replay as stored
from gradstore.methods.dynamics import row_weights
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
    ``torch.optim`` optimizer of the run (:meth:`of`). ``groups``: where the run's optimizer had parameter groups
    that differ, each group's hyper-parameters (an :class:`Optimizer` of the same kind each, in the optimizer's
    order; this one's own fields are the first group's); the replay checks them against the groups capture
    recorded."""

    kind: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    groups: tuple[Optimizer, ...] = ()

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
        unused = (
            {"betas": (betas, (0.9, 0.999)), "eps": (self.eps, 1e-8)}
            if self.kind == "sgd"
            else {
                "momentum": (self.momentum, 0.0),
                "dampening": (self.dampening, 0.0),
                "nesterov": (self.nesterov, False),
            }
        )
        given = [
            name
            for name, (value, default) in unused.items()
            if tuple(np.atleast_1d(value)) != tuple(np.atleast_1d(default))
        ]
        if given:
            takes = "momentum, dampening, nesterov, weight_decay" if self.kind == "sgd" else "betas, eps, weight_decay"
            raise InvalidArgumentError(
                f"{self.kind} does not use {', '.join(given)} (it takes {takes}): leave them out"
            )
        if self.kind == "sgd" and self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError("nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)")
        for name in ("momentum", "dampening", "weight_decay", "eps"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        object.__setattr__(self, "groups", tuple(self.groups))
        if any(not isinstance(g, Optimizer) or g.kind != self.kind or g.groups for g in self.groups):
            raise InvalidArgumentError(
                f"an Optimizer's groups are Optimizers of its kind ({self.kind!r}) without groups of their own"
            )

    @classmethod
    def of(cls, optimizer: Any, **hyper: Any) -> Optimizer:
        """The :class:`Optimizer` of ``optimizer``: an :class:`Optimizer`, a name (``"sgd"``, ``"adam"``,
        ``"adamw"``) with ``hyper``-parameters, a ``torch.optim`` class (``SGD``, ``Adam``, ``AdamW``) with
        ``hyper``-parameters (its own defaults otherwise), or an instance of one (its hyper-parameters, one
        parameter group; where its groups differ, each group's as :attr:`groups`). ``lr`` (as the torch optimizer
        takes it) is not read: each step's is the recorded one."""
        if isinstance(optimizer, cls):
            if hyper:
                raise InvalidArgumentError("an Optimizer carries its hyper-parameters: give no keywords with it")
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            specs = [
                cls.of(type(optimizer), **{**{k: v for k, v in group.items() if k not in (*NOT_HYPER, "lr")}, **hyper})
                for group in optimizer.param_groups
            ]
            if group_differences(optimizer) is None:
                return specs[0]
            return replace(specs[0], groups=tuple(specs))
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            names = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
            if optimizer not in names:
                raise InvalidArgumentError(
                    f"replay implements torch.optim.SGD, Adam and AdamW, not {optimizer.__name__}: give one of them"
                )
            kind = names[optimizer]
            if kind == "adam" and hyper.get("decoupled_weight_decay"):
                kind = "adamw"  # Adam(decoupled_weight_decay=True) is AdamW
            defaults = {"sgd": {}, "adam": {"weight_decay": 0.0}, "adamw": {"weight_decay": 1e-2}}[names[optimizer]]
            return cls.of(kind, **{**defaults, **hyper})
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
        if self.groups:
            return f"{len(self.groups)} parameter groups: " + "; ".join(g.describe() for g in self.groups)
        if self.kind == "sgd":
            return (
                f"sgd(momentum={self.momentum}, dampening={self.dampening}, nesterov={self.nesterov}, "
                f"weight_decay={self.weight_decay})"
            )
        return f"{self.kind}(betas={self.betas}, eps={self.eps}, weight_decay={self.weight_decay})"

    def init(self, params: Tensors) -> Tensors:
        """The optimizer's state before the first step (one flat tuple of tensors)."""
        return _init((self,) * len(params), params)

    def step(self, params: Tensors, state: Tensors, grads: Tensors, lr: float, index: int) -> tuple[Tensors, Tensors]:
        """The parameters and state after the step of 0-based ``index`` with gradients ``grads``."""
        return _step((self,) * len(params), params, state, grads, (lr,) * len(params), (index,) * len(params))


def _init(specs: Sequence[Optimizer], params: Tensors) -> Tensors:
    """The state before the first step of parameters ``params``, each updated by its ``specs`` entry (one kind):
    SGD's momentum buffers (where any parameter has momentum), Adam's ``m`` then ``v``."""
    if specs and specs[0].kind == "sgd":
        return tuple(torch.zeros_like(p) for p in params) if any(s.momentum for s in specs) else ()
    return tuple(torch.zeros_like(p) for p in params) + tuple(torch.zeros_like(p) for p in params)  # m, v


def _step(
    specs: Sequence[Optimizer],
    params: Tensors,
    state: Tensors,
    grads: Tensors,
    rates: Sequence[float],
    counts: Sequence[int],
    skip: frozenset[int] = frozenset(),
) -> tuple[Tensors, Tensors]:
    """The parameters and state (:func:`_init`'s layout) after a step: parameter ``i`` updated by ``specs[i]``'s
    hyper-parameters at learning rate ``rates[i]`` (its parameter group's), its ``counts[i]``-th update (0-based:
    SGD's momentum buffer starts at the first, Adam's bias corrections count them); the parameters in ``skip`` had
    no gradient (``torch.optim`` leaves them and their state as they are)."""
    if specs and specs[0].kind == "sgd":
        new_params, buffers = [], []
        for i, (spec, p, g, lr) in enumerate(zip(specs, params, grads, rates)):
            if i in skip:
                new_params.append(p)
                if state:
                    buffers.append(state[i])
                continue
            if spec.weight_decay:
                g = g + spec.weight_decay * p
            if spec.momentum:
                b = g if counts[i] == 0 else spec.momentum * state[i] + (1 - spec.dampening) * g
                buffers.append(b)
                g = g + spec.momentum * b if spec.nesterov else b
            elif state:  # another group's momentum: this parameter's buffer stays unused
                buffers.append(state[i])
            new_params.append(p - lr * g)
        return tuple(new_params), tuple(buffers)
    n = len(params)
    new_params, ms, vs = [], [], []
    for i, (spec, p, g, m, v, lr) in enumerate(zip(specs, params, grads, state[:n], state[n:], rates)):
        if i in skip:
            new_params.append(p)
            ms.append(m)
            vs.append(v)
            continue
        count = float(counts[i] + 1)
        beta1, beta2 = spec.betas
        if spec.weight_decay:
            if spec.kind == "adamw":
                p = p * (1 - lr * spec.weight_decay)
            else:
                g = g + spec.weight_decay * p
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        denom = _sqrt(v) / (1 - beta2**count) ** 0.5 + spec.eps
        new_params.append(p - lr / (1 - beta1**count) * (m / denom))
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
    parameters (by name), the segments it was checkpointed in, the most states (parameters and optimizer state,
    one per step) it held at once, the optimizer it applied (with the run's parameter groups where they differ),
    each step's recorded learning rate and each step's learning rate per parameter group."""

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
    group_learning_rates: list[list[float]] = field(default_factory=list)  # per step, each parameter group's


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
    batches, step_numbers, rates = _recorded_batches(store, run, label)
    record = _check_recorded_optimizer(store, run, label, spec, reduction, step_numbers[0])
    steps = len(batches)
    if segments is None:
        segments = math.ceil(math.sqrt(steps))
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= steps:
        raise InvalidArgumentError(
            f"segments must be a whole number in [1, {steps}] (the run's steps), got {segments!r}"
        )
    if write:
        store.require_writable("replay with write=True")
    model = _model(store, run, model_fn, record)
    _check_initial_weights(run, model, record, step_numbers[0])
    plan, applied = _plan(run, model, spec, record, step_numbers, rates)
    names = plan.names
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

    # each step's gradient over its rows' mean (the loss scale, a sum's batch size), as capture recorded it
    totals = [record.totals.get(s) for s in step_numbers]
    factors = [record.scale if m is None else m if reduction == "mean" else m / len(b) for m, b in zip(totals, batches)]

    def step(t: int, params: Tensors, state: Tensors, weights: torch.Tensor) -> tuple[Tensors, Tensors]:
        batch = data.get(batches[t], f"training step {t}")

        def objective_loss(p: Tensors) -> torch.Tensor:
            weighted = weights * losses(p, batch, len(batches[t]), f"the batch of step {t}")
            reduced = weighted.mean() if reduction == "mean" else weighted.sum()
            return reduced if factors[t] == 1.0 else reduced * factors[t]

        grads = torch.func.grad(objective_loss)(params)
        return plan.step(t, params, state, grads)

    initial = tuple(dict(model.named_parameters())[n].detach().clone() for n in names)
    first = _first_losses(losses, initial, data.get(batches[0], "training step 0"), len(batches[0]))
    recorded = _recorded_losses(store, run, label, step_numbers[0])
    if recorded is not None:
        _check_first_losses(run, step_numbers[0], recorded, first.double().cpu().numpy())
    length = math.ceil(steps / segments)
    starts = list(range(0, steps, length))
    kept = _States()
    params, state = initial, plan.init(initial)
    at = [torch.full((len(b),), weight, dtype=dtype, device=device) for b in batches]  # every eps where taken

    def locate_nonfinite(start: int, params: Tensors, state: Tensors, end: int) -> None:
        """Steps ``start..end`` again from their finite start, checked one by one: raises at the first step
        whose weights hold NaN/Inf (the forward replay checks only once a segment: no host sync per step)."""
        for t in range(start, end):
            params, state = step(t, params, state, at[t])
            _check_finite(params, f"the weights after step {t}")

    with torch.no_grad():
        mark = (0, params, state)  # the last state checked finite
        for t in range(steps):  # forward replay: keep each segment's first state
            if t in starts:
                if not _finite(params):
                    locate_nonfinite(*mark, t)
                mark = (t, params, state)
                kept.keep(t, params, state)
            params, state = step(t, params, state, at[t])
        if not _finite(params):
            locate_nonfinite(*mark, steps)
    final = params
    query_batch = data.get(query_ids, "the queries")
    query_losses, query_vjp = torch.func.vjp(lambda p: losses(p, query_batch, len(query_ids), "the queries"), final)
    _check_finite((query_losses,), "the queries' final losses")
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
            try:
                _, vjp = torch.func.vjp(lambda p, s, w, t=t: step(t, p, s, w), params, state, at[t])
                meta.index_add_(1, columns[t], adjoint.back(vjp))
            except RuntimeError as error:
                raise _second_order_error(error, t) from error
    _check_finite((meta,), "the metagradients")
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
        applied,
        rates,
        weight,
        plan.rates,
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
                applied.describe(),
                result.losses.tolist(),
                weight,
            ),
        )
    return result


def _second_order_error(error: RuntimeError, t: int) -> Exception:
    """The error differentiating step ``t``'s gradient raised, as an ``InvalidArgumentError`` saying what to do
    where an operation of the model has no second derivative (PyTorch's fused attention kernels); else itself."""
    text = str(error)
    if "derivative for" not in text and "not implemented" not in text:
        return error
    return InvalidArgumentError(
        f"the replay differentiates each step's gradient once more (a second derivative), which an operation of the "
        f"model does not implement ({text.splitlines()[0]}; at step {t}): build model_fn()'s model with operations "
        "that have one, e.g. a Hugging Face model with attn_implementation='eager' instead of the fused "
        "scaled_dot_product_attention kernels"
    )


def _first_losses(losses: Callable[..., torch.Tensor], params: Tensors, batch: Any, size: int) -> torch.Tensor:
    """The per-example losses of the first training batch at the initial weights (detached); an
    ``InvalidArgumentError`` when they do not depend on the model's parameters (a ``.detach()``, ``.item()`` or
    ``torch.no_grad()`` inside ``loss_fn``): every metagradient would be a silent zero."""
    with torch.enable_grad():
        tracked = tuple(p.detach().requires_grad_() for p in params)
        out = losses(tracked, batch, size, "the batch of step 0")
    if not out.requires_grad:
        raise InvalidArgumentError(
            "loss_fn(model, batch) returned losses that do not depend on the model's parameters (on the batch of "
            "step 0): every metagradient would be zero; compute them from model(...) without .detach(), .item() or "
            "torch.no_grad()"
        )
    return out.detach()


def _finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _check_finite(tensors: Sequence[torch.Tensor], what: str) -> None:
    """``InvalidArgumentError`` naming ``what`` when one of ``tensors`` holds NaN/Inf: a replay never stores or
    returns non-finite metagradients."""
    if _finite(tensors):
        return
    raise InvalidArgumentError(
        f"the replay became non-finite: {what} hold NaN/Inf (nothing was stored); check that loss_fn returns "
        "finite losses on every recorded batch and the queries' (e.g. a log of 0), and that model_fn(), "
        "batch_fn and the optimizer are the run's: a replay that diverges where training did not is replaying "
        "another run"
    )


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
_STEP_NOTES = ("group_differences", "gradients", "row_weights", "without_gradients", "initial_state", "adam_step")
#: Capture's record of the parameter groups and the initial weights (absent in stores of earlier versions).
_GROUP_COLUMNS = ("group_parameters", "group_hyperparameters", "initial_weights")


@dataclass
class _Record:
    """What capture recorded of the replayed steps' parameter groups: each group's trainable parameters by name
    (``members``), each group's hyper-parameters (``groups``, one set for the run) and learning rate per step
    (``rates``, step -> per group), and the weights' fingerprint before the first step a capture recorded
    (``initial``: its step and ``{name: [sum, sum of squares]}``); ``None`` (empty) where not recorded."""

    members: list[list[str]] | None = None
    groups: list[Optimizer] | None = None
    rates: dict[int, list[float]] = field(default_factory=dict)
    initial: tuple[int, dict[str, list[float]]] | None = None
    totals: dict[int, float] = field(default_factory=dict)  # step -> its gradient over the mean of its rows
    scale: float = 1.0  # the factor of a step whose rows' weights are not recorded (a sum overriding the default)
    without: dict[int, list[str]] = field(default_factory=dict)  # step -> the parameters it had no gradient for


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


def _check_recorded_optimizer(
    store: StoreCore, run: str, label: str, spec: Optimizer, reduction: Reduction = "mean", first: int = 0
) -> _Record:
    """Refuse an optimizer that contradicts the one capture recorded for the run's steps (``optimizer_steps``:
    kind and hyper-parameters, read from the training's optimizer; a ``spec`` with :attr:`Optimizer.groups`
    is checked group by group, else against the group of the first captured layer's weight), and a run whose
    steps the replay cannot reproduce (:func:`_check_steps`, :func:`_groups_record`); the record of the groups.
    A store without the table is not checked. One exception: a weight decay where none was recorded (in any
    group), for SGD and Adam, whose L2 term is the gradient of an objective's ``wd/2 ||theta||^2`` (a penalty of
    the training loss that ``loss_fn``'s per-example losses cannot carry): every group takes it."""
    names = store.dataset(S.OPTIMIZER_STEPS).schema.names if store.has_table(S.OPTIMIZER_STEPS) else []
    notes = [c for c in _STEP_NOTES if c in names]
    kept = [c for c in _GROUP_COLUMNS if c in names]
    table = None
    if names:
        columns = [*_RECORDED, *notes, *kept, "step"]
        table = store.scan(S.OPTIMIZER_STEPS, columns, gradient_filter(run, label, None), cache=False)
    if table is None or table.num_rows == 0:
        if spec.groups:
            raise InvalidArgumentError(
                f"the replay was given an optimizer whose parameter groups differ, but run {run!r} has no record of "
                "its optimizer's groups (which parameters each held): capture the run with this version of "
                "gradstore, or replay a run whose optimizer has one parameter group"
            )
        return _Record()
    table = table.sort_by("step")
    hyper = table.select(_RECORDED).drop_columns(["weight_decays"])
    recorded = {tuple(row.values()) for row in hyper.to_pylist()}
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
    record = _groups_record(run, kind, table)
    _check_steps(run, table, grouped=record.groups is not None)
    _check_start(run, kind, table, first)
    _step_record(store, run, table, record, reduction)
    if table.column("weight_decays").null_count != table.num_rows and record.groups is None:
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer applied different weight decays to its parameter groups; the replay applies "
            "one to every parameter: replay a run trained with one weight decay"
        )
    given = f"the replay was given {spec.describe()}"

    def close(a: float, b: float) -> bool:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)

    undecayed = decay == 0 and all(g.weight_decay == 0 for g in record.groups or ())
    objective_l2 = undecayed and spec.kind in ("sgd", "adam") and kind == spec.kind
    adam_alike = {kind, spec.kind} <= {"adam", "adamw"} and undecayed and spec.weight_decay == 0
    if kind != spec.kind and not adam_alike:
        raise InvalidArgumentError(f"run {run!r} was trained with {kind} but {given}: pass the run's optimizer")
    if spec.groups:
        _check_groups(run, record, spec, objective_l2)
    elif kind == "sgd":
        found = (momentum, dampening, bool(nesterov))
        wanted = (spec.momentum, spec.dampening, spec.nesterov)
        same = close(found[0], wanted[0]) and close(found[1], wanted[1]) and found[2] == wanted[2]
        recorded_as = f"sgd(momentum={momentum}, dampening={dampening}, nesterov={bool(nesterov)}, "
    else:
        same = close(momentum, spec.betas[0]) and close(beta2, spec.betas[1]) and close(eps, spec.eps)
        recorded_as = f"{kind}(betas=({momentum}, {beta2}), eps={eps}, "
    if not spec.groups and not (same and (close(decay, spec.weight_decay) or objective_l2)):
        which = " (the parameter group of the first captured layer's weight)" if len(record.groups or ()) > 1 else ""
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer was recorded as {recorded_as}weight_decay={decay}){which} but {given}: pass "
            "the run's optimizer (its torch.optim instance gives the same hyper-parameters)"
        )
    if objective_l2 and record.groups is not None:
        decays = [g.weight_decay for g in spec.groups] if spec.groups else [spec.weight_decay] * len(record.groups)
        record.groups = [replace(g, weight_decay=wd) for g, wd in zip(record.groups, decays)]
    return record


def _groups_record(run: str, kind: str, table: Any) -> _Record:
    """The record of the parameter groups in ``table`` (the label's ``optimizer_steps`` rows in step order, of
    optimizer ``kind``): refuses groups whose parameters changed during the run, that hold tensors of no name,
    or whose hyper-parameters (other than the learning rate) changed or the replay does not implement. ``groups``
    only where every row recorded them (else stores of earlier versions' rules hold)."""
    names = table.column_names
    record = _Record()
    if "group_parameters" in names:
        members = list(dict.fromkeys(m for m in table.column("group_parameters").to_pylist() if m is not None))
        if len(members) > 1:
            raise InvalidArgumentError(
                f"run {run!r}'s optimizer changed which parameters its groups hold during the recorded steps "
                "(add_param_group, or parameters frozen or unfrozen); the replay keeps each parameter in one group "
                "throughout: replay a run whose groups stay as they start"
            )
        if members:
            record.members = json.loads(members[0])
            if any(name is None for group in record.members for name in group):
                raise InvalidArgumentError(
                    f"run {run!r}'s optimizer trained tensors that are no parameters of the captured model; the "
                    "replay updates the model's parameters only: replay a run whose optimizer holds only them"
                )
    if "initial_weights" in names:
        record.initial = _initial(table)
    hyper = table.column("group_hyperparameters").to_pylist() if "group_hyperparameters" in names else [None]
    if record.members is None or any(h is None for h in hyper):
        return record
    steps = table.column("step").to_pylist()
    sets = [json.loads(h) for h in hyper]
    record.rates = {step: [float(g["lr"]) for g in groups] for step, groups in zip(steps, sets)}
    fixed = {json.dumps([{k: v for k, v in g.items() if k != "lr"} for g in groups], sort_keys=True) for groups in sets}
    if len(fixed) > 1 or len(sets[0]) != len(record.members):
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer changed its groups' hyper-parameters (other than the learning rate) during "
            "the recorded steps; the replay applies one set per group: replay a run whose groups keep theirs"
        )
    record.groups = []
    for i, group in enumerate(sets[0]):
        try:
            record.groups.append(Optimizer.of(kind, **{k: v for k, v in group.items() if k != "lr"}))
        except InvalidArgumentError as error:
            raise InvalidArgumentError(
                f"run {run!r}'s optimizer's parameter group {i} cannot be replayed ({error}); the replay implements "
                "torch.optim's SGD (momentum, dampening, nesterov, weight_decay) and Adam/AdamW (betas, eps, "
                "weight_decay) per group, without amsgrad, maximize or other settings"
            ) from error
    return record


def _initial(table: Any) -> tuple[int, dict[str, list[float]]] | None:
    """The weights' fingerprint of the earliest step in ``table`` that carries one, with that step."""
    for step, fingerprint in zip(table.column("step").to_pylist(), table.column("initial_weights").to_pylist()):
        if fingerprint is not None:
            return int(step), json.loads(fingerprint)
    return None


def _check_groups(run: str, record: _Record, spec: Optimizer, objective_l2: bool) -> None:
    """Refuse a ``spec`` whose groups (:attr:`Optimizer.groups`) differ from the recorded ones in number or in a
    hyper-parameter other than the learning rate (a weight decay where none was recorded: an objective's L2)."""
    if record.groups is None:
        raise InvalidArgumentError(
            f"the replay was given an optimizer whose parameter groups differ, but run {run!r} has no record of its "
            "optimizer's groups (which parameters each held): capture the run with this version of gradstore"
        )
    if len(spec.groups) != len(record.groups):
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer had {len(record.groups)} parameter groups but the replay was given one with "
            f"{len(spec.groups)}: pass the run's optimizer (built with the same groups)"
        )
    for i, (given, recorded) in enumerate(zip(spec.groups, record.groups)):
        if objective_l2:
            given = replace(given, weight_decay=0.0)
        if given != recorded:
            raise InvalidArgumentError(
                f"run {run!r}'s optimizer's parameter group {i} was recorded as {recorded.describe()} but the "
                f"replay was given {given.describe()}: pass the run's optimizer (built with the same groups)"
            )


def _check_steps(run: str, table: Any, grouped: bool) -> None:
    """Refuse a run whose recorded steps the replay cannot reproduce: an optimizer whose parameter groups differ
    (``group_differences``) where capture did not record the groups (``grouped`` false: a store of an earlier
    version), or steps whose gradients were changed between the backward and the step (``gradients ==
    "modified"``: clipping, rescaling). Gradients only unscaled by the capture's GradScaler are the backward's."""
    names = table.column_names
    if "group_differences" in names and not grouped:
        differ = sorted({d for d in table.column("group_differences").to_pylist() if d})
        if differ:
            raise InvalidArgumentError(
                f"run {run!r}'s optimizer had parameter groups that differ in {'; '.join(differ)}; the replay applies "
                "one learning rate (each step's recorded one) and one set of hyper-parameters to every parameter, so "
                "it cannot reproduce this training (capture recorded no groups: an earlier version of gradstore): "
                "capture the run again with this version, or replay a run whose optimizer has one parameter group "
                "(or groups with the same hyper-parameters)"
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
                "replay a run trained without them (the HF Trainer: max_grad_norm=0)"
            )


def _check_start(run: str, kind: str, table: Any, first: int) -> None:
    """Refuse a run whose first replayed step (``first``, the first with rows) did not start from the optimizer's
    empty state: the optimizer stepped before it under the capture (a ``normalizer="adam_*"`` capture records no
    rows at the first step), or before the capture (a capture begun mid-training: momentum buffers, Adam's moments
    and step count from steps the store does not hold). The replay starts from ``Optimizer.init``."""
    steps = table.column("step").to_pylist()
    earlier = [step for step in steps if step < first]
    if earlier:
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer took {len(earlier)} recorded step(s) (from step {earlier[0]}) before the first "
            f"step with training rows, {first} (a capture with normalizer='adam_*' records no rows at the first "
            "step), so the replay, which needs every step's batch from the run's first, cannot reproduce them: "
            "capture the run's training rows from its first optimizer step (without a normalizer)"
        )
    at = [row for row in table.slice(0, 1).to_pylist() if row["step"] == first]
    if not at:
        return
    row = at[0]
    held = row.get("initial_state") == "held"
    counted = kind in ("adam", "adamw") and (row.get("adam_step") or 1) > 1
    if held or counted:
        what = f"Adam's step count {row['adam_step']}" if counted else "state (momentum buffers, moments)"
        raise InvalidArgumentError(
            f"run {run!r}'s capture began mid-training: before its first recorded step {first} the optimizer "
            f"already held {what} from steps the store does not hold, and the replay starts from an empty optimizer "
            "state, so it cannot reproduce this training: capture from the run's first optimizer step"
        )


def _step_record(store: StoreCore, run: str, table: Any, record: _Record, reduction: Reduction) -> None:
    """Fill ``record``'s per-step weights of the rows (``row_weights``, formed by capture under the run's
    ``loss_reduction``; refusing rows weighted unevenly within a step, which a replay of per-example losses reduced
    by one mean cannot reproduce, except a ``"token_mean"`` run's, whose ``loss_fn`` weighs the tokens; where the
    replay's ``reduction`` overrides the run's default, its ``"sum"`` weighs every row alike, at the loss scale) and
    parameters without gradients (``without_gradients``)."""
    names = table.column_names
    steps = table.column("step").to_pylist()
    options = store.run_config(run).get("capture") or {}
    captured = options.get("loss_reduction") or "mean"
    if captured != "token_mean" and reduction != captured:
        record.scale = float(options.get("loss_scale") or 1.0)
    elif "row_weights" in names and captured != "token_mean":
        for step, recorded in zip(steps, table.column("row_weights").to_pylist()):
            if not recorded:
                continue
            weights = row_weights({"row_weights": recorded})
            if weights.uneven:
                raise InvalidArgumentError(
                    f"run {run!r}'s step {step} weighted its examples unevenly (each example's weight in the step's "
                    f"gradient from {weights.least:.4g} to {weights.most:.4g} times the mean: gradient "
                    "accumulation over micro-batches of different sizes, each reduced by its own mean); the replay "
                    "reduces each step's losses by one mean or sum, so it cannot reproduce this training: accumulate "
                    "micro-batches of equal size, or reduce each by the step's total count"
                )
            record.totals[step] = weights.total
    if "without_gradients" in names:
        for step, missing in zip(steps, table.column("without_gradients").to_pylist()):
            if missing:
                record.without[step] = json.loads(missing)


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
            "losses divided by the count the training loss divided by (the batch's label tokens, or the loop's "
            "num_items_in_batch), and pass reduction='sum'"
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


def _recorded_batches(store: StoreCore, run: str, label: str) -> tuple[list[list[str]], list[int], list[float]]:
    """Each recorded step's example ids (in the order captured), step and learning rate; every optimizer step
    must have been captured."""
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
    batches = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return batches, [s.step for s in steps], [s.learning_rate for s in steps]


def _recorded_losses(store: StoreCore, run: str, label: str, step: int) -> np.ndarray | None:
    """The per-example losses capture recorded for ``step``'s batch (``per_example_loss=``), in the order of its
    rows; ``None`` where any was not recorded."""
    where = gradient_filter(run, label, "train", steps=(step, step))
    table = store.scan(store.gradient_table_name(run), ["loss", "grad_id"], where).sort_by("grad_id")
    column = table.column("loss")
    if table.num_rows == 0 or column.null_count:
        return None
    return column.to_numpy().astype(np.float64)


def _check_first_losses(run: str, step: int, recorded: np.ndarray, replayed: np.ndarray) -> None:
    """Compare the replay's per-example losses of its first step (at ``model_fn()``'s weights, the run's before
    that step) with those capture recorded: the same values in another order mean ``batch_fn`` did not return the
    examples in the order of the ids it was given (every example's weight would be another's: refused); other
    values, that ``loss_fn`` or the data differ from the training's (warned: capture's ``per_example_loss`` may
    be another function than the training loss)."""

    def close(a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.allclose(a, b, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(b).max()))))

    if close(replayed, recorded):
        return
    if close(np.sort(replayed), np.sort(recorded)):
        raise InvalidArgumentError(
            f"batch_fn returned the examples of run {run!r}'s step {step} in another order than the ids it was given "
            "(the replay's per-example losses are those capture recorded, permuted): batch_fn(ids) must return the "
            "batch of exactly those ids in that order, or every example's metagradient is another's"
        )
    worst = float(np.abs(replayed - recorded).max())
    warnings.warn(
        f"the replay's per-example losses of run {run!r}'s first step {step} differ from those capture recorded "
        f"(per_example_loss=) by up to {worst:.3g}: check that batch_fn(ids) builds the batch of those ids in their "
        "order and loss_fn(model, batch) is the training's per-example loss; the scores are the replay's of "
        "loss_fn, which may not be the run's",
        ReplayMismatchWarning,
        stacklevel=3,
    )


def _model(store: StoreCore, run: str, model_fn: Callable[[], nn.Module], record: _Record) -> nn.Module:
    """``model_fn()``'s model, checked against the run's: the parameter names its optimizer's groups held, the
    architecture (:func:`model_fingerprint`), some trainable parameter."""
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
    names = [name for name, _ in model.named_parameters()]
    missing = [n for group in record.members or () for n in group if n not in set(names)]
    if missing:
        raise InvalidArgumentError(
            f"model_fn()'s model has no parameters named {missing[:5]}, which run {run!r}'s optimizer trained (the "
            f"model's are named {names[:5]}{', ...' if len(names) > 5 else ''}): the replay maps the optimizer's "
            "parameter groups by name, so model_fn() must return the run's model with the parameter names capture "
            "saw (model.named_parameters(); wrapped as in training, e.g. in DDP or torch.compile, or unwrapped in both)"
        )
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


def _check_initial_weights(run: str, model: nn.Module, record: _Record, first: int) -> None:
    """Refuse a ``model`` whose weights are not those the run started from: the fingerprint capture took before
    its first step (:func:`~gradstore.capture.optimizer_state.weights_fingerprint`), where that step is the
    replay's ``first``. Sums in float64 of the same float32/float64 numbers agree to ~1e-12 of their scale; a
    relative 1e-7 tells any training step apart."""
    if record.initial is None or record.initial[0] != first:
        return
    found = json.loads(weights_fingerprint(model))
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    for name, (total, squares) in record.initial[1].items():
        if name not in found:
            continue
        mine, my_squares = found[name]
        scale = max(squares, my_squares)
        if abs(mine - total) > 1e-7 * math.sqrt(sizes[name] * scale) or abs(my_squares - squares) > 1e-7 * scale:
            raise InvalidArgumentError(
                f"model_fn() returned other weights than run {run!r} started from at its first recorded step {first} "
                f"(parameter {name!r}: sum {mine:.9g}, sum of squares {my_squares:.9g}; recorded {total:.9g}, "
                f"{squares:.9g}): the replay starts from model_fn()'s weights, so they must be the run's before its "
                "first step (the same seed and initialisation, or a copy saved before training), not e.g. the "
                "trained model"
            )


@dataclass
class _Plan:
    """What the replay updates and how: the trained parameters' ``names`` (the model's order), each one's
    hyper-parameters (``specs``, its parameter group's) and group (``group_of``), and per step each group's
    learning rate (``rates``)."""

    names: list[str]
    group_of: list[int]
    specs: list[Optimizer]
    rates: list[list[float]]
    skips: list[frozenset[int]] = field(default_factory=list)  # per step: the parameters without a gradient
    _counts: list[tuple[int, ...]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        counts = [0] * len(self.names)
        for skip in self.skips:  # each parameter's updates before each step (where some step skips one)
            self._counts.append(tuple(counts))
            counts = [c + (i not in skip) for i, c in enumerate(counts)]

    def init(self, params: Tensors) -> Tensors:
        """The optimizer's state before the first step."""
        return _init(self.specs, params)

    def step(self, t: int, params: Tensors, state: Tensors, grads: Tensors) -> tuple[Tensors, Tensors]:
        """The parameters and state after step ``t`` (0-based)."""
        rates = [self.rates[t][g] for g in self.group_of]
        if not self.skips:
            return _step(self.specs, params, state, grads, rates, (t,) * len(params))
        return _step(self.specs, params, state, grads, rates, self._counts[t], self.skips[t])


def _plan(
    run: str, model: nn.Module, spec: Optimizer, record: _Record, steps: list[int], rates: list[float]
) -> tuple[_Plan, Optimizer]:
    """The replay's :class:`_Plan` and the optimizer it applies: each recorded group's parameters (by name; the
    model's trainable ones where capture recorded none) at its recorded hyper-parameters and learning rates (one
    group: each step's rows' learning rate where no step was recorded); parameters in no group stay as they are."""
    if record.members is None:
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        return _Plan(names, [0] * len(names), [spec] * len(names), [[r] for r in rates]), spec
    group = {name: i for i, members in enumerate(record.members) for name in members}
    names = [name for name, _ in model.named_parameters() if name in group]
    if not names:
        raise InvalidArgumentError(
            f"run {run!r}'s optimizer held no trainable parameter of the model: nothing to replay"
        )
    groups = record.groups or [spec] * len(record.members)
    if len(groups) > 1:
        absent = [step for step in steps if step not in record.rates]
        if absent:
            raise InvalidArgumentError(
                f"run {run!r}'s recorded steps {absent[:5]} have no record of their optimizer step (optimizer_steps) "
                "and so no learning rate per parameter group: replay a run whose every recorded step the optimizer "
                "took under capture"
            )
    per_step = [record.rates.get(step, [rate] * len(groups)) for step, rate in zip(steps, rates)]
    group_of = [group[name] for name in names]
    applied = spec if len(groups) == 1 else replace(spec, groups=tuple(groups))
    position = {name: i for i, name in enumerate(names)}
    skips = [frozenset(position[n] for n in record.without.get(step, ()) if n in position) for step in steps]
    skips = skips if any(skips) else []
    return _Plan(names, group_of, [groups[g] for g in group_of], per_step, skips), applied


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
