"""Kronecker curvature statistics of a run's checkpoint as one ``.npz`` side file per split: the store's side of
:mod:`ingest.curvature`, which accumulates them during a capture with ``curvature=True``.

A checkpoint has the factors of its training rows (split ``"train"``, the empirical Fisher's: the key stores made
before true-Fisher factors existed use) and, where a capture with ``curvature=True`` wrote true-Fisher rows, those of
split ``"true-fisher"`` (the true Fisher's), each in its own file. :class:`Curvature` is the store's part that keeps
them for its runs.

A checkpoint's factors add up over its captures: each capture with ``curvature=True`` adds its sums and token counts
to the saved ones (:meth:`Curvature.save`; the file keeps token means and counts, so the sums are ``mean x count``),
and the saved factors equal those of one capture over all the rows. A file also records the rows of its split the
checkpoint held when it was saved and whether the factors are known to describe only part of them (*stale*): rows
added by a capture without ``curvature=True`` (or deleted) make them so, warned (:class:`StaleCurvatureWarning`) at
that capture and whenever they are loaded (``kfac``/``ekfac`` fits). A resumed capture (``resume=True``) replays
rows already committed: :meth:`Curvature.record_capture` says what it does then."""

from __future__ import annotations

import hashlib
import io
import warnings
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from gradstore.core import schema as S
from gradstore.core.catalog import RunCatalog
from gradstore.core.filters import gradient_filter
from gradstore.core.sidefiles import SideFiles
from gradstore.core.tables import writes
from gradstore.errors import InvalidArgumentError, MissingCurvatureError, StaleCurvatureWarning, StoreCorruptError
from ingest.curvature import CURVATURE_SPLITS

LayerCurvature = dict[str, tuple[np.ndarray, np.ndarray, int]]
"""``{layer: (A [k_in, k_in], S [k_out, k_out], count)}``."""

ROWS_KEY, STALE_KEY = "rows", "stale"
"""The file's entries beside the layers' (``{layer}|A``, ``{layer}|S``, ``{layer}|count``): no ``|``, so never a
layer's."""


@dataclass(frozen=True)
class ResumedRows:
    """What a resumed capture (``resume=True``) replayed, as :meth:`Curvature.record_capture` sees it."""

    from_step: int  # the step of its first batch
    committed: dict[tuple[str, str], int]  # rows committed before it from that step on, per (checkpoint, split) saved
    skipped: int  # the rows it skipped as committed (of any checkpoint and split)

    def replayed(self, pair: tuple[str, str]) -> int | None:
        """The committed rows of ``(checkpoint, split)`` it replayed (``None``: not known). Its skipped rows are taken
        as rows of the checkpoints and splits it saves factors of: where they are at least all of those committed,
        it replayed every one; where one of them has committed rows, they are its."""
        own = self.committed.get(pair, 0)
        total = sum(self.committed.values())
        if own == 0 or self.skipped >= total:
            return own
        return self.skipped if total == own else None


@dataclass(frozen=True)
class SavedCurvature:
    """A checkpoint's saved factors of one split and what they describe."""

    layers: LayerCurvature
    rows: int | None  # rows of the split the checkpoint held when they were saved (None: saved by an earlier version)
    stale: bool  # known to describe only part of the checkpoint's rows (rows added without curvature=True, ...)

    @property
    def tokens(self) -> int:
        """The tokens the factors count (the largest of the layers' counts)."""
        return max((count for _, _, count in self.layers.values()), default=0)


def _key(run_id: str, checkpoint: str, split: str) -> tuple[str, str]:
    """Side-file key of a run's checkpoint and split: hashes, so any run or checkpoint name is a safe file name
    (the training split keeps the key of stores written before splits were kept apart)."""
    if split not in CURVATURE_SPLITS:
        raise InvalidArgumentError(f"curvature statistics are kept for the splits {CURVATURE_SPLITS}, not {split!r}")
    text = f"{run_id}\0{checkpoint}" if split == "train" else f"{run_id}\0{checkpoint}\0{split}"
    return ("curvature", hashlib.sha256(text.encode()).hexdigest()[:32] + ".npz")


def _of(run_id: str, checkpoint: str, split: str) -> str:
    return f"run {run_id!r} checkpoint {checkpoint!r}" + ("" if split == "train" else f" split {split!r}")


def _remedy(split: str) -> str:
    """What a warning about stale factors of ``split`` tells to do."""
    removal = "store.core.curvature.remove(run, checkpoint" + ("" if split == "train" else f", split={split!r}") + ")"
    return (
        f"kfac/ekfac score every row with them as they are; {removal} lets them estimate the factors from the rows "
        "instead, or capture all of the checkpoint's rows with curvature=True into a new checkpoint"
    )


def merged(saved: LayerCurvature, added: LayerCurvature) -> LayerCurvature:
    """The factors of the tokens of ``saved`` and ``added`` together: per layer the sums (``mean x count``, in
    float64) added and divided by the summed count, kept in the wider of the two dtypes; a layer of one of them only
    is kept as it is (the other counted no token of it)."""
    out = dict(saved)
    for layer, (a_new, s_new, n_new) in added.items():
        if layer not in out:
            out[layer] = (a_new, s_new, n_new)
            continue
        a_old, s_old, n_old = out[layer]
        if a_old.shape != a_new.shape or s_old.shape != s_new.shape:
            raise InvalidArgumentError(
                f"layer {layer!r}: factors of shapes {a_new.shape}, {s_new.shape} cannot be added to the saved "
                f"{a_old.shape}, {s_old.shape}"
            )
        count = n_old + n_new
        denominator = max(count, 1)
        a = (a_old.astype(np.float64) * n_old + a_new.astype(np.float64) * n_new) / denominator
        s = (s_old.astype(np.float64) * n_old + s_new.astype(np.float64) * n_new) / denominator
        out[layer] = (a.astype(np.result_type(a_old, a_new)), s.astype(np.result_type(s_old, s_new)), count)
    return out


def save_curvature(
    files: SideFiles,
    run_id: str,
    checkpoint: str,
    stats: LayerCurvature,
    split: str = "train",
    *,
    rows: int | None = None,
    stale: bool = False,
) -> None:
    """Write per-layer ``(A, S, count)`` of a run's checkpoint over its rows of ``split`` as they are (replacing
    the saved ones; :meth:`Curvature.save` adds them up), with the rows of the split they were saved with and whether
    they are stale (:class:`SavedCurvature`)."""
    key = _key(run_id, checkpoint, split)
    with files.writing(*key):  # ranks saving at once take turns (file and checksum stay one pair)
        _write(files, key, SavedCurvature(stats, rows, stale))


def _write(files: SideFiles, key: tuple[str, str], saved: SavedCurvature) -> None:
    """Write ``saved`` under ``key`` (the caller holds the key's lock)."""
    arrays: dict[str, np.ndarray] = {}
    for layer, (a_cov, s_cov, count) in saved.layers.items():
        arrays[f"{layer}|A"], arrays[f"{layer}|S"] = a_cov, s_cov
        arrays[f"{layer}|count"] = np.asarray(count)
    if saved.rows is not None:
        arrays[ROWS_KEY] = np.asarray(saved.rows, dtype=np.int64)
    arrays[STALE_KEY] = np.asarray(saved.stale)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    files.write_bytes(buffer.getvalue(), *key)


def has_curvature(files: SideFiles, run_id: str, checkpoint: str, split: str = "train") -> bool:
    """Whether a capture with ``curvature=True`` saved factors of the checkpoint's rows of ``split``."""
    return files.exists(*_key(run_id, checkpoint, split))


def read_curvature(files: SideFiles, run_id: str, checkpoint: str, split: str = "train") -> SavedCurvature:
    """The saved factors of the checkpoint's rows of ``split`` and what they describe (:class:`SavedCurvature`)."""
    key = _key(run_id, checkpoint, split)
    with files.reading(*key):
        return _read(files, key, _of(run_id, checkpoint, split))


def _read(files: SideFiles, key: tuple[str, str], of: str) -> SavedCurvature:
    """The file under ``key`` (the caller holds the key's lock)."""
    try:
        data = files.read_bytes(*key)
    except FileNotFoundError:
        raise MissingCurvatureError(f"no curvature statistics for {of}: capture with curvature=True") from None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            layers = sorted(key[: -len("|A")] for key in arrays.files if key.endswith("|A"))
            factors = {
                layer: (
                    np.asarray(arrays[f"{layer}|A"]),
                    np.asarray(arrays[f"{layer}|S"]),
                    int(arrays[f"{layer}|count"]),
                )
                for layer in layers
            }
            rows = int(arrays[ROWS_KEY]) if ROWS_KEY in arrays.files else None
            stale = bool(arrays[STALE_KEY]) if STALE_KEY in arrays.files else False
    except (ValueError, KeyError, OSError) as error:
        raise StoreCorruptError(f"curvature of {of} is damaged: {error}") from error
    return SavedCurvature(factors, rows, stale)


def load_curvature(files: SideFiles, run_id: str, checkpoint: str, split: str = "train") -> LayerCurvature:
    """Per layer ``(A, S, count)`` of the checkpoint's rows of ``split`` saved by a capture with ``curvature=True``."""
    return read_curvature(files, run_id, checkpoint, split).layers


class Curvature:
    """The curvature statistics of a store's runs' checkpoints (one side file per checkpoint and split)."""

    def __init__(self, catalog: RunCatalog) -> None:
        self.catalog = catalog
        self.tables = catalog.tables

    @writes("save curvature statistics")
    def save(
        self,
        run_id: str,
        checkpoint: str,
        stats: LayerCurvature,
        split: str = "train",
        *,
        add: bool = True,
        stale: bool = False,
    ) -> None:
        """Save per-layer Kronecker curvature statistics of a run's checkpoint over its rows of ``split``
        (``"train"`` or ``"true-fisher"``, one side file each): added to the saved ones (sums and token counts, so
        captures of parts of the checkpoint's rows save the factors of all of them; saved stale, they stay so), or,
        with ``add=False``, replacing them. The file records the split's rows the checkpoint holds now; ``stale``:
        the factors describe only part of them (warned on every load)."""
        self.catalog.run(run_id)
        key = _key(run_id, checkpoint, split)
        with self.tables.files.writing(*key):  # read, add and write under one lock: captures saving at once add up
            if add and self.tables.files.exists(*key):
                saved = _read(self.tables.files, key, _of(run_id, checkpoint, split))
                stats, stale = merged(saved.layers, stats), stale or saved.stale
            _write(self.tables.files, key, SavedCurvature(stats, self.rows(run_id, checkpoint, split), stale))

    def load(self, run_id: str, checkpoint: str, split: str = "train") -> LayerCurvature:
        """Per layer ``(A, S, count)`` of the checkpoint's rows of ``split`` saved by captures with
        ``curvature=True`` (``MissingCurvatureError`` if none was); :class:`StaleCurvatureWarning` where they do not
        describe the checkpoint's rows now (:meth:`stale`)."""
        saved = self.read(run_id, checkpoint, split)
        reason = self.stale(run_id, checkpoint, split, saved)
        if reason:
            warnings.warn(reason, StaleCurvatureWarning, stacklevel=2)
        return saved.layers

    def read(self, run_id: str, checkpoint: str, split: str = "train") -> SavedCurvature:
        """The saved factors of the checkpoint's rows of ``split`` and what they describe (no check)."""
        return read_curvature(self.tables.files, run_id, checkpoint, split)

    def has(self, run_id: str, checkpoint: str, split: str = "train") -> bool:
        """Whether a capture with ``curvature=True`` saved statistics of the checkpoint's rows of ``split``."""
        return has_curvature(self.tables.files, run_id, checkpoint, split)

    @writes("remove curvature statistics")
    def remove(self, run_id: str, checkpoint: str, split: str = "train") -> None:
        """Delete the saved factors of the checkpoint's rows of ``split`` (nothing happens if there are none):
        ``kfac``/``ekfac`` then estimate them from the rows (all of them), or a capture with ``curvature=True`` saves
        new ones."""
        key = _key(run_id, checkpoint, split)
        with self.tables.files.writing(*key):
            self.tables.files.remove(*key)

    def rows(self, run_id: str, checkpoint: str, split: str, before_step: int | None = None) -> int:
        """The rows of the run's checkpoint of ``split`` (at steps before ``before_step`` only, where given)."""
        steps = None if before_step is None else (None, before_step - 1)
        return self.tables.count(S.GRADIENTS, gradient_filter(run_id, checkpoint, split, steps))

    def stale(self, run_id: str, checkpoint: str, split: str, saved: SavedCurvature | None = None) -> str | None:
        """Why the checkpoint's saved factors of ``split`` do not describe its rows of ``split`` now (``None`` where
        they do, or where a file of an earlier version does not say which rows it was saved with)."""
        saved = self.read(run_id, checkpoint, split) if saved is None else saved
        of = f"{_of(run_id, checkpoint, split)}: its Kronecker factors (curvature=True, {saved.tokens} tokens)"
        rows = self.rows(run_id, checkpoint, split) if saved.stale or saved.rows is not None else None
        if saved.stale:
            return f"{of} describe only part of its {rows} {split} rows; {_remedy(split)}"
        if saved.rows is not None and rows != saved.rows:
            return (
                f"{of} were saved when it held {saved.rows} {split} rows, it holds {rows} now (rows added or deleted "
                f"without curvature=True); {_remedy(split)}"
            )
        return None

    @writes("mark curvature statistics stale")
    def mark_stale(self, run_id: str, checkpoint: str, split: str = "train") -> None:
        """Record that the checkpoint's saved factors of ``split`` describe only part of its rows (they stay as
        they are, and every later load warns)."""
        key = _key(run_id, checkpoint, split)
        with self.tables.files.writing(*key):
            saved = _read(self.tables.files, key, _of(run_id, checkpoint, split))
            _write(self.tables.files, key, SavedCurvature(saved.layers, saved.rows, True))

    def record_capture(
        self,
        run_id: str,
        checkpoints: Iterable[str],
        captured: Mapping[tuple[str, str], LayerCurvature],
        *,
        trained: Collection[str] = (),
        resumed_from: int | None = None,
        committed: Collection[tuple[str, int, str, str]] = (),
        skipped: int = 0,
    ) -> None:
        """After a capture of the run (its rows committed): save its factors of each of ``checkpoints`` and split
        (``captured[checkpoint, split]``; none for a capture without ``curvature=True``), and keep the saved factors
        from going silently stale. ``trained``: the checkpoints it wrote training rows to (training factors of other
        checkpoints are not saved: their rows were not written).

        - A capture's factors are added to the checkpoint's (:meth:`save`): captures of parts of its rows save the
          factors of all of them.
        - A resumed capture (``resumed_from``: the step of its first batch; ``committed``: the keys
          ``(checkpoint, step, split, example_id)`` of the rows committed from that step on before it; ``skipped``:
          the rows it skipped as committed) replays committed rows, which its factors count again:
          :meth:`_save_replayed` adds or replaces so that no row counts twice where that is exact, and saves them
          stale with a warning where it is not.
        - Where the capture saves no factors of a checkpoint's split but the checkpoint has saved factors whose rows
          changed since they were saved (rows written without ``curvature=True``), they are marked stale
          (:meth:`mark_stale`) and warned about (:class:`StaleCurvatureWarning`); factors of an earlier version, which
          do not record their rows, only where the capture wrote training rows."""
        pairs = [(checkpoint, split) for checkpoint in dict.fromkeys(checkpoints) for split in CURVATURE_SPLITS]
        stats = {pair: captured.get(pair, {}) if pair[1] != "train" or pair[0] in trained else {} for pair in pairs}
        replay = None
        if resumed_from is not None and skipped > 0:
            counts = Counter((key[0], key[2]) for key in committed)
            replay = ResumedRows(resumed_from, {pair: counts[pair] for pair in pairs if stats[pair]}, skipped)
        for (checkpoint, split), factors in stats.items():
            if factors and replay is not None and replay.replayed((checkpoint, split)) != 0:
                self._save_replayed(run_id, checkpoint, split, factors, replay)
            elif factors:
                self.save(run_id, checkpoint, factors, split)
            elif self.has(run_id, checkpoint, split):
                self._check_kept(run_id, checkpoint, split, trained)

    def _save_replayed(
        self, run_id: str, checkpoint: str, split: str, stats: LayerCurvature, replay: ResumedRows
    ) -> None:
        """Save the factors of a resumed capture that replayed ``r`` (:meth:`ResumedRows.replayed`) of the ``n`` rows
        of the split committed before it, whose saved factors describe all but ``u`` of them (the rows committed since
        they were saved: a crash lost their factors; ``u = n`` without saved factors). Its factors count the ``r``
        rows again and the rows it wrote. Replacing the saved ones is exact where ``r = n`` (the checkpoint replayed
        from its first batch), adding to them where ``r = u`` (the replay re-ran exactly the rows whose factors were
        lost). Otherwise neither is: the one that misdescribes fewer rows is saved (replacing leaves ``n - r`` out,
        adding counts ``|r - u|`` twice or not at all), stale, with a warning."""
        replayed = replay.replayed((checkpoint, split))
        earlier = self.rows(run_id, checkpoint, split, before_step=replay.from_step)
        before = earlier + replay.committed[checkpoint, split]  # the split's rows before the capture
        saved = self.read(run_id, checkpoint, split) if self.has(run_id, checkpoint, split) else None
        if saved is None:
            unfactored: int | None = before
        else:
            unfactored = None if saved.stale or saved.rows is None else before - saved.rows
        if replayed == before:
            self.save(run_id, checkpoint, stats, split, add=False)
            return
        if replayed is not None and replayed == unfactored:
            self.save(run_id, checkpoint, stats, split)
            return
        add = replayed is not None and unfactored is not None and abs(replayed - unfactored) < before - replayed
        self.save(run_id, checkpoint, stats, split, add=add, stale=True)
        if add:
            done = f"added to the saved ones ({abs(replayed - unfactored)} rows counted twice or left out)"
        else:
            done = "saved in place of the saved ones" + (
                "" if replayed is None else f" (the {before - replayed} rows it did not replay left out)"
            )
        lost = "" if unfactored is None or saved is None else f", {unfactored} of them without saved factors"
        warnings.warn(
            f"{_of(run_id, checkpoint, split)}: the resumed capture (resume=True) replayed "
            f"{'some' if replayed is None else replayed} of the {before} {split} rows committed before it{lost}, so "
            "neither adding its Kronecker factors to the saved ones nor replacing them counts every row once: they "
            f"were {done} and marked stale; replaying the checkpoint from its first batch gives exact factors; "
            f"{_remedy(split)}",
            StaleCurvatureWarning,
            stacklevel=5,
        )

    def _check_kept(self, run_id: str, checkpoint: str, split: str, trained: Collection[str]) -> None:
        saved = self.read(run_id, checkpoint, split)
        if saved.stale:
            return  # warned when it went stale, and on every load
        if saved.rows is None and (split != "train" or checkpoint not in trained):
            return  # a file of an earlier version: which rows it describes is not known
        rows = self.rows(run_id, checkpoint, split)
        if rows == saved.rows:
            return
        was = "" if saved.rows is None else f", saved when it held {saved.rows} {split} rows"
        how = "deleted" if saved.rows is not None and rows < saved.rows else "added"
        self.mark_stale(run_id, checkpoint, split)
        warnings.warn(
            f"{_of(run_id, checkpoint, split)}: {split} rows were {how} without curvature=True (by this capture, or "
            f"since its Kronecker factors were saved), so the factors ({saved.tokens} tokens{was}) do not describe "
            f"its {rows} {split} rows; {_remedy(split)}",
            StaleCurvatureWarning,
            stacklevel=5,
        )
