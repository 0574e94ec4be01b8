"""Online data selection inside the training step: score the examples of each step from the per-example rows a
:class:`~ingest.capture.GradientCapture` already holds, and drop (or reweight) the chosen ones *before* the
optimizer step by removing their exact contribution from ``.grad``.

How the removal is exact without per-example gradients: the gradient a Linear layer's weight receives from a
backward is ``sum_b sum_t dy[b, t] x[b, t]^T`` (``dy`` the gradient of the loop's loss with respect to the layer's
output, ``x`` its input), so example ``b``'s term is ``dy[b]^T x[b]``. The selector keeps each captured forward's
``x`` (already held by autograd) and the ``dy`` autograd hands to the output, and at the step subtracts
``(1 - w_b) dy[b]^T x[b]`` of the examples it drops (``w_b = 0``) or reweights, for every use of every trainable
module. ``dy`` already carries the loop's loss reduction (``1/B`` of the example's own gradient for a batch mean),
so the removal needs no knowledge of it. Embeddings (a scatter of ``dy`` at the token ids) and Hugging Face
``Conv1D`` work alike; a model with any other trainable parameter (LayerNorm, Conv2d, a bare ``nn.Parameter``)
is refused with :class:`ExactRemovalError`: its examples' terms cannot be removed exactly from the saved factors.
So is a forward that also uses such a layer's parameter outside the layer's own forward (``F.linear(h,
self.emb.weight)``; :class:`~ingest.online_selection.removable.OutsideUses`); weights tied across layers are exact.

``renormalize=True`` (the default) then scales the step's gradient so it equals the loop's loss *over the kept
examples only*: for a batch mean, ``B / |kept|``; for the causal-LM token mean, ``N_tokens / N_kept_tokens``;
for a sum, 1 (a sum over the kept examples). With it, a selected step equals a step on the kept examples alone
(the exactness guarantee tested in ``tests/capture/test_online_selection.py``); without it, dropped examples simply
contribute nothing and the gradient stays ``1/B``-scaled.

>>> selector = OnlineSelector(capture, KeepTopFraction(0.5), target=query_mean)
>>> with capture, selector:
...     loss.backward(); opt.step()      # the step pre-hook drops the low-scoring half first

Modules, one job each: :mod:`~ingest.online_selection.policies` (a weight per example),
:mod:`~ingest.online_selection.target` (what examples are scored against), :mod:`~ingest.online_selection.decision`
(what was decided at a step), :mod:`~ingest.online_selection.removable` (which modules' terms can be removed
exactly), :mod:`~ingest.online_selection.collective` (deciding over every DDP rank) and
:mod:`~ingest.online_selection.selector` (the :class:`OnlineSelector` and its exact removal).
"""

from ingest.online_selection.decision import StepDecision
from ingest.online_selection.policies import (
    DropBelowThreshold,
    KeepTopFraction,
    LossBased,
    RandomSelection,
    SelectionPolicy,
)
from ingest.online_selection.removable import ExactRemovalError, removal_kind
from ingest.online_selection.selector import OnlineSelector
from ingest.online_selection.target import RefreshedTarget, Target

__all__ = [
    "DropBelowThreshold",
    "ExactRemovalError",
    "KeepTopFraction",
    "LossBased",
    "OnlineSelector",
    "RandomSelection",
    "RefreshedTarget",
    "SelectionPolicy",
    "StepDecision",
    "Target",
    "removal_kind",
]
