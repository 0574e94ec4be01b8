"""Bearer tokens for ``gradstore serve``: read from a file or the environment, compared in constant time, never
logged (a token's ``repr`` names only its scope)."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from gradstore.errors import GradstoreError, InvalidArgumentError

#: Environment variable holding tokens (``TOKEN`` or ``TOKEN:write``, comma- or newline-separated).
TOKENS_ENV = "GRADSTORE_TOKENS"
SCOPES = ("read", "write")


class AuthError(GradstoreError):
    """A request without a valid bearer token (401), or whose token lacks the scope it needs (403)."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Token:
    secret: str = field(repr=False)
    scope: str = "read"


class Tokens:
    """The tokens a server accepts. ``Tokens.parse("abc, def:write")``; ``Tokens.load(file=..., env=...)``."""

    def __init__(self, tokens: list[Token]) -> None:
        if not tokens:
            raise InvalidArgumentError(
                f"no tokens: give --token-file or set {TOKENS_ENV} (a server without tokens refuses every request)"
            )
        self._tokens = tokens

    def __repr__(self) -> str:
        return f"Tokens({len(self._tokens)} tokens)"

    @classmethod
    def parse(cls, text: str) -> Tokens:
        tokens = []
        for raw in text.replace("\n", ",").split(","):
            item = raw.strip()
            if not item or item.startswith("#"):
                continue
            secret, _, scope = item.partition(":")
            scope = scope or "read"
            if scope not in SCOPES:
                raise InvalidArgumentError(f"a token's scope must be one of {SCOPES}, got {scope!r}")
            if len(secret) < 16:
                raise InvalidArgumentError("a token must be at least 16 characters")
            tokens.append(Token(secret, scope))
        return cls(tokens)

    @classmethod
    def load(cls, file: str | Path | None = None, env: str = TOKENS_ENV) -> Tokens:
        """Tokens from ``file`` (one per line, ``TOKEN`` or ``TOKEN:write``) and from environment variable ``env``."""
        text = os.environ.get(env, "")
        if file is not None:
            try:
                text += "\n" + Path(file).read_text(encoding="utf-8")
            except OSError as error:
                raise InvalidArgumentError(f"cannot read the token file: {error.strerror or error}") from error
        return cls.parse(text)

    def check(self, authorization: str | None, scope: str = "read") -> Token:
        """The token of an ``Authorization: Bearer ...`` header value; ``AuthError`` when none matches or its
        scope is too small."""
        if not authorization or not authorization.startswith("Bearer "):
            raise AuthError("a bearer token is required (Authorization: Bearer <token>)")
        given = authorization[len("Bearer ") :].strip().encode()
        found = None
        for token in self._tokens:  # every token compared: the time does not say which one matched
            if hmac.compare_digest(given, token.secret.encode()):
                found = token
        if found is None:
            raise AuthError("the bearer token is not valid")
        if scope == "write" and found.scope != "write":
            raise AuthError("this request writes to the store: it needs a write-scoped token", status=403)
        return found
