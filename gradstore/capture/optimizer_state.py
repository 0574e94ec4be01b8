"""What each optimizer step of a capture applied: a row of the store's ``optimizer_steps`` table per step.

Read from the optimizer in its step post-hook (no user action): the kind (``"sgd"``, ``"adam"``, ``"adamw"``,
else the class name), the learning rate, momentum (Adam: ``beta1``), dampening, nesterov, weight decay, ``beta2``,
``eps``, Adam's step count and, for Adam/AdamW, the step's preconditioner ``1 / (sqrt(v_hat) + eps)`` in the
space of the stored rows. The hyper-parameters are those of the parameter group holding the first captured
layer's weight; where the captured parameters' groups differ in weight decay, each coordinate's (or layer's) is
recorded too (``weight_decays``), and where the optimizer's groups differ in any hyper-parameter (the learning rate
included) the names of those that differ (``group_differences``, e.g. ``"lr, weight_decay"``). Which of the
model's parameters each group holds is recorded by name (``group_parameters``, :class:`ParameterGroups`) and every
group's hyper-parameters at each step (``group_hyperparameters``): what an exact replay of
the run applies per parameter. Before the first step a capture records, a fingerprint of the model's weights
(``initial_weights``, :func:`weights_fingerprint`) lets a replay check that it starts from them.

Adam's preconditioner is elementwise over the parameters; a random projection does not commute with it. Where
every captured layer is stored unprojected (``projection=None``) it is recorded per coordinate, in the rows'
layout, and the trajectory methods' Adam dynamics are exact for a quadratic model. Otherwise it is recorded as
one value per layer: ``sum_i v_i d_i / sum_i v_i`` with ``d_i = 1 / (sqrt(v_hat_i) + eps)``, the layer's
preconditioner averaged with the weights of a typical gradient's squared entries (``v_hat`` is their running
mean), so coordinates that get no gradient (an embedding's unused rows, ``d = 1 / eps``) do not dominate it. An
isotropic approximation of the layer's preconditioner in its projected block: the projected step ``R D g`` is
taken as ``d_layer R g``; the per-row/column structure that the ``normalizer="adam_*"`` rows fold in is lost
(the rows themselves are the raw gradients).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import torch

from gradstore.errors import UnscaledRowsWarning
from ingest.normalizers import adam_second_moment, bias_correction, raw_second_moment

#: Layer kinds whose unprojected block is the ``[d_out, d_in (+1)]`` gradient flattened row by row.
EXACT_KINDS = ("linear", "conv")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"``, ``"adam"`` or ``"adamw"`` (decoupled weight decay), else the optimizer's class name."""
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adamw" if optimizer.param_groups[0].get("decoupled_weight_decay", False) else "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return type(optimizer).__name__


def step_record(
    optimizer: torch.optim.Optimizer,
    hooks: Sequence[Any],
    run: str,
    checkpoint: str,
    step: int,
    rank: int,
    rows_normalizer: str | None = None,
) -> dict[str, Any]:
    """The ``optimizer_steps`` row of the step the optimizer just took (``hooks``: the capture's layer hooks,
    each with ``parameter``, ``bias`` and ``slot``; ``rows_normalizer``: the capture's normalizer, when its rows
    are in Adam's geometry already)."""
    first = hooks[0].parameter if hooks else None
    group = next(
        (g for g in optimizer.param_groups if first is not None and any(p is first for p in g["params"])),
        optimizer.param_groups[0],
    )
    kind = optimizer_kind(optimizer)
    adam = kind in ("adam", "adamw")
    betas = group.get("betas", (None, None))
    state = optimizer.state.get(first, {}) if first is not None else {}
    adam_step = state.get("step") if adam else None
    return {
        "run_id": run,
        "checkpoint": checkpoint,
        "step": int(step),
        "rank": int(rank),
        "optimizer": kind,
        "learning_rate": float(group["lr"]),
        "momentum": float(betas[0]) if adam else float(group.get("momentum", 0.0) or 0.0),
        "dampening": float(group.get("dampening", 0.0) or 0.0),
        "nesterov": bool(group.get("nesterov", False)),
        "weight_decay": float(group.get("weight_decay", 0.0) or 0.0),
        "beta2": float(betas[1]) if adam else None,
        "eps": float(group["eps"]) if adam else None,
        "adam_step": int(float(adam_step)) if adam_step is not None else None,
        "preconditioner": preconditioner(optimizer, hooks, float(group["eps"])) if adam else None,
        "rows_normalizer": rows_normalizer,
        "weight_decays": weight_decays(optimizer, hooks),
        "learning_rates": learning_rates(optimizer, hooks),
        "group_differences": group_differences(optimizer),
        "created_at": datetime.now(timezone.utc),
    }


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's sum of squares in float64: zero only for a zero gradient (a plain sum cancels by construction
    where the parameter's gradient sums to ~0, e.g. a bias feeding a LayerNorm, and then missed clipping), scaled
    by ``c^2`` by any rescaling ``c`` (exactly, for a power of two)."""
    return grad.detach().double().square().sum()


class StepGradients:
    """Whether each optimizer step applied the gradients the backward produced (``optimizer_steps.gradients``).

    A fingerprint: the sum of squares of one small trainable parameter's ``.grad`` (:func:`_fingerprint`), taken
    by a post-accumulate-grad hook after every backward (with gradient accumulation, the last one's is the
    accumulated gradient's) and again before the optimizer step (:meth:`before_step`, from its step pre-hook).
    Equal: ``"backward"``; equal once multiplied by the square of the ``grad_scaler``'s scale (the scaler unscaled
    the gradients, exactly for its power-of-two scales):
    ``"unscaled"``; else ``"modified"`` (clipping such as ``clip_grad_norm_`` that cut the norm, any rescaling
    between the backward and the step, non-finite gradients); ``None`` where no backward reached the parameter
    since the last step.
    Clipping that did not change the gradients (a norm under the limit) leaves them ``"backward"``. Two reductions
    of a small tensor per step and no host sync: the outcomes stay on the device until :meth:`resolve`."""

    NAMES = ("backward", "unscaled", "modified")

    def __init__(self, parameter: torch.Tensor, grad_scaler: Any | None) -> None:
        self.parameter = parameter
        enabled = grad_scaler is not None and bool(getattr(grad_scaler, "is_enabled", lambda: True)())
        self.grad_scaler = grad_scaler if enabled else None
        self._backward: torch.Tensor | None = None
        self._outcome: torch.Tensor | None = None
        self._pending: list[tuple[dict[str, Any], torch.Tensor]] = []
        self._told = False  # warned of an AMP GradScaler not given to capture
        self._handle = parameter.register_post_accumulate_grad_hook(self._after_backward)

    def remove(self) -> None:
        """Remove the parameter's hook."""
        self._handle.remove()

    def _after_backward(self, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            self._backward = _fingerprint(parameter.grad)

    def before_step(self) -> None:
        """Compare the gradient the optimizer is about to apply with the last backward's."""
        backward, self._backward = self._backward, None
        grad = self.parameter.grad
        if backward is None or grad is None:
            self._outcome = None
            return
        now = _fingerprint(grad)
        if self.grad_scaler is None:  # 0 "backward", 1 "modified", 3 "modified": divided by a power of two
            ratio = backward / now  # a power-of-two scale S divides the sum of squares by S^2: a power of four
            mantissa, exponent = torch.frexp(ratio)
            scaled = (ratio >= 4) & (mantissa == 0.5) & (exponent % 2 == 1) & torch.isfinite(ratio)
            self._outcome = torch.where(now == backward, 0, torch.where(scaled, 3, 1))
            return
        scale = getattr(self.grad_scaler, "_scale", None)
        scale = scale.to(now.device) if isinstance(scale, torch.Tensor) else float(self.grad_scaler.get_scale())
        self._outcome = torch.where(now == backward, 0, torch.where(now * scale * scale == backward, 1, 2))

    def mark(self, row: dict[str, Any]) -> None:
        """Give ``row`` (the ``optimizer_steps`` row of the step just taken) the step's outcome, read at
        :meth:`resolve`; every 256 steps the outcomes held so far are read (one transfer)."""
        outcome, self._outcome = self._outcome, None
        row["gradients"] = None
        if outcome is not None:
            self._pending.append((row, outcome))
            if len(self._pending) >= 256:
                self.resolve()

    def resolve(self) -> None:
        """Write the held outcomes into their rows (one device-to-host transfer)."""
        if self._pending:
            codes = torch.stack([outcome for _, outcome in self._pending]).tolist()
            for (row, _), code in zip(self._pending, codes):
                row["gradients"] = self.NAMES[code if self.grad_scaler is not None else min(2, 2 * code)]
            if 3 in codes and self.grad_scaler is None and not self._told:
                self._told = True
                warnings.warn(
                    "capture: the optimizer stepped on the backward's gradients divided by a power of two (e.g. step "
                    f"{self._pending[codes.index(3)][0]['step']}), as an AMP GradScaler's unscaling does: if so, the "
                    "captured rows are multiplied by its scale. Give the scaler to the capture (store.capture(..., "
                    "grad_scaler=scaler)) so its scale is divided out of the rows",
                    UnscaledRowsWarning,
                    stacklevel=2,
                )
            self._pending = []


class StepWeights:
    """How each optimizer step weighted its training rows (``optimizer_steps.row_weights``): the step's gradient is
    ``sum_i w_i g_i`` over the rows ``g_i`` (each example's own gradient) that its backwards captured, with
    ``w_i = 1 / scale_i`` (:func:`ingest.scaling.example_scales`: ``1 / B`` for a batch mean, 1 for a sum, divided
    by the loss scale; gradient accumulation's micro-batches each reduced on its own). Recorded per step as JSON
    ``{"total": sum_i w_i, "least": B min_i w_i, "most": B max_i w_i}`` (``B`` the step's rows): the trajectory
    methods take a step as the mean of its rows (``w_i = 1 / B``: total, least and most 1), so ``total`` is the
    step's size relative to that, and ``least < most`` says the rows were weighted unevenly (micro-batches of
    different sizes each reduced by its own mean, token-weighted losses). Per backward a list append; every 256
    steps one pass of segment reductions over all their scales and one transfer."""

    #: Backwards held for one step before they are folded into their sums (a pass with no optimizer step).
    FOLD = 1024

    def __init__(self) -> None:
        self._scales: list[torch.Tensor] = []
        self._folded: list[float] | None = None  # [sum, min, max, count] of the scales folded before the step
        self._pending: list[tuple[dict[str, Any], list[torch.Tensor], list[float] | None]] = []

    def add(self, scales: torch.Tensor) -> None:
        """A captured training backward's per-example scales ``[B]`` (its rows are part of the next step)."""
        self._scales.append(scales.detach())
        if len(self._scales) >= self.FOLD:
            self._folded = _merged(self._folded, _summaries([self._scales])[0])
            self._scales = []

    def mark(self, row: dict[str, Any]) -> None:
        """Give ``row`` (the ``optimizer_steps`` row of the step just taken) its ``row_weights``, read at
        :meth:`resolve`; ``None`` where the step had no captured training rows."""
        row["row_weights"] = None
        if self._scales or self._folded is not None:
            self._pending.append((row, self._scales, self._folded))
        self._scales, self._folded = [], None
        if len(self._pending) >= 256:
            self.resolve()

    def resolve(self) -> None:
        """Write the held steps' ``row_weights``."""
        if not self._pending:
            return
        summaries = _summaries([scales for _, scales, _ in self._pending])
        for (row, _, folded), summary in zip(self._pending, summaries):
            total, least, most, count = _merged(folded, summary)
            if count:
                row["row_weights"] = json.dumps({"total": total, "least": count * least, "most": count * most})
        self._pending = []


def _summaries(steps: list[list[torch.Tensor]]) -> list[list[float]]:
    """Per step, ``[sum, min, max, count]`` of the weights ``1 / scale`` of its scales (0 where a scale is 0: an
    example whose loss has no term, e.g. no label token): segment reductions over all of them, one transfer."""
    parts = [(i, s) for i, scales in enumerate(steps) for s in scales if s.numel()]
    out = torch.zeros(len(steps), 4, dtype=torch.float64)
    if parts:
        device = parts[0][1].device
        sizes = [s.numel() for _, s in parts]
        index = torch.repeat_interleave(torch.tensor([i for i, _ in parts]), torch.tensor(sizes)).to(device)
        joined = torch.cat([s.to(device).reshape(-1) for _, s in parts]).double()
        weights = torch.where(joined > 0, 1.0 / joined.clamp(min=1e-300), torch.zeros_like(joined))
        found = torch.zeros(len(steps), 3, dtype=torch.float64, device=device)
        found[:, 1], found[:, 2] = math.inf, -math.inf
        found[:, 0].index_add_(0, index, weights)
        found[:, 1].scatter_reduce_(0, index, weights, "amin")
        found[:, 2].scatter_reduce_(0, index, weights, "amax")
        out[:, :3] = found.cpu()
        for i, size in zip((i for i, _ in parts), sizes):
            out[i, 3] += size
    return out.tolist()


def _merged(a: list[float] | None, b: list[float]) -> list[float]:
    """Two ``[sum, min, max, count]`` as one (``a`` may be absent; an empty one, count 0, adds nothing)."""
    if a is None or not a[3]:
        return b
    if not b[3]:
        return a
    return [a[0] + b[0], min(a[1], b[1]), max(a[2], b[2]), a[3] + b[3]]


def check_parameter(hooks: Sequence[Any]) -> torch.Tensor | None:
    """The smallest trainable parameter of the captured layers (``hooks``), whose gradient :class:`StepGradients`
    fingerprints; ``None`` where there is none (or it is sharded)."""
    candidates = [
        tensor
        for hook in hooks
        for tensor in (hook.parameter, hook.bias if hook.slot.has_bias else None)
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and not hasattr(tensor, "to_local")
    ]
    return min(candidates, key=lambda tensor: tensor.numel()) if candidates else None


#: Parameter-group entries that are no hyper-parameter of the update (``initial_lr``: a scheduler's base ``lr``;
#: ``param_names``: the names of an optimizer built from ``named_parameters()``).
NOT_HYPER = frozenset(
    {"params", "param_names", "initial_lr", "name", "foreach", "fused", "capturable", "differentiable"}
    | {"max_lr", "min_lr", "base_momentum", "max_momentum"}  # OneCycleLR's and CyclicLR's own entries
)


def group_differences(optimizer: torch.optim.Optimizer) -> str | None:
    """The names of the hyper-parameters (learning rate included) whose values differ between the optimizer's
    parameter groups, sorted and comma-separated (``"lr, weight_decay"``); ``None`` with one group or where every
    group has the same values."""
    groups = optimizer.param_groups
    if len(groups) < 2:
        return None
    first = groups[0]
    differ = {
        key
        for group in groups[1:]
        for key in first.keys() | group.keys()
        if key not in NOT_HYPER and first.get(key) != group.get(key)
    }
    return ", ".join(sorted(differ)) or None


class ParameterGroups:
    """Which of ``model``'s parameters each parameter group of the optimizer holds, by name, and each group's
    hyper-parameters: :meth:`mark` gives a step's ``optimizer_steps`` row ``group_parameters`` (JSON, each group's
    trainable parameters' names, ``null`` for a tensor that is no parameter of the model) on the first step it sees
    under a checkpoint and where the groups change (a group added or its parameter list replaced; which parameters
    are trainable is read then), and ``group_hyperparameters`` (JSON, each group's hyper-parameters, the learning
    rate included) on every step. Per step: a few dictionary reads and one
    ``json.dumps`` of the groups' scalars."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._recorded: dict[str, tuple[tuple[int, int], ...]] = {}  # checkpoint -> the groups last recorded

    def trains(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps some of the model's parameters."""
        return any(id(p) in self._names for group in optimizer.param_groups for p in group["params"])

    def trained(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The model's parameters that ``optimizer`` steps."""
        return [p for group in optimizer.param_groups for p in group["params"] if id(p) in self._names]

    def mark(self, row: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Give ``row`` (the step's, with its ``checkpoint``) the groups' columns and ``without_gradients`` (the
        names of the model's trainable parameters in the optimizer whose ``.grad`` is ``None`` after the step: the
        optimizer left them as they were; ``None`` when every one had a gradient)."""
        groups = optimizer.param_groups
        key = tuple((id(group["params"]), len(group["params"])) for group in groups)
        row["group_parameters"] = None
        if self._recorded.get(row["checkpoint"]) != key:
            self._recorded[row["checkpoint"]] = key
            members = [[self._names.get(id(p)) for p in group["params"] if p.requires_grad] for group in groups]
            row["group_parameters"] = json.dumps(members)
        hyper = [{k: v for k, v in group.items() if k not in NOT_HYPER} for group in groups]
        row["group_hyperparameters"] = json.dumps(hyper, default=_number)
        missing = [
            self._names[id(p)]
            for group in groups
            for p in group["params"]
            if p.grad is None and p.requires_grad and id(p) in self._names
        ]
        row["without_gradients"] = json.dumps(missing) if missing else None


def _number(value: Any) -> Any:
    """A group's value that JSON does not take as it is: a tensor (a learning rate) as its number, else its text."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else str(value)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """JSON ``{name: [sum, sum of squares]}`` of ``model``'s parameters, in float64, read in chunks of 2**24
    entries (no float64 copy of a large parameter) and brought to the host in one transfer; sharded parameters
    (DTensors) are left out. Taken once per capture, before its first optimizer step."""
    names, sums = [], []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if hasattr(p, "to_local"):
                continue
            total = torch.zeros(2, dtype=torch.float64, device=p.device)
            for chunk in p.detach().reshape(-1).split(1 << 24):
                wide = chunk.double()
                total += torch.stack([wide.sum(), wide.square().sum()])
            names.append(name)
            sums.append(total)
    values = torch.stack([total.to(sums[0].device) for total in sums]).tolist() if sums else []
    return json.dumps(dict(zip(names, values)))


def preconditioner(optimizer: torch.optim.Optimizer, hooks: Sequence[Any], eps: float) -> list[float] | None:
    """``1 / (sqrt(v_hat) + eps)`` in the rows' space: per coordinate ``[dim]`` when every layer is stored
    unprojected, else the per-layer weighted mean ``[layers]`` (module doc); ``None`` while the optimizer holds
    no state. Runs after every optimizer step: the per-layer means read each moment once more in its own dtype
    (no float64 copy of the optimizer's state), and the step's values come to the host in one transfer."""
    if not hooks or any(hook.parameter is None for hook in hooks):
        return None
    sharded = [_sharded_moment(optimizer, h.parameter, h.bias if h.slot.has_bias else None) for h in hooks]
    if all(s is None and h.slot.mode == "exact" and h.slot.kind in EXACT_KINDS for s, h in zip(sharded, hooks)):
        exact = _per_coordinate(optimizer, hooks, eps)
        if exact is not None:
            return exact
    means = []
    for hook, v in zip(hooks, sharded):
        mean = _weighted_mean(v, eps) if v is not None else _layer_mean(optimizer, hook, eps)
        if mean is None:
            return None
        means.append(mean)
    return torch.stack(means).cpu().tolist()


def _weighted_mean(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``sum v d / sum v`` with ``d = 1 / (sqrt(v) + eps)`` over bias-corrected ``v`` (``1 / eps`` where ``v = 0``)."""
    v = v.double().clamp(min=0)
    energy = v.sum()
    return torch.where(energy > 0, (v / (v.sqrt() + eps)).sum() / energy.clamp(min=1e-300), 1.0 / eps)


def _layer_mean(optimizer: torch.optim.Optimizer, hook: Any, eps: float) -> torch.Tensor | None:
    """:func:`_weighted_mean` of a layer's ``v_hat`` computed from the raw moments ``m`` (``v_hat = m / c``):
    ``sum_p sum(m / (sqrt(m) + eps sqrt(c_p))) / sqrt(c_p)`` over ``sum_p sum(m) / c_p``, sums in float64."""
    weighted, energy = 0.0, 0.0
    for param in (hook.parameter, hook.bias if hook.slot.has_bias else None):
        if param is None:
            continue
        state = optimizer.state.get(param, {})
        moment = raw_second_moment(state)
        if moment is None:
            return None
        root = bias_correction(optimizer, param, state) ** 0.5
        denominator = moment.sqrt().add_(eps * root)
        weighted = weighted + torch.div(moment, denominator, out=denominator).sum(dtype=torch.float64) / root
        energy = energy + moment.sum(dtype=torch.float64) / root**2
    return torch.where(energy > 0, weighted / energy.clamp(min=1e-300), 1.0 / eps)


def _per_coordinate(optimizer: torch.optim.Optimizer, hooks: Sequence[Any], eps: float) -> list[float] | None:
    """Every layer unprojected: the preconditioner per coordinate, in the rows' layout."""
    exact = []
    for hook in sorted(hooks, key=lambda h: h.slot.offset):
        layer = SimpleNamespace(weight=hook.parameter, bias=hook.bias)
        v = adam_second_moment(optimizer, layer, hook.slot.kind, hook.slot.has_bias)
        if v is None or v.numel() != hook.slot.size:
            return None
        exact.append((1.0 / (v.double().clamp(min=0).sqrt() + eps)).reshape(-1))
    return torch.cat(exact).cpu().tolist()


def _sharded_moment(optimizer: torch.optim.Optimizer, weight: torch.Tensor, bias: torch.Tensor | None):
    """The bias-corrected ``v_hat`` entries of this rank's shards of a layer whose Adam state is sharded
    (FSDP2 DTensors), flattened; ``None`` for unsharded state. Such a layer's preconditioner is its per-layer
    weighted mean over the local shard (never per coordinate): reading the full state would be a collective
    per layer and step."""
    out = []
    for param in (weight, bias):
        if param is None:
            continue
        state = optimizer.state.get(param, {})
        moment = raw_second_moment(state)
        if moment is None or not hasattr(moment, "to_local"):
            return None
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        correction = 1.0 - group.get("betas", (0.9, 0.999))[1] ** max(float(state.get("step", 1)), 1.0)
        out.append(moment.to_local().reshape(-1) / correction)
    return torch.cat(out) if out else None


def learning_rates(optimizer: torch.optim.Optimizer, hooks: Sequence[Any]) -> str | None:
    """Where the captured parameters' groups differ in learning rate: JSON ``[[weight's lr, bias's lr or null],
    ...]``, one pair per captured layer in the rows' order (their slots' offsets); ``None`` when all are alike (the
    rows' ``learning_rate`` holds it)."""
    of = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
    pairs = [
        [of.get(id(h.parameter)), of.get(id(h.bias)) if h.slot.has_bias and h.bias is not None else None]
        for h in sorted(hooks, key=lambda h: h.slot.offset)
    ]
    if any(weight is None for weight, _ in pairs) or len({v for pair in pairs for v in pair if v is not None}) <= 1:
        return None  # all alike, or a layer whose weight no group holds (frozen, sharded): not recorded
    return json.dumps(pairs)


def weight_decays(optimizer: torch.optim.Optimizer, hooks: Sequence[Any]) -> list[float] | None:
    """Each coordinate's weight decay where the captured parameters' groups differ (e.g. none on biases):
    ``[dim]`` when every layer is stored unprojected (the bias as each row's last entry), else ``[layers]``, the
    weight's group's; ``None`` when all are alike (the row's ``weight_decay`` holds it)."""
    of = {id(p): float(g.get("weight_decay", 0.0) or 0.0) for g in optimizer.param_groups for p in g["params"]}
    pairs = [
        (of.get(id(h.parameter), 0.0), of.get(id(h.bias), 0.0) if h.slot.has_bias and h.bias is not None else None)
        for h in hooks
    ]
    if len({v for pair in pairs for v in pair if v is not None}) <= 1:
        return None
    exact = all(h.slot.mode == "exact" and h.slot.kind in EXACT_KINDS for h in hooks)
    if not exact:
        return [weight for weight, _ in pairs]
    out = []
    for hook, (weight, bias) in sorted(zip(hooks, pairs), key=lambda item: item[0].slot.offset):
        slot = hook.slot
        columns = slot.size // max(1, slot.d_out)
        row = [weight] * (columns - 1) + [bias] if bias is not None else [weight] * columns
        out.extend(row * slot.d_out)
    return out
