"""References for exact per-example gradients (tests/capture): torch.func per-sample gradients, padded language-model
batches, a checkpointed module, and the slices of a captured row that hold one layer."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def slot_matrix(spec, rows, name):
    s = spec.slot(name)
    return rows[:, s.offset : s.offset + s.size].reshape(-1, s.k_out, s.k_in)


def linear_reference(g, name, transpose=False):
    w = g[f"{name}.weight"]
    w = w.transpose(1, 2) if transpose else w
    b = g.get(f"{name}.bias")
    return w if b is None else torch.cat([w, b.unsqueeze(-1)], dim=-1)


def padded_batch():
    """Mixed lengths, right padding, labels -100 on padding."""
    lengths = torch.tensor([9, 4, 12, 6])
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def gpt2_reference(model, ids, mask, labels):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, i, m, lab):
        return functional_call(model, p, (i[None],), {"attention_mask": m[None], "labels": lab[None]}).loss

    return vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, ids, mask, labels)


class Blocks(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(4, 8), nn.Linear(8, 2), reentrant

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
        return self.b(h)


def lm_batch(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence of *this* batch; labels -100 on padding."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


SEQS = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 12, 6)]
