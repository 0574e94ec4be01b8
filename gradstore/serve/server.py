"""Start and stop both transports of one :class:`~gradstore.serve.service.Service`."""

from __future__ import annotations

import threading
from pathlib import Path, PurePath
from typing import Any

from gradstore.serve.auth import Tokens
from gradstore.serve.flight import FlightService
from gradstore.serve.service import Limits, Service


class Server:
    """A running server: ``.flight_uri``, ``.http_url``; ``.stop()``. Made by :func:`serve`."""

    def __init__(
        self, service: Service, flight_server: FlightService | None, http_server: Any, scheme: str, host: str
    ) -> None:
        self.service = service
        self.flight = flight_server
        self.http = http_server
        self.flight_uri = f"{scheme}://{host}:{flight_server.port}" if flight_server else None
        self._threads: list[threading.Thread] = []
        self.http_url: str | None = None
        self._host = host

    def start(self) -> Server:
        if self.flight is not None:
            thread = threading.Thread(target=self.flight.serve, name="gradstore-flight", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.http is not None:
            thread = threading.Thread(target=self.http.run, name="gradstore-http", daemon=True)
            thread.start()
            self._threads.append(thread)
            while not self.http.started:  # uvicorn binds then sets started; a bind failure ends the thread
                if not thread.is_alive():
                    raise OSError("the HTTP server did not start (is the port in use?)")
                thread.join(0.02)
            port = self.http.servers[0].sockets[0].getsockname()[1]
            tls = self.http.config.ssl_certfile is not None
            self.http_url = f"{'https' if tls else 'http'}://{self._host}:{port}"
        return self

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C stops it)."""
        try:
            for thread in self._threads:
                while thread.is_alive():
                    thread.join(0.5)
        except KeyboardInterrupt:
            self.stop()

    def stop(self) -> None:
        if self.http is not None:
            self.http.should_exit = True
        if self.flight is not None:
            self.flight.shutdown()
        for thread in self._threads:
            thread.join(30)
        self.service.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    store: str | PurePath,
    *,
    tokens: Tokens,
    host: str = "127.0.0.1",
    flight_port: int | None = 8815,
    http_port: int | None = 8080,
    allow_writes: bool = False,
    refresh_s: float = 1.0,
    limits: Limits | None = None,
    batch_window_s: float = 0.0,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    warm: list[str] | None = None,
    warm_kinds: tuple[str, ...] = ("exact",),
    start: bool = True,
    model: str | None = None,
) -> Server:
    """Serve ``store`` (opened read-only for requests; ``allow_writes``: write-scoped tokens may ask ``write=True``).
    ``flight_port``/``http_port``: ``0`` picks a free port, ``None`` leaves that transport off. ``tls_cert`` and
    ``tls_key`` (PEM files) turn on TLS for both. ``limits``: what a request may ask and the server spend
    (:class:`~gradstore.serve.service.Limits`, docs/serve.md "Security model"). ``warm``: methods looked up once per
    run (and per index kind of ``warm_kinds``) before the first request (:meth:`Service.warm`). ``model``:
    ``"module:factory"`` (:mod:`gradstore.serve.model`), loaded once here, turns on text queries
    (``POST /api/attribute_text``).
    Returns the started :class:`Server`."""
    text_model = None
    if model is not None:
        from gradstore.serve.model import load_model

        text_model = load_model(model)
    service = Service(
        store,
        allow_writes=allow_writes,
        refresh_s=refresh_s,
        limits=limits,
        batch_window_s=batch_window_s,
        model=text_model,
    )
    if warm:
        service.warm(list(warm), tuple(warm_kinds))
    tls = None
    if tls_cert is not None or tls_key is not None:
        if tls_cert is None or tls_key is None:
            from gradstore.errors import InvalidArgumentError

            raise InvalidArgumentError("TLS needs both a certificate and its key")
        tls = [(Path(tls_cert).read_bytes(), Path(tls_key).read_bytes())]
    scheme = "grpc+tls" if tls else "grpc"
    flight_server = None
    if flight_port is not None:
        flight_server = FlightService(service, tokens, f"{scheme}://{host}:{flight_port}", tls_certificates=tls)
    http_server = None
    if http_port is not None:
        import uvicorn

        from gradstore.serve.guard import protocol_class
        from gradstore.serve.http import create_app

        limits = service.limits
        config = uvicorn.Config(
            create_app(service, tokens),
            host=host,
            port=http_port,
            http=protocol_class(limits.header_timeout_s, limits.body_timeout_s, limits.max_connections_per_client),
            log_level="warning",
            access_log=False,
            ssl_certfile=str(tls_cert) if tls else None,
            ssl_keyfile=str(tls_key) if tls else None,
            limit_concurrency=limits.max_connections,
            backlog=min(limits.max_connections, 4096),
            timeout_keep_alive=5,
        )
        http_server = uvicorn.Server(config)
        http_server.install_signal_handlers = lambda: None  # the caller's thread owns signals
    server = Server(service, flight_server, http_server, scheme, host)
    return server.start() if start else server
