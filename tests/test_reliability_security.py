"""Security options: TLS, mutual TLS, the bearer token (health stays open), safe defaults, limits.
Certificates are generated at test time with `cryptography` (tests/reliability_common.make_certs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import EncoderClient, main as client_main
from serve.config import ServerConfig
from tests.reliability_common import InProcessServer, count, make_certs

TOKEN = "s3cret-token-for-tests"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def mtls_token_server(serve_export_dir, certs):
    server = InProcessServer(serve_export_dir, tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]),
                             tls_client_ca=str(certs["ca_cert"]), auth_token=TOKEN, admin=True)
    yield server
    server.stop()


def _client(server, certs, **overrides) -> EncoderClient:
    options = dict(tls_ca=str(certs["ca_cert"]), tls_cert=str(certs["client_cert"]),
                   tls_key=str(certs["client_key"]), token=TOKEN, retries=0, timeout=10)
    options.update(overrides)
    return EncoderClient(server.target, **options)


def test_mtls_with_the_right_token_is_served(mtls_token_server, certs):
    with _client(mtls_token_server, certs) as client:
        assert client.health() == "SERVING"
        assert client.encode([[1, 2, 3]]).embeddings.shape == (1, 32)
        assert client.model_info().name


def test_container_health_probe_speaks_mtls_and_fails_without_a_client_certificate(mtls_token_server, certs):
    probe = [sys.executable, str(REPO / "docker" / "health_probe.py"), "--addr", mtls_token_server.target,
             "--tls-ca", str(certs["ca_cert"])]
    ok = subprocess.run([*probe, "--tls-cert", str(certs["client_cert"]), "--tls-key", str(certs["client_key"])],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1], ""])
def test_a_missing_or_wrong_token_is_unauthenticated_on_every_rpc_but_health(mtls_token_server, certs, token):
    with _client(mtls_token_server, certs, token=token) as client:
        assert client.health() == "SERVING"  # probes need no token
        for call in (lambda: client.encode([[1, 2, 3]]), client.model_info, lambda: client.reload_model("")):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in caught.value.details()
    count(security_refusals=3)


def test_a_wrong_token_on_a_stream_is_unauthenticated(mtls_token_server, certs):
    from client import build_request

    with _client(mtls_token_server, certs, token="wrong") as client:
        with pytest.raises(grpc.RpcError) as caught:
            list(client.stub.EncodeStream(iter([build_request([[1, 2]])]), timeout=10, metadata=client.metadata))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("who", ["no_client_cert", "untrusted_client_cert", "plaintext", "untrusted_server"])
def test_mtls_refuses_clients_without_a_certificate_signed_by_the_ca(mtls_token_server, certs, who):
    overrides = {
        "no_client_cert": dict(tls_cert=None, tls_key=None),
        "untrusted_client_cert": dict(tls_cert=str(certs["rogue_client_cert"]),
                                      tls_key=str(certs["rogue_client_key"])),
        "plaintext": dict(tls_ca=None, tls_cert=None, tls_key=None),
        "untrusted_server": dict(tls_ca=str(certs["rogue_ca_cert"])),  # the client does not trust the server
    }[who]
    with _client(mtls_token_server, certs, timeout=3, **overrides) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.encode([[1, 2, 3]])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails; nothing is served
    count(security_refusals=1)


def test_tls_without_client_ca_serves_any_tls_client_and_the_cli_speaks_tls_and_token(
        serve_export_dir, certs, capsys):
    server = InProcessServer(serve_export_dir, tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]),
                             auth_token=TOKEN)
    try:
        with EncoderClient(server.target, tls_ca=str(certs["ca_cert"]), token=TOKEN, retries=0) as client:
            assert client.encode([[5, 6]]).embeddings.shape == (1, 32)
        argv = ["--target", server.target, "--tls-ca", str(certs["ca_cert"]), "--retries", "0"]
        assert client_main([*argv, "--token", TOKEN, "encode", "--ids", "1,2,3"]) == 0
        assert "sequence[0] length=3" in capsys.readouterr().out
        assert client_main([*argv, "--token", "nope", "encode", "--ids", "1,2,3"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        server.stop()


def test_token_only_server_on_plaintext_loopback(serve_export_dir):
    server = InProcessServer(serve_export_dir, auth_token=TOKEN)
    try:
        with EncoderClient(server.target, token=TOKEN, retries=0) as client:
            assert client.encode([[1]]).embeddings.shape == (1, 32)
        with EncoderClient(server.target, retries=0) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.encode([[1]])
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(server.target) as channel:  # health: open, for probes
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_defaults_bind_loopback_and_refuse_inconsistent_tls_settings(tmp_path):
    config = ServerConfig()
    assert config.host == "127.0.0.1" and config.metrics_host == "127.0.0.1"
    assert not config.admin and not config.auth_token and not config.fault_inject
    assert "auth_token" not in repr(ServerConfig(auth_token="x"))  # never logged by accident
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerConfig(tls_cert="a.pem")
    with pytest.raises(ValueError, match="needs tls_cert"):
        ServerConfig(tls_client_ca="ca.pem")


def test_an_unreadable_certificate_fails_at_start_with_a_clear_message(serve_export_dir, tmp_path):
    from serve.errors import ServeError

    missing = tmp_path / "nope.pem"
    with pytest.raises(ServeError, match="tls_cert .*cannot read"):
        InProcessServer(serve_export_dir, tls_cert=str(missing), tls_key=str(missing))

