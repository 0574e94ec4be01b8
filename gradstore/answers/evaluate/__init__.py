"""Counterfactual checks of attribution scores: the linear datamodeling score (LDS) and the query loss
difference (QLD).

**LDS.** Retrain the user's model on random subsets of the training set and ask whether a method's scores
predict the retrained models' query losses: for query ``q`` and subset ``S`` the prediction is
``sum_{i in S} score(q, i)`` (a positive score means example ``i`` lowers ``q``'s loss); ``LDS_q`` is the
Spearman correlation of the predictions with ``-loss_S(q)`` across subsets, and the LDS is the mean over
queries (with its standard error over queries). With two or more seeds per subset the losses are averaged
over seeds, and the **noise ceiling** is the mean over queries of the Spearman correlation between the
seed-averaged losses of two disjoint seed groups: how well retraining predicts itself, which bounds what
any method can reach at this number of seeds.

**QLD.** For each query, retrain without the query's top ``fraction`` proponents by a method's scores and,
as the control, without random sets of the same size; ``QLD_q`` is the first retraining's loss on ``q`` minus
the control's, and the QLD is the mean over queries (with its standard error). Removing what really
supported a query raises its loss more than removing as much at random: higher is better, 0 is no better
than chance (:func:`qld`).

``train_fn(subsets, queries, seed)`` is the user's code: given a list of subsets (each a list of training
example ids) it retrains one model per subset with ``seed`` and returns their losses on the query ids,
``[len(subsets), len(queries)]``. It receives all subsets of a seed at once, so it may train them together
or in parallel. Everything is deterministic given ``seed`` and ``seeds`` (and a deterministic ``train_fn``).
"""

from gradstore.answers.evaluate.datamodeling import (
    LDSResult,
    Retraining,
    average_ranks,
    lds,
    lds_of_scores,
    retrain,
    spearman_columns,
)
from gradstore.answers.evaluate.evaluations import (
    DEFAULT_METHODS,
    EVALUATIONS,
    EVALUATIONS_SCHEMA,
    TrainFn,
    query_ids,
    scores_by_example,
    training_ids,
)
from gradstore.answers.evaluate.loss_difference import (
    QLDResult,
    qld,
    qld_of_scores,
    random_removals,
    removal_size,
    top_proponents,
)

__all__ = [
    "DEFAULT_METHODS",
    "EVALUATIONS",
    "EVALUATIONS_SCHEMA",
    "LDSResult",
    "QLDResult",
    "Retraining",
    "TrainFn",
    "average_ranks",
    "lds",
    "lds_of_scores",
    "qld",
    "qld_of_scores",
    "query_ids",
    "random_removals",
    "removal_size",
    "retrain",
    "scores_by_example",
    "spearman_columns",
    "top_proponents",
    "training_ids",
]
