"""W-capture: cost of capturing per-example projected gradients into a real store during training.

Workload (``../shared/WORKLOADS.md``, W-capture; issue 3 "Benchmark"):

* ``GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=512))``,
  random init, on CPU with ``torch.set_num_threads(2)``.
* Batches of 16 random token sequences of length 128 (``labels = input_ids``), fixed seed.
* AdamW, lr 1e-4. One step = forward + backward + optimizer step + zero_grad.
* Capture arm: ``store.capture(model, run, optimizer=opt, include=r"transformer\\.h\\.",
  layer_types=("linear", "conv1d"), loss_reduction="token_mean")`` -- the 16 Conv1D layers of the
  four blocks at the default 16 x 16 factorized projection (4,096 dims per example), rows streamed
  into a real store (``gradstore.open(tmpdir)``, default float16 storage) by the background writer.

Method (paired): model copies with identical initial weights (``copy.deepcopy``), each with its own AdamW; only
the captured one has capture hooks (the third, ``floor``, is described below). For every batch every arm runs one
step on that same batch, back to back, and the order rotates from batch to batch so drift and cache effects
cancel. After ``--warmup`` batches, ``--steps`` are timed; the median of the per-batch ratios ``t_captured /
t_plain`` is one repeat's figure. The script runs ``--repeats`` (3) such paired measurements (fresh models,
optimizers and store each, same seed) and reports the median of their medians. Separate models are used rather
than pause/resume on one model so the plain arm carries no hooks. The RNG is reseeded per batch (untimed) so the
arms draw the same dropout masks; capture must not change training, so the plain and captured copies must end
with bit-identical weights (checked and reported).

Work the capture pushes to background threads (content hashing and ``writer.append`` on the sink thread,
float16 encoding and Lance commits on the writer thread) shares the 2 cores with training; it lands in
whichever step is running, so the ratio of total times is printed beside the median ratio.

Also reported: steps/s of each arm (median step time), bytes per stored example on disk (store
directory size / rows, and the gradients table alone) against the nominal ``2 * dim + 4`` of float16
storage, and the row count in the store at the end (must equal captured steps x 16).

Beside them a third copy (``floor``) runs the capture's projection GEMMs and nothing else: the same hooks' work
(``addmm`` of every captured layer's inputs to 16 columns in a forward hook, ``mm`` of its output gradients in a
tensor hook, the per-example contraction; :func:`ingest.per_example.project_tokens` and ``contract_tokens``) with
the results dropped, no store, no scaling, no copy. Its median ratio to the plain step is what any capture that
projects with dense ``k = 16`` matrices through its own GEMMs pays on this machine: the floor the capture's
ratio is compared with (``docs/capture.md``).

Each repeat's median is printed; the last line is ``RESULT capture_overhead=<median of the repeats' medians>
target<=1.02 PASS|MISS`` (issue 12).

``--width N`` trains a GPT-2 of ``n_embd = N`` instead (64-wide heads; not W-capture: its RESULT is named
``capture_overhead_width<N>``), to see how the cost falls as layers widen: the projections cost ``16 (d_in +
d_out)`` multiply-adds per token and side pair, the layer's own forward and backward ``3 d_in d_out``.

``--fused`` captures with ``fused=True`` (the projections inside the layers' GEMMs, :mod:`ingest.fused`); the last
line is then ``RESULT capture_overhead_fused=...``. ``--device cuda`` (``bench/gpu_check.sh``) trains every copy on
the GPU (same workload; each timed step ends with ``torch.cuda.synchronize()``, so it covers the GPU's work and the
capture's device-to-host copies are started inside it); the last line is then ``RESULT
capture_overhead_cuda=<x> target<=1.02``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import gradstore
from gradstore.capture.session import StoreCapture
from gradstore.core import schema as S
from ingest.per_example import contract_tokens, project_tokens
from ingest.projection import ProjectionSpec

TARGET = 1.02
REPEATS = 3
BATCH = 16
SEQ = 128
VOCAB = 512
EXPECTED_LAYERS = 16
EXPECTED_DIM = 4096
K = 16  # projection columns per side (W-capture: 16 x 16)
WIDTH = 256  # W-capture's n_embd


def make_model(seed: int, width: int = WIDTH) -> GPT2LMHeadModel:
    """The W-capture GPT-2 (``width`` 256; other widths keep its 64-wide heads), randomly initialised from ``seed``."""
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=4, n_embd=width, n_head=width // 64, n_positions=SEQ, vocab_size=VOCAB)
    return GPT2LMHeadModel(config)


def make_batches(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of ``[16, 128]`` random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(count)]


def train_step(model: GPT2LMHeadModel, opt: torch.optim.Optimizer, tokens: torch.Tensor, seed: int) -> float:
    """One timed training step (forward, backward, optimizer step, zero_grad); returns seconds.

    The RNG is reseeded (untimed) first, so both arms draw the same dropout masks for a batch. On a GPU the step
    is timed from an idle device to the end of its queued work.
    """
    torch.manual_seed(seed)
    if tokens.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if tokens.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def hook_projection_floor(model: nn.Module) -> None:
    """Give ``model``'s block layers the projection GEMMs of a capture and nothing else (results dropped): forward
    hooks project each layer's inputs, hooks on the outputs project the output gradients and contract per
    example, with operands of the capture's shapes."""
    generator = torch.Generator().manual_seed(0)
    layers = [m for name, m in model.named_modules() if isinstance(m, Conv1D) and name.startswith("transformer.h.")]
    if len(layers) != EXPECTED_LAYERS:
        raise SystemExit(f"expected {EXPECTED_LAYERS} Conv1D layers in the blocks, found {len(layers)}")
    for layer in layers:
        d_in, d_out = layer.weight.shape
        shapes = ((d_in, K), (K,), (d_out, K))
        in_t, in_bias, out_t = (torch.randn(shape, generator=generator).to(layer.weight.device) for shape in shapes)
        layer.register_forward_hook(_projecting_hook(in_t, in_bias, out_t))


def _projecting_hook(in_t: torch.Tensor, in_bias: torch.Tensor, out_t: torch.Tensor) -> Callable:
    def project(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        inputs = project_tokens(args[0].detach(), in_t, in_bias)

        def contract(dy: torch.Tensor) -> None:
            contract_tokens(inputs, project_tokens(dy, out_t))

        output.register_hook(contract)

    return project


def block_capture(
    store: gradstore.GradStore, model: nn.Module, optimizer: torch.optim.Optimizer, fused: bool = False
) -> StoreCapture:
    """W-capture's capture of ``model`` (not entered): the 16 Conv1D layers of the blocks at 16 x 16, token-mean
    loss, into ``store`` as run ``bench``; refuses another layer count or width."""
    cap = store.capture(
        model,
        "bench",
        optimizer=optimizer,
        include=r"transformer\.h\.",
        layer_types=("linear", "conv1d"),
        loss_reduction="token_mean",
        fused=fused,
    )
    spec = cap.spec
    if len(spec.layers) != EXPECTED_LAYERS or spec.dim != EXPECTED_DIM:
        raise SystemExit(
            f"expected {EXPECTED_LAYERS} layers / {EXPECTED_DIM} dims, got {len(spec.layers)} / {spec.dim}"
        )
    return cap


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class Repeat:
    """One paired measurement: per-batch step times of every arm and what the store holds afterwards."""

    t_plain: list[float]
    t_cap: list[float]
    t_floor: list[float]
    rows: int
    expected_rows: int
    rows_written: int
    store_bytes: int
    grad_table_bytes: int
    flush_s: float
    loop_s: float
    same_weights: bool
    spec: ProjectionSpec

    @property
    def ratios(self) -> list[float]:
        return [c / p for c, p in zip(self.t_cap, self.t_plain)]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def floor_median(self) -> float:
        """Median per-batch ratio of the projection GEMMs alone (:func:`hook_projection_floor`) to the plain step."""
        return statistics.median(f / p for f, p in zip(self.t_floor, self.t_plain))


def measure(
    steps: int, warmup: int, seed: int, device: torch.device, fused: bool = False, width: int = WIDTH
) -> Repeat:
    """One paired run on ``device``: fresh model copies, optimizers and store; ``warmup`` + ``steps`` batches."""
    plain = make_model(seed, width).to(device)
    captured = copy.deepcopy(plain)
    floor = copy.deepcopy(plain)
    for model in (plain, captured, floor):
        model.train()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_captured = torch.optim.AdamW(captured.parameters(), lr=1e-4)
    opt_floor = torch.optim.AdamW(floor.parameters(), lr=1e-4)
    hook_projection_floor(floor)
    batches = [batch.to(device) for batch in make_batches(warmup + steps, seed + 1)]

    root = Path(tempfile.mkdtemp(prefix="gradstore-bench-capture-"))
    try:
        store = gradstore.open(root / "store")
        cap = block_capture(store, captured, opt_captured, fused)
        spec = cap.spec

        arms = {"plain": (plain, opt_plain), "captured": (captured, opt_captured), "floor": (floor, opt_floor)}
        times: dict[str, list[float]] = {name: [] for name in arms}
        wall = time.perf_counter()
        with cap:
            for i, tokens in enumerate(batches):
                step_seed = seed * 1_000_003 + i  # same dropout masks in every arm
                names = list(arms)
                for name in names[i % len(names) :] + names[: i % len(names)]:  # the order rotates
                    elapsed = train_step(*arms[name], tokens, step_seed)
                    if i >= warmup:
                        times[name].append(elapsed)
            loop_s = time.perf_counter() - wall
            drain = time.perf_counter()
            cap.flush()
            flush_s = time.perf_counter() - drain
        return Repeat(
            t_plain=times["plain"],
            t_cap=times["captured"],
            t_floor=times["floor"],
            rows=store.core.table(S.GRADIENTS).count_rows(),
            expected_rows=len(batches) * BATCH,
            rows_written=cap.rows_written,
            store_bytes=dir_bytes(root / "store"),
            grad_table_bytes=dir_bytes(root / "store" / f"{S.GRADIENTS}.lance"),
            flush_s=flush_s,
            loop_s=loop_s,
            same_weights=all(torch.equal(p, q) for p, q in zip(plain.parameters(), captured.parameters())),
            spec=spec,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="measured batches per repeat (>= 20 for the report)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed batches before measuring, per repeat")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="paired measurements; the result is their median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both model copies train")
    parser.add_argument("--fused", action="store_true", help="project inside the layers' GEMMs (ingest.fused)")
    parser.add_argument(
        "--width", type=int, default=WIDTH, help="the model's n_embd (W-capture: 256; others are not W-capture)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")

    torch.set_num_threads(2)
    device = torch.device(args.device)
    if args.width % 64:
        raise SystemExit("--width must be a multiple of 64 (64-wide heads)")
    repeats = [measure(args.steps, args.warmup, args.seed, device, args.fused, args.width) for _ in range(args.repeats)]
    spec = repeats[0].spec
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 2 threads"
    print(
        f"{'W-capture' if args.width == WIDTH else 'not W-capture'}: GPT-2 4x{args.width}, batch {BATCH} x {SEQ}, "
        f"{len(spec.layers)} layers captured, "
        f"{spec.dim} dims ({spec.layers[0].k_out}x{spec.layers[0].k_in} factorized{', fused' if args.fused else ''}), "
        f"float16 store; {where}"
    )
    print(
        "method: three identical model copies (plain / captured / projection GEMMs only), same batches, order "
        f"rotating per batch; {args.warmup} warm-up + {args.steps} measured batches per repeat, {args.repeats} "
        "repeats (fresh models, optimizers and store each)"
    )
    nominal = 2 * spec.dim + 4
    for r, rep in enumerate(repeats):
        ratios = rep.ratios
        q = statistics.quantiles(ratios, n=4)
        med_plain, med_cap = statistics.median(rep.t_plain), statistics.median(rep.t_cap)
        print(
            f"repeat {r}: median ratio {rep.median:.4f} (quartiles {q[0]:.4f} / {q[2]:.4f}); ratio of totals "
            f"{sum(rep.t_cap) / sum(rep.t_plain):.4f}; median s/step plain {med_plain:.4f} ({1 / med_plain:.3f} "
            f"steps/s), captured {med_cap:.4f} ({1 / med_cap:.3f} steps/s); fastest step captured / plain "
            f"{min(rep.t_cap) / min(rep.t_plain):.4f} (least disturbed by other load); projection GEMMs alone "
            f"(floor): median ratio {rep.floor_median:.4f}"
        )
        print(
            f"  store: {rep.rows} rows (expected {rep.expected_rows}; capture reported {rep.rows_written}); "
            f"bytes/example {rep.store_bytes / rep.rows:,.0f} (store), {rep.grad_table_bytes / rep.rows:,.0f} "
            f"(gradients table), nominal 2*dim+4 = {nominal:,}; final flush {rep.flush_s:.3f} s "
            f"(loop {rep.loop_s:.1f} s); weights identical with and without capture: {rep.same_weights}"
        )
        if rep.rows != rep.expected_rows:
            raise SystemExit(f"row count mismatch: {rep.rows} rows in the store, expected {rep.expected_rows}")
    medians = [rep.median for rep in repeats]
    ratio = statistics.median(medians)
    print(f"median ratio per repeat: {', '.join(f'{m:.4f}' for m in medians)}")
    floors = [rep.floor_median for rep in repeats]
    print(
        f"projection GEMMs alone (floor), median ratio per repeat: {', '.join(f'{m:.4f}' for m in floors)}; "
        f"median {statistics.median(floors):.4f}"
    )
    verdict = "PASS" if ratio <= TARGET else "MISS"
    name = "capture_overhead" + ("_fused" if args.fused else "") + ("" if device.type == "cpu" else f"_{device.type}")
    name += "" if args.width == WIDTH else f"_width{args.width}"
    print(f"RESULT {name}={ratio:.4f} target<={TARGET} {verdict}")


if __name__ == "__main__":
    main()
