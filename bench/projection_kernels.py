"""Can a sparse/structured projection cut capture's projection cost? Kernels on the W-capture shapes (issue 12).

The projections of a captured W-capture step (``bench/capture.py``) are skinny GEMMs: every layer's inputs
(2,048 tokens x ``d_in``) and output gradients (2,048 x ``d_out``) times a dense Gaussian ``[d, 16]``, 16
multiply-adds per entry, ~90% of the hook work (``docs/capture.md``). A CountSketch (each input coordinate
hashed to one of the 16 buckets with a random sign) needs one multiply-add per entry. This script measures
whether torch's CPU kernels turn that into time, three ways:

1. **Isolated kernels**, 2,048 x d -> 16 for d in {256, 768, 1024, 2304}, one thread, CPU time
   (``time.thread_time``), minimum over ``--repeats`` calls, the arms alternated three times: ``mm`` with the
   Gaussian matrix (what capture runs now); a CountSketch with balanced random buckets as a dense ``mm``, as a
   column gather into bucket order + sign multiply + sum per bucket, as ``index_add_`` into the buckets and as a
   ``torch.sparse`` CSR ``mm``; and a *sign-strided* sketch without a random bucket map (bucket ``j mod 16``,
   random signs: ``(x * sign).view(N, d / 16, 16).sum(1)``, the cheapest form torch's eager kernels offer, but a
   fixed, data-blind hash), whole or 512 tokens at a time (the signed copy stays in cache). ``--fused`` adds the
   sign-strided sketch compiled by ``torch.compile`` (one fused pass; needs a C++ compiler at run time). Every
   sketch arm is checked against its explicit matrix.
2. **In the hooks' context**: a forward hook on each of the 16 captured Conv1D layers of the W-capture GPT-2 and
   a tensor hook on its output apply the arm's kernel to the layer's inputs and output gradients during real
   training steps; the hooks' own CPU time per step is summed (one thread, arms alternated step by step, median
   over ``--steps`` steps). A last arm only reads each tensor once (a column sum): the floor of any projection
   kernel run there, whatever its arithmetic.
3. **Quality**: per-example gradients ``G_i = sum_t dy_t [x_t, 1]^T`` of the 16 layers for one batch of 16
   examples, projected ``P_out G_i P_in^T`` at 16 x 16 with each kind over ``--seeds`` seeds; reported: the mean
   over layers, seeds and example pairs of ``|<P g_i, P g_j> - <g_i, g_j>| / (|g_i| |g_j|)`` (the inner-product
   distortion attribution scores inherit) and the mean Spearman correlation of each layer's projected
   inner products with the exact ones.

4. **Fused into the layer's GEMMs** (hot cache, isolated): the projections appended as 16 extra columns to the
   layer's forward GEMM and its input-gradient GEMM, against separate projection GEMMs, with a check that the
   layer's own output columns stay bit-identical.

The last line is ``RESULT sketch_projection_speedup=<Gaussian hook time / best eager-kernel sketch hook time,
median step> target>=2 PASS|MISS``: the gate for adding a sketch projection kind to capture.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from ingest.projection import projection_matrix

TOKENS, K, TARGET = 2048, 16, 2.0
# An arm that only reads each tensor once (a column sum): no projection can be cheaper than this in the hooks.
READ_FLOOR = "read floor (column sum)"
Kernel = Callable[[torch.Tensor], torch.Tensor]


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Minimum CPU time of this thread over ``repeats`` calls of ``fn`` (after one warm-up call), in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def countsketch(seed: int, d: int, strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bucket [d], sign [d])`` of a CountSketch into ``K`` buckets: balanced random buckets (a random
    permutation of the columns dealt round-robin), or with ``strided`` the fixed buckets ``j mod K``."""
    gen = torch.Generator().manual_seed(seed)
    bucket = torch.arange(d) % K
    if not strided:
        bucket = bucket[torch.argsort(torch.randperm(d, generator=gen))]
    sign = torch.randint(0, 2, (d,), generator=gen).float().mul_(2).sub_(1)
    return bucket, sign


def sketch_dense(bucket: torch.Tensor, sign: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The explicit ``[K, d]`` matrix of a CountSketch (``sign[j]`` at ``(bucket[j], j)``)."""
    mat = torch.zeros(K, len(bucket), dtype=dtype)
    mat[bucket, torch.arange(len(bucket))] = sign.to(dtype)
    return mat


def gathered(bucket: torch.Tensor, sign: torch.Tensor) -> Kernel:
    """A balanced CountSketch as a column gather into bucket order, a sign multiply and a sum per bucket."""
    order = torch.argsort(bucket, stable=True)
    weight = sign[order]

    def apply(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, len(order))
        picked = torch.index_select(flat, 1, order).mul_(weight)
        return picked.view(flat.shape[0], K, -1).sum(-1)

    return apply


def strided_sum(x: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """The sign-strided sketch (bucket ``j mod K``) of ``x``'s rows: ``(x * sign).view(N, d / K, K).sum(1)``."""
    flat = x.reshape(-1, sign.shape[0])
    return (flat * sign).view(flat.shape[0], -1, K).sum(1)


def chunked(sign: torch.Tensor, rows: int = 512) -> Kernel:
    """:func:`strided_sum` ``rows`` tokens at a time through a reused buffer, so the signed copy stays in cache."""
    d = sign.shape[0]
    buffer = torch.empty(rows, d)

    def apply(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, d)
        out = torch.empty(flat.shape[0], K)
        for start in range(0, flat.shape[0], rows):
            part = flat[start : start + rows]
            signed = torch.mul(part, sign, out=buffer[: part.shape[0]])
            torch.sum(signed.view(part.shape[0], -1, K), 1, out=out[start : start + rows])
        return out

    return apply


def kernels(d: int, fused: Callable | None = None, seed: int = 0) -> dict[str, Kernel]:
    """The projection kernels ``[N, d] -> [N, K]`` compared, for inputs of width ``d`` (``fused``: the
    ``torch.compile``d :func:`strided_sum`, added as an arm when given)."""
    gauss_t = torch.randn(d, K, generator=torch.Generator().manual_seed(seed)) / K**0.5
    bucket, sign = countsketch(seed, d)
    dense_t = sketch_dense(bucket, sign).T.contiguous()
    csr = dense_t.to_sparse_csr()
    _, strided_sign = countsketch(seed, d, strided=True)
    arms = {
        "gaussian addmm": lambda x: torch.mm(x.reshape(-1, d), gauss_t),
        "sketch as dense mm": lambda x: torch.mm(x.reshape(-1, d), dense_t),
        "sketch gather+mul+sum": gathered(bucket, sign),
        "sketch index_add_": lambda x: torch.zeros(x.numel() // d, K).index_add_(1, bucket, x.reshape(-1, d) * sign),
        "sketch CSR mm": lambda x: torch.mm(x.reshape(-1, d), csr),
        "sign-strided mul+sum": lambda x: strided_sum(x, strided_sign),
        "sign-strided, 512-row chunks": chunked(strided_sign),
    }
    if fused is not None:
        arms["sign-strided, torch.compile (fused)"] = lambda x: fused(x.reshape(-1, d), strided_sign)
    return arms


def references(d: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The explicit ``[d, K]`` matrix each sketch arm of :func:`kernels` must equal (by name prefix)."""
    return {
        "sketch": sketch_dense(*countsketch(seed, d)).T,
        "sign-strided": sketch_dense(*countsketch(seed, d, strided=True)).T,
    }


def isolated(repeats: int, fused: Callable | None) -> None:
    """Part 1: each kernel alone on a random ``[2048, d]`` input (checked against its explicit matrix)."""
    print(f"1. isolated kernels, {TOKENS} x d -> {K}, one thread, min CPU ms over {repeats} calls (x Gaussian addmm)")
    for d in (256, 768, 1024, 2304):
        x = torch.randn(TOKENS, d, generator=torch.Generator().manual_seed(d))
        fns = kernels(d, fused)
        for prefix, matrix in references(d).items():
            for name, fn in fns.items():
                if name.startswith(prefix) and not torch.allclose(fn(x), x @ matrix, atol=1e-3):
                    raise SystemExit(f"{name} disagrees with its explicit sketch matrix at d = {d}")
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(cpu_ms(lambda fn=fn, x=x: fn(x), repeats))
        base = min(times["gaussian addmm"])
        print(f"  d = {d:4d}: " + ", ".join(f"{n} {min(t):.3f} ({min(t) / base:.2f}x)" for n, t in times.items()))


def make_model() -> GPT2LMHeadModel:
    """The W-capture GPT-2 (4 x 256, 128 positions, vocabulary 512)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=512))


def captured_layers(model: GPT2LMHeadModel) -> list[Conv1D]:
    """The 16 Conv1D layers of the blocks (what ``bench/capture.py`` captures)."""
    return [m for n, m in model.named_modules() if isinstance(m, Conv1D) and n.startswith("transformer.h.")]


class HookTimer:
    """Forward and output-gradient hooks that project each captured layer's tensors with the current arm's
    kernel and sum their own CPU time."""

    def __init__(self, model: GPT2LMHeadModel, arms: dict[str, Callable[[int], Kernel]]) -> None:
        layers = captured_layers(model)
        self.kernels = {
            arm: {(id(m), side): make(d) for m in layers for side, d in zip(("in", "out"), m.weight.shape)}
            for arm, make in arms.items()
        }
        self.arm = next(iter(arms))
        self.cpu = 0.0
        self.handles = [m.register_forward_hook(self._forward) for m in layers]

    def _forward(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        start = time.thread_time()
        self.kernels[self.arm][(id(module), "in")](args[0].detach())
        self.cpu += time.thread_time() - start
        key = (id(module), "out")
        output.register_hook(lambda dy: self._backward(key, dy))

    def _backward(self, key: tuple[int, str], dy: torch.Tensor) -> None:
        start = time.thread_time()
        self.kernels[self.arm][key](dy)
        self.cpu += time.thread_time() - start


def in_context(steps: int, fused: Callable | None) -> dict[str, float]:
    """Part 2: median hook CPU ms per training step of each arm."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    names = ["gaussian addmm", "sketch gather+mul+sum", "sign-strided mul+sum", "sign-strided, 512-row chunks"]
    if fused is not None:
        names.append("sign-strided, torch.compile (fused)")
    arms: dict[str, Callable[[int], Kernel]] = {name: lambda d, name=name: kernels(d, fused)[name] for name in names}
    arms[READ_FLOOR] = lambda d: lambda x: x.reshape(-1, d).sum(0)
    timer = HookTimer(model, arms)
    gen = torch.Generator().manual_seed(1)
    per_arm: dict[str, list[float]] = {arm: [] for arm in arms}
    step_ms: list[float] = []
    for step in range(steps + 1):
        for arm in arms if step % 2 == 0 else reversed(list(arms)):
            tokens = torch.randint(0, 512, (16, 128), generator=gen)
            timer.arm, timer.cpu = arm, 0.0
            start = time.thread_time()
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            if step:  # the first round warms up
                per_arm[arm].append(timer.cpu * 1e3)
                step_ms.append((time.thread_time() - start) * 1e3 - per_arm[arm][-1])
    for handle in timer.handles:
        handle.remove()
    medians = {arm: statistics.median(times) for arm, times in per_arm.items()}
    base = medians["gaussian addmm"]
    plain = statistics.median(step_ms)
    print(
        "2. in the hooks of real W-capture steps (16 layers, inputs + output gradients), one thread, CPU ms per "
        f"step (x Gaussian; % of the {plain:.0f} ms median CPU time of the step without the hooks' work)"
    )
    for arm, times in per_arm.items():
        print(
            f"  {arm}: min {min(times):.2f}, median {medians[arm]:.2f} ({medians[arm] / base:.2f}x, "
            f"{100 * medians[arm] / plain:.1f}%)"
        )
    return medians


def exact_gradients() -> list[torch.Tensor]:
    """Per-example ``[16, d_out, d_in + 1]`` gradients of the 16 captured layers for one batch (sum loss)."""
    model = make_model()
    layers = captured_layers(model)
    grads: list[torch.Tensor] = [torch.empty(0)] * len(layers)

    def forward(i: int, args: tuple, output: torch.Tensor) -> None:
        x = args[0].detach()
        x1 = torch.cat([x, torch.ones(*x.shape[:-1], 1)], -1)
        output.register_hook(lambda dy: grads.__setitem__(i, torch.einsum("bto,bti->boi", dy, x1).double()))

    handles = [m.register_forward_hook(lambda _, a, o, i=i: forward(i, a, o)) for i, m in enumerate(layers)]
    tokens = torch.randint(0, 512, (16, 128), generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=tokens).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").backward()
    for handle in handles:
        handle.remove()
    return grads


def ranks(v: torch.Tensor) -> torch.Tensor:
    """Ranks of ``v``'s entries (0 = smallest), as float64."""
    return torch.argsort(torch.argsort(v)).double()


def quality(seeds: int) -> None:
    """Part 3: inner-product distortion and Spearman correlation of each kind at 16 x 16 against exact."""
    grads = exact_gradients()
    kinds: dict[str, Callable[[int, int], torch.Tensor]] = {
        "gaussian": lambda s, d: projection_matrix(s, "quality", "in", K, d, dtype=torch.float64),
        "countsketch": lambda s, d: sketch_dense(*countsketch(s, d), dtype=torch.float64),
        "sign-strided": lambda s, d: sketch_dense(*countsketch(s, d, strided=True), dtype=torch.float64),
    }
    pairs = torch.triu_indices(16, 16, 1)
    print(f"3. quality: 16 layers x {seeds} seeds, 16 x 16 projection of one batch's 16 exact per-example gradients")
    for kind, draw in kinds.items():
        distortion, spearman = [], []
        for seed in range(seeds):
            for layer, g in enumerate(grads):
                base = 1_000 * seed + 2 * layer
                p_in, p_out = draw(base, g.shape[2]), draw(base + 1, g.shape[1])
                flat, proj = g.flatten(1), (p_out @ g @ p_in.T).flatten(1)
                norms = flat.norm(dim=1)
                exact_ip, proj_ip = (flat @ flat.T)[pairs[0], pairs[1]], (proj @ proj.T)[pairs[0], pairs[1]]
                scale = norms[pairs[0]] * norms[pairs[1]]
                distortion.append(float(((proj_ip - exact_ip).abs() / scale).mean()))
                spearman.append(float(torch.corrcoef(torch.stack([ranks(exact_ip), ranks(proj_ip)]))[0, 1]))
        print(
            f"  {kind}: mean |<Pg_i, Pg_j> - <g_i, g_j>| / (|g_i| |g_j|) {statistics.mean(distortion):.4f}, "
            f"Spearman of projected vs exact inner products {statistics.mean(spearman):.4f}"
        )


def layer_gemms(
    x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, p_in_t: torch.Tensor, p_out_t: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """The GEMMs of part 4 for one layer (``w`` is ``[d_in, d_out]``, as HF ``Conv1D`` stores it)."""
    bias = torch.zeros(w.shape[1])
    w_ext, bias_ext, w_t_ext = torch.cat([w, p_in_t], 1), torch.zeros(w.shape[1] + K), torch.cat([w.T, p_out_t], 1)
    return {
        "forward": lambda: torch.addmm(bias, x, w),
        "forward extended": lambda: torch.addmm(bias_ext, x, w_ext),
        "separate input projection": lambda: torch.mm(x, p_in_t),
        "input gradient": lambda: torch.mm(dy, w.T),
        "input gradient extended": lambda: torch.mm(dy, w_t_ext),
        "separate output-gradient projection": lambda: torch.mm(dy, p_out_t),
    }


def fused_into_layer(repeats: int) -> None:
    """Part 4: the projections as 16 extra columns of the layer's own GEMMs (forward ``x @ [W | P_in^T]``, input
    gradient ``dy @ [W^T | P_out^T]``): extra cost against a separate projection, and whether the layer's own
    columns stay bit-identical."""
    print(f"4. projection appended to the layer's GEMMs, {TOKENS} tokens, one thread, min CPU ms over {repeats} calls")
    for d_in, d_out in ((256, 768), (256, 256), (256, 1024), (1024, 256)):  # c_attn, attn.c_proj, c_fc, mlp.c_proj
        gen = torch.Generator().manual_seed(d_in * d_out)
        x, dy = torch.randn(TOKENS, d_in, generator=gen), torch.randn(TOKENS, d_out, generator=gen)
        w = torch.randn(d_in, d_out, generator=gen)
        gemms = layer_gemms(x, dy, w, torch.randn(d_in, K, generator=gen), torch.randn(d_out, K, generator=gen))
        same = torch.equal(gemms["forward"](), gemms["forward extended"]()[:, :d_out]) and torch.equal(
            gemms["input gradient"](), gemms["input gradient extended"]()[:, :d_in]
        )
        t = {name: min(cpu_ms(fn, repeats) for _ in range(3)) for name, fn in gemms.items()}
        print(
            f"  {d_in} -> {d_out}: forward {t['forward']:.3f}, extra columns "
            f"{t['forward extended'] - t['forward']:+.3f} vs separate {t['separate input projection']:.3f}; "
            f"input gradient {t['input gradient']:.3f}, extra "
            f"columns {t['input gradient extended'] - t['input gradient']:+.3f} vs separate "
            f"{t['separate output-gradient projection']:.3f}; layer's own columns bit-identical: {same}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="calls per isolated-kernel timing")
    parser.add_argument("--steps", type=int, default=10, help="measured training steps per arm in part 2")
    parser.add_argument("--seeds", type=int, default=5, help="projection seeds in part 3")
    parser.add_argument(
        "--fused", action="store_true", help="add a torch.compile arm (needs a C++ compiler; ~1 min to compile)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    fused = torch.compile(strided_sum, dynamic=False) if args.fused else None
    isolated(args.repeats, fused)
    medians = in_context(args.steps, fused)
    quality(args.seeds)
    fused_into_layer(args.repeats)
    eager = [t for arm, t in medians.items() if arm.startswith(("sketch", "sign")) and "compile" not in arm]
    speedup = medians["gaussian addmm"] / min(eager)
    verdict = "PASS" if speedup >= TARGET else "MISS"
    print(f"RESULT sketch_projection_speedup={speedup:.3f} target>={TARGET} {verdict}")


if __name__ == "__main__":
    main()
