"""A zoo of tiny models (built in code, no downloads) and their exact per-example reference gradients.

Each builder returns a :class:`ZooCase`: a model in training mode with every dropout at 0, one batch of ``B``
examples (every tensor batch-first), the batch's training loss and the ``loss_reduction`` that capture undoes.

References never go through capture: :func:`per_example_grads` runs ``torch.func.grad`` of each example's own
loss (the example alone, through ``functional_call``; an ordinary backward of it where ``extra["reference"]`` is
``"autograd"``), with one entry per *use site* of a parameter: a key per
module attribute (``"lm_head.weight"`` and ``"transformer.wte.weight"`` are separate keys of one tied parameter),
so a tied parameter's gradient is the sum of its keys'. :func:`batch_grads` is the ordinary ``.grad`` of the
batch loss; ``sum_i weights[i] * per_example[key][i]`` summed over a parameter's keys must equal it (the check
that a reference is right before it judges capture).

:func:`reference_slot` builds a capture slot's row matrix from the slot's kind and name alone (row layout of
``docs/capture.md``): ``linear`` ``[W | b]``, ``conv1d`` ``[W^T | b]``, ``embedding`` ``W^T``, ``conv``
``[W.reshape(C_out, -1) | b]``, ``attention`` (``<mha>.in_proj``) ``[in_proj_weight | in_proj_bias]``,
``parameter`` ``grad.reshape(-1, shape[-1])`` (a stacked 3-D parameter's slice ``<name>.<e>``: ``grad[e]``),
``recurrent`` (``<rnn>.weight_ih_l0``) ``[weight_ih_l0 | bias_ih_l0]``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ingest.capture import CaptureConfig, GradientCapture
from ingest.projection import LAYER_KINDS

Batch = dict[str, torch.Tensor]
#: ``loss(forward, batch) -> scalar``: the training loss of ``batch`` where ``forward(**model_kwargs)`` runs the
#: model (the model itself, or a functional call of it with other parameters).
LossFn = Callable[[Callable[..., Any], Batch], torch.Tensor]


@dataclass
class ZooCase:
    """One model of the zoo with one batch, and how its batch loss combines the examples' own losses."""

    name: str
    model: nn.Module
    batch: Batch
    loss: LossFn
    loss_reduction: str = "mean"
    #: ``[B]``: the batch loss is ``sum_i weights[i] * loss_i`` (``loss_i`` the example's own loss).
    weights: torch.Tensor | None = None
    note: str = ""
    #: extra capture options (``include=`` ...), beside ``projection=None`` and the loss reduction
    options: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.batch.values())).shape[0]

    def example(self, i: int) -> Batch:
        return {k: v[i : i + 1] for k, v in self.batch.items()}

    def example_weights(self) -> torch.Tensor:
        if self.weights is not None:
            return self.weights
        return torch.full((self.batch_size,), 1.0 / self.batch_size)


# ---------------------------------------------------------------------------------------------- references


def use_sites(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every ``<module>.<attr>`` that holds a parameter, one key per module (``named_modules`` order, modules
    reached by two names counted once), so parameters tied across modules get one key per module."""
    out = {}
    for mname, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is not None:
                out[f"{mname}.{pname}" if mname else pname] = param
    return out


def per_example_grads(case: ZooCase) -> dict[str, torch.Tensor]:
    """``{key: [B, *shape]}``: torch.func gradient of each example's own loss at each use site (untied)."""
    sites = use_sites(case.model)
    params = {k: p.detach() for k, p in sites.items()}

    def example_loss(p: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return functional_call(case.model, p, args, kwargs, tie_weights=False, strict=False)

        return case.loss(forward, batch)

    if case.extra.get("reference") == "autograd":  # ops torch.func cannot trace (a packed sequence's lengths)
        sites = {k: p for k, p in sites.items() if p.requires_grad}
        per = []
        for i in range(case.batch_size):
            found = torch.autograd.grad(case.loss(case.model, case.example(i)), list(sites.values()))
            per.append(dict(zip(sites, found)))
        return {k: torch.stack([g[k] for g in per]) for k in sites}
    per = [grad(example_loss)(params, case.example(i)) for i in range(case.batch_size)]
    return {k: torch.stack([g[k] for g in per]) for k in params}


def batch_grads(case: ZooCase) -> dict[int, torch.Tensor]:
    """``{id(param): param.grad}`` of one ordinary backward of the batch loss (no capture)."""
    case.model.zero_grad(set_to_none=True)
    case.loss(case.model, case.batch).backward()
    out = {id(p): p.grad.detach().clone() for p in case.model.parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return out


def reference_check(case: ZooCase, grads: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    """``(parameter, rel. error)`` of every parameter whose weighted sum of per-example gradients (over all its
    use sites) differs from the batch gradient by more than 1e-5: empty when the reference is right."""
    full = batch_grads(case)
    w = case.example_weights()
    summed: dict[int, torch.Tensor] = {}
    names: dict[int, str] = {}
    for key, param in use_sites(case.model).items():
        if not param.requires_grad:
            continue
        g = torch.einsum("b,b...->...", w, grads[key])
        summed[id(param)] = summed.get(id(param), 0) + g
        names.setdefault(id(param), key)
    # a gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores a shift of every
    # score) is judged against the model's largest gradient instead of its own rounding noise
    floor = 1e-3 * max(float(g.norm()) for g in full.values())
    bad = []
    for pid, g in summed.items():
        ref = full.get(pid, torch.zeros_like(g))
        err = float((g - ref).norm()) / max(float(ref.norm()), floor)
        if err > 1e-5:
            bad.append((names[pid], err))
    return bad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.norm()
    if den == 0:
        return 0.0 if a.norm() == 0 else math.inf
    return float((a - b).norm() / den)


def _stacked(name: str, grads: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    base, _, index = name.rpartition(".")
    if base in grads and index.isdigit() and grads[base].dim() == 4:
        return base, int(index)
    return None


def slot_keys(slot: Any, grads: dict[str, torch.Tensor]) -> list[str]:
    """The use-site keys (parameters) a slot holds, from its kind and name."""
    if slot.kind == "attention":
        base = slot.name.removesuffix(".in_proj") if slot.name != "in_proj" else ""
        prefix = f"{base}." if base else ""
        keys = [f"{prefix}in_proj_weight"] + ([f"{prefix}in_proj_bias"] if slot.has_bias else [])
    elif slot.kind in ("parameter", "norm"):
        stacked = _stacked(slot.name, grads)
        keys = [stacked[0] if stacked else slot.name]
    elif slot.kind == "recurrent":  # <rnn>.weight_ih_l0 with <rnn>.bias_ih_l0
        prefix, _, weight = slot.name.rpartition(".")
        bias = f"{prefix}.{weight.replace('weight_', 'bias_', 1)}" if prefix else weight.replace("weight_", "bias_", 1)
        keys = [slot.name] + ([bias] if slot.has_bias else [])
    else:
        keys = [f"{slot.name}.weight"] + ([f"{slot.name}.bias"] if slot.has_bias else [])
    missing = [k for k in keys if k not in grads]
    if missing:
        raise KeyError(f"slot {slot.name!r} ({slot.kind}): no parameter {missing} in the model")
    return keys


def reference_slot(slot: Any, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``[B, d_out, d_in(+1)]`` matrix a slot of kind ``slot.kind`` named ``slot.name`` must hold."""
    keys = slot_keys(slot, grads)
    g = grads[keys[0]]
    b = g.shape[0]
    if slot.kind in ("parameter", "norm"):
        stacked = _stacked(slot.name, grads)
        if stacked is not None:
            return g[:, stacked[1]]
        return g.reshape(b, slot.d_out, slot.d_in)  # row-major: [numel / last, last], or [C_in, rest] (transposed conv)
    if slot.kind in ("conv1d", "embedding"):
        w = g.transpose(1, 2)
    elif slot.kind == "conv":
        w = g.reshape(b, g.shape[1], -1)
    else:  # linear, attention
        w = g
    if len(keys) == 2:
        w = torch.cat([w, grads[keys[1]].unsqueeze(-1)], dim=-1)
    return w


def slot_to_params(slot: Any, matrix: torch.Tensor, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A slot's ``[B, d_out, d_in(+1)]`` matrix back in its parameters' own layout (``{key: [B, *shape]}``, a
    stacked slice as the full stacked parameter with zeros elsewhere), to sum the slots of a tied parameter."""
    keys = slot_keys(slot, grads)
    b = matrix.shape[0]
    if slot.kind == "parameter":
        stacked = _stacked(slot.name, grads)
        full = torch.zeros_like(grads[keys[0]])
        if stacked is not None:
            full[:, stacked[1]] = matrix
        else:
            full = matrix.reshape(full.shape)
        return {keys[0]: full}
    shape = grads[keys[0]].shape
    w = matrix[..., : slot.d_in]
    if slot.kind in ("conv1d", "embedding"):
        w = w.transpose(1, 2)
    out = {keys[0]: w.reshape(shape)}
    if len(keys) == 2:
        out[keys[1]] = matrix[..., slot.d_in]
    assert out[keys[0]].shape[0] == b
    return out


# ---------------------------------------------------------------------------------------------- capture


@dataclass
class Captured:
    spec: Any
    rows: torch.Tensor  # [B, dim] float32
    batches: int
    coverage: str
    warnings: list[str]
    #: the capture's own record of the trainable parameters it does not capture: ``{name: reason}`` (None: the
    #: capture keeps no such record)
    uncaptured: dict[str, str] | None


def capture(case: ZooCase) -> Captured:
    """One backward of ``case``'s batch loss under an exact (projection=None) capture."""
    out: list = []
    case.model.zero_grad(set_to_none=True)
    config = CaptureConfig.from_options(projection=None, loss_reduction=case.loss_reduction, **case.options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(case.model, out.append, config) as cap:
            case.loss(case.model, case.batch).backward()
    case.model.zero_grad(set_to_none=True)
    coverage = getattr(cap, "coverage", None)
    summary = coverage.summary() if coverage is not None and hasattr(coverage, "summary") else "(no coverage)"
    rows = out[0].grads if out else torch.zeros(0, 0)
    records = getattr(coverage, "parameters", None)
    uncaptured = None if records is None else {p.name: str(p.reason) for p in records if not p.captured}
    return Captured(cap.spec, rows, len(out), summary, [str(w.message) for w in caught], uncaptured)


def silent_gaps(case: ZooCase, got: Captured, grads: dict[str, torch.Tensor]) -> list[str]:
    """Trainable parameters with a gradient that no slot holds and that the capture does not record as left
    out (with a reason): the capture is blind to them without a word."""
    held = {id(use_sites(case.model)[k]) for slot in got.spec.layers for k in slot_keys(slot, grads)}
    recorded = got.uncaptured or {}
    out = []
    for name, param in case.model.named_parameters():
        if not param.requires_grad or id(param) in held or name in recorded:
            continue
        keys = [k for k, p in use_sites(case.model).items() if p is param]
        if any(grads[k].abs().sum() > 0 for k in keys):
            out.append(name)
    return out


def slot_matrix(spec: Any, rows: torch.Tensor, slot: Any) -> torch.Tensor:
    return rows[:, slot.offset : slot.offset + slot.size].reshape(-1, slot.k_out, slot.k_in)


def compare(case: ZooCase, got: Captured, grads: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """``(report lines, failures)``: every slot against its reference; slots that share a parameter (tied
    weights) are also compared as their sum in the parameter's layout (the contract for tied weights)."""
    sites = use_sites(case.model)
    lines, failures = [], []
    by_param: dict[int, list[Any]] = {}  # parameter -> its slots
    by_part: dict[tuple[int, int | None], int] = {}  # (parameter, stacked slice) -> slots holding it
    for slot in got.spec.layers:
        pid = id(sites[slot_keys(slot, grads)[0]])
        by_param.setdefault(pid, []).append(slot)
        part = (pid, (_stacked(slot.name, grads) or (None, None))[1])
        by_part[part] = by_part.get(part, 0) + 1
    tied = {pid for (pid, _), n in by_part.items() if n > 1}
    tied |= {id(p) for p in sites.values() if sum(q is p for q in sites.values()) > 1}
    for slot in got.spec.layers:
        keys = slot_keys(slot, grads)
        mat, ref = slot_matrix(got.spec, got.rows, slot), reference_slot(slot, grads)
        err = rel_err(mat, ref) if mat.shape == ref.shape else math.inf
        zero = bool(ref.norm() > 0 and mat.norm() == 0)
        is_tied = id(sites[keys[0]]) in tied
        status = "ok" if err < 1e-5 and not zero else ("tied" if is_tied else "FAIL")
        recorded = [k for k in keys if k in (got.uncaptured or {})]
        loud = f" (recorded as not captured: {got.uncaptured[recorded[0]]})" if recorded else ""
        lines.append(
            f"  {slot.kind:9s} {slot.name:48s} {tuple(mat.shape[1:])!s:14s} rel.err {err:.2e}"
            + (" ALL ZERO" if zero else "")
            + (" (tied: judged as a sum below)" if is_tied and status != "ok" else "")
            + (loud if status != "ok" else "")
        )
        if status == "FAIL":
            failures.append(
                f"{slot.kind} slot {slot.name}: rel. error {err:.3g}"
                + (" (rows all zero)" if zero else "")
                + (" [loud: coverage records it]" if recorded else " [silent]")
            )
    for pid in tied:
        slots = by_param.get(pid, [])
        if not slots:
            continue
        # the uses of the parameter through the slots' own modules (a tied alias that the selection leaves out,
        # e.g. an lm_head excluded by include=, is not part of any slot)
        keys = list(dict.fromkeys(k for slot in slots for k in slot_keys(slot, grads) if id(sites[k]) == pid))
        ref = sum(grads[k] for k in keys)
        got_sum = torch.zeros_like(ref)
        for slot in slots:
            parts = slot_to_params(slot, slot_matrix(got.spec, got.rows, slot), grads)
            got_sum = got_sum + parts[slot_keys(slot, grads)[0]]
        err = rel_err(got_sum, ref)
        names = "+".join(s.name for s in slots)
        lines.append(f"  tied sum  {names:48s} over uses {keys}: rel.err {err:.2e}")
        if err >= 1e-5:
            failures.append(f"tied parameter {keys[0]} (slots {names}): sum rel. error {err:.3g}")
    return lines, failures


# ---------------------------------------------------------------------------------------------- builders


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return forward(**batch).loss


def _causal_weights(labels: torch.Tensor) -> torch.Tensor:
    """HF causal-LM token mean: example i's share of the batch loss is its shifted label count / all of them."""
    counts = (labels[:, 1:] != -100).sum(1).float()
    return counts / counts.sum()


def _causal_case(name: str, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, note="") -> ZooCase:
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "labels": labels}
    if mask is not None:
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return ZooCase(name, model.train(), batch, _hf_loss, "token_mean", _causal_weights(labels), note)


def _right_padded(lengths: list[int], seq: int, vocab: int, seed: int, low: int = 0) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(low, vocab, (len(lengths), seq), generator=_gen(seed))
    mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def gpt2() -> ZooCase:
    from tiny_models import tiny_gpt2

    ids, mask = _right_padded([8, 5, 8, 3], 8, 64, seed=1)
    return _causal_case("gpt2", tiny_gpt2(attention="eager"), ids, mask, "Conv1D, tied wte/lm_head, padding")


def llama() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    ids = torch.randint(0, 64, (3, 7), generator=_gen(2))
    return _causal_case("llama", transformers.LlamaForCausalLM(config), ids, note="GQA, RoPE, untied head")


def gemma() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.GemmaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    ids = torch.randint(3, 64, (3, 6), generator=_gen(3))
    note = "GemmaTextScaledWordEmbedding (lookup x sqrt(hidden)), tied lm_head"
    return _causal_case("gemma", transformers.GemmaForCausalLM(config), ids, note=note)


def opt() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=64,
        hidden_size=32,
        ffn_dim=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        attn_implementation="eager",
    )
    ids, mask = _right_padded([7, 4, 6], 7, 64, seed=4, low=3)
    # left padding (as OPT is used for generation): an example's positions start where its mask does, not at 0
    ids, mask = ids.flip(1), mask.flip(1)
    note = "OPTLearnedPositionalEmbedding(attention_mask): positions cumsum(mask)-1 + offset 2, left padding"
    return _causal_case("opt", transformers.OPTForCausalLM(config), ids, mask, note)


def opt_positions() -> ZooCase:
    # the position table alone (include=), so it is judged even where another layer of OPT is refused
    case = opt()
    case.name, case.options = "opt-positions", {"include": r"embed_(positions|tokens)$"}
    return case


def _t5(name: str, batch: int, enc: int, dec: int, attention: str = "eager") -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="relu",
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        attn_implementation=attention,
    )
    model = transformers.T5ForConditionalGeneration(config).train()
    ids = torch.randint(2, 64, (batch, enc), generator=_gen(5))
    labels = torch.randint(2, 64, (batch, dec), generator=_gen(6))
    note = f"relative_attention_bias looked up with [T, T] indices, B={batch} T_enc={enc} T_dec={dec}, {attention}"
    # T5's loss is the mean over all (unshifted) label tokens; with equal lengths that is the mean of the examples'.
    return ZooCase(name, model, {"input_ids": ids, "labels": labels}, _hf_loss, "mean", note=note)


def t5() -> ZooCase:
    return _t5("t5", batch=3, enc=6, dec=5)


def t5_square() -> ZooCase:
    return _t5("t5-square", batch=4, enc=4, dec=4)


def t5_sdpa() -> ZooCase:
    return _t5("t5-sdpa", batch=3, enc=6, dec=5, attention="sdpa")


def _whisper(name: str, low: int, dec: int) -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=64,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=8,
        max_target_positions=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        attn_implementation="eager",
    )
    model = transformers.WhisperForConditionalGeneration(config).train()
    features = torch.randn(3, 8, 16, generator=_gen(7))  # [B, mel bins, 2 * max_source_positions]
    dec_ids = torch.randint(low, 64 if low else 8, (3, dec), generator=_gen(8))
    labels = torch.randint(3, 64, (3, dec), generator=_gen(9))
    batch = {"input_features": features, "decoder_input_ids": dec_ids, "labels": labels}
    note = f"conv encoder, decoder positions weight[position_ids], decoder ids in [{low}, {64 if low else 8})"
    return ZooCase(name, model, batch, _hf_loss, "mean", note=note)


def whisper() -> ZooCase:
    # token ids below max_target_positions (8) but not equal to their positions: a lookup by id is silently wrong
    return _whisper("whisper", low=0, dec=6)


def whisper_large_ids() -> ZooCase:
    # token ids >= max_target_positions: a lookup of the position table by token id is out of range
    return _whisper("whisper-large-ids", low=8, dec=8)


def vit() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        attn_implementation="eager",
    )
    model = transformers.ViTForImageClassification(config).train()
    with torch.no_grad():  # ViT initialises cls_token / position_embeddings small: make them matter
        model.vit.embeddings.cls_token.normal_()
        model.vit.embeddings.position_embeddings.normal_()
    pixels = torch.randn(4, 3, 8, 8, generator=_gen(10))
    labels = torch.randint(0, 3, (4,), generator=_gen(11))
    note = "Conv2d patch embedding, bare cls_token and position_embeddings"
    return ZooCase("vit", model, {"pixel_values": pixels, "labels": labels}, _hf_loss, "mean", note=note)


def swin() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.SwinConfig(
        image_size=16,
        patch_size=2,
        num_channels=3,
        embed_dim=8,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=2,
        mlp_ratio=2.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        num_labels=3,
    )
    model = transformers.SwinForImageClassification(config).train()
    with torch.no_grad():  # the relative position tables start near zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                param.normal_()
    pixels = torch.randn(4, 3, 16, 16, generator=_gen(74))
    labels = torch.randint(0, 3, (4,), generator=_gen(75))
    note = "windows [B x windows, N, C], shifted with a mask, relative position tables, patch merging"
    return ZooCase("swin", model, {"pixel_values": pixels, "labels": labels}, _hf_loss, "mean", note=note)


class SpeechClassifier(nn.Module):
    """A tiny ``Wav2Vec2Model`` (conv feature encoder, weight-normed positional convolution, SpecAugment's
    ``masked_spec_embed`` written into the masked time steps) with a mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.Wav2Vec2Config(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=(8, 8),
            conv_stride=(4, 2),
            conv_kernel=(8, 3),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            feat_proj_dropout=0.0,
            layerdrop=0.0,
            apply_spec_augment=True,
        )
        self.encoder = transformers.Wav2Vec2Model(config)
        self.head = nn.Linear(16, 3)

    def forward(self, audio: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(audio, mask_time_indices=masked).last_hidden_state.mean(1))


def _speech_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(batch["audio"], batch["masked"]), batch["y"])


def wav2vec2() -> ZooCase:
    torch.manual_seed(0)
    model = SpeechClassifier().train()
    with torch.no_grad():
        model.encoder.masked_spec_embed.normal_()
    audio = torch.randn(4, 96, generator=_gen(76))
    masked = torch.zeros(4, 11, dtype=torch.bool)
    masked[0, 2:5], masked[2, 0:2], masked[3, 7:11] = True, True, True  # the second example unmasked
    batch = {"audio": audio, "masked": masked, "y": torch.randint(0, 3, (4,), generator=_gen(77))}
    note = "conv feature encoder, weight_norm positional conv, masked_spec_embed at masked steps"
    return ZooCase("wav2vec2", model, batch, _speech_loss, note=note)


class WindowAttention(nn.Module):
    """SAM/ViTDet's windowed attention: the image padded and partitioned into windows folded into the batch
    (``[B x windows, ws, ws, C]``), heads folded in too (``qkv.reshape(3, B' x H, N, d)``), decomposed relative
    positions read by ``einsum`` from bare tables; a LayerNorm, grouped convolution, GroupNorm and a bare
    ``F.linear`` on the windows; then the windows put back and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.norm = nn.Linear(8, 24), nn.Linear(8, 8), nn.LayerNorm(8)
        self.rel_h, self.rel_w = nn.Parameter(0.3 * torch.randn(5, 4)), nn.Parameter(0.3 * torch.randn(5, 4))
        self.conv, self.group_norm = nn.Conv1d(8, 8, 3, padding=1, groups=2), nn.GroupNorm(2, 8)
        self.mix, self.mix_bias = nn.Parameter(0.3 * torch.randn(8, 8)), nn.Parameter(0.1 * torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, size, ws, heads = x.shape[0], x.shape[1], 3, 2
        h = F.pad(x, (0, 0, 0, 1, 0, 1))  # 5 x 5 -> 6 x 6: four 3 x 3 windows
        w = h.view(b, 2, ws, 2, ws, 8).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, 8)  # [B x 4, 3, 3, 8]
        w = self.norm(w)
        n = w.shape[0]
        q, k, v = self.qkv(w).reshape(n, ws * ws, 3, heads, 4).permute(2, 0, 3, 1, 4).reshape(3, n * heads, ws * ws, 4)
        scores = q @ k.transpose(-2, -1) / 2
        offsets = torch.arange(ws)[:, None] - torch.arange(ws)[None, :] + ws - 1
        r_q = q.reshape(n * heads, ws, ws, 4)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, self.rel_h[offsets])
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, self.rel_w[offsets])
        scores = scores.view(n * heads, ws, ws, ws, ws) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
        out = scores.view(n * heads, ws * ws, ws * ws).softmax(-1) @ v
        out = self.proj(out.view(n, heads, ws * ws, 4).transpose(1, 2).reshape(n, ws * ws, 8))
        out = self.group_norm(self.conv(out.transpose(1, 2))).transpose(1, 2)
        out = torch.tanh(F.linear(out, self.mix, self.mix_bias))
        h = out.view(b, 2, 2, ws, ws, 8).permute(0, 1, 3, 2, 4, 5).reshape(b, 6, 6, 8)[:, :size, :size]
        return self.head(h.mean((1, 2)))


def window_attention() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 5, 5, 8, generator=_gen(78)), "y": torch.randint(0, 3, (4,), generator=_gen(79))}
    note = "windows and heads folded into the batch, decomposed relative positions by einsum"
    return ZooCase(
        "window-attention",
        WindowAttention().train(),
        batch,
        _sequence_loss,
        note=note,
        options={"layer_types": LAYER_KINDS},
    )


def _mixtral(name: str, experts: str, intermediate: int = 24) -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        router_jitter_noise=0.0,
        output_router_logits=False,
        attn_implementation="eager",
        experts_implementation=experts,
    )
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 64, (3, 6), generator=_gen(12))
    impl = model.config._experts_implementation
    shape = tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape[1:])
    note = f"3-D experts {shape} (experts_implementation={impl!r}), bare router weight"
    case = _causal_case(name, model, ids, note=note)
    case.extra["experts_implementation"] = impl
    return case


def mixtral_square() -> ZooCase:
    """``gate_up_proj`` slices of 2I x H = 16 x 16 (OLMoE's 2,048 = 2 x 1,024): square, so transposed or not is
    told by strides, not shapes."""
    return _mixtral("mixtral-square", "grouped_mm", intermediate=8)


def mixtral() -> ZooCase:
    return _mixtral("mixtral", None)  # transformers' default for a model built in code


def mixtral_eager() -> ZooCase:
    return _mixtral("mixtral-eager", "eager")


def mixtral_batched() -> ZooCase:
    return _mixtral("mixtral-batched-mm", "batched_mm")


def bert() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=16,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        attn_implementation="eager",
    )
    model = transformers.BertForSequenceClassification(config).train()
    ids, mask = _right_padded([7, 4, 6, 7], 7, 64, seed=13, low=3)
    types = (torch.arange(7)[None] >= 3).long().expand(4, 7) * mask
    labels = torch.randint(0, 3, (4,), generator=_gen(14))
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}
    note = "position_ids [1, T] from a buffer, token types, pooler, padding"
    return ZooCase("bert", model, batch, _hf_loss, "mean", note=note)


def longformer() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.LongformerConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        attention_window=[4],
        max_position_embeddings=40,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        sep_token_id=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    model = transformers.LongformerForSequenceClassification(config).train()
    ids, mask = _right_padded([8, 6, 4, 7], 8, 40, seed=15, low=3)
    labels = torch.randint(0, 3, (4,), generator=_gen(16))
    note = "sliding-window chunks by as_strided over heads folded into the batch, global attention on the first token"
    return ZooCase(
        "longformer", model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, _hf_loss, note=note
    )


def _detection_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    out = forward(pixel_values=batch["pixel_values"])
    classes = F.cross_entropy(out.logits.transpose(1, 2), batch["classes"], reduction="none").mean(1)
    return (classes + out.pred_boxes.pow(2).mean((1, 2))).mean()


def detr() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        out_features=["stage2"],
    )
    config = transformers.DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_queries=4,
        num_labels=3,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        auxiliary_loss=False,
    )
    model = transformers.DetrForObjectDetection(config).train()
    pixels = torch.randn(4, 3, 32, 32, generator=_gen(17))
    classes = torch.randint(0, 4, (4, 4), generator=_gen(18))
    note = "object queries repeated over the batch meet it in SDPA, frozen batch norm backbone (no matching loss)"
    return ZooCase("detr", model, {"pixel_values": pixels, "classes": classes}, _detection_loss, note=note)


class SmallCNN(nn.Module):
    """8x8 images: Conv2d -> ReLU -> grouped strided Conv2d -> ReLU -> Linear head (no BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv2(F.relu(self.conv1(x)))).flatten(1))


class SmallConv1d(nn.Module):
    """Sequences of 3 channels: Conv1d -> ReLU -> dilated grouped Conv1d (no bias) -> mean over time -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv1d(6, 6, 3, dilation=2, groups=3, bias=False)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv2(F.relu(self.conv1(x)))).mean(-1))


class SmallConv3d(nn.Module):
    """Volumes: Conv3d (stride 2) -> ReLU -> Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1))
        self.head = nn.Linear(4 * 3 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).flatten(1))


def _classify(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(x=batch["x"]), batch["y"])


def cnn() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 1, 8, 8, generator=_gen(15)), "y": torch.randint(0, 10, (4,), generator=_gen(16))}
    return ZooCase("cnn", SmallCNN().train(), batch, _classify, note="Conv2d (groups=2, stride 2) + Linear")


def cnn1d() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 3, 10, generator=_gen(17)), "y": torch.randint(0, 4, (4,), generator=_gen(18))}
    return ZooCase("cnn1d", SmallConv1d().train(), batch, _classify, note="Conv1d (dilation 2, groups 3, no bias)")


def cnn3d() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(3, 2, 4, 6, 6, generator=_gen(19)), "y": torch.randint(0, 3, (3,), generator=_gen(20))}
    return ZooCase("cnn3d", SmallConv3d().train(), batch, _classify, note="Conv3d")


class EncoderClassifier(nn.Module):
    """Token ids ``[B, T]`` -> Embedding -> nn.TransformerEncoder -> mean over tokens -> Linear. With
    ``batch_first=False`` the encoder runs sequence-first (the model transposes), the input stays batch-first."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.batch_first:
            return self.head(self.encoder(h).mean(1))
        return self.head(self.encoder(h.transpose(0, 1)).mean(0))


def _encoder(name: str, batch_first: bool) -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randint(0, 32, (3, 5), generator=_gen(21)), "y": torch.randint(0, 3, (3,), generator=_gen(22))}
    note = f"nn.MultiheadAttention packed in_proj + out_proj (never called), batch_first={batch_first}"
    return ZooCase(name, EncoderClassifier(batch_first).train(), batch, _classify, note=note)


def transformer_encoder() -> ZooCase:
    return _encoder("transformer-encoder", batch_first=True)


def transformer_encoder_seq_first() -> ZooCase:
    return _encoder("transformer-encoder-seq-first", batch_first=False)


class Seq2Seq(nn.Module):
    """Source and target ids ``[B, S]``, ``[B, T]`` -> embeddings -> ``nn.Transformer`` (encoder-decoder, causal
    target mask) -> Linear over the vocabulary. The decoder's cross-attention projects the target with the first
    rows of its packed ``in_proj_weight`` and the memory with the rest (``w.split``): one parameter, two uses."""

    def __init__(self) -> None:
        super().__init__()
        self.src = nn.Embedding(32, 16)
        self.tgt = nn.Embedding(32, 16)
        self.transformer = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 32)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.transformer(self.src(src), self.tgt(tgt), tgt_mask=mask, tgt_is_causal=True))


def _seq2seq_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    logits = forward(src=batch["src"], tgt=batch["tgt"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def seq2seq() -> ZooCase:
    torch.manual_seed(0)
    batch = {
        "src": torch.randint(0, 32, (3, 6), generator=_gen(23)),
        "tgt": torch.randint(0, 32, (3, 4), generator=_gen(24)),
        "y": torch.randint(0, 32, (3, 4), generator=_gen(25)),
    }
    note = "nn.Transformer: cross-attention splits the packed in_proj_weight (q rows on the target, k/v on memory)"
    return ZooCase("seq2seq", Seq2Seq().train(), batch, _seq2seq_loss, note=note)


class CrossAttention(nn.Module):
    """Queries from a sequence, keys and values from two others: ``nn.MultiheadAttention`` with ``key is not
    value`` chunks its packed weight and bias in three (``w.chunk(3)``); with ``kdim``/``vdim`` it keeps three
    weights and chunks the packed bias."""

    def __init__(self, kdim: int | None, bias_kv: bool = False) -> None:
        super().__init__()
        self.kdim = kdim or 8
        self.attention = nn.MultiheadAttention(
            8, 2, batch_first=True, kdim=kdim, vdim=kdim, add_bias_kv=bias_kv, add_zero_attn=bias_kv
        )
        self.head = nn.Linear(8, 3)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = self.attention(q, k, v, need_weights=False)
        return self.head(out.mean(1))


def _cross_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(q=batch["q"], k=batch["k"], v=batch["v"]), batch["y"])


def _cross(name: str, kdim: int | None, bias_kv: bool = False) -> ZooCase:
    torch.manual_seed(0)
    model = CrossAttention(kdim, bias_kv).train()
    batch = {
        "q": torch.randn(4, 3, 8, generator=_gen(26)),
        "k": torch.randn(4, 5, model.kdim, generator=_gen(27)),
        "v": torch.randn(4, 5, model.kdim, generator=_gen(28)),
        "y": torch.randint(0, 3, (4,), generator=_gen(29)),
    }
    note = "nn.MultiheadAttention(q, k, v), three inputs: " + ("kdim=vdim=6, separate weights" if kdim else "packed")
    return ZooCase(name, model, batch, _cross_loss, note=note + (", add_bias_kv, add_zero_attn" if bias_kv else ""))


def cross_attention() -> ZooCase:
    return _cross("cross-attention", None)


def cross_attention_kdim() -> ZooCase:
    return _cross("cross-attention-kdim", 6)


def cross_attention_bias_kv() -> ZooCase:
    return _cross("cross-attention-bias-kv", 6, bias_kv=True)


class SequenceFirstPositions(nn.Module):
    """Token ids -> Embedding -> sequence-first ``[T, B, E]`` + a position table ``[T, E]`` broadcast over the
    examples' dim 1 (with ``T == B`` a split along dim 0 would hand each position's share to an example)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.positions = nn.Parameter(torch.randn(4, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x).transpose(0, 1) + self.positions[:, None, :])
        return self.head(h.mean(0))


def sequence_first_positions() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randint(0, 10, (4, 4), generator=_gen(30)), "y": torch.randint(0, 3, (4,), generator=_gen(31))}
    note = "a position table added sequence-first, T == B"
    return ZooCase("sequence-first-positions", SequenceFirstPositions().train(), batch, _classify, note=note)


class Mixer(nn.Module):
    """Bare parameters in matrix products: channel mixing ``h @ W``, token mixing ``U @ h`` and ``U.T @ h``, a
    projection ``h @ V.T``, an output tied to the embedding ``h @ embed.weight.T`` (an MLP-Mixer with a tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.channels = nn.Parameter(torch.randn(8, 6) * 0.3)
        self.tokens = nn.Parameter(torch.randn(4, 4) * 0.3)
        self.back = nn.Parameter(torch.randn(8, 6) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x) @ self.channels)
        h = torch.tanh(self.tokens @ h) + torch.tanh(self.tokens.T @ h)
        return torch.tanh(h @ self.back.T) @ self.embed.weight.T


def _token_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(x=batch["x"]).flatten(0, 1), batch["y"].flatten())


def mixer() -> ZooCase:
    torch.manual_seed(0)
    batch = {
        "x": torch.randint(0, 12, (4, 4), generator=_gen(32)),
        "y": torch.randint(0, 12, (4, 4), generator=_gen(33)),
    }
    note = "x @ W, U @ x, U.T @ x, x @ V.T with bare parameters; a head tied to the embedding by x @ E.T; T == B"
    return ZooCase("mixer", Mixer().train(), batch, _token_loss, note=note)


class Upsampler(nn.Module):
    """A decoder of 2x2 maps: ConvTranspose2d (stride 2, padding 1, output_padding 1, groups 2) -> ReLU ->
    ConvTranspose2d (dilation 2, no bias) -> mean -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.refine = nn.ConvTranspose2d(4, 2, 2, dilation=2, bias=False)
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.refine(torch.relu(self.up(x)))).mean((2, 3)))


def conv_transpose() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 2, 2, 2, generator=_gen(34)), "y": torch.randint(0, 3, (4,), generator=_gen(35))}
    note = "ConvTranspose2d (stride, padding, output_padding, groups 2; dilation, no bias)"
    return ZooCase("conv-transpose", Upsampler().train(), batch, _classify, note=note)


class PairScorer(nn.Module):
    """``nn.Bilinear`` between a token's features and a projection of them (per position), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.pair = nn.Bilinear(4, 3, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.pair(torch.tanh(self.proj(x)), x)).mean(1))


def bilinear() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 2, 3, generator=_gen(36)), "y": torch.randint(0, 3, (4,), generator=_gen(37))}
    return ZooCase("bilinear", PairScorer().train(), batch, _classify, note="nn.Bilinear on [B, T, d] inputs")


class TiedAutoencoder(nn.Module):
    """An encoder Linear whose transposed weight decodes (``F.linear(z, enc.weight.t())`` plus a bias of its own):
    the reconstruction error is the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 3)
        self.dec_bias = nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t()) + self.dec_bias


def _reconstruction(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return ((forward(x=batch["x"]) - batch["x"]) ** 2).sum(-1).mean()


def tied_autoencoder() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 6, generator=_gen(38))}
    note = "a Linear's weight transposed as the decoder (F.linear(z, W.t())), the module's own forward hooked"
    return ZooCase("tied-autoencoder", TiedAutoencoder().train(), batch, _reconstruction, note=note)


class ManualLinear(nn.Linear):
    """HF ``FalconLinear``: ``x @ W.T + b`` in its own forward (no ``F.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class CastLinear(nn.Linear):
    """``F.linear(x, W.type_as(x), b.type_as(x))``: casts that take the batch only for its dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.type_as(x), self.bias.type_as(x))


class CastsAndTables(nn.Module):
    """A Linear subclass with its own matmul and bias add, a scale cast to the activations' dtype (a no-op cast
    returns the parameter itself), a head casting its weights ``type_as`` the batch, and a position table projected
    by a stock Linear on a batch-1 input and divided in place (DeBERTa's and Longformer's pattern), added to the
    batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = ManualLinear(6, 8)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.table = nn.Parameter(torch.randn(5, 8))
        self.proj = nn.Linear(8, 8)
        self.head = CastLinear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale.to(x.dtype)
        positions = self.proj(self.table.unsqueeze(0))
        positions /= 2.0
        return self.head(torch.tanh(h + positions).mean(1))


def casts_and_tables() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 5, 6, generator=_gen(39)), "y": torch.randint(0, 3, (4,), generator=_gen(40))}
    note = "x @ W.T + b in a Linear subclass, param.to(dtype), a projected position table on a batch-1 input"
    return ZooCase("casts-and-tables", CastsAndTables().train(), batch, _classify, note=note)


class PromptPrefix(nn.Module):
    """Token embeddings with learned prompt tokens in front (peft's prompt tuning: an Embedding run on one row of
    prompt ids, its output repeated over the batch and concatenated) and a position Embedding on one row of
    position ids expanded over the batch by the model (``.expand(B, -1, -1)``) before it is added."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8)
        self.prompt = nn.Embedding(3, 8)
        self.positions = nn.Embedding(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[0]
        prompt = self.prompt(torch.arange(3).unsqueeze(0)).repeat(size, 1, 1)
        h = torch.cat([prompt, self.tokens(x)], dim=1)
        h = h + self.positions(torch.arange(h.shape[1]).unsqueeze(0)).expand(size, -1, -1)
        return self.head(torch.tanh(h).mean(1))


def prompt_prefix() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randint(0, 16, (4, 5), generator=_gen(41)), "y": torch.randint(0, 3, (4,), generator=_gen(42))}
    note = "one-row Embedding outputs repeated and concatenated (prompt tuning), expanded by the model (positions)"
    return ZooCase("prompt-prefix", PromptPrefix().train(), batch, _classify, note=note)


class PooledToken(nn.Module):
    """CLIP's text pooling: the hidden state of each example's own token picked by ``h[arange(B), ids.argmax(-1)]``,
    then a bias-free projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.projection = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.embed(x)))
        return self.projection(h[torch.arange(h.shape[0]), x.argmax(-1)])


def pooled_token() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randint(0, 10, (4, 4), generator=_gen(43)), "y": torch.randint(0, 3, (4,), generator=_gen(44))}
    return ZooCase("pooled-token", PooledToken().train(), batch, _classify, note="h[arange(B), positions] (CLIP)")


class RecurrentTagger(nn.Module):
    """Token embeddings through a two-layer bidirectional ``nn.LSTM`` with projections (batch-first), whose output,
    final hidden and final cell states all reach the loss, and a sequence-first ``nn.GRU`` (a ReLU ``nn.RNN``
    without biases on top) over them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.lstm = nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True, proj_size=2)
        self.gru = nn.GRU(4, 3)
        self.rnn = nn.RNN(3, 3, nonlinearity="relu", bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(self.embed(x))
        seq, _ = self.gru(out.transpose(0, 1))
        top, last = self.rnn(seq)
        return self.head(torch.cat([top.mean(0) + last[0], h[-1], c[-1]], dim=-1))


def recurrent() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randint(0, 10, (4, 5), generator=_gen(45)), "y": torch.randint(0, 3, (4,), generator=_gen(46))}
    note = "LSTM (2 layers, bidirectional, proj_size; output, h_n, c_n used), GRU sequence-first, RNN relu, no bias"
    return ZooCase("recurrent", RecurrentTagger().train(), batch, _classify, note=note)


class CellDecoder(nn.Module):
    """A Python loop over ``nn.LSTMCell`` and ``nn.GRUCell`` steps (a decoder's pattern), states carried along."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTMCell(3, 4)
        self.gru = nn.GRUCell(4, 4)
        self.rnn = nn.RNNCell(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = g = torch.zeros(x.shape[0], 4)
        r = None
        for t in range(x.shape[1]):
            h, c = self.lstm(x[:, t], (h, c))
            g = self.gru(h, g)
            r = self.rnn(g, r)
        return self.head(r + c)


def recurrent_cells() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 3, 3, generator=_gen(47)), "y": torch.randint(0, 3, (4,), generator=_gen(48))}
    return ZooCase("recurrent-cells", CellDecoder().train(), batch, _classify, note="LSTMCell, GRUCell, RNNCell loop")


class SosDecoder(nn.Module):
    """A GRUCell decoder from an encoder's state: its first input the embedding of a start token made inside the
    forward (``embed(full((B,), SOS))``: from parameters alone, every example's row), then teacher forcing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.encoder = nn.Linear(4, 5)
        self.cell = nn.GRUCell(3, 5)
        self.head = nn.Linear(5, 10)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        step = self.embed(torch.full((x.shape[0],), 0, dtype=torch.long))
        logits = []
        for t in range(tokens.shape[1]):
            h = self.cell(step, h)
            logits.append(self.head(h))
            step = self.embed(tokens[:, t])
        return torch.stack(logits, 1)


def _decoder_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    logits = forward(x=batch["x"], tokens=batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["tokens"].flatten(), reduction="sum") / batch["x"].shape[0]


def recurrent_decoder() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=_gen(51)), "tokens": torch.randint(1, 10, (4, 3), generator=_gen(52))}
    note = "GRUCell decoder from embed(SOS) made in the forward, teacher forcing"
    return ZooCase("recurrent-decoder", SosDecoder().train(), batch, _decoder_loss, note=note)


class PackedTagger(nn.Module):
    """Padded token sequences of different lengths packed (``enforce_sorted=False``: sorted by length inside) through
    a two-layer bidirectional ``nn.LSTM`` whose output is padded back and averaged, and a ``nn.GRU`` whose final
    state joins it (the packed sequence's own order undone by the modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(x), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, counts = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        _, h = self.gru(packed)
        return self.head(padded.sum(1) / counts[:, None].to(padded.dtype) + h[-1])


def _packed_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(x=batch["x"], lengths=batch["lengths"]), batch["y"])


def recurrent_packed() -> ZooCase:
    torch.manual_seed(0)
    batch = {
        "x": torch.randint(0, 10, (4, 6), generator=_gen(49)),
        "lengths": torch.tensor([3, 6, 2, 5]),
        "y": torch.randint(0, 3, (4,), generator=_gen(50)),
    }
    note = "pack_padded_sequence (unsorted lengths) through a bidirectional LSTM and a GRU, pad_packed_sequence"
    model = PackedTagger().train()
    return ZooCase("recurrent-packed", model, batch, _packed_loss, note=note, extra={"reference": "autograd"})


#: Every model of the zoo by name (the pytest ids).
class Factorization(nn.Module):
    """A recommender's bare tables indexed by the batch's ids: ``U[user]``, ``V.index_select(0, item)``, per-id
    biases ``bu[user]``, and ``F.embedding(history, V)`` over each example's past items (several lookups each)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Parameter(0.3 * torch.randn(7, 4))
        self.items = nn.Parameter(0.3 * torch.randn(9, 4))
        self.user_bias = nn.Parameter(0.1 * torch.randn(7))
        self.mix = nn.Linear(4, 4)

    def forward(self, user: torch.Tensor, item: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        taste = self.users[user] + self.mix(F.embedding(history, self.items, padding_idx=0).mean(1))
        return (taste * self.items.index_select(0, item)).sum(-1) + self.user_bias[user]


def _rating_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    predicted = forward(user=batch["user"], item=batch["item"], history=batch["history"])
    return (predicted - batch["rating"]).pow(2).mean()


def factorization() -> ZooCase:
    torch.manual_seed(0)
    user = torch.tensor([3, 3, 0, 6])  # a user twice in the batch
    batch = {
        "user": user,
        "item": torch.randint(0, 9, (4,), generator=_gen(53)),
        "history": torch.randint(0, 9, (4, 3), generator=_gen(54)),  # 0: padding
        "rating": torch.randn(4, generator=_gen(55)),
    }
    note = "matrix factorisation: bare tables indexed by ids (getitem, index_select, F.embedding with padding)"
    return ZooCase("factorization", Factorization().train(), batch, _rating_loss, note=note)


class TiedOutputLM(nn.Module):
    """An output layer tied to the input embedding through ``F.linear(h, E, b)``, with a bias of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.out_bias = nn.Parameter(0.1 * torch.randn(11))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mix(self.embed(ids))), self.embed.weight, self.out_bias)


def _next_token_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(ids=batch["ids"]).flatten(0, 1), batch["targets"].flatten())


def tied_output() -> ZooCase:
    torch.manual_seed(0)
    batch = {
        "ids": torch.randint(0, 11, (3, 5), generator=_gen(56)),
        "targets": torch.randint(0, 11, (3, 5), generator=_gen(57)),
    }
    note = "F.linear(h, embed.weight, out_bias): output layer tied to the embedding, its own bias"
    return ZooCase("tied-output", TiedOutputLM().train(), batch, _next_token_loss, note=note)


class SlopesAndAddmm(nn.Module):
    """``nn.PReLU`` slopes per channel and shared, and a layer written out as ``torch.addmm(b, h, W)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.channel_slopes = nn.PReLU(3)
        self.shared_slope = nn.PReLU()
        self.weight = nn.Parameter(0.3 * torch.randn(3, 10))
        self.bias = nn.Parameter(0.1 * torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared_slope(self.channel_slopes(self.conv(x)).mean((2, 3)) - 0.2)
        return torch.addmm(self.bias, h, self.weight)


def slopes_and_addmm() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 1, 5, 5, generator=_gen(58)), "y": torch.randint(0, 10, (4,), generator=_gen(59))}
    return ZooCase("slopes-addmm", SlopesAndAddmm().train(), batch, _classify, note="nn.PReLU(C), nn.PReLU(), addmm")


class BagClassifier(nn.Module):
    """fastText-style bags of ``[B, L]`` token ids: ``nn.EmbeddingBag`` in mean mode with a padding id, in sum
    mode with per-token weights and in max mode with a padding id."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_bag = nn.EmbeddingBag(12, 4, mode="mean", padding_idx=0)
        self.sum_bag = nn.EmbeddingBag(12, 4, mode="sum")
        self.max_bag = nn.EmbeddingBag(12, 4, mode="max", padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        pooled = self.mean_bag(tokens) + self.sum_bag(tokens, per_sample_weights=weights) + self.max_bag(tokens)
        return self.head(pooled)


def _bag_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(tokens=batch["tokens"], weights=batch["weights"]), batch["y"])


def embedding_bag() -> ZooCase:
    torch.manual_seed(0)
    tokens = torch.randint(0, 12, (4, 5), generator=_gen(60))
    tokens[0, :3] = 0  # padding in the mean bag
    batch = {
        "tokens": tokens,
        "weights": torch.rand(4, 5, generator=_gen(61)),
        "y": torch.randint(0, 3, (4,), generator=_gen(62)),
    }
    note = "EmbeddingBag mean + padding, sum + weights, max + padding"
    return ZooCase("embedding-bag", BagClassifier().train(), batch, _bag_loss, note=note)


class AttentionPooling(nn.Module):
    """Token embeddings pooled by a learned query vector (``h @ q``: attention pooling), a second scoring vector
    on the left of the transposed tokens (``v @ h^T``), and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(15, 6)
        self.query = nn.Parameter(torch.randn(6))
        self.gate = nn.Parameter(torch.randn(6))
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(ids))  # [B, T, 6]
        weights = torch.softmax(h @ self.query, dim=1)  # [B, T]
        gates = torch.sigmoid(torch.matmul(self.gate, h.transpose(1, 2)))  # [B, T]
        return self.head(((weights * gates).unsqueeze(-1) * h).sum(1))


def _pooling_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(batch["ids"]), batch["y"])


def attention_pooling() -> ZooCase:
    torch.manual_seed(0)
    batch = {
        "ids": torch.randint(0, 15, (4, 5), generator=_gen(66)),
        "y": torch.randint(0, 3, (4,), generator=_gen(67)),
    }
    return ZooCase("attention-pooling", AttentionPooling().train(), batch, _pooling_loss, note="h @ q, q @ h^T (1-D)")


class RelativeBiasAttention(nn.Module):
    """Self-attention with a learned relative position bias per head (a bare ``[H, T, T]`` parameter, one slot
    per head) added to the scores (eager) and given to SDPA as ``attn_mask``; ``q, k, v = qkv`` by iteration."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.scores_bias = nn.Parameter(0.3 * torch.randn(2, length, length))
        self.mask_bias = nn.Parameter(0.3 * torch.randn(2, length, length))
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        eager = torch.softmax(q @ k.transpose(-1, -2) / 2 + self.scores_bias, -1) @ v
        fused = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_bias)
        return self.head(self.proj((eager + fused).transpose(1, 2).reshape(b, t, d)).mean(1))


def _sequence_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(batch["x"]), batch["y"])


def relative_bias(length: int) -> Callable[[], ZooCase]:
    def case() -> ZooCase:
        torch.manual_seed(0)
        batch = {"x": torch.randn(4, length, 8, generator=_gen(68)), "y": torch.randint(0, 3, (4,), generator=_gen(69))}
        note = f"[H, T, T] relative bias on scores and as SDPA mask, q, k, v = qkv (T={length})"
        return ZooCase(
            f"relative-bias-t{length}", RelativeBiasAttention(length).train(), batch, _sequence_loss, note=note
        )

    return case


class LatentQueries(nn.Module):
    """Perceiver-style: learned latents expanded over the batch as the query of a cross-attention over the inputs,
    and learned object queries repeated over the batch (DETR, a Q-Former) in a second one."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(0.5 * torch.randn(3, 8))
        self.queries = nn.Parameter(0.5 * torch.randn(2, 8))
        self.cross = nn.MultiheadAttention(8, 2, batch_first=True)
        self.decode = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        latents, _ = self.cross(self.latents.expand(x.shape[0], -1, -1), x, x, need_weights=False)
        objects, _ = self.decode(self.queries.unsqueeze(0).repeat(x.shape[0], 1, 1), latents, latents)
        return self.head(objects.mean(1))


def latent_queries() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 5, 8, generator=_gen(70)), "y": torch.randint(0, 3, (4,), generator=_gen(71))}
    note = "latents.expand(B) and queries.repeat(B) as cross-attention queries"
    return ZooCase("latent-queries", LatentQueries().train(), batch, _sequence_loss, note=note)


class PackedBagClassifier(nn.Module):
    """PyTorch's text classification tutorial model on packed bags (flat ids and offsets): ``nn.EmbeddingBag``
    in mean mode with a padding id, beside one in sum mode with per-id weights and one in max mode with a padding
    id, and a linear head."""

    def __init__(self, include_last_offset: bool) -> None:
        super().__init__()
        self.mean_bag = nn.EmbeddingBag(12, 4, mode="mean", padding_idx=0, include_last_offset=include_last_offset)
        self.sum_bag = nn.EmbeddingBag(12, 4, mode="sum", include_last_offset=include_last_offset)
        self.max_bag = nn.EmbeddingBag(12, 4, mode="max", padding_idx=0, include_last_offset=include_last_offset)
        self.head = nn.Linear(4, 3)

    def forward(self, text: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        pooled = self.mean_bag(text, offsets) + self.sum_bag(text, offsets, per_sample_weights=weights)
        return self.head(pooled + self.max_bag(text, offsets))


@dataclass
class PackedBagsCase(ZooCase):
    """A batch of packed bags: ``text`` and ``weights`` ``[N]`` (every example's ids one after the other),
    ``lengths`` ``[B]``; the model is given the offsets (with the total last under ``include_last_offset``)."""

    include_last_offset: bool = False

    @property
    def batch_size(self) -> int:
        return self.batch["y"].shape[0]

    def example(self, i: int) -> Batch:
        starts = torch.cumsum(self.batch["lengths"], 0) - self.batch["lengths"]
        rows = slice(int(starts[i]), int(starts[i] + self.batch["lengths"][i]))
        return {
            "text": self.batch["text"][rows],
            "weights": self.batch["weights"][rows],
            "lengths": self.batch["lengths"][i : i + 1],
            "y": self.batch["y"][i : i + 1],
            "last": self.batch["last"],
        }


def _packed_bag_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    lengths = batch["lengths"]
    offsets = torch.cumsum(lengths, 0) - lengths
    if bool(batch["last"]):
        offsets = torch.cat([offsets, lengths.sum().reshape(1)])
    return F.cross_entropy(forward(batch["text"], offsets, batch["weights"]), batch["y"])


def packed_bags(include_last_offset: bool) -> Callable[[], ZooCase]:
    def case() -> ZooCase:
        torch.manual_seed(0)
        lengths = torch.tensor([3, 0, 5, 2]) if include_last_offset else torch.tensor([3, 1, 5, 2])  # an empty bag
        text = torch.randint(1, 12, (int(lengths.sum()),), generator=_gen(63))
        text[4] = 0  # padding in the mean bag (the third bag's first id)
        batch = {
            "text": text,
            "weights": torch.rand(text.shape[0], generator=_gen(64)),
            "lengths": lengths,
            "y": torch.randint(0, 3, (4,), generator=_gen(65)),
            "last": torch.tensor(include_last_offset),
        }
        name = "packed-bags-last" if include_last_offset else "packed-bags"
        model = PackedBagClassifier(include_last_offset).train()
        note = "EmbeddingBag(text, offsets): mean + padding, sum + weights, max + padding"
        note += ", last offset, an empty bag" * include_last_offset
        return PackedBagsCase(name, model, batch, _packed_bag_loss, note=note, include_last_offset=include_last_offset)

    return case


class WeightsInProducts(nn.Module):
    """Bare weights in the products people write by hand: ``einsum`` (a matrix with a bias, per-head matrices
    stacked ``[H, d, e]``, an ellipsis, the output implicit), ``bmm`` with the weight expanded over the batch, per-head
    matrices broadcast in ``@``, and a matrix computed from parameters (``A - A^T``) on the tokens' right."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(0.3 * torch.randn(6, 8))
        self.mix_bias = nn.Parameter(0.1 * torch.randn(8))
        self.heads = nn.Parameter(0.3 * torch.randn(2, 8, 4))
        self.expanded = nn.Parameter(0.3 * torch.randn(8, 8))
        self.per_head = nn.Parameter(0.3 * torch.randn(2, 4, 4))
        self.skew = nn.Parameter(0.3 * torch.randn(8, 8))
        self.spread = nn.Parameter(0.3 * torch.randn(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = torch.tanh(torch.einsum("btd,de->bte", x, self.mix) + self.mix_bias)
        h = torch.einsum("btd,hde->bhte", h, self.heads)  # [B, H, T, 4]
        h = torch.tanh(h @ self.per_head).transpose(1, 2).reshape(b, t, 8)
        h = torch.tanh(torch.bmm(h, self.expanded.expand(b, 8, 8)))
        h = torch.tanh(torch.einsum("...d,de->...e", h, self.spread))
        h = torch.einsum("btd,de", h, self.skew - self.skew.T)  # implicit output "bet"
        return self.head(h.mean(-1))


def weights_in_products() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 5, 6, generator=_gen(70)), "y": torch.randint(0, 3, (4,), generator=_gen(71))}
    note = "einsum, bmm(x, W.expand(B)), x @ W[H], x @ (A - A^T)"
    return ZooCase("weights-in-products", WeightsInProducts().train(), batch, _sequence_loss, note=note)


class BareConvolutions(nn.Module):
    """Convolutions with bare weights (``F.conv1d(x, self.weight, self.bias)``, a 4-D kernel strided in groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(4, 6, 3))
        self.bias = nn.Parameter(0.1 * torch.randn(4))
        self.kernel = nn.Parameter(0.3 * torch.randn(6, 2, 2, 2))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=1))  # [B, 4, T]
        h = F.conv2d(h.reshape(x.shape[0], 4, 1, -1).expand(-1, -1, 3, -1), self.kernel, stride=(1, 2), groups=2)
        return self.head(h.mean((2, 3)))


def bare_convolutions() -> ZooCase:
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 6, 6, generator=_gen(72)), "y": torch.randint(0, 3, (4,), generator=_gen(73))}
    return ZooCase("bare-convolutions", BareConvolutions().train(), batch, _sequence_loss, note="F.convNd(x, W, b)")


class RoutedTokens(nn.Module):
    """Learned positions read at each example's own position ids (``torch.gather`` of a table expanded over the
    batch), then a hand-written top-2 mixture of experts on tokens flattened across the batch, combined by
    ``index_add`` at the tokens' own rows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(20, 6), nn.Parameter(0.3 * torch.randn(1, 8, 6))
        self.router = nn.Linear(6, 3)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        where = (torch.arange(t)[None] + offsets[:, None]).clamp(max=7)  # left padding: positions start later
        h = self.embed(ids) + torch.gather(self.positions.expand(b, -1, -1), 1, where[..., None].expand(-1, -1, 6))
        h = h.reshape(b * t, 6)
        weights, chosen = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(h[token]) * weights[token, slot, None])
        return self.head(out.view(b, t, 6).mean(1))


def _routed_loss(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return F.cross_entropy(forward(batch["ids"], batch["offsets"]), batch["y"])


def routed_tokens() -> ZooCase:
    torch.manual_seed(0)
    batch = {
        "ids": torch.randint(0, 20, (4, 5), generator=_gen(80)),
        "offsets": torch.tensor([0, 2, 1, 3]),
        "y": torch.randint(0, 3, (4,), generator=_gen(81)),
    }
    note = "positions by torch.gather of an expanded table, top-2 experts combined by index_add"
    return ZooCase("routed-tokens", RoutedTokens().train(), batch, _routed_loss, note=note)


ZOO: dict[str, Callable[[], ZooCase]] = {
    "gpt2": gpt2,
    "llama": llama,
    "gemma": gemma,
    "opt": opt,
    "opt-positions": opt_positions,
    "t5": t5,
    "t5-square": t5_square,
    "t5-sdpa": t5_sdpa,
    "whisper": whisper,
    "whisper-large-ids": whisper_large_ids,
    "vit": vit,
    "swin": swin,
    "wav2vec2": wav2vec2,
    "window-attention": window_attention,
    "mixtral": mixtral,
    "mixtral-square": mixtral_square,
    "mixtral-eager": mixtral_eager,
    "mixtral-batched-mm": mixtral_batched,
    "bert": bert,
    "longformer": longformer,
    "detr": detr,
    "cnn": cnn,
    "cnn1d": cnn1d,
    "cnn3d": cnn3d,
    "transformer-encoder": transformer_encoder,
    "transformer-encoder-seq-first": transformer_encoder_seq_first,
    "seq2seq": seq2seq,
    "cross-attention": cross_attention,
    "cross-attention-kdim": cross_attention_kdim,
    "cross-attention-bias-kv": cross_attention_bias_kv,
    "sequence-first-positions": sequence_first_positions,
    "mixer": mixer,
    "conv-transpose": conv_transpose,
    "bilinear": bilinear,
    "tied-autoencoder": tied_autoencoder,
    "casts-and-tables": casts_and_tables,
    "prompt-prefix": prompt_prefix,
    "pooled-token": pooled_token,
    "recurrent": recurrent,
    "recurrent-cells": recurrent_cells,
    "recurrent-packed": recurrent_packed,
    "recurrent-decoder": recurrent_decoder,
    "factorization": factorization,
    "tied-output": tied_output,
    "slopes-addmm": slopes_and_addmm,
    "embedding-bag": embedding_bag,
    "attention-pooling": attention_pooling,
    "latent-queries": latent_queries,
    "relative-bias-t5": relative_bias(5),
    "relative-bias-t4": relative_bias(4),
    "packed-bags": packed_bags(False),
    "packed-bags-last": packed_bags(True),
    "weights-in-products": weights_in_products,
    "bare-convolutions": bare_convolutions,
    "routed-tokens": routed_tokens,
}
