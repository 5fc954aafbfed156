"""Helpers shared by tests/test_reliability_*.py: figures for the summary line, throwaway
certificates, in-process servers, and export directories that differ only in their graph bytes."""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

# Printed by conftest.pytest_terminal_summary as one "reliability:" line.
FIGURES: collections.Counter = collections.Counter()
LATENCY: dict[str, str] = {}
_lock = threading.Lock()


def count(**amounts: int) -> None:
    with _lock:
        FIGURES.update(amounts)


def summary_line() -> str | None:
    if not FIGURES and not LATENCY:
        return None
    keys = ("load_sent", "load_ok", "load_errors", "load_lost", "load_checked_vs_pytorch",
            "faults_survived", "bad_inputs_tried", "fuzz_requests")
    parts = [f"{k}={FIGURES[k]}" for k in keys if k in FIGURES]
    parts += [f"{k}={v}" for k, v in sorted(FIGURES.items()) if k not in keys]
    parts += [f"{k}={v}" for k, v in LATENCY.items()]
    return "reliability: " + " ".join(parts)


# --- export directories -------------------------------------------------------------------------

def copy_with_new_graph_bytes(source: Path, dest: Path, tag: str) -> Path:
    """A copy of an export whose graph differs only in its doc_string (same weights, new sha256),
    with metadata.json updated to match: a valid "new model" that responses tell apart by hash."""
    import onnx

    shutil.copytree(source, dest)
    meta = json.loads((dest / "metadata.json").read_text())
    graph_file = dest / meta["graphs"]["fp32"]["file"]
    model = onnx.load(str(graph_file), load_external_data=False)
    model.doc_string = f"reliability test copy {tag}"
    onnx.save(model, str(graph_file))
    meta["graphs"]["fp32"]["sha256"] = hashlib.sha256(graph_file.read_bytes()).hexdigest()
    (dest / "metadata.json").write_text(json.dumps(meta, indent=2))
    return dest


def corrupt_export(source: Path, dest: Path, how: str) -> Path:
    """Broken copies of an export: each fails a different start-up check.

    truncated      graph cut in half, metadata sha256 updated (passes the hash check, fails the session)
    garbage        graph replaced by random bytes, sha256 updated
    hash_mismatch  graph changed, sha256 not updated
    bad_json       metadata.json is not JSON
    wrong_config   metadata config says d_model=48 while the graph computes 32 (probe inference catches it)
    wrong_kind     metadata config says input_kind=features for a token graph (graph-input check)
    missing_graph  the graph file is gone
    """
    shutil.copytree(source, dest)
    meta_path = dest / "metadata.json"
    meta = json.loads(meta_path.read_text())
    graph = dest / meta["graphs"]["fp32"]["file"]
    if how == "truncated":
        data = graph.read_bytes()
        graph.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        graph.write_bytes(hashlib.sha256(b"x").digest() * 500)
    elif how == "hash_mismatch":
        with open(graph, "ab") as handle:
            handle.write(b"\0")
        return dest
    elif how == "bad_json":
        meta_path.write_text("{ not json")
        return dest
    elif how == "wrong_config":
        meta["config"]["d_model"] = 48
        meta["config"]["n_heads"] = 4
    elif how == "wrong_kind":
        meta["config"]["input_kind"] = "features"
    elif how == "missing_graph":
        graph.unlink()
        return dest
    else:
        raise ValueError(how)
    meta["graphs"]["fp32"]["sha256"] = hashlib.sha256(graph.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta, indent=2))
    return dest


# --- certificates (generated at test time; nothing committed) ----------------------------------

def make_certs(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost, a client certificate signed by
    the CA, and a second, untrusted CA's client certificate. Returns PEM paths by name."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(label, cert, private_key):
        paths[f"{label}_cert"] = directory / f"{label}.crt"
        paths[f"{label}_key"] = directory / f"{label}.key"
        paths[f"{label}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{label}_key"].write_bytes(private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    def ca(label):
        k = key()
        cert = (x509.CertificateBuilder().subject_name(name(label)).issuer_name(name(label))
                .public_key(k.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(k, hashes.SHA256()))
        write(label, cert, k)
        return cert, k

    def leaf(label, issuer, sans, usage):
        issuer_cert, issuer_key = issuer
        k = key()
        builder = (x509.CertificateBuilder().subject_name(name(label)).issuer_name(issuer_cert.subject)
                   .public_key(k.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        write(label, builder.sign(issuer_key, hashes.SHA256()), k)

    root = ca("ca")
    leaf("server", root, [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
         ExtendedKeyUsageOID.SERVER_AUTH)
    leaf("client", root, [], ExtendedKeyUsageOID.CLIENT_AUTH)
    leaf("rogue_client", ca("rogue_ca"), [], ExtendedKeyUsageOID.CLIENT_AUTH)
    return paths


# --- in-process servers -----------------------------------------------------------------------

class InProcessServer:
    """create_server + start + load in this process (faster than a subprocess); `stop()` drains."""

    def __init__(self, export_dir: Path, **fields) -> None:
        from serve.assembly.app import create_server
        from serve.config import ServerConfig

        config = ServerConfig(port=0, metrics_port=-1, http_port=0, export_dir=str(export_dir), **fields)
        self.server, self.port = create_server(config)
        self.server.start()
        try:
            self.server.load()
        except BaseException:
            self.server.shutdown(0)
            raise
        self.target = f"127.0.0.1:{self.port}"

    def stop(self, grace: float = 5.0) -> bool:
        return self.server.shutdown(grace)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --- shutdown under load (test_serve_lifecycle, and test_reliability_chaos with a CPU hog) -----------

def assert_sigterm_under_load_answers_every_accepted_request(serve_start, export_dir: Path, *flags: str,
                                                             connect=None) -> list:
    """SIGTERM to a `python -m serve` under a closed-loop load of 6 clients: every refusal is
    UNAVAILABLE (never CANCELLED: nothing accepted is dropped), the log says drained, exit 0.
    `connect(server)`: each client (a context manager with `encode(sequences, hidden_states=)`; default: an
    EncoderClient, which gRPC puts on one shared connection per target). Returns the (code, details) of every
    call."""
    import grpc
    import numpy as np

    from client import EncoderClient

    connect = connect or (lambda server: EncoderClient(server.target, retries=0, timeout=30))
    server = serve_start(export_dir, "--max-queue-delay-ms", "5", "--grace-s", "20", *flags)
    codes: list[tuple[str, str]] = []
    ok = threading.Semaphore(0)
    lock = threading.Lock()
    stop = threading.Event()

    def load(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with connect(server) as client:
            while not stop.is_set():
                seqs = [rng.integers(0, 100, rng.integers(1, 100)) for _ in range(4)]
                try:
                    out = client.encode(seqs, hidden_states=True)
                    assert out.embeddings.shape == (4, 32)
                    result = ("OK", "")
                    ok.release()
                except grpc.RpcError as error:
                    result = (error.code().name, error.details() or "")
                    stop.set()  # after the first refusal, stop sending
                with lock:
                    codes.append(result)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in range(30):  # well under way
        assert ok.acquire(timeout=60)
    exit_code = server.terminate(timeout=60)
    stop.set()
    for t in threads:
        t.join(60)

    assert exit_code == 0, server.log()
    refused = [(code, details) for code, details in codes if code != "OK"]
    assert all(code == "UNAVAILABLE" for code, _ in refused), refused
    # A refusal happens at admission; no request that was admitted was dropped unanswered.
    assert not any("stopped before" in details or "grace period" in details for _, details in refused), refused
    log = server.log()
    assert "event=draining" in log and "drained=True" in log and "abandoned=0" in log
    return codes
