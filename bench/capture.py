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

Method (paired): two model copies with identical initial weights (``copy.deepcopy``), each with its own
AdamW; only the second has capture hooks. For every batch both arms run one step on that same batch,
back to back, and the order inside a pair alternates (plain first on even pairs, captured first on odd
pairs) so drift and cache effects cancel. After ``--warmup`` pairs, ``--steps`` pairs are timed; the
result is the median of the per-pair ratios ``t_captured / t_plain``. Two models are used rather than
pause/resume on one model so the plain arm carries no hooks at all. The RNG is reseeded per batch
(untimed) so both arms draw the same dropout masks; capture must not change training, so both copies
must then end with bit-identical weights (checked and reported).

Work the capture pushes to background threads (content hashing and ``writer.append`` on the sink thread,
float16 encoding and Lance commits on the writer thread) shares the 2 cores with training; it lands in
whichever step is running, so the ratio of total times is printed beside the median ratio.

Also reported: steps/s of each arm (median step time), bytes per stored example on disk (store
directory size / rows, and the gradients table alone) against the nominal ``2 * dim + 4`` of float16
storage, and the row count in the store at the end (must equal captured steps x 16).

The last line is ``RESULT capture_overhead=<ratio> target<=1.05 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradstore
from gradstore.core import schema as S

TARGET = 1.05
BATCH = 16
SEQ = 128
VOCAB = 512
EXPECTED_LAYERS = 16
EXPECTED_DIM = 4096


def make_model(seed: int) -> GPT2LMHeadModel:
    """The W-capture GPT-2, randomly initialised from ``seed``."""
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=SEQ, vocab_size=VOCAB)
    return GPT2LMHeadModel(config)


def make_batches(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of ``[16, 128]`` random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(count)]


def train_step(model: GPT2LMHeadModel, opt: torch.optim.Optimizer, tokens: torch.Tensor, seed: int) -> float:
    """One timed training step (forward, backward, optimizer step, zero_grad); returns seconds.

    The RNG is reseeded (untimed) first, so both arms draw the same dropout masks for a batch.
    """
    torch.manual_seed(seed)
    start = time.perf_counter()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="measured pairs (>= 20 for the report)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed pairs before measuring")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(2)
    plain = make_model(args.seed)
    captured = copy.deepcopy(plain)
    plain.train()
    captured.train()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_captured = torch.optim.AdamW(captured.parameters(), lr=1e-4)
    batches = make_batches(args.warmup + args.steps, args.seed + 1)

    root = Path(tempfile.mkdtemp(prefix="gradstore-bench-capture-"))
    try:
        store = gradstore.open(root / "store")
        cap = store.capture(
            captured,
            "bench",
            optimizer=opt_captured,
            include=r"transformer\.h\.",
            layer_types=("linear", "conv1d"),
            loss_reduction="token_mean",
        )
        spec = cap.spec
        if len(spec.layers) != EXPECTED_LAYERS or spec.dim != EXPECTED_DIM:
            raise SystemExit(
                f"expected {EXPECTED_LAYERS} layers / {EXPECTED_DIM} dims, got {len(spec.layers)} / {spec.dim}"
            )

        t_plain: list[float] = []
        t_cap: list[float] = []
        captured_steps = 0
        wall = time.perf_counter()
        with cap:
            for i, tokens in enumerate(batches):
                step_seed = args.seed * 1_000_003 + i  # same dropout masks in both arms
                if i % 2 == 0:
                    a = train_step(plain, opt_plain, tokens, step_seed)
                    b = train_step(captured, opt_captured, tokens, step_seed)
                else:
                    b = train_step(captured, opt_captured, tokens, step_seed)
                    a = train_step(plain, opt_plain, tokens, step_seed)
                captured_steps += 1
                if i >= args.warmup:
                    t_plain.append(a)
                    t_cap.append(b)
            loop_s = time.perf_counter() - wall
            drain = time.perf_counter()
            cap.flush()
            flush_s = time.perf_counter() - drain
        rows_written = cap.rows_written

        rows = store.table(S.GRADIENTS).count_rows()
        store_bytes = dir_bytes(root / "store")
        grad_table_bytes = dir_bytes(root / "store" / f"{S.GRADIENTS}.lance")
        same_weights = all(torch.equal(p, q) for p, q in zip(plain.parameters(), captured.parameters()))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratios = [c / p for c, p in zip(t_cap, t_plain)]
    ratio = statistics.median(ratios)
    total_ratio = sum(t_cap) / sum(t_plain)
    q = statistics.quantiles(ratios, n=4)
    med_plain, med_cap = statistics.median(t_plain), statistics.median(t_cap)
    nominal = 2 * spec.dim + 4
    expected_rows = captured_steps * BATCH

    print(
        f"W-capture: GPT-2 4x256, batch {BATCH} x {SEQ}, {len(spec.layers)} layers captured, "
        f"{spec.dim} dims ({spec.layers[0].k_out}x{spec.layers[0].k_in} factorized), float16 store"
    )
    print(
        "method: two identical model copies (plain / captured), same batches, order alternating per pair; "
        f"{args.warmup} warm-up + {len(ratios)} measured pairs"
    )
    print(f"{'arm':<10}{'median s/step':>15}{'steps/s':>10}{'total s':>10}")
    print(f"{'plain':<10}{med_plain:>15.4f}{1 / med_plain:>10.3f}{sum(t_plain):>10.2f}")
    print(f"{'captured':<10}{med_cap:>15.4f}{1 / med_cap:>10.3f}{sum(t_cap):>10.2f}")
    print(
        f"ratio per pair: median {ratio:.4f}  (quartiles {q[0]:.4f} / {q[2]:.4f}, "
        f"min {min(ratios):.4f}, max {max(ratios):.4f}); ratio of totals {total_ratio:.4f}"
    )
    print(
        f"store: {rows} rows (expected {captured_steps} captured steps x {BATCH} = {expected_rows}; "
        f"capture reported {rows_written})"
    )
    print(
        f"bytes/example on disk: {store_bytes / rows:,.0f} (whole store), {grad_table_bytes / rows:,.0f} "
        f"(gradients table); nominal 2*dim+4 = {nominal:,}"
    )
    print(
        f"final flush after the loop: {flush_s:.3f} s (loop {loop_s:.1f} s); "
        f"weights identical with and without capture: {same_weights}"
    )
    if rows != expected_rows:
        raise SystemExit(f"row count mismatch: {rows} rows in the store, expected {expected_rows}")
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"RESULT capture_overhead={ratio:.4f} target<={TARGET} {verdict}")


if __name__ == "__main__":
    main()
