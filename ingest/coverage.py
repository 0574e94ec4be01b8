"""Coverage: which trainable parameters a capture records, how, and why the others are not.

Every capture builds a :class:`Coverage` from its layer selection: per trainable parameter, captured or not,
by a module hook or at its ops (:mod:`ingest.uses`), and why not. Uses found while training that capture cannot
split per example (:meth:`Coverage.uncovered`) turn a captured parameter into an uncaptured one. ``mode``:

* ``"warn"`` (default): one :class:`CoverageWarning` listing the parameters not captured for a reason other than
  a documented decision (layers left out by ``layer_types``/``include``/``exclude``, e.g. the norms' scales and
  shifts, which the default ``layer_types`` leaves out)
  with their share of the trainable parameters;
* ``"strict"``: such parameters raise :class:`~ingest.misuse.CaptureUsageError` (at capture start, or at the
  forward where an uncovered use appears);
* ``"ignore"``: recorded only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from torch import nn

from ingest.layers import LayerInfo, clean_name, fsdp1_wrapped, uncaptured_parameters
from ingest.misuse import CaptureUsageError

COVERAGE_MODES = ("warn", "strict", "ignore")
#: The name suffix of a coverage entry that records a module mixing the examples (:meth:`Coverage.mixed`).
MIXES = " (mixes examples)"
#: The coverage entry of captured steps that brought no rows (see :meth:`Coverage.rowless`).
ROWLESS = "(steps without rows)"
#: Reasons that are a documented choice, not a gap: recorded, never warned about.
DECISIONS = ("layer kind", "left out by include=/exclude=")


class CoverageWarning(UserWarning):
    """Trainable parameters that a capture does not record (warned once per capture)."""


@dataclass
class ParameterCoverage:
    """One trainable parameter: captured (``how``: ``"hook"`` or ``"op"``, into ``slot``) or not (``reason``)."""

    name: str
    numel: int
    captured: bool
    slot: str | None = None
    how: str | None = None
    reason: str | None = None

    @property
    def decided(self) -> bool:
        """Whether it is left out by a documented decision rather than a gap."""
        return not self.captured and any(self.reason.startswith(d) for d in DECISIONS)


class Coverage:
    """The coverage of one capture (see the module doc)."""

    def __init__(self, parameters: list[ParameterCoverage], mode: str = "warn") -> None:
        if mode not in COVERAGE_MODES:
            raise CaptureUsageError(f"coverage must be one of {COVERAGE_MODES}, got {mode!r}")
        self.parameters = parameters
        self.mode = mode
        self._warned = False

    @classmethod
    def of(
        cls,
        model: nn.Module,
        layers: list[LayerInfo],
        layer_types: tuple[str, ...],
        include: str | None,
        exclude: str | None,
        mode: str = "warn",
    ) -> Coverage:
        """The coverage of capturing ``layers`` of ``model``."""
        names = {id(p): clean_name(n) for n, p in model.named_parameters()}
        views = fsdp1_wrapped(model)  # FSDP1: a layer's weight is a view of a flat parameter, named by its layer
        records: dict[int, ParameterCoverage] = {}
        for info in layers:
            for param in (info.parameter, info.bias if info.weight is not None else _module_bias(info)):
                if param is None or not param.requires_grad or id(param) in records:
                    continue
                if id(param) not in names and not views:
                    continue  # a weight computed from parameters (weight_norm, parametrizations): they are listed
                how = "hook" if info.hooked else "op"
                records[id(param)] = ParameterCoverage(
                    names.get(id(param), info.name), param.numel(), True, info.name, how
                )
        parameters = list(records.values())
        for name, numel, reason in uncaptured_parameters(model, layers, layer_types, include, exclude):
            parameters.append(ParameterCoverage(name, numel, False, reason=reason))
        order = {name: i for i, name in enumerate(names.values())}
        parameters.sort(key=lambda p: order.get(p.name, len(order)))
        return cls(parameters, mode)

    # ------------------------------------------------------------------ reading
    @property
    def trainable(self) -> int:
        """Trainable parameter entries (elements) in all."""
        return sum(p.numel for p in self.parameters)

    @property
    def fraction(self) -> float:
        """Share of the trainable parameter entries captured."""
        total = self.trainable
        return 1.0 if total == 0 else sum(p.numel for p in self.parameters if p.captured) / total

    def gaps(self) -> list[ParameterCoverage]:
        """The parameters not captured for a reason other than a documented decision."""
        return [p for p in self.parameters if not p.captured and not p.decided]

    def to_dict(self) -> dict:
        """JSON-serialisable form (kept with the run)."""
        return {
            "mode": self.mode,
            "fraction": self.fraction,
            "trainable": self.trainable,
            "parameters": [asdict(p) for p in self.parameters],
        }

    def summary(self) -> str:
        """One line: the share captured and the gaps."""
        mixing = [p for p in self.gaps() if p.name.endswith(MIXES)]
        rowless = [p for p in self.gaps() if p.name == ROWLESS]
        gaps = [p for p in self.gaps() if not p.name.endswith(MIXES) and p.name != ROWLESS]
        text = f"{self.fraction:.1%} of {self.trainable:,} trainable parameter entries captured"
        if rowless:
            text += f" where rows were formed, but some steps have none: {rowless[0].reason}"
        if gaps:
            share = sum(p.numel for p in gaps) / max(self.trainable, 1)
            listed = "; ".join(f"{p.name} ({p.reason})" for p in gaps[:6]) + ("; ..." if len(gaps) > 6 else "")
            text += f"; not captured ({share:.1%}): {listed}"
        if mixing:
            names = ", ".join(p.name.removesuffix(MIXES) for p in mixing)
            text += f"; rows mix the examples at {names}: {mixing[0].reason}"
        return text

    # ------------------------------------------------------------------ changes
    def uncovered(self, names: Iterable[str], how: str, *, warn: bool = True, reason: str | None = None) -> None:
        """Parameters ``names`` had a use (by op ``how``) that capture cannot split per example: their rows miss
        it, so they count as not captured from now on (``warn``: :meth:`check` now, else the caller does;
        ``reason``: the whole reason recorded, instead of one built from ``how``)."""
        changed = False
        for p in self.parameters:
            if p.name in names and p.captured:
                p.captured = False
                p.reason = reason or (
                    f"used by {how} in a way capture cannot split per example (its slot {p.slot} misses it)"
                )
                changed = True
        if changed:
            self._warned = False
            if warn:
                self.check()

    def appeared(self, names: dict[str, int], when: str) -> None:
        """Parameters ``names`` (name -> numel) became trainable, or joined the model, after the capture chose its
        layers (``when``): no slot holds them, so they are recorded as not captured and warned about."""
        known = {p.name for p in self.parameters}
        reason = (
            f"trainable by {when}, after the capture chose its layers (unfrozen, or added to the model): start a "
            "new capture (a new run) after changing which parameters train"
        )
        new = [
            ParameterCoverage(name, numel, False, reason=reason) for name, numel in names.items() if name not in known
        ]
        if new:
            self.parameters.extend(new)
            self._warned = False
            self.check()

    def mixed(self, module: str, how: str) -> None:
        """Module ``module`` mixes the examples of a batch (``how``: e.g. BatchNorm's batch statistics): every
        row is the example's share of the batch gradient, not the gradient of its own loss alone. Recorded once
        as an entry ``"<module> (mixes examples)"`` of no parameters, not captured, and warned as a gap."""
        name = f"{module}{MIXES}"
        if any(p.name == name for p in self.parameters):
            return
        self.parameters.append(ParameterCoverage(name, 0, False, reason=how))
        self._warned = False
        self.check()

    def rowless(self, how: str) -> None:
        """A captured step brought no rows (``how``): recorded once as an entry ``"(steps without rows)"`` of no
        parameters, not captured, and warned as a gap."""
        if any(p.name == ROWLESS for p in self.parameters):
            return
        self.parameters.append(ParameterCoverage(ROWLESS, 0, False, reason=how))
        self._warned = False
        self.check()

    def check(self) -> None:
        """Warn or raise about the gaps, as ``mode`` says (warned once)."""
        gaps = self.gaps()
        if not gaps or self.mode == "ignore":
            return
        message = (
            f"capture: {self.summary()}. The rows miss these parameters' uses (a slot keeps only the uses capture "
            "splits). Pass coverage='ignore' to "
            "silence this, coverage='strict' to refuse such a model; docs/capture.md lists what is captured."
        )
        if self.mode == "strict":
            raise CaptureUsageError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, CoverageWarning, stacklevel=4)


def _module_bias(info: LayerInfo) -> nn.Parameter | None:
    bias = getattr(info.module, "bias", None)
    return bias if isinstance(bias, nn.Parameter) and info.has_bias else None
