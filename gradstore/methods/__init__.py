"""The method registry: every attribution method, what it computes, which arguments it uses and what its rows need.

| method       | score of training row g for query q                | preconditioner                          |
|--------------|----------------------------------------------------|-----------------------------------------|
| ``grad-dot`` | ``q . g``                                          | identity                                |
| ``cosine``   | ``q . g / (|q| |g|)``                              | cosine (both sides)                     |
| ``diagonal`` | ``q^T (D + damping)^-1 g``                         | diagonal second moment                  |
| ``fisher``   | ``q^T (G^T G / n + damping * mean_eig * I)^-1 g``  | projected empirical Fisher (blocks)     |
| ``kfac``     | ``q^T (S (x) A + damping * mean_eig * I)^-1 g``    | Kronecker factors (``curvature=True``)  |
| ``ekfac``    | as ``kfac`` with eigenvalues refitted on the rows  | eigen-corrected Kronecker factors       |
| ``tracin``   | ``sum_c lr_c * q_c . g_c`` over checkpoints        | identity per checkpoint                 |
| ``trackstar``| ``cos(F^-1/2 q, F^-1/2 g)``                        | projected empirical Fisher, unit norm   |
| ``tracin-steps`` | ``sum_t lr_t s_t / B_t * q . g_t`` over recorded training steps | identity per step     |
| ``source``   | ``sum_l q^T (prod_{l'>l} E_l') (I - E_l) F_l^-1 g_l``, ``E_l = exp(-lr_l K_l F_l)`` | Fisher/segment |
| ``source-ekfac`` | as ``source`` with ``F_l`` the checkpoint's EK-FAC                 | EK-FAC per segment   |
| ``dvemb``    | ``q . e_z``, ``e_z = sum_t lr_t / B_t prod_{s>t} (I - lr_s H_s) g_t``  | batch curvature per step |
| ``replay``   | ``-d L_q(theta_T) / d eps_z`` through the replayed run (exact)      | none: the run itself      |

``influence`` is an alias of ``fisher``. Damping is relative to the mean eigenvalue (default 0.1).
``kfac``/``ekfac`` use the factors a capture with ``curvature=True`` recorded (:data:`KRONECKER_FACTORS`); rows
captured without it get factors estimated from the rows themselves
(:func:`gradstore.preconditioning.fitting.kronecker_source`).
``trackstar`` (TrackStar, Chang et al. 2024) is meant for rows captured with ``normalizer="adam_factored"``
(optimizer-aware: Adam second-moment normalisation): both sides are whitened by the Fisher of the stored rows
and unit-normalised, so the score is a cosine in the whitened space.

A method is an object: an instance of one of five families, each a module of this package, that declares what it
uses and needs and implements the calls that take it (:class:`Method`: ``attribute``, ``matrix`` for
``score_matrix``, ``self_influence``, ``select``, ``build_index``); the calls dispatch to it, they do not branch
on its name:

* :class:`~gradstore.methods.preconditioned.Preconditioned` (:mod:`~gradstore.methods.preconditioned`): one
  checkpoint's rows in a fitted preconditioner's space: ``grad-dot``, ``cosine``, ``diagonal``, ``fisher``,
  ``kfac``, ``ekfac``, ``trackstar`` and the methods :func:`~gradstore.methods.extension.register_method` adds;
* :class:`~gradstore.methods.checkpoint_sum.CheckpointSum` (:mod:`~gradstore.methods.checkpoint_sum`): ``tracin``;
* :class:`~gradstore.methods.trajectory.Trajectory` (:mod:`~gradstore.methods.trajectory`): ``tracin-steps``,
  ``source``, ``source-ekfac``;
* :class:`~gradstore.methods.dvemb.Embeddings` (:mod:`~gradstore.methods.dvemb`): ``dvemb``;
* :class:`~gradstore.methods.replay.Replayed` (:mod:`~gradstore.methods.replay`): ``replay``, the exact
  metagradients :func:`gradstore.answers.replay.replay` (``store.replay(...)``) computed and kept.

The trajectory methods (:mod:`gradstore.methods.trajectory`, :mod:`gradstore.methods.dvemb`) use the store's training
history:
``tracin-steps`` and ``dvemb`` the rows captured *during training* (one checkpoint label, many steps: ``s_t``
optimizer steps stand for each recorded one, ``B_t`` rows per step), ``source`` the checkpoint passes (segments
of ``K_l`` steps at mean learning rate ``lr_l``). Curvature comes from rows of split ``"true-fisher"`` (labels
sampled from the model, :data:`TRUE_FISHER_SPLIT`) where a checkpoint (or step) has them, else from the
training rows (the empirical Fisher); ``fisher``, ``kfac`` and ``ekfac`` fit on true-Fisher rows the same way
(``kfac``/``ekfac``: the Kronecker factors captured on those rows, for the eigenbasis and the eigenvalues alike).

:data:`METHODS` (declared in :mod:`gradstore.methods.registry`, filled here) is the one table the API, the CLI's
choices and the docs' methods table come from: each :class:`Method` says which optional arguments it uses
(:attr:`Method.uses`), which calls accept it (:attr:`Method.operations`) and what its rows must have
(:attr:`Method.requires`). :func:`check_arguments` turns an argument the chosen method does not use into an
``InvalidArgumentError`` naming both.
"""

from gradstore.methods import dvemb, trajectory
from gradstore.methods.checkpoint_sum import CheckpointSum
from gradstore.methods.dvemb import Embeddings
from gradstore.methods.preconditioned import Preconditioned
from gradstore.methods.registry import (
    ALIASES,
    ALL_OPERATIONS,
    DEFAULT_DAMPING,
    DEFAULT_METHOD,
    KRONECKER_FACTORS,
    METHODS,
    NOT_GIVEN,
    ONE_CHECKPOINT,
    OPTION_HELP,
    OPTIONAL_ARGUMENTS,
    TRUE_FISHER_SPLIT,
    BlockStructure,
    Method,
    MethodName,
    Operation,
    ScoreOptions,
    check_arguments,
    check_blocks,
    check_damping,
    given_arguments,
    method_names,
    methods_table,
    options_table,
    resolve_method,
)
from gradstore.methods.replay import Replayed
from gradstore.methods.trajectory import Trajectory

#: The families: one module each, the classes :data:`METHODS` holds instances of.
FAMILIES = (Preconditioned, CheckpointSum, Trajectory, Embeddings, Replayed)
_ONE_CHECKPOINT_CALLS = frozenset({"attribute", "score_matrix", "build_index"})
_HISTORY_REQUIRES = "training rows captured during training (one checkpoint label, many steps, a learning rate)"

BUILT_IN: tuple[Method, ...] = (
    Preconditioned(
        "grad-dot",
        "identity",
        query_only=True,
        damped=False,
        summary="q . g: the raw gradient inner product (no curvature)",
    ),
    Preconditioned(
        "cosine",
        "cosine",
        query_only=False,
        damped=False,
        summary="q . g / (norm(q) norm(g)): the gradients' cosine",
        operations=_ONE_CHECKPOINT_CALLS,
    ),
    Preconditioned(
        "diagonal",
        "diagonal",
        query_only=True,
        damped=True,
        summary="q^T (D + damping)^-1 g with D the rows' diagonal second moment",
    ),
    Preconditioned(
        "fisher",
        "fisher",
        query_only=True,
        damped=True,
        true_fisher=True,
        summary="q^T (F + damping)^-1 g with F the projected Fisher of the rows (per layer or full; true Fisher "
        "where the checkpoint has true-fisher rows)",
    ),
    Preconditioned(
        "kfac",
        "kfac",
        query_only=True,
        damped=True,
        true_fisher=True,
        summary="q^T (S (x) A + damping)^-1 g with the Kronecker factors recorded at capture (those of the "
        "true-fisher rows where the checkpoint has them)",
        requires=KRONECKER_FACTORS,
    ),
    Preconditioned(
        "ekfac",
        "kfac",
        query_only=True,
        damped=True,
        eigen_correction=True,
        true_fisher=True,
        summary="kfac with its eigenvalues refitted on the stored rows (eigen-corrected; eigenbasis and eigenvalues "
        "both from the true-fisher rows where the checkpoint has them)",
        requires=KRONECKER_FACTORS,
    ),
    CheckpointSum(
        "tracin",
        "sum over checkpoints of lr_c * q_c . g_c (TracIn-CP)",
        requires="query rows at checkpoints with a recorded learning rate (checkpoint passes)",
    ),
    Preconditioned(
        "trackstar",
        "fisher",
        query_only=False,
        damped=True,
        unit_norm=True,
        summary="cos(F^-1/2 q, F^-1/2 g): a cosine in the Fisher-whitened space (for Adam-normalised rows)",
        requires="rows captured with normalizer='adam_factored' (and the optimizer) for its intended use",
        operations=frozenset({"attribute", "score_matrix", "build_index", "select"}),
    ),
    Trajectory(
        "tracin-steps",
        "identity",
        query_only=True,
        damped=False,
        trajectory="steps",
        summary="sum over recorded training steps of lr_t * s_t / B_t * q_c(t) . g_t (s_t steps per recorded one, "
        "B_t rows per step, q_c(t) the queries of the first checkpoint at or after step t)",
        requires=_HISTORY_REQUIRES,
    ),
    Trajectory(
        "source",
        "fisher",
        query_only=True,
        damped=False,
        true_fisher=True,
        trajectory="segments",
        summary="SOURCE: segments between checkpoint passes, each with its own Fisher F_l: "
        "sum_l q^T (prod_{l'>l} exp(-lr K F)) (I - exp(-lr_l K_l F_l)) F_l^-1 g_l / N_l",
        requires="checkpoint passes: training rows at checkpoints with a recorded step and learning rate",
    ),
    Trajectory(
        "source-ekfac",
        "kfac",
        query_only=True,
        damped=False,
        eigen_correction=True,
        true_fisher=True,
        trajectory="segments",
        summary="source with each checkpoint's curvature its EK-FAC (Kronecker eigenbasis, eigenvalues refitted on "
        "the rows) instead of the projected Fisher",
        requires="checkpoint passes (a step and learning rate each) with Kronecker-structured rows",
    ),
    Embeddings(
        "dvemb",
        "data value embeddings: q . e_z with e_z = sum_t lr_t / B_t prod_{s>t} (I - lr_s H_s) g_t, "
        "kept as the derived run <run>.dvemb",
        requires=_HISTORY_REQUIRES,
    ),
    Replayed(
        "replay",
        "exact metagradient -dL_q(theta_T)/deps_z through the whole recorded run (its order, learning rates and "
        "optimizer replayed and differentiated: MAGIC), as store.replay(...) computed it",
        requires="a replay of the queries by store.replay(...): rows captured at every training step; the model, a "
        "batch function, the loss and the optimizer from the caller",
    ),
)
METHODS.update((method.name, method) for method in BUILT_IN)

__all__ = [
    "ALIASES",
    "ALL_OPERATIONS",
    "BUILT_IN",
    "DEFAULT_DAMPING",
    "DEFAULT_METHOD",
    "FAMILIES",
    "KRONECKER_FACTORS",
    "METHODS",
    "NOT_GIVEN",
    "ONE_CHECKPOINT",
    "OPTION_HELP",
    "OPTIONAL_ARGUMENTS",
    "TRUE_FISHER_SPLIT",
    "BlockStructure",
    "CheckpointSum",
    "Embeddings",
    "Method",
    "MethodName",
    "Operation",
    "Preconditioned",
    "Replayed",
    "ScoreOptions",
    "Trajectory",
    "check_arguments",
    "check_blocks",
    "check_damping",
    "dvemb",
    "given_arguments",
    "method_names",
    "methods_table",
    "options_table",
    "resolve_method",
    "trajectory",
]
