"""Attribution quality of a small CNN on scikit-learn's bundled digits (8x8 images), through gradstore: the
vision row of ``bench/fidelity.py``, under its protocol.

Everything that is not the architecture is ``bench/fidelity.py``'s, imported from it (data split, ids, the
cosine schedule, the stacked retraining behind ``gradstore.answers.evaluate.retrain``, training under ``store.capture``,
checkpoint passes, true-Fisher rows, the variants, the methods, the damping grid, the LDS): see its docstring.
Here:

* Model: ``Unflatten -> Conv2d(1, 8, 3, stride 2, padding 1) -> ReLU -> Conv2d(8, 16, 3, stride 2, padding 1)
  -> ReLU -> Flatten -> Linear(64, 10)`` (1,898 parameters; 8x8 -> 4x4 -> 2x2), one seeded init. The issue's
  sketch (first convolution at stride 1, a 256-wide head) costs 7x more per step; with the stride-2 stem the 2 x 100
  retrainings take about 70 s on two cores. Training: full-batch Adam, cosine schedule from lr 0.02, 300
  steps, weight decay 1e-3 (train CE 0.006, test accuracy 0.96). The stacked retraining is
  ``torch.func.functional_call`` of the same module under ``vmap`` over stacked parameters (a grouped
  convolution per layer). Float32: the model trained under capture and the stacked full-set copy end 6e-7 apart
  (``bench/fidelity.py``'s 1e-5 check holds); float64 convolutions take 4-5x longer on CPU.
* Capture: the convolutions are captured at their ops (``ingest/uses/``; slot ``[C_out, C_in * 3 * 3 + 1]``,
  the im2col view), the head by its hook. Before scoring, a capture check compares exact rows (``projection=None``)
  of 64 training examples with ``torch.func`` per-example gradients and prints the run's coverage; it stops the
  bench on a relative error above 1e-5 or a parameter not captured.
* Byte budget: factorized 16x16 per layer, capped at the slot's sides: conv1 10x8 (slot ``[8, 10]``), conv2 16x16
  (``[16, 73]``), head 16x10 (``[10, 65]``): **496 dims** (1,984 bytes a float32 row), against 1,898 exact.
* In-loop rows every 6th step (50 recorded steps, as the MLP's), five checkpoint passes (60, 120, ..., 300).
* Variants: exact gradients (ceiling, never a candidate); random factorized seeds 0 and 1; the curvature-aware
  K-FAC eigenbasis (``ingest.basis.estimate_basis`` on the true Fisher, requested sizes and ``split="energy"``).
  The eigenbasis replaces the random projection on the ``Linear`` head only: ``estimate_basis`` keeps the seeded
  random projection of layers captured at their ops, the two convolutions here, so the "curvature-aware"
  variants are the seed-0 random projection on the convolutions (and the energy split keeps the head's 16x10,
  so its rows equal the fixed split's: a duplicate candidate, kept as in ``bench/fidelity.py``). Methods: every
  method of ``bench/fidelity.py`` (``grad-dot``, ``fisher`` on the empirical and the true Fisher, ``tracin``
  over the five checkpoints, ``tracin-steps``, ``dvemb``, ``source`` on either Fisher); damping on validation.

Ends with ``RESULT lds_vision_cnn_496``: the test LDS of the (variant, method) with the best validation LDS among
every method on the four projected variants.

Target >= 0.54, fixed from the validation figures of the first full run (2026-12-05, ``--subsets 100``) before
any of its test figures was read. On validation, the best projected candidate is ``fisher`` on the true Fisher with
the curvature-aware basis, 0.569 (s.e. 0.009 over 200 queries; random factorized 0.536 / 0.527), and the exact
gradients reach 0.643 with the same method: the CNN sits about 0.1 under the MLP (exact 0.743, chosen 0.678) and
keeps 0.88 of its ceiling at 496 dims (the MLP 0.91 at 416). A test figure differs from a validation one by
independent queries and retrainings: the s.e. of that difference over queries alone is about 0.013, so the
target is the best validation LDS minus two of those, rounded down: 0.54 (0.84 of the exact ceiling; the MLP's
0.65 is 0.87 of its own, 0.03 under its figure). A 10-subset smoke run before it printed test figures of a
different, noisier LDS (Spearman over 10 subsets), not used.

Run: ``python bench/fidelity_vision.py`` (``--subsets 20`` for a quick run; ``bench/fidelity.py`` runs it at its
end unless ``--no-vision``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import gradstore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity  # bench/ is not a package

TARGET = 0.54
VARIANTS = ("exact", "factorized-s0", "factorized-s1", "curvature-kfac", "curvature-kfac-energy")
ROW_TOLERANCE = 1e-5  # exact captured rows vs torch.func, relative


@dataclass(frozen=True)
class CNNConfig(fidelity.ModelConfig):
    """``fidelity.ModelConfig`` with a two-convolution CNN (``hidden`` is the second convolution's channels)."""

    channels: tuple[int, int] = (8, 16)

    def module(self) -> nn.Module:
        first, second = self.channels
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, first, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(first, second, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(second * 2 * 2, fidelity.CLASSES),
        ).to(self.dtype)

    def stacked_logits(self, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits ``[copies, n, 10]``: the module called with each copy's parameters, vmapped over the stack."""
        module = self.module()
        names = [name for name, _ in module.named_parameters()]

        def one(copy: tuple[torch.Tensor, ...], inputs: torch.Tensor) -> torch.Tensor:
            return functional_call(module, dict(zip(names, copy)), (inputs,))

        return vmap(one)(tuple(params), x)

    def projected_dims(self) -> int:
        """Dims of a factorized run: ``min(k_in, d_in + 1) * min(k_out, d_out)`` summed over the captured layers."""
        total = 0
        for layer in self.module().modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                fan_in = layer.weight[0].numel() + (layer.bias is not None)
                total += min(self.k_in, fan_in) * min(self.k_out, layer.weight.shape[0])
        return total


CONFIG = CNNConfig("cnn", 16, weight_decay=1e-3, lr=0.02, steps=300, k_in=16, k_out=16, every=6, dtype=torch.float32)


def capture_check(config: CNNConfig, data: fidelity.Data, seed: int, workdir: Path, count: int = 64) -> str:
    """Exact rows of ``count`` training examples at the initial weights vs ``torch.func`` per-example gradients
    (slots in module order, ``[weight.reshape(C_out, -1) | bias]``), and the run's coverage. Raises on a
    mismatch or a parameter not captured; returns a one-line summary."""
    module = config.module()
    fidelity.load_into(module, [p[0] for p in config.initial(1, seed)])
    x, y = data.x_train[:count].to(config.dtype), data.y_train[:count]
    store = gradstore.open(workdir / "cnn-capture-check", storage_dtype="float32")
    with store.capture(module, "check", projection=None, loss_reduction="mean", coverage="strict") as cap:
        cap.set_ids([str(i) for i in range(count)])
        F.cross_entropy(module(x), y).backward()
    block = store.read_gradients("check")
    order = np.argsort([int(i) for i in block.metadata.column("example_id").to_pylist()])
    rows = block.vectors[order].astype(np.float64)
    params = {name: p.detach() for name, p in module.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(module, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    layers = [name.rsplit(".", 1)[0] for name in params if name.endswith(".weight")]
    expected = (
        torch.cat(
            [
                torch.cat(
                    [
                        grads[f"{n}.weight"].reshape(count, grads[f"{n}.weight"].shape[1], -1),
                        grads[f"{n}.bias"][:, :, None],
                    ],
                    2,
                ).reshape(count, -1)
                for n in layers
            ],
            1,
        )
        .double()
        .numpy()
    )
    if rows.shape != expected.shape:
        raise AssertionError(f"capture check: rows {rows.shape}, torch.func {expected.shape}")
    error = float(np.linalg.norm(rows - expected) / np.linalg.norm(expected))
    coverage = store.info()["coverage"]["check"]
    if error > ROW_TOLERANCE or coverage["not_captured"]:
        raise AssertionError(f"capture check failed: relative error {error:.2e}, coverage {coverage}")
    return (
        f"capture check: exact rows of {count} examples vs torch.func, relative error {error:.1e}; coverage "
        f"{coverage['fraction']:.3f} of {coverage['trainable']:,} trainable weights ({len(coverage['captured'])} "
        "parameters, none left out)"
    )


def print_table(rows: list[fidelity.Row]) -> None:
    """Every (variant, method) with validation and test LDS and their standard errors over queries."""
    print(f"{'model':<5} {'variant':<22} {'method':<19} {'val LDS':>7} {'s.e.':>6} {'test LDS':>8} {'s.e.':>6}  note")
    for r in rows:
        print(
            f"{r.model:<5} {r.variant.name:<22} {r.method.label:<19} {r.val:>7.3f} {r.val_stderr:>6.3f} "
            f"{r.test.value:>8.3f} {r.test.stderr:>6.3f}  {r.note}"
        )


def vision_rows(
    subsets: int = 100,
    seed: int = 0,
    variants: list[str] | None = None,
    methods: list[str] | None = None,
    workdir: Path | None = None,
) -> list[fidelity.Row]:
    """Run the CNN under ``bench/fidelity.py``'s protocol; print its table, the choice and the RESULT line."""
    config = CONFIG
    began = time.perf_counter()
    data = fidelity.load_data(seed)
    chosen_variants = [v for v in fidelity.VARIANTS if v.name in (variants or VARIANTS)]
    with tempfile.TemporaryDirectory(prefix="gradstore-fidelity-vision-") as scratch:
        root = Path(workdir or scratch)
        check = capture_check(config, data, seed, root)
        fidelity.log(check)
        rows, _, _ = fidelity.evaluate_model(config, data, chosen_variants, methods, subsets, seed, root)
    dims, weights = config.projected_dims(), sum(p.numel() for p in config.module().parameters())
    print(
        f"\nVision: CNN Conv(1,8,3,s2)-Conv(8,16,3,s2)-Linear(64,10) on digits, {weights:,} parameters; factorized"
        f" {config.k_in}x{config.k_out} per layer capped at each slot = {dims} dims; "
        f"2 x {subsets} subsets; {time.perf_counter() - began:.0f}s wall"
    )
    print(check)
    print_table(rows)
    projected = [r for r in rows if r.variant.family != "exact"]
    for row in projected:
        if f"dim {dims}" not in row.note:
            raise AssertionError(f"{row.variant.name}: expected {dims} dims, got {row.note}")
    print("\nEach method on the projected variant with its best validation LDS:")
    for (_, label), r in fidelity.per_method(rows).items():
        val, test = f"val {r.val:.3f} ({r.val_stderr:.3f})", f"test {r.test.value:.3f} ({r.test.stderr:.3f})"
        print(f"  {label:<19} {r.variant.name:<22} {val}  {test}")
    best = fidelity.chosen(rows, lambda r: r.variant.family != "exact")
    if best is None:
        return rows
    ceiling = fidelity.chosen(rows, lambda r: r.variant.family == "exact")
    if ceiling is not None:
        print(
            f"exact gradients (ceiling, not a candidate), best on validation: {ceiling.method.label} "
            f"val {ceiling.val:.3f}, test {ceiling.test.value:.3f}"
        )
    print(
        f"chosen on validation among every method on the {len({r.variant.name for r in projected})} projected "
        f"variants: {best.method.label} {best.variant.name} (val {best.val:.3f}, s.e. {best.val_stderr:.3f}); "
        f"MLP at 416 dims 0.678, logreg at 320 dims 0.788 (README)"
    )
    value = best.test.value
    print(f"RESULT lds_vision_cnn_{dims}={value:.3f} target>={TARGET:.2f} {fidelity.verdict(value, TARGET)}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--subsets", type=int, default=100, help="retrained subsets per retraining (two retrainings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the method labels (default: all)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vision_rows(
        args.subsets,
        args.seed,
        None if args.variants is None else args.variants.split(","),
        None if args.methods is None else args.methods.split(","),
    )


if __name__ == "__main__":
    main()
