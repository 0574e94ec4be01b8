"""gradstore serve with TLS: both transports with a (self-signed) certificate, clients that trust it."""

from __future__ import annotations

import datetime
import ipaddress
import ssl

import httpx
import pytest
from served_store import READ, RUN, make_store

import gradstore
from gradstore.serve import Tokens, serve


@pytest.fixture
def certificate(tmp_path):
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_both_transports_serve_tls(tmp_path, certificate):
    cert, key = certificate
    local = make_store(tmp_path / "store")
    tokens = Tokens.parse(READ)
    with serve(local.uri, tokens=tokens, flight_port=0, http_port=0, tls_cert=cert, tls_key=key) as server:
        assert server.flight_uri.startswith("grpc+tls://") and server.http_url.startswith("https://")
        with gradstore.connect(server.flight_uri, token=READ, tls_root_certs=cert.read_bytes()) as client:
            assert client.attribute(run=RUN, k=2, method="grad-dot").equals(
                local.attribute(run=RUN, k=2, method="grad-dot", write=False)
            )
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=server.http_url, verify=trusted, timeout=60) as http:
            assert http.get("/api/runs", headers={"Authorization": f"Bearer {READ}"}).status_code == 200
            login = http.post("/login", data={"token": READ})
            cookie = login.headers["set-cookie"].lower()  # over TLS the login cookie is never sent in clear
            assert login.status_code == 303 and "secure" in cookie and "httponly" in cookie
        with httpx.Client(base_url=server.http_url, timeout=60) as untrusting, pytest.raises(httpx.ConnectError):
            untrusting.get("/api/runs")
