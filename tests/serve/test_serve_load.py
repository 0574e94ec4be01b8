"""gradstore serve as a process (the ``gradstore serve`` command): clients mixing attribute, sql and report
requests while another process's writer appends (zero failures, every answer equal to what the store held at
the version it names), and the server SIGKILLed mid-load and restarted (the store verifies clean, the client
reconnects). The issue's 16 clients for 60 s is bench/serve.py's; here 8 clients for a few seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from served_store import DIM, READ, RUN, make_store

import gradstore

K = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, store_path, flight_port: int, http_port: int) -> None:
        env = {**os.environ, "GRADSTORE_TOKENS": READ}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradstore.cli",
                "serve",
                str(store_path),
                "--flight-port",
                str(flight_port),
                "--http-port",
                str(http_port),
                "--refresh",
                "0",
                "--batch-window-ms",
                "20",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        lines = []
        deadline = time.monotonic() + 180  # a hang guard for a busy machine, not a speed assert
        while len(lines) < 2:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the server exited: {self.process.stderr.read()}")
            lines.append(line.split()[1])
            assert time.monotonic() < deadline
        self.flight_uri, self.http_url = lines

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)


@pytest.fixture
def store_path(tmp_path):
    make_store(tmp_path / "store")
    return tmp_path / "store"


def _expected_ids(ids: list[str], rows: np.ndarray, query: np.ndarray) -> list[str]:
    scores = rows.astype(np.float64) @ query.astype(np.float64)
    return [ids[i] for i in np.argsort(-scores, kind="stable")[:K]]


def test_clients_under_load_while_a_writer_appends(store_path):
    server = ServerProcess(store_path, _free_port(), _free_port())
    try:
        store = gradstore.open(store_path)
        rng = np.random.default_rng(5)
        versions = {store.core.dataset("gradients").version: None}
        stop = threading.Event()
        answers: list = []
        failures: list = []

        def writer():
            for batch in range(6):
                with store.writer(RUN) as w:
                    w.append(
                        rng.standard_normal((5, DIM), dtype=np.float32) * 3,
                        [f"w-{batch}-{i}" for i in range(5)],
                        checkpoint="final",
                        split="train",
                    )
                versions[store.core.dataset("gradients").version] = batch
                time.sleep(0.3)

        def client(seed):
            local_rng = np.random.default_rng(seed)
            try:
                with (
                    gradstore.connect(server.flight_uri, token=READ) as remote,
                    httpx.Client(
                        base_url=server.http_url, headers={"Authorization": f"Bearer {READ}"}, timeout=120
                    ) as http,
                ):
                    turn = 0
                    while not stop.is_set():
                        turn += 1
                        if turn % 3 == 0:
                            count = remote.sql("SELECT count(*) AS n FROM gradients WHERE split = 'train'")
                            answers.append(("sql", remote.last_version, int(count.df()["n"][0])))
                        elif turn % 7 == 0:
                            response = http.get("/report")
                            assert response.status_code == 200 and "report-data" in response.text
                        else:
                            query = local_rng.standard_normal(DIM).astype(np.float32)
                            table = remote.attribute(query[None], run=RUN, k=K, method="grad-dot")
                            answers.append(("attribute", remote.last_version, (query, table)))
            except Exception as error:
                failures.append(error)

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        write = threading.Thread(target=writer)
        write.start()
        write.join(300)
        time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join(300)
        assert not failures, failures[:3]
        assert len(answers) > 20
        dataset = store.core.dataset("gradients")
        checked = set()
        for kind, version, value in answers:
            assert version in versions, (version, sorted(versions))  # only versions the writer committed
            at = dataset.checkout_version(version).to_table(
                columns=["example_id", "grad", "grad_norm"], filter="split = 'train'"
            )
            if kind == "sql":
                assert value == at.num_rows
            else:
                query, result = value
                ids = at.column("example_id").to_pylist()
                unit = np.asarray(at.column("grad").to_pylist(), dtype=np.float32)  # stored as unit vector x norm
                rows = unit * at.column("grad_norm").to_numpy()[:, None]
                assert result.column("example_id").to_pylist() == _expected_ids(ids, rows, query)
            checked.add(version)
        assert len(checked) >= 2  # answers were read at several versions while the writer appended
    finally:
        server.stop()


def test_a_killed_server_restarts_and_clients_reconnect(store_path):
    flight_port, http_port = _free_port(), _free_port()
    server = ServerProcess(store_path, flight_port, http_port)
    remote = gradstore.connect(server.flight_uri, token=READ, timeout_s=60)
    expected = remote.attribute(run=RUN, k=K, method="fisher")
    busy = threading.Event()

    def load():
        own = gradstore.connect(server.flight_uri, token=READ, timeout_s=60, reconnect_delays_s=())
        while not busy.is_set():
            with contextlib.suppress(gradstore.GradstoreError):  # the server is being killed: a failed call
                own.attribute(np.ones((1, DIM), np.float32), run=RUN, k=K, method="fisher")

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(0.5)
    server.kill()
    busy.set()
    thread.join(120)
    report = gradstore.open(store_path, create=False).verify()
    assert report.ok, report
    server = ServerProcess(store_path, flight_port, http_port)
    try:
        got = remote.attribute(run=RUN, k=K, method="fisher")  # the same client object reconnects
        assert got.equals(expected)
    finally:
        remote.close()
        server.stop()


def test_the_serve_command_refuses_in_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gradstore.cli import app

    monkeypatch.delenv("GRADSTORE_TOKENS", raising=False)
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "none")])
    assert result.exit_code == 1 and result.output.startswith("error: no tokens"), result.output
    monkeypatch.setenv("GRADSTORE_TOKENS", "short")
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "none")])
    assert result.exit_code == 1 and "at least 16 characters" in result.output
    monkeypatch.setenv("GRADSTORE_TOKENS", READ)
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "none"), "--http-port", "0", "--flight-port", "0"])
    assert result.exit_code == 1 and result.output.startswith("error:") and READ not in result.output
    assert len(result.output.strip().splitlines()) == 1
