"""Adding attribution methods from user code: :func:`register_method`.

A method over one checkpoint's rows is a preconditioner (a class with the :class:`indexers.Preconditioner`
protocol: a streaming fit over the stored rows, then ``apply_query``/``apply_both``) and how it scores: with the
query side alone (``(P^-1 q) . g``) or both sides (``(P^-1/2 q) . (P^-1/2 g)``). Registered, it is a row of
:data:`gradstore.methods.METHODS` like the built-in ones, so ``attribute``, ``score_matrix``,
``self_influence``, ``select`` and ``build_index`` take it, its fits are cached and saved in the store like
theirs, the CLI offers it, and ``gradstore serve`` serves it.

Where user code is loaded from: the process that registers it (a script, a notebook), and for the command line
and the server the modules named in the ``GRADSTORE_PLUGINS`` environment variable (comma-separated) and the
entry points of group ``gradstore.methods`` of installed packages (:func:`load_plugins`). A store never names
code to load: a call naming a method this process has not registered is refused as an unknown method, whatever
fits of it the store holds.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points

from gradstore.errors import InvalidArgumentError
from gradstore.methods.preconditioned import Preconditioned
from gradstore.methods.registry import ALIASES, METHODS, Method
from indexers import PRECONDITIONERS, register_preconditioner

#: Environment variable naming modules (comma-separated) the CLI and the server import before they start.
PLUGINS_VARIABLE = "GRADSTORE_PLUGINS"
#: Entry-point group of installed packages that register methods.
ENTRY_POINT_GROUP = "gradstore.methods"
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}")


def register_method(
    name: str,
    preconditioner: type,
    *,
    summary: str,
    query_only: bool = True,
    damped: bool = True,
    unit_norm: bool = False,
) -> Preconditioned:
    """Register a method called ``name`` scoring with ``preconditioner`` (a class, registered under its own
    ``name`` attribute; see the module docstring) and return it: a
    :class:`~gradstore.methods.preconditioned.Preconditioned` method over one checkpoint's rows.

    ``query_only``: score ``(P^-1 q) . g`` (``True``) or ``(P^-1/2 q) . (P^-1/2 g)``; ``damped``: the method
    takes ``damping=`` (passed to the class as ``damping=``); ``unit_norm``: both sides unit-normalised after
    preconditioning (a cosine in that space). Registering the same name with the same definition again is a
    no-op; any other clash, a name that is not lower-case letters, digits, ``-``/``_`` (at most 40), or a class
    that lacks a member of the protocol is an ``InvalidArgumentError``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"a method name is 1-40 lower-case letters, digits, '-' or '_' starting with a letter, got {name!r}"
        )
    try:
        register_preconditioner(preconditioner)
    except ValueError as error:
        raise InvalidArgumentError(f"cannot register method {name!r}: {error}") from None
    method = Preconditioned(
        name,
        preconditioner.name,
        query_only=query_only,
        damped=damped,
        unit_norm=unit_norm,
        summary=summary,
    )
    return register(method)


def register(method: Method) -> Method:
    """Register ``method``, an instance of a family (:class:`~gradstore.methods.Method`: one of
    :data:`gradstore.methods.FAMILIES`, or a subclass of your own implementing the operations its ``operations``
    name), under its ``name``, and return it. Registering the same method again is a no-op; a name that exists
    (a built-in method, an alias or another definition) or is not 1-40 lower-case letters, digits, ``-`` or ``_``
    is an ``InvalidArgumentError``."""
    if not isinstance(method, Method):
        raise InvalidArgumentError(f"register takes a gradstore.methods.Method, got {type(method).__name__}")
    name = method.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"a method name is 1-40 lower-case letters, digits, '-' or '_' starting with a letter, got {name!r}"
        )
    existing = METHODS.get(name)
    if existing is not None and existing != method or name in ALIASES:
        raise InvalidArgumentError(f"a method named {name!r} exists already: register yours under another name")
    METHODS[name] = method
    return method


def load_plugins() -> list[str]:
    """Import the modules of ``GRADSTORE_PLUGINS`` and load the ``gradstore.methods`` entry points (what the CLI
    and ``gradstore serve`` do before they start); returns what was loaded. A module or entry point that fails
    to load is an ``InvalidArgumentError`` naming it."""
    loaded = []
    names = [part.strip() for part in os.environ.get(PLUGINS_VARIABLE, "").split(",") if part.strip()]
    for module in names:
        try:
            importlib.import_module(module)
        except Exception as error:
            raise InvalidArgumentError(
                f"{PLUGINS_VARIABLE} names {module!r}, which failed to import: {error}"
            ) from error
        loaded.append(module)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()
        except Exception as error:
            raise InvalidArgumentError(f"entry point {point.name!r} of {ENTRY_POINT_GROUP} failed: {error}") from error
        loaded.append(point.value)
    return loaded


@contextmanager
def scoped_registry() -> Iterator[None]:
    """Methods (and their preconditioners) registered inside the block are forgotten when it ends: for a method's
    tests and for trying one out without leaving it in the process's registry."""
    methods, preconditioners = dict(METHODS), dict(PRECONDITIONERS)
    try:
        yield
    finally:
        METHODS.clear()
        METHODS.update(methods)
        PRECONDITIONERS.clear()
        PRECONDITIONERS.update(preconditioners)
