"""What a capture is told and what it delivers: :class:`ProjectionConfig`, :class:`CaptureLabels`,
:class:`CaptureConfig` (validated), the rows it hands its sink (:class:`CapturedBatch`) and the batches it skips
(:class:`SkippedBatch`), and the projection spec a config gives a model's layers (:func:`build_spec`).
:class:`~ingest.capture.GradientCapture` takes them; ``ingest.capture`` exports them all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ingest.coverage import COVERAGE_MODES
from ingest.layers import LayerInfo
from ingest.misuse import CaptureUsageError
from ingest.normalizers import NORMALIZERS
from ingest.per_example import ROUTES
from ingest.projection import (
    DEFAULT_LAYER_KINDS,
    LAYER_KINDS,
    LayerSizes,
    ProjectionBasis,
    ProjectionSpec,
    make_slot,
    slot_sizes,
)
from ingest.scaling import REDUCTIONS

PROJECTIONS = (None, "factorized", "dense")
#: What capture does with a training batch whose rows hold NaN/Inf (see :class:`CaptureConfig`).
NONFINITE_MODES = ("skip", "raise")
#: Reasons a training batch is not delivered (:attr:`SkippedBatch.reason`).
SKIP_GRAD_SCALER = "grad_scaler_overflow"
SKIP_NONFINITE = "nonfinite_gradient"
# A dense projection matrix larger than this many entries is refused (use "factorized").
MAX_DENSE_ENTRIES = 1 << 27


def default_rank() -> int:
    """This process's rank in torch.distributed (0 outside a process group): :attr:`CaptureLabels.rank`'s default."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class ProjectionConfig:
    """What defines a run's vectors: fingerprinted into its :class:`ProjectionSpec`, shared by every capture
    of the run (training rows, checkpoint passes, query rows).

    ``kind``: ``None`` exact gradients, ``"factorized"`` (``k_out x k_in`` per layer), ``"dense"`` (one JL
    matrix per layer, ``k_in * k_out`` dims, for small layers). ``layer_types``/``include``/``exclude``:
    which layers (regexes on module names); layers whose weight is frozen (``requires_grad=False``, e.g. the
    base layers of a LoRA model) are left out unless ``include_frozen``. ``layer_sizes``: per-layer
    ``(k_in, k_out)`` by layer-name regex
    (first match, ``re.search``), else ``k_in``/``k_out``; sizes never exceed the layer's width. ``basis``:
    fixed factorized matrices (e.g. the K-FAC eigenbasis of :func:`ingest.basis.estimate_basis`) instead of
    seeded random ones; they fix each layer's sizes, and their digest is part of the projection spec.
    """

    kind: str | None = "factorized"
    k_in: int = 16
    k_out: int = 16
    seed: int = 0
    layer_types: tuple[str, ...] = DEFAULT_LAYER_KINDS
    include: str | None = None
    exclude: str | None = None
    layer_sizes: LayerSizes | None = None
    basis: ProjectionBasis | None = None
    include_frozen: bool = False

    def validate(self) -> None:
        """Raise ValueError on an unknown option."""
        if self.kind not in PROJECTIONS:
            raise CaptureUsageError(f"projection must be one of {PROJECTIONS}, got {self.kind!r}")
        unknown = set(self.layer_types) - set(LAYER_KINDS)
        if unknown:
            raise CaptureUsageError(f"unknown layer types {sorted(unknown)}; supported: {LAYER_KINDS}")
        if self.k_in < 1 or self.k_out < 1:
            raise CaptureUsageError("k_in and k_out must be positive")
        if self.basis is not None and self.kind != "factorized":
            raise CaptureUsageError("a projection basis needs projection='factorized'")
        if not isinstance(self.include_frozen, bool):
            raise CaptureUsageError(f"include_frozen must be True or False, got {self.include_frozen!r}")


@dataclass(frozen=True)
class CaptureLabels:
    """What one capture records on its rows, not part of the run's identity (changeable while capturing
    through ``set_split``/``set_checkpoint``)."""

    split: str = "train"
    checkpoint: str = "train"
    rank: int = field(default_factory=default_rank)


#: The flat option names of :meth:`CaptureConfig.from_options`, by the part of the config they set.
PROJECTION_OPTIONS = {
    "projection": "kind",
    **{
        name: name
        for name in (
            "k_in",
            "k_out",
            "seed",
            "layer_types",
            "include",
            "exclude",
            "layer_sizes",
            "basis",
            "include_frozen",
        )
    },
}
LABEL_OPTIONS = ("split", "checkpoint", "rank")


@dataclass
class CaptureConfig:
    """How to capture: the run's :class:`ProjectionConfig`, this capture's :class:`CaptureLabels`, and how
    the rows are formed.

    ``route``: factorized contraction route, ``"auto"`` (cost rule) or forced ``"project"`` /
    ``"materialize"``. ``loss_reduction``/``loss_scale``: how the loop's loss was formed, undone so
    rows are per-example gradients (see :mod:`ingest.scaling`). ``curvature``: also accumulate Kronecker
    covariances of the training rows (and, kept apart, of the ``"true-fisher"`` rows). ``normalizer``:
    ``"adam_factored"`` records LESS-style rows normalised by the optimizer's Adam second moments in factored
    form, ``"adam_sqrt"`` by their square roots (rows in the
    coordinates where an Adam step is a gradient step, for the trajectory methods; see
    :mod:`ingest.normalizers`); forwards before the optimizer holds state are not captured. ``fused``: project
    inside the Linear/Conv1D layers' own GEMMs
    (:mod:`ingest.fused`; the same rows, training unchanged, the activations read once instead of twice, the
    weights copied twice per step: it pays where batches hold more tokens than a layer is wide).
    ``coverage``: what to do about trainable parameters the capture does not record (:mod:`ingest.coverage`:
    ``"warn"`` once, ``"strict"`` raises, ``"ignore"``).
    ``on_nonfinite``: a training batch (split ``"train"``) with a NaN/Inf row, or one of a step a ``GradScaler``
    skipped, is ``"skip"``-ped (not delivered; reported to ``on_skip`` and warned once) or, with ``"raise"``,
    :class:`NonFiniteRowsError` is raised from the ``backward()`` that produced a non-finite row (one device
    sync per backward). Rows of other splits are delivered as they are.
    ``example_dim``: the dim of the model's input tensor (and of the other inputs of the batch's size there) that
    indexes the examples: 0 (batch-first, the default), or 1 for a sequence-first model fed ``[T, B, ...]``
    (``nn.Transformer``/``nn.LSTM`` with ``batch_first=False``, PyTorch's word-language-model): every use of the
    captured parameters is then split at its op, with the examples followed from that dim.
    """

    projection: ProjectionConfig = field(default_factory=ProjectionConfig)
    labels: CaptureLabels = field(default_factory=CaptureLabels)
    loss_reduction: str = "mean"
    loss_scale: float = 1.0
    route: str = "auto"
    curvature: bool = False
    max_pending_batches: int = 4
    normalizer: str | None = None
    fused: bool = False
    on_nonfinite: str = "skip"
    coverage: str = "warn"
    example_dim: int = 0

    @classmethod
    def from_options(cls, **options: Any) -> CaptureConfig:
        """A config from flat options: ``projection`` (the kind), the other :class:`ProjectionConfig` fields,
        ``split``/``checkpoint``/``rank`` and this class's own fields (``TypeError`` on an unknown one)."""
        projection = {PROJECTION_OPTIONS[k]: options.pop(k) for k in list(options) if k in PROJECTION_OPTIONS}
        labels = {k: options.pop(k) for k in list(options) if k in LABEL_OPTIONS}
        if "layer_types" in projection:
            projection["layer_types"] = tuple(projection["layer_types"])
        return cls(projection=ProjectionConfig(**projection), labels=CaptureLabels(**labels), **options)

    def options(self) -> dict[str, Any]:
        """The flat options of :meth:`from_options` (without the basis, which is kept as arrays elsewhere)."""
        flat = {
            option: getattr(self.projection, name) for option, name in PROJECTION_OPTIONS.items() if name != "basis"
        }
        flat.update({name: getattr(self.labels, name) for name in LABEL_OPTIONS})
        flat.update({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("projection", "labels")})
        return flat

    def validate(self) -> None:
        """Raise ValueError on an unknown option."""
        self.projection.validate()
        if self.loss_reduction not in REDUCTIONS:
            raise CaptureUsageError(f"loss_reduction must be one of {REDUCTIONS}, got {self.loss_reduction!r}")
        if self.route not in ("auto", *ROUTES):
            raise CaptureUsageError(f"route must be 'auto' or one of {ROUTES}, got {self.route!r}")
        if self.normalizer not in NORMALIZERS:
            raise CaptureUsageError(f"normalizer must be one of {NORMALIZERS}, got {self.normalizer!r}")
        if self.normalizer is not None and self.curvature:
            raise CaptureUsageError("curvature statistics of normalised rows are not supported: capture them raw")
        if self.coverage not in COVERAGE_MODES:
            raise CaptureUsageError(f"coverage must be one of {COVERAGE_MODES}, got {self.coverage!r}")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise CaptureUsageError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {self.on_nonfinite!r}")
        for name in ("split", "checkpoint"):
            check_label(name, getattr(self.labels, name))
        if isinstance(self.example_dim, bool) or not isinstance(self.example_dim, int) or self.example_dim < 0:
            raise CaptureUsageError(
                f"example_dim must be a non-negative int (the input dim that indexes the examples), got "
                f"{self.example_dim!r}"
            )
        if self.example_dim and self.fused:
            raise CaptureUsageError(
                "fused=True projects inside the layers' GEMMs, which needs batch-first inputs; with "
                f"example_dim={self.example_dim} leave fused=False"
            )


def check_label(name: str, value: Any) -> str:
    """``value`` if it is a non-empty string (a split or checkpoint label)."""
    if not isinstance(value, str) or not value:
        raise CaptureUsageError(f"{name} must be a non-empty string, got {value!r}")
    return value


@dataclass
class CapturedBatch:
    """One micro-batch of captured rows, as handed to the sink."""

    grads: torch.Tensor  # float32 [B, dim], CPU
    example_ids: list[str]
    example_hash: list[str] | None
    step: int
    epoch: int
    checkpoint: str
    split: str
    rank: int
    learning_rate: float | None
    loss: torch.Tensor | None  # float32 [B]
    num_tokens: torch.Tensor  # int32 [B]


@dataclass
class SkippedBatch:
    """One training micro-batch whose rows were not delivered, as handed to ``on_skip``."""

    example_ids: list[str]
    step: int
    epoch: int
    checkpoint: str
    split: str
    rank: int
    reason: str  # SKIP_GRAD_SCALER or SKIP_NONFINITE
    nonfinite_rows: int  # rows holding NaN/Inf (0: a scaler skipped the step over other gradients)


def build_spec(layers: Sequence[LayerInfo], config: ProjectionConfig) -> ProjectionSpec:
    """The projection spec of ``layers`` under ``config`` (slots in module order)."""
    mode = {None: "exact", "factorized": "factorized", "dense": "dense"}[config.kind]
    slots, offset = [], 0
    for info in layers:
        k_in, k_out = (
            slot_sizes(info.name, config.k_in, config.k_out, config.layer_sizes)
            if config.basis is None
            else _basis_sizes(config.basis, info)
        )
        slot = make_slot(info.name, info.kind, info.d_in, info.d_out, info.has_bias, mode, k_in, k_out, offset)
        if mode == "dense" and slot.size * slot.d_out * slot.d_in_eff > MAX_DENSE_ENTRIES:
            raise CaptureUsageError(
                f"dense projection of layer {info.name!r} needs a {slot.size} x {slot.d_out * slot.d_in_eff} "
                "matrix; use projection='factorized' or exclude the layer"
            )
        slots.append(slot)
        offset += slot.size
    kind = "none" if config.kind is None else config.kind
    basis = None if config.basis is None else config.basis.digest()
    return ProjectionSpec(seed=config.seed, kind=kind, layers=tuple(slots), basis=basis)


def _basis_sizes(basis: ProjectionBasis, info: LayerInfo) -> tuple[int, int]:
    """``(k_in, k_out)`` of ``info``'s layer in ``basis``, checking the matrices fit the layer."""
    if info.name not in basis.matrices:
        raise CaptureUsageError(
            f"the projection basis has no matrices for layer {info.name!r}; estimate it with the "
            "same layer selection as the capture"
        )
    p_in, p_out = basis.matrices[info.name]
    d_in_eff = info.d_in + int(info.has_bias)
    if (
        p_in.shape[1] != d_in_eff
        or p_out.shape[1] != info.d_out
        or p_in.shape[0] > d_in_eff
        or p_out.shape[0] > info.d_out
    ):
        raise CaptureUsageError(
            f"projection basis of layer {info.name!r} has shapes {p_in.shape} / {p_out.shape}, "
            f"the layer needs [k_in <= {d_in_eff}, {d_in_eff}] / [k_out <= {info.d_out}, {info.d_out}]"
        )
    return p_in.shape[0], p_out.shape[0]
