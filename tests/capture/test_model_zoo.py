"""Model zoo: on every model people fine-tune (tiny, built in code), every captured row is the example's exact
gradient (projection=None, float32), checked against torch.func per-example gradients (see
tests/support/model_zoo.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from model_zoo import ZOO, capture, compare, per_example_grads, reference_check, reference_slot, silent_gaps

from ingest.capture import CaptureConfig, GradientCapture
from ingest.projection import projection_matrix

NAMES = list(ZOO)
_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


def references(name: str) -> dict[str, torch.Tensor]:
    if name not in _REFERENCES:
        _REFERENCES[name] = per_example_grads(ZOO[name]())
    return _REFERENCES[name]


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_reference_sums_to_the_batch_gradient(name):
    """The reference itself: its per-example gradients, weighted as the batch loss weighs the examples and
    summed over each parameter's uses, are the ordinary ``.grad`` of the batch loss."""
    case = ZOO[name]()
    assert reference_check(case, references(name)) == []


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_rows_equal_per_example_gradients(name):
    case = ZOO[name]()
    grads = references(name)
    got = capture(case)
    assert got.batches == 1
    assert got.rows.shape[0] == case.batch_size
    assert got.rows.dtype == torch.float32
    lines, failures = compare(case, got, grads)
    print(f"\n{name}: {case.note}\n" + "\n".join(lines) + f"\n  coverage: {got.coverage}")
    if name.startswith("mixtral"):
        # COVERAGE (issue 35): the 3-D expert weights (`mlp.experts.gate_up_proj` / `down_proj`) must be either
        # exact slots (checked above) or a recorded, loud non-capture: assert it here once the coverage API is
        # settled, e.g. that every expert parameter is captured or listed in `got.coverage` with a reason and
        # that a CoverageWarning was raised.
        pass
    assert not failures, f"{name}: " + "; ".join(failures)


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_every_trainable_parameter_is_captured_or_recorded(name):
    """Never blind without a word: a trainable parameter with a gradient is in a slot, or the capture's coverage
    records it as not captured (with why)."""
    case = ZOO[name]()
    got = capture(case)
    gaps = silent_gaps(case, got, references(name))
    print(f"\n{name}: coverage: {got.coverage}")
    record = "" if got.uncaptured is not None else " (the capture keeps no coverage record)"
    assert gaps == [] and got.uncaptured is not None, f"{name}: not captured and not recorded{record}: {gaps}"


#: Models whose every trainable parameter has an exact slot (no gap recorded, whatever the coverage policy).
WHOLE = [
    "seq2seq",
    "cross-attention",
    "cross-attention-kdim",
    "cross-attention-bias-kv",
    "sequence-first-positions",
    "mixer",
    "t5-sdpa",
    "conv-transpose",
    "bilinear",
    "tied-autoencoder",
    "casts-and-tables",
    "prompt-prefix",
    "pooled-token",
    "recurrent",
    "recurrent-cells",
    "recurrent-packed",
    "recurrent-decoder",
    "factorization",
    "tied-output",
    "slopes-addmm",
    "embedding-bag",
    "packed-bags",
    "attention-pooling",
    "relative-bias-t5",
    "latent-queries",
    "relative-bias-t4",
    "packed-bags-last",
    "weights-in-products",
    "bare-convolutions",
    "swin",
    "wav2vec2",
    "window-attention",
    "longformer",
    "detr",
    "routed-tokens",
]


@pytest.mark.parametrize("name", WHOLE, ids=WHOLE)
def test_attention_variants_are_captured_whole(name):
    """Cross-attention splits the packed in-projection by rows, ``kdim``/``vdim`` chunk the packed bias over three
    weights, ``bias_k``/``bias_v`` are concatenated sequence-first, bare parameters and a tied embedding meet the
    batch in matrix products: each is a use with an exact rule, not a gap (norms aside, which the default
    ``layer_types`` leave out by decision)."""
    got = capture(ZOO[name]())
    assert got.uncaptured is not None
    gaps = {k: v for k, v in got.uncaptured.items() if "layer_types" not in v}
    assert gaps == {} and not any("not captured" in w for w in got.warnings), got.coverage


@pytest.mark.parametrize("name", WHOLE, ids=WHOLE)
def test_projected_rows_of_the_new_rules_equal_the_projected_reference(name):
    """The same models under the default factorized projection (row blocks widened before projecting, products'
    rows projected on both sides): each slot's block is ``P_out G P_in^T`` of the example's exact gradient."""
    case = ZOO[name]()
    grads = references(name)
    out: list = []
    config = CaptureConfig.from_options(k_in=3, k_out=3, seed=5, loss_reduction=case.loss_reduction)
    with GradientCapture(case.model, out.append, config) as cap:
        case.loss(case.model, case.batch).backward()
    case.model.zero_grad(set_to_none=True)
    rows = out[0].grads.double()
    for slot in cap.spec.layers:
        if slot.kind == "norm":
            continue
        g = reference_slot(slot, grads).double()
        p_in = projection_matrix(5, slot.name, "in", slot.k_in, slot.d_in_eff, dtype=torch.float64)
        p_out = projection_matrix(5, slot.name, "out", slot.k_out, slot.d_out, dtype=torch.float64)
        expected = (p_out @ g @ p_in.T).flatten(1)
        got = rows[:, slot.offset : slot.offset + slot.size]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item(), msg=slot.name)
