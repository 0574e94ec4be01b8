"""The linearised dynamics of the optimizer of each recorded step, for the trajectory methods.

Capture records per optimizer step what the optimizer applied (the ``optimizer_steps`` table,
:mod:`gradstore.capture.optimizer_state`). Up-weighting example ``z`` by ``eps`` adds ``eps g_z / B`` to the
step's gradient; to first order the perturbation of the joint state (weights ``theta``, momentum buffer ``n``)
then follows, per step (``H`` the step's batch curvature, ``P`` a diagonal preconditioner, ``u`` the injected
gradient):

    ``dg = (H + l2 I) dtheta + u``
    ``dn' = mu dn + c dg``
    ``dtheta' = rho dtheta - P (a dg + b dn)``

with, for

* SGD (``lr``, momentum ``mu``, dampening ``tau``, L2 weight decay ``wd``, PyTorch's convention
  ``n <- mu n + (1 - tau) g``, ``theta <- theta - lr n``): ``c = 1 - tau``, ``a = lr c``, ``b = lr mu``,
  ``l2 = wd``, ``rho = 1``, ``P = I``; Nesterov (``theta <- theta - lr (g + mu n')``): ``a = lr (1 + mu c)``,
  ``b = lr mu^2``. Momentum 0: ``a = lr``, ``b = 0``: the plain ``I - lr H`` of a step.
* Adam (``beta1``, bias corrections at its step count ``k``; ``P = diag(1 / (sqrt(v_hat) + eps))`` frozen at
  the value the step used: the change of ``v`` with the weights is not modelled): ``mu = beta1``,
  ``c = 1 - beta1``, ``a = lr c / (1 - beta1^k)``, ``b = lr beta1 / (1 - beta1^k)``; coupled L2 weight decay
  ``l2 = wd`` (``torch.optim.Adam``), decoupled (AdamW) ``rho = 1 - lr wd``.

The final weights' response to the step's injection is ``-(a R_theta P - c R_n) u`` where ``[R_theta, R_n]`` is
the weights' row of the product of the later steps' operators; ``dvemb`` keeps ``[R_theta, R_n]`` per layer
block and runs backwards: ``K = a R_theta P - c R_n`` is the step's embedding operator, then
``R_theta <- rho R_theta - K (H + l2 I)``, ``R_n <- -b R_theta P + mu R_n``. Exact for a quadratic model with
unprojected rows and the exact batch Hessian (true-Fisher rows of a linear model). Without momentum ``R_n``
is never formed (the recursion is the plain one, with weight decay and preconditioner). A step without a
recorded optimizer (stores made before the table, another optimizer, Adam whose state could not be read) is
``lr x gradient``.

**Stability.** One curvature mode ``lambda`` of ``P^1/2 H P^1/2`` gives the 2x2 step ``[[1 - a l, -b],
[c l, mu]]``, stable while ``a lambda (1 + mu) - b c lambda < 2 (1 + mu)`` (plain SGD: ``lr lambda < 2``; heavy
ball: ``lr lambda < 2 (1 + mu)``; Nesterov: ``lr lambda < 2 (1 + mu) / (1 + 2 mu)``). Training that stayed
finite did not follow a mode beyond it (the step's curvature rows over-state its Hessian, or training sat at the
edge of stability, where the nonlinearity keeps it bounded), while the linear recursion would grow it
geometrically. Rule (``STABILITY = "clip"``): the step's curvature eigenvalues beyond the bound are clipped to
it (such a mode neither grows nor decays), with one :class:`~gradstore.errors.UnstableStepWarning` per call
naming the steps (``dvemb`` keeps what its build clipped with the embeddings and warns it whenever it reads them).
A recursion that still overflows raises :class:`~gradstore.errors.UnstableRecursionError` naming the step and
what to do.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import torch

from gradstore.core import StoreCore, gradient_filter
from gradstore.core import schema as S
from gradstore.errors import (
    InvalidArgumentError,
    UnmodelledOptimizerWarning,
    UnstableRecursionError,
    UnstableStepWarning,
)

#: ``"clip"``: clip a step's curvature to the stable range (warned); ``"off"``: use it as recorded.
STABILITY = "clip"
#: Entries of the carried product above this (float32 rows times it overflow) name the step in the error.
LARGE = 1e30


@dataclass(frozen=True)
class Coefficients:
    """One step's linearised dynamics (module doc): ``dtheta' = rho dtheta - P (a dg + b dn)``,
    ``dn' = mu dn + c dg``, ``dg = (H + l2 I) dtheta + u``; ``p`` the diagonal of ``P`` (``None``: ``I``)."""

    rho: float | torch.Tensor  # [dim] where parameter groups differ in (decoupled) weight decay
    a: float
    b: float
    mu: float
    c: float
    l2: float | torch.Tensor  # likewise
    p: torch.Tensor | None = None
    optimizer: str = "lr"

    @classmethod
    def plain(cls, lr: float) -> Coefficients:
        """``lr x gradient``: a step of plain SGD."""
        return cls(1.0, lr, 0.0, 0.0, 1.0, 0.0)

    @property
    def is_plain(self) -> bool:
        return self.mu == 0 and _scalar(self.l2) == 0 and _scalar(self.rho) == 1 and self.p is None

    @property
    def has_momentum(self) -> bool:
        return self.mu != 0

    def bound(self, p_max: float = 1.0) -> float:
        """The largest stable eigenvalue of ``P^1/2 H P^1/2`` (module doc), less the weight decay's share."""
        slope = self.a * (1 + self.mu) - self.b * self.c
        if slope <= 0:
            return math.inf
        return max(0.0, 2 * (1 + self.mu) / slope - _largest(self.l2) * p_max)


def _scalar(value: float | torch.Tensor) -> float | None:
    """A scalar as it is; a per-coordinate tensor as its value when constant, else ``None``."""
    if isinstance(value, torch.Tensor):
        return float(value[0]) if bool((value == value[0]).all()) else None
    return value


def _largest(value: float | torch.Tensor) -> float:
    return float(value.max()) if isinstance(value, torch.Tensor) else value


def _mean(value: float | torch.Tensor) -> float:
    return float(value.mean()) if isinstance(value, torch.Tensor) else value


def coefficients(
    row: dict, lr: float, dim: int, layers: Sequence[tuple[int, int]], slots: Sequence | None = None
) -> Coefficients:
    """The step's :class:`Coefficients` from its ``optimizer_steps`` row (``lr``: the rows' learning rate;
    ``slots``: the run's layer slots, for learning rates recorded per layer), its size relative to the mean of its
    rows (:func:`row_weights`) and the learning rates of its layers where their parameter groups differ (folded into
    ``P`` as ``lr_i / lr``)."""
    co = _optimizer_coefficients(row, lr, dim, layers)
    rates = layer_rates(row.get("learning_rates"), slots, dim) if slots is not None else None
    if rates is not None:
        ratio = rates / lr if lr else torch.ones_like(rates)
        rho = co.rho
        if co.optimizer == "adamw":  # decoupled weight decay at each coordinate's own learning rate
            rho = 1.0 - (1.0 - torch.as_tensor(co.rho, dtype=torch.float64)) * ratio
        co = replace(co, rho=rho, p=ratio if co.p is None else co.p * ratio)
    total = row_weights(row).total
    if total != 1.0:  # the step's gradient is total x the mean of its rows: u and H scale, the weight decay does not
        co = replace(co, a=co.a * total, b=co.b * total, l2=co.l2 / total if total else co.l2)
    return co


@dataclass(frozen=True)
class RowWeights:
    """How a step weighted its captured rows (``optimizer_steps.row_weights``): ``total``, its gradient over the
    mean of its rows (1 for a batch mean, the batch's size for a sum, the loss scale, ...); ``least``/``most``, the
    smallest and largest row's weight over the mean's."""

    total: float = 1.0
    least: float = 1.0
    most: float = 1.0

    @property
    def uneven(self) -> bool:
        """Whether the rows were weighted unevenly (micro-batches of different sizes each reduced by its mean)."""
        return not math.isclose(self.least, self.most, rel_tol=1e-5)


def row_weights(row: dict) -> RowWeights:
    """A step's :class:`RowWeights` from its ``optimizer_steps`` row (all 1 where not recorded)."""
    recorded = row.get("row_weights")
    if not recorded:
        return RowWeights()
    weights = json.loads(recorded)
    return RowWeights(*(float(weights[k]) for k in ("total", "least", "most")))


def layer_rates(recorded: str | None, slots: Sequence, dim: int) -> torch.Tensor | None:
    """The learning rate of every coordinate ``[dim]`` (float64) from a step's ``learning_rates`` (JSON, a
    ``[weight's, bias's]`` pair per layer in the rows' order; the bias's applies to the bias column of a layer
    stored unprojected); ``None`` where not recorded or not in these ``slots``' layout."""
    if not recorded:
        return None
    pairs = json.loads(recorded)
    ordered = sorted(slots, key=lambda slot: slot.offset)
    if len(pairs) != len(ordered) or sum(slot.size for slot in ordered) != dim:
        return None
    out = torch.empty(dim, dtype=torch.float64)
    for (weight, bias), slot in zip(pairs, ordered):
        block = out[slot.offset : slot.offset + slot.size]
        block.fill_(float(weight))
        exact = slot.mode == "exact" and slot.kind in ("linear", "conv") and slot.has_bias and bias is not None
        if exact and slot.size % max(1, slot.d_out) == 0:
            block.view(slot.d_out, -1)[:, -1] = float(bias)
    return out


def _optimizer_coefficients(row: dict, lr: float, dim: int, layers: Sequence[tuple[int, int]]) -> Coefficients:
    """The step's :class:`Coefficients` from its optimizer's kind and hyper-parameters alone."""
    kind = row.get("optimizer")
    mu = float(row.get("momentum") or 0.0)
    wd: float | torch.Tensor = float(row.get("weight_decay") or 0.0)
    if row.get("weight_decays") is not None and kind in ("sgd", "adam", "adamw"):
        per = expand(row["weight_decays"], dim, layers)  # parameter groups with different weight decays
        wd = per if per is not None else wd
    if kind == "sgd":
        if mu == 0:
            return Coefficients(1.0, lr, 0.0, 0.0, 1.0, wd, None, kind)
        c = 1.0 - float(row.get("dampening") or 0.0)
        if row.get("nesterov"):
            return Coefficients(1.0, lr * (1 + mu * c), lr * mu * mu, mu, c, wd, None, kind)
        return Coefficients(1.0, lr * c, lr * mu, mu, c, wd, None, kind)
    if kind in ("adam", "adamw") and row.get("preconditioner") is not None:
        k = max(1, int(row.get("adam_step") or 1))
        correction = 1.0 / (1.0 - mu**k) if mu > 0 else 1.0
        if row.get("rows_normalizer"):  # rows in Adam's geometry: its preconditioner is in them already
            p = None
        else:
            p = expand(row["preconditioner"], dim, layers)
            if p is None:
                return Coefficients.plain(lr)
        rho, l2 = (1.0 - lr * wd, 0.0) if kind == "adamw" else (1.0, wd)
        return Coefficients(rho, lr * (1 - mu) * correction, lr * mu * correction, mu, 1 - mu, l2, p, kind)
    return Coefficients.plain(lr)


def expand(values: Sequence[float], dim: int, layers: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """A recorded preconditioner as ``[dim]`` float64: per coordinate as it is, per layer spread over each
    layer's block (``None`` when it matches neither)."""
    values = torch.tensor(values, dtype=torch.float64)
    if values.numel() == dim:
        return values
    if values.numel() != len(layers):
        return None
    out = torch.ones(dim, dtype=torch.float64)
    for value, (offset, size) in zip(values, layers):
        out[offset : offset + size] = value
    return out


def with_dynamics(store: StoreCore, run: str, label: str, steps: Sequence) -> list:
    """``steps`` (:class:`~gradstore.methods.trajectory.RecordedStep`, in step order) with their ``coefficients``
    from the ``optimizer_steps`` table (``None`` for a step it does not list, or a store without it: ``lr x
    gradient``). Only the rows of ``steps``' range are read: a caller streaming over the steps passes a chunk of
    them at a time, so the per-coordinate preconditioners in memory do not grow with the run."""
    if not steps or not store.has_table(S.OPTIMIZER_STEPS):
        return list(steps)
    span = (steps[0].step, steps[-1].step)
    table = store.scan(S.OPTIMIZER_STEPS, None, gradient_filter(run, label, None, span), cache=False)
    rows = {row["step"]: row for row in _rows(table)}  # ranks and resumed steps: the last
    if not rows:
        return list(steps)
    dim, layers, slots = _layout(store, run, "dvemb")
    return [
        replace(s, coefficients=coefficients(rows[s.step], s.learning_rate, dim, layers, slots))
        if s.step in rows
        else s
        for s in steps
    ]


def _layout(store: StoreCore, run: str, method: str) -> tuple[int, list[tuple[int, int]], Sequence | None]:
    """The run's dimension, its layers' ``(offset, size)`` (one block without a projection spec) and slots."""
    dim = store.run_dim(run)
    if not store.run(run)["projection"]:
        return dim, [(0, dim)], None
    slots = store.run_spec(run, method).layers
    return dim, [(s.offset, s.size) for s in slots], slots


#: The optimizers whose dynamics :func:`coefficients` models (capture's ``optimizer_kind``).
MODELLED = ("sgd", "adam", "adamw")
#: ``optimizer_steps`` columns :func:`warn_unmodelled` reads (those absent in a store of an earlier version skipped).
_NOTED = ("step", "optimizer", "gradients", "row_weights")


def warn_unmodelled(store: StoreCore, run: str, label: str | None, method: str, row_steps: Sequence[int] = ()) -> None:
    """One :class:`~gradstore.errors.UnmodelledOptimizerWarning` per kind of recorded step of ``run`` (under
    ``label``; any label with ``None``) that ``method``'s dynamics do not model: steps of an optimizer they do not
    model (RMSprop, Adagrad, NAdam, ...: taken as ``lr x gradient``), steps on gradients other than the backward's
    (clipping that cut the norm, a GradScaler not given to capture), rows weighted unevenly within a step
    (micro-batches of different sizes each reduced by its own mean; a ``"token_mean"`` run's token weighting is
    its documented approximation, not warned); recorded optimizer steps between ``row_steps`` (the steps with
    rows) that have none where those are not every ``s``-th step (a capture that lost some steps' rows)."""
    if not store.has_table(S.OPTIMIZER_STEPS):
        return
    columns = [c for c in _NOTED if c in store.dataset(S.OPTIMIZER_STEPS).schema.names]
    table = store.scan(S.OPTIMIZER_STEPS, columns, gradient_filter(run, label, None), cache=False)
    if table.num_rows == 0:
        return
    rows = table.to_pylist()
    exact = "for exact metagradients use store.replay (it refuses what it cannot reproduce)"
    kinds = sorted({str(r.get("optimizer")) for r in rows if r.get("optimizer") not in (None, *MODELLED)})
    if kinds:
        _warn(
            f"run {run!r} was trained with {', '.join(kinds)}, whose update rule the trajectory methods do not "
            f"model (they model {', '.join(MODELLED)}): each of its steps is taken as lr x gradient, a plain SGD "
            f"step, so {method}'s scores weight the steps as such; {exact} with one of the modelled optimizers, "
            "else a single-checkpoint method (fisher, grad-dot) does not depend on the dynamics"
        )
    modified = sorted(r["step"] for r in rows if r.get("gradients") == "modified")
    if modified:
        _warn(
            f"run {run!r}'s optimizer stepped on other gradients than the backward produced in {len(modified)} of its "
            f"{len(rows)} recorded steps (e.g. step {modified[0]}): gradient clipping that cut the norm "
            "(clip_grad_norm_, the HF Trainer's max_grad_norm) or a rescaling between backward() and step() (a "
            f"GradScaler not given to capture as grad_scaler=: then the rows are scaled too); {method} takes each step "
            "as the backward's gradient, so the clipped steps weigh more than they did: give capture the GradScaler, "
            "or read the scores as approximate"
        )
    spans = {b - a for a, b in zip(row_steps, row_steps[1:])}
    if len(spans) > 1:
        inside = sorted({r["step"] for r in rows if row_steps[0] < r["step"] < row_steps[-1]} - set(row_steps))
        if inside:
            _warn(
                f"run {run!r}'s optimizer took {len(inside)} recorded step(s) without training rows between its "
                f"steps with rows (e.g. step {inside[0]}), not every s-th step: the capture was paused there or lost "
                "those steps' rows (its coverage warning says why; e.g. a torch.compile'd wrapper: capture the module "
                f"it compiles, or use model.compile() in place). {method} takes each step with rows as standing for "
                "the steps up to the next one"
            )
    reduction = (store.run_config(run).get("capture") or {}).get("loss_reduction")
    uneven = sorted(r["step"] for r in rows if row_weights(r).uneven)
    if uneven and reduction != "token_mean":
        _warn(
            f"run {run!r}'s steps weighted their rows unevenly in {len(uneven)} of its {len(rows)} recorded steps "
            f"(e.g. step {uneven[0]}: gradient accumulation over micro-batches of different sizes, each reduced by "
            f"its own mean): {method} takes a step as the mean of its rows (times the step's total weight), so "
            "examples of small micro-batches weigh less than they did; accumulate micro-batches of equal size, or "
            "reduce each by the step's total count (loss.sum() / total)"
        )


def _warn(message: str) -> None:
    warnings.warn(message, UnmodelledOptimizerWarning, stacklevel=5)


def check_descent(store: StoreCore, run: str) -> None:
    """``InvalidArgumentError`` when a recorded optimizer step of ``run`` ascended its loss (a parameter group
    with ``maximize=True``): the trajectory methods model descent (``theta <- theta - lr ...``), so their scores
    would have the wrong sign and the wrong dynamics."""
    if not store.has_table(S.OPTIMIZER_STEPS):
        return
    columns = ("step", "group_hyperparameters")
    if not all(name in store.dataset(S.OPTIMIZER_STEPS).schema.names for name in columns):
        return  # stores of earlier versions recorded no group hyper-parameters
    # only the steps whose JSON (json.dumps' separators) names maximize=True are read and parsed
    where = f"{gradient_filter(run)} AND group_hyperparameters LIKE '%\"maximize\": true%'"
    table = store.scan(S.OPTIMIZER_STEPS, list(columns), where, cache=False)
    ascended = sorted(
        {
            int(step)
            for step, groups in zip(table.column("step").to_pylist(), table.column("group_hyperparameters").to_pylist())
            if groups and any(isinstance(g, dict) and g.get("maximize") for g in json.loads(groups))
        }
    )
    if ascended:
        raise InvalidArgumentError(
            f"run {run!r} was trained with an optimizer set to maximize=True ({len(ascended)} recorded step(s), "
            f"from step {ascended[0]}): the trajectory methods (tracin-steps, source, source-ekfac, dvemb) model "
            "steps that descend the loss, so their scores would have the wrong sign; train on the negated loss "
            "with maximize=False, or score with a single-checkpoint method (fisher, grad-dot, ...)"
        )


#: Recorded steps whose dynamics :func:`summary` reads at a time.
SUMMARY_STEPS = 256


def summary(store: StoreCore, run: str, label: str, steps: Sequence) -> tuple[bool, bool]:
    """Whether every one of ``steps`` is plain SGD (``lr x gradient``), and whether some step has momentum: read
    :data:`SUMMARY_STEPS` steps at a time."""
    plain, momentum = True, False
    for start in range(0, len(steps), SUMMARY_STEPS):
        for step in with_dynamics(store, run, label, steps[start : start + SUMMARY_STEPS]):
            co = coefficients_of(step)
            plain, momentum = plain and co.is_plain, momentum or co.has_momentum
    return plain, momentum


def _rows(table: pa.Table) -> list[dict]:
    """The ``optimizer_steps`` rows as dicts, their per-coordinate lists as float64 numpy views of the Arrow buffers
    (not Python floats: a ``[dim]`` list is ~32 bytes a value as a Python list, which made the memory of the
    trajectory methods grow by ~0.25 MB a recorded step at 7,435 unprojected dims)."""
    lists = [name for name in ("preconditioner", "weight_decays") if name in table.column_names]
    rows = table.drop_columns(lists).to_pylist()
    for name in lists:
        for row, value in zip(rows, table.column(name)):
            row[name] = value.values.to_numpy(zero_copy_only=False) if value.is_valid else None
    return rows


def coefficients_of(step) -> Coefficients:
    """The step's recorded dynamics, else ``lr x gradient``."""
    recorded = getattr(step, "coefficients", None)
    return recorded if recorded is not None else Coefficients.plain(step.learning_rate)


# ---------------------------------------------------------------------------------------------- stability
@dataclass(frozen=True)
class Clipped:
    """A step whose curvature was clipped to the stable range: its largest eigenvalue against the bound."""

    step: int
    largest: float
    bound: float


def stable_rows(
    curvature: torch.Tensor, co: Coefficients, p: torch.Tensor | None, step: int, clipped: list[Clipped]
) -> torch.Tensor:
    """The step's curvature rows ``C [blocks, n, s]`` (``H = C^T C / n`` per block) with the eigenvalues of
    ``P^1/2 H P^1/2`` above :meth:`Coefficients.bound` clipped to it (``p [blocks, s]`` or ``None``); each block
    clipped is listed in ``clipped``."""
    if STABILITY == "off" or curvature.shape[1] == 0:
        return curvature
    n = curvature.shape[1]
    root = p.sqrt()[:, None, :] if p is not None else None
    scaled = curvature * root if root is not None else curvature
    bounds = torch.tensor(
        [co.bound(float(p[i].max()) if p is not None else 1.0) for i in range(curvature.shape[0])],
        dtype=torch.float64,
    )
    left = n <= scaled.shape[2]
    gram = (torch.bmm(scaled, scaled.transpose(1, 2)) if left else torch.bmm(scaled.transpose(1, 2), scaled)) / n
    largest = torch.linalg.eigvalsh(gram)[:, -1]
    over = largest > bounds
    if not bool(over.any()):
        return curvature
    values, vectors = torch.linalg.eigh(gram)
    limit = bounds[:, None].expand_as(values)
    factor = torch.where(values > limit, (limit / values.clamp(min=1e-300)).sqrt(), torch.ones_like(values))
    factor = torch.where(over[:, None], factor, torch.ones_like(factor))
    projector = torch.bmm(vectors * factor[:, None, :], vectors.transpose(1, 2))
    scaled = torch.bmm(projector, scaled) if left else torch.bmm(scaled, projector)
    for block in torch.nonzero(over).flatten().tolist():
        clipped.append(Clipped(step, float(largest[block]), float(bounds[block])))
    return scaled / root if root is not None else scaled


def per_step(clipped: Sequence[Clipped]) -> list[Clipped]:
    """``clipped`` with one entry per step, its worst block (largest eigenvalue against its bound), in step order:
    what a build keeps to warn again whenever its result is used (:func:`warn_clipped`)."""
    worst: dict[int, Clipped] = {}
    for entry in clipped:
        kept = worst.get(entry.step)
        if kept is None or _excess(entry) > _excess(kept):
            worst[entry.step] = entry
    return [worst[step] for step in sorted(worst)]


def _excess(clipped: Clipped) -> float:
    return clipped.largest / clipped.bound if clipped.bound > 0 else math.inf


def warn_clipped(clipped: Sequence[Clipped], run: str, method: str = "dvemb") -> None:
    """One :class:`UnstableStepWarning` naming the steps whose curvature was clipped."""
    if not clipped:
        return
    steps = sorted({c.step for c in clipped})
    worst = max(clipped, key=_excess)
    warnings.warn(
        f"{method} on run {run!r}: the curvature of {len(steps)} recorded step(s) (steps {steps[:8]}"
        f"{' ...' if len(steps) > 8 else ''}) makes the linearised recursion expand "
        f"(the step operator's eigenvalues leave the unit disc: lr * lambda_max(H) > 2 for plain SGD, "
        f"> 2 (1 + momentum) for heavy ball); worst at step {worst.step}: largest curvature eigenvalue "
        f"{worst.largest:.4g} against the stable bound {worst.bound:.4g}. Those eigenvalues were clipped to the "
        "bound, which is approximate where training itself expanded for a few steps (a model quadratic in its "
        "weights: gradstore.methods.dynamics.STABILITY = 'off' keeps those exact; docs/concepts.md, 'Optimizer "
        "dynamics and stability')",
        UnstableStepWarning,
        stacklevel=2,
    )


def stability_rule() -> str:
    """:data:`STABILITY`, checked: ``InvalidArgumentError`` for a value other than ``"clip"`` and ``"off"``."""
    if STABILITY not in ("clip", "off"):
        raise InvalidArgumentError(
            f"gradstore.methods.dynamics.STABILITY is {STABILITY!r}: set it to 'clip' (the default: clip unstable "
            "steps' curvature to the stable bound, with a warning) or 'off' (use it as recorded)"
        )
    return STABILITY


def _unstable_remedy() -> str:
    """What to do about an overflowing recursion under the current stability rule."""
    if STABILITY == "off":
        return (
            "turn the stability rule back on (gradstore.methods.dynamics.STABILITY = 'clip', the default: unstable "
            "steps' curvature is clipped to the stable bound, with an UnstableStepWarning)"
        )
    return (
        "check the recorded learning rates and optimizer of those steps (store.sql('select step, learning_rate, "
        "optimizer from optimizer_steps')), or score with a method that does not unroll the steps "
        "(method='tracin-steps')"
    )


def check_finite(products: Sequence[torch.Tensor], step: int, run: str, first_large: list[int]) -> None:
    """``UnstableRecursionError`` naming ``step`` when the carried product is no longer finite; the first step
    whose product grew past :data:`LARGE` is kept in ``first_large``."""
    worst = max(float(torch.linalg.vector_norm(t, math.inf)) if t.numel() else 0.0 for t in products)
    if not math.isfinite(worst):
        raise UnstableRecursionError(
            f"dvemb on run {run!r}: the recursion over the recorded steps became non-finite at step {step} "
            f"(its product of step operators grew geometrically"
            f"{f' past {LARGE:.0e} from step {first_large[0]}' if first_large else ''}): the linearised dynamics "
            f"are unstable there, not the stored rows: {_unstable_remedy()}"
        )
    if worst > LARGE and not first_large:
        first_large.append(step)


def check_embeddings(embeddings: np.ndarray, run: str, first_large: list[int]) -> None:
    """``UnstableRecursionError`` when embeddings do not fit the store's float32 rows."""
    with np.errstate(over="ignore"):  # the overflow is what is checked
        fits = np.isfinite(embeddings.astype(np.float32)).all()
    if embeddings.size and not fits:
        where = f" from step {first_large[0]}" if first_large else ""
        raise UnstableRecursionError(
            f"dvemb on run {run!r}: the data value embeddings overflow float32: the recursion over the recorded "
            f"steps grew geometrically{where} (unstable linearised dynamics, not non-finite stored rows): "
            f"{_unstable_remedy()}"
        )


# ---------------------------------------------------------------------------------------------- the recursion
class JointProduct:
    """The weights' row ``[R_theta, R_n]`` of the product of the later steps' operators (module doc), per layer
    block: one batched ``[blocks, s, s]`` tensor per group of equal, contiguous blocks (else one per block).
    ``R_n`` only when some step has momentum."""

    def __init__(self, spans: Sequence[tuple[int, int]], momentum: bool, run: str = "") -> None:
        self.spans = list(spans)
        sizes = {size for _, size in self.spans}
        contiguous = all(offset == i * self.spans[0][1] for i, (offset, _) in enumerate(self.spans))
        if len(sizes) == 1 and contiguous:
            self.groups = [(0, len(self.spans), self.spans[0][1])]
        else:
            self.groups = [(offset, 1, size) for offset, size in self.spans]
        self.theta = [torch.zeros(g, size, size, dtype=torch.float64) for _, g, size in self.groups]
        for theta in self.theta:
            theta.diagonal(dim1=1, dim2=2).fill_(1.0)  # the identity, with no second s x s matrix alongside
        self.moment = [torch.zeros_like(t) for t in self.theta] if momentum else None
        self.run = run
        self.clipped: list[Clipped] = []
        self.first_large: list[int] = []

    def _split(self, rows: torch.Tensor, group: int) -> torch.Tensor:
        start, g, size = self.groups[group]
        return rows[:, start : start + g * size].reshape(rows.shape[0], g, size).transpose(0, 1)

    def _join(self, parts: list[torch.Tensor], n: int) -> torch.Tensor:
        out = torch.empty(n, sum(g * size for _, g, size in self.groups), dtype=torch.float64)
        for (start, g, size), part in zip(self.groups, parts):
            out[:, start : start + g * size] = part.transpose(0, 1).reshape(n, g * size)
        return out

    def _columns(self, values: float | torch.Tensor | None, group: int) -> torch.Tensor | None:
        """A per-coordinate ``[dim]`` vector as the group's ``[g, 1, s]`` column factors (``None`` for a scalar)."""
        return self._split(values[None], group)[:, 0, None, :] if isinstance(values, torch.Tensor) else None

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """``R_theta g`` per block for every row (folding earlier embeddings in: valid without momentum)."""
        parts = [torch.bmm(self._split(rows, i), t.transpose(1, 2)) for i, t in enumerate(self.theta)]
        return self._join(parts, rows.shape[0])

    def _times_operator(self, rows: torch.Tensor, co: Coefficients, group: int) -> torch.Tensor:
        """``rows K^T`` for the group's rows ``[g, n, s]``, ``K = a R_theta P - c R_n`` the step's embedding
        operator, as ``a (rows P) R_theta^T - c rows R_n^T``: ``K`` itself (an ``s x s`` matrix) is never formed."""
        p = self._columns(co.p, group)
        out = torch.bmm(rows * p if p is not None else rows, self.theta[group].transpose(1, 2)).mul_(co.a)
        if self.moment is not None:
            out.baddbmm_(rows, self.moment[group].transpose(1, 2), alpha=-co.c)
        return out

    def absorb(self, rows: torch.Tensor, curvature: torch.Tensor, step) -> torch.Tensor:
        """The step's terms ``K g / B`` of its training rows (summed over the steps it stands for), then the
        product carried through it."""
        co = coefficients_of(step)
        total = torch.zeros_like(rows)
        for _ in range(step.span):
            terms = self._join(
                [self._times_operator(self._split(rows, i), co, i) for i in range(len(self.theta))], rows.shape[0]
            )
            total += terms
            self._carry(curvature, co, step.step)
            # the step's terms read the whole product (K = a R_theta P - c R_n): an overflow shows in them
            check_finite([terms], step.step, self.run, self.first_large)
        return total / step.rows

    def _carry(self, curvature: torch.Tensor, co: Coefficients, step: int) -> None:
        """``R_n <- mu R_n - b R_theta P``, ``R_theta <- rho R_theta - K (H + l2 I)`` in place, one slice of
        :data:`SLICE_BYTES` of rows at a time through two reused buffers (``K C^T`` is formed from the old
        product first; ``K``'s rows only per slice, where ``l2`` needs them): a full-dimension block costs two
        ``s x s`` float64 matrices with momentum, one without."""
        n = max(1, curvature.shape[0])
        for i, theta in enumerate(self.theta):
            p = self._columns(co.p, i)
            rows = stable_rows(self._split(curvature, i), co, None if p is None else p[:, 0, :], step, self.clipped)
            pulled = self._times_operator(rows, co, i).transpose(1, 2)  # K C^T: [g, s, n], from the old product
            rho, l2 = self._columns(co.rho, i), self._columns(co.l2, i)
            decoupled = co.rho if rho is None else 1.0  # scalars; per-coordinate factors scale columns below
            coupled = co.l2 if l2 is None else 0.0
            slices = _row_slices(theta)
            scaled_buffer = torch.empty_like(theta[:, slices[0]])
            operator_buffer = torch.empty_like(scaled_buffer) if l2 is not None or coupled else None
            for lines in slices:
                block = theta[:, lines]
                count = lines.stop - lines.start
                scaled = torch.mul(block, p, out=scaled_buffer[:, :count]) if p is not None else block  # R_theta P
                if operator_buffer is not None:  # K's rows: a R_theta P - c R_n (the old R_n)
                    operator = torch.mul(scaled, co.a, out=operator_buffer[:, :count])
                    if self.moment is not None:
                        operator.sub_(self.moment[i][:, lines], alpha=co.c)
                if self.moment is not None:
                    self.moment[i][:, lines].mul_(co.mu).sub_(scaled, alpha=co.b)
                if rho is not None:  # per-coordinate decay: scale R_theta's columns
                    block.mul_(rho)
                block.baddbmm_(pulled[:, lines], rows, beta=decoupled, alpha=-1 / n)
                if l2 is not None:
                    block.sub_(operator.mul_(l2))
                elif coupled:
                    block.sub_(operator, alpha=coupled)


#: Bytes of the slices :meth:`JointProduct._carry` takes a product's rows in.
SLICE_BYTES = 16 * 2**20


def _row_slices(matrices: torch.Tensor) -> list[slice]:
    """Slices of the rows of ``[g, s, s]`` ``matrices`` of about :data:`SLICE_BYTES` each (at least one row)."""
    g, s = matrices.shape[0], matrices.shape[1]
    step = max(1, SLICE_BYTES // max(1, g * matrices.shape[2] * matrices.element_size()))
    return [slice(start, min(s, start + step)) for start in range(0, s, step)]


# ---------------------------------------------------------------------------------------------- source
def segment_coefficients(store: StoreCore, run: str, ends: Sequence[tuple[int, int]]) -> list[Coefficients | None]:
    """Per SOURCE segment ``(first step, end step)``: the mean of the recorded steps' :class:`Coefficients` over
    its optimizer steps ``first <= step < end`` (any checkpoint label; Adam's preconditioner as its mean, a
    scalar: the segment's curvature is one symmetric matrix, so only an isotropic preconditioner keeps SOURCE's
    spectral closed form), ``None`` where no step is recorded or every one is plain SGD (the segment keeps
    SOURCE's ``exp(-lr K F)`` form)."""
    if not ends or not store.has_table(S.OPTIMIZER_STEPS):
        return [None] * len(ends)
    check_descent(store, run)
    rows = {row["step"]: row for row in _rows(store.scan(S.OPTIMIZER_STEPS, None, gradient_filter(run), cache=False))}
    warn_unmodelled(store, run, None, "source")
    dim, layers, slots = _layout(store, run, "source")
    out: list[Coefficients | None] = []
    for first, end in ends:
        recorded = [rows[s] for s in range(first, end) if s in rows]
        if not recorded:
            out.append(None)
            continue
        every = [coefficients(r, float(r["learning_rate"]), dim, layers, slots) for r in recorded]
        if all(c.is_plain for c in every):
            out.append(None)
            continue
        scale = [isotropic_preconditioner(c, r) for c, r in zip(every, recorded)]
        out.append(
            Coefficients(
                float(np.mean([_mean(c.rho) for c in every])),
                float(np.mean([c.a * s for c, s in zip(every, scale)])),
                float(np.mean([c.b * s for c, s in zip(every, scale)])),
                float(np.mean([c.mu for c in every])),
                float(np.mean([c.c for c in every])),
                float(np.mean([_mean(c.l2) for c in every])),
                None,
                every[-1].optimizer,
            )
        )
    return out


def isotropic_preconditioner(co: Coefficients, row: dict) -> float:
    """Adam's preconditioner ``p = 1 / (sqrt(v_hat) + eps)`` of one step as the one scalar SOURCE's closed form
    takes. Recorded per coordinate (unprojected layers): its mean weighted by the second moment it came from,
    ``sum p v_hat / sum v_hat`` (``v_hat`` recovered from ``p`` and the step's ``eps``), the preconditioning where the
    gradients are; the plain mean is dominated by the coordinates whose gradients are ~0 (``p ~ 1 / eps``), which
    overstated the step by orders of magnitude (bench/fidelity.py's Adam MLP, ``source`` on exact true-Fisher rows:
    validation LDS 0.544 -> 0.735, test 0.557 -> 0.736). Recorded per layer (projected rows: each value already the
    layer's ``v_hat``-weighted preconditioner, no such outliers): the plain mean over the coordinates (weighting
    the layers by ``v_hat`` as well moved bench/fidelity.py's 416-dim variants by <= 0.003 and cost the demo's
    ``source`` row 0.10 recall@10)."""
    if co.p is None:
        return 1.0
    recorded = row.get("preconditioner")
    if recorded is None or len(recorded) != co.p.numel():  # per layer, spread over each layer's block
        return float(co.p.mean())
    eps = float(row.get("eps") or 0.0)
    second = (1.0 / co.p - eps).clamp(min=0.0) ** 2
    total = float(second.sum())
    return float((co.p * second).sum()) / total if total > 0 else float(co.p.mean())


class SegmentFunctions:
    """Spectral functions of a segment of ``steps`` optimizer steps with constant curvature ``F`` (eigenvalue
    ``lambda``) and dynamics ``co``: the entries of ``A(lambda)^steps`` (``A`` the 2x2 step of the mode,
    module doc) and of ``S = sum_{j < steps} A^j w`` (``w = [-a, c]``: one step's injection), computed by
    iterating the 2x2 recursion elementwise. Eigenvalues above the stable bound are clipped to it (``clipped``
    records the largest one seen)."""

    def __init__(self, co: Coefficients, steps: int) -> None:
        self.co = co
        self.steps = steps
        self.bound = co.bound()
        self.largest = 0.0

    def _run(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        co = self.co
        values = values.to(torch.float64)
        if values.numel():
            self.largest = max(self.largest, float(values.max()))
        if STABILITY != "off":
            values = values.clamp(max=self.bound)
        curvature = values + co.l2
        a11, a21 = co.rho - co.a * curvature, co.c * curvature
        a12, a22 = torch.full_like(values, -co.b), torch.full_like(values, co.mu)
        p11, p22 = torch.ones_like(values), torch.ones_like(values)  # A^0 = I
        p12, p21 = torch.zeros_like(values), torch.zeros_like(values)
        s_theta, s_moment = torch.zeros_like(values), torch.zeros_like(values)
        for _ in range(self.steps):  # S <- A S + w; P <- A P
            s_theta, s_moment = a11 * s_theta + a12 * s_moment - co.a, a21 * s_theta + a22 * s_moment + co.c
            p11, p12, p21, p22 = (
                a11 * p11 + a12 * p21,
                a11 * p12 + a12 * p22,
                a21 * p11 + a22 * p21,
                a21 * p12 + a22 * p22,
            )
        return p11, p12, p21, p22, s_theta, s_moment

    def entry(self, which: int):
        """The spectral function of entry ``which`` (0-3: ``A^K`` row by row; 4, 5: ``S``)."""
        return lambda values: self._run(values)[which]

    @property
    def clipped(self) -> bool:
        return STABILITY != "off" and self.largest > self.bound
