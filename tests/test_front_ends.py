"""The server on several processes (`--front-ends N`, serve/assembly/front_ends.py): one engine process holds the
models, N front-end processes run the request path on the server's shared ports. From outside it is still one
server: the same answers as one process, one /metrics whose counts add up every process, a repository change
made through one front end seen through all, a front end that dies replaced (only its own calls fail), an
engine that dies failing every call at once and taking the server down, a drain under load that loses nothing,
and the weights held once, by the engine."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from client import EncoderClient, build_request, parse_response
from serve.assembly.front_ends import queued_connections_migrate
from serve.protocols.pb import pb_grpc
from tests.concurrency import call_concurrently
from tests.reliability_common import assert_sigterm_under_load_answers_every_accepted_request, wait_until

FRONT_ENDS = "2"
ATOL = 1e-6  # the same graph and session options in both servers; only the batches around a row may differ


class Connection:
    """A client on a connection of its own (grpc shares one per target otherwise): the kernel hands each new
    connection to one of the front ends (SO_REUSEPORT)."""

    def __init__(self, server) -> None:
        self.channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.EncoderServiceStub(self.channel)

    def encode(self, sequences, model: str = "", **options):
        request = build_request(list(sequences), **options)
        request.model = model
        return parse_response(self.stub.Encode(request, timeout=30))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _channels(server, count: int) -> list[Connection]:
    return [Connection(server) for _ in range(count)]


def _counter(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture(scope="module")
def pair(serve_start, serve_export_dir):
    """The same export served by one process and by an engine with two front ends."""
    return serve_start(serve_export_dir), serve_start(serve_export_dir, "--front-ends", FRONT_ENDS)


def test_a_server_on_the_cpu_runs_in_one_process_by_default(pair):
    import psutil

    one, _ = pair  # started without --front-ends: the default by device (serve/config.py front_end_count)
    assert one.front_ends == () and psutil.Process(one.proc.pid).children() == []


def test_the_front_ends_are_their_own_processes_beside_the_engine(pair):
    _, front = pair
    assert len(front.front_ends) == int(FRONT_ENDS) and front.proc.pid not in front.front_ends
    assert all(Path(f"/proc/{pid}").exists() for pid in front.front_ends)


def test_answers_through_front_ends_equal_one_processs(pair):
    one, front = pair
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 100, n) for n in (1, 7, 33, 128)]
    with EncoderClient(one.target, retries=0) as client:
        expected = client.encode(sequences, hidden_states=True)
    for client in _channels(front, 4):  # whichever front end each connection reaches
        with client:
            got = client.encode(sequences, hidden_states=True)
        np.testing.assert_allclose(got.embeddings, expected.embeddings, atol=ATOL, rtol=0)
        for g, e in zip(got.hidden_states, expected.hidden_states):
            np.testing.assert_allclose(g, e, atol=ATOL, rtol=0)
        assert got.token_counts == expected.token_counts
    body = {"input": [[5, 17, 42, 7]], "dimensions": 16}
    (status_one, one_json), (status_front, front_json) = _post(one, "/v1/embeddings", body), \
        _post(front, "/v1/embeddings", body)
    assert status_one == status_front == 200
    np.testing.assert_allclose(front_json["data"][0]["embedding"], one_json["data"][0]["embedding"], atol=ATOL)


def test_concurrent_calls_answered_in_bursts_each_get_their_own_answer(pair):
    """Calls that share runs come back from the engine in bursts (one message for the answers a run finished,
    serve/core/ipc.py): each call, whatever it asked (hidden states or not, its own lengths), gets its own."""
    one, front = pair
    rng = np.random.default_rng(1)
    asked = [([rng.integers(1, 100, n) for n in (3 + i % 5, 9 + i)], i % 2 == 0) for i in range(12)]
    with EncoderClient(one.target, retries=0) as client:
        expected = [client.encode(sequences, hidden_states=hidden) for sequences, hidden in asked]
    connections = _channels(front, 3)
    try:
        got = call_concurrently(lambda i: connections[i % 3].encode(asked[i][0], hidden_states=asked[i][1]),
                                len(asked))
    finally:
        for connection in connections:
            connection.close()
    for (sequences, hidden), g, e in zip(asked, got, expected):
        assert g is not None
        np.testing.assert_allclose(g.embeddings, e.embeddings, atol=ATOL, rtol=0)
        assert g.token_counts == e.token_counts == tuple(len(s) for s in sequences)
        assert bool(g.hidden_states) == hidden
        for gh, eh in zip(g.hidden_states or (), e.hidden_states or ()):
            np.testing.assert_allclose(gh, eh, atol=ATOL, rtol=0)


def test_a_refusal_is_the_same_through_a_front_end(pair):
    one, front = pair
    refusals = []
    for server in (one, front):
        with EncoderClient(server.target, retries=0) as client, pytest.raises(grpc.RpcError) as refused:
            client.encode([[1, 2, 999]])
        refusals.append((refused.value.code(), refused.value.details()))
    assert refusals[0] == refusals[1] and refusals[0][0] == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_add_up_every_front_ends_requests_on_the_engines_port(pair):
    _, front = pair
    before = _counter(front.metrics(), "encoder_requests_total", method="Encode", code="OK")
    clients = _channels(front, 6)
    for client in clients:
        for _ in range(5):
            client.encode([[1, 2, 3]])
        client.close()
    text = front.metrics()
    assert _counter(text, "encoder_requests_total", method="Encode", code="OK") == before + 30
    assert _counter(text, "encoder_ready") == 1.0  # the engine's own, once (no front end reports one)
    assert "encoder_batch_size_count" in text


def test_a_lone_client_through_a_front_end_is_answered_by_express_runs_in_the_engine(pair, serve_start,
                                                                                     serve_export_dir):
    """One client, one call at a time, through a front end: the engine runs each call after the model's first run
    (which measures its seconds per token) on the thread that read it from the wire (serve/core/express.py), counted
    on the engine's /metrics, and the answers equal one process's. The budget is set high so a busy machine's slower
    runs still qualify."""
    one, _ = pair
    front = serve_start(serve_export_dir, "--front-ends", "1", "--express-run-ms", "1000")
    rng = np.random.default_rng(5)
    sequences = [rng.integers(1, 100, n) for n in (3, 17, 40, 8)]
    with EncoderClient(one.target, retries=0) as client:
        expected = [client.encode([sequence], hidden_states=True) for sequence in sequences]
    with Connection(front) as client:
        got = [client.encode([sequence], hidden_states=True) for sequence in sequences]
    assert _counter(front.metrics(), "encoder_express_runs_total") == len(sequences) - 1
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.embeddings, e.embeddings, atol=ATOL, rtol=0)
        np.testing.assert_allclose(g.hidden_states[0], e.hidden_states[0], atol=ATOL, rtol=0)


def test_the_weights_are_held_by_the_engine_only(pair):
    _, front = pair
    engine_maps = Path(f"/proc/{front.proc.pid}/maps").read_text()
    assert "libonnxruntime" in engine_maps or "onnxruntime_pybind11_state" in engine_maps
    for pid in front.front_ends:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "onnxruntime" not in maps, "a front end loaded ONNX Runtime"
        assert ".onnx" not in maps, "a front end mapped a graph file"


@pytest.fixture
def repository_pair(serve_start, serve_export_dir, tmp_path):
    """A repository of two models (the test export twice), served by an engine with two front ends."""
    import shutil

    for name in ("a", "b"):
        shutil.copytree(serve_export_dir, tmp_path / name)
    return serve_start(tmp_path / "unused", "--model-repository", str(tmp_path), "--front-ends", FRONT_ENDS)


def test_an_unload_through_one_front_end_is_seen_through_every_one(repository_pair):
    server = repository_pair
    status, _ = _post(server, "/v2/repository/models/b/unload", {})
    assert status == 200
    for client in _channels(server, 6):  # every front end now refuses b as one process does, and serves a
        with client:
            # the news of the unload reaches the other front ends a moment later (UNAVAILABLE "unloading" meanwhile)
            assert wait_until(lambda: _refusal(client, "b") == grpc.StatusCode.NOT_FOUND, 30), _refusal(client, "b")
            assert client.encode([[1, 2]], model="a").embeddings.shape == (1, 32)
    status, _ = _post(server, "/v2/repository/models/b/load", {})
    assert status == 200
    for client in _channels(server, 6):
        with client:
            assert wait_until(lambda: _serves(client, "b"), 30)


def _refusal(client: Connection, model: str) -> grpc.StatusCode | None:
    """The status a call to `model` is refused with (None: it was served)."""
    try:
        client.encode([[1, 2]], model=model)
    except grpc.RpcError as error:
        return error.code()
    return None


def _serves(client: Connection, model: str) -> bool:
    try:
        return client.encode([[1, 2]], model=model).embeddings.shape == (1, 32)
    except grpc.RpcError:
        return False


def _load(server, stop: threading.Event, outcomes: list, lock: threading.Lock, clients: int = 6, *,
          reconnect: bool = False, reaped=None, late: list | None = None) -> list:
    """`clients` threads, each on its own connection, sending until `stop`. After a failed call a client stops
    (a client without retries), or with `reconnect` opens a new connection and goes on. Each call adds (client,
    result) to `outcomes`; with `reaped` (a callable: the dead front end is gone) a failure on a connection opened
    once it was is added to `late` too."""
    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        client, opened_late = Connection(server), False
        try:
            while not stop.is_set():
                ids = rng.integers(1, 100, 8)
                try:
                    out = client.encode([ids])
                    result = "OK" if out.embeddings.shape == (1, 32) else "WRONG"
                except grpc.RpcError as error:
                    result = error.code().name
                with lock:
                    outcomes.append((seed, result))
                    if result != "OK" and opened_late:
                        late.append((seed, result))
                if result != "OK":
                    if not reconnect:
                        return
                    client.close()
                    opened_late = reaped is not None and reaped()
                    client = Connection(server)
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def _results(outcomes: list) -> list[str]:
    return [result for _, result in list(outcomes)]


def test_a_killed_front_end_is_replaced_and_only_calls_it_held_fail(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--front-ends", FRONT_ENDS)
    stop, lock, outcomes, late, clients = threading.Event(), threading.Lock(), [], [], 6
    threads = _load(server, stop, outcomes, lock, clients, reconnect=True, late=late,
                    reaped=lambda: "event=front_end_died" in server.log())  # logged once the engine reaped it
    assert wait_until(lambda: _results(outcomes).count("OK") >= 50, 60)
    victim = server.front_ends[0]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: server.log().count("event=front_end_started index=0") >= 2, 60)  # started again
    with lock:
        seen = len(outcomes)
    assert wait_until(lambda: len(outcomes) >= seen + 50, 60)  # the load goes on
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a call hung"
    results = _results(outcomes)
    assert "WRONG" not in results
    assert set(results) <= {"OK", "UNAVAILABLE", "CANCELLED"}, set(results)
    # Only the calls the dead front end held failed: those on its connections, and those on connections that
    # reached its listener while the kernel tore the process down (some ms: the listener closes last, and with
    # net.ipv4.tcp_migrate_req=0 the connections waiting there are reset). Once it is gone, no call fails.
    assert late == [], late
    if queued_connections_migrate():  # the waiting connections go to the live front end: one failure a client
        failed = [seed for seed, result in outcomes if result != "OK"]
        assert len(failed) == len(set(failed)) <= clients, outcomes
    for client in _channels(server, 4):  # new connections, whichever front end takes them, are served
        with client:
            assert client.encode([[1, 2, 3]]).embeddings.shape == (1, 32)
    assert "front_end_died" in server.log() and server.proc.poll() is None


def _running(pid: int) -> bool:
    """The process runs: neither gone nor a zombie its parent has not reaped (it may go between two reads)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _kill_engine(server) -> None:
    """SIGKILL to the engine, as the OOM killer would (the engine itself removes nothing); then every front end
    has ended within 60 s."""
    server.proc.kill()
    server.proc.wait(10)
    assert wait_until(lambda: not any(_running(pid) for pid in server.front_ends), 60), \
        "a front end outlived its engine"


def test_a_killed_engine_fails_every_call_at_once_and_the_front_ends_exit(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--front-ends", FRONT_ENDS)
    stop, lock, outcomes = threading.Event(), threading.Lock(), []
    threads = _load(server, stop, outcomes, lock)
    assert wait_until(lambda: _results(outcomes).count("OK") >= 50, 60)
    _kill_engine(server)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a call hung"
    results = _results(outcomes)
    assert "WRONG" not in results and set(results) <= {"OK", "UNAVAILABLE"}, set(results)
    assert "event=engine_gone" in server.log()


def _engine_folder(server) -> Path:
    """The engine's folder (sockets, metrics files), as its front ends were told it."""
    environ = Path(f"/proc/{server.front_ends[0]}/environ").read_bytes().split(b"\0")
    return Path(next(v for v in environ if v.startswith(b"ENCODER_IPC_DIR=")).split(b"=", 1)[1].decode())


def test_a_killed_engines_folder_is_removed_by_its_last_front_end(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--front-ends", FRONT_ENDS)
    folder = _engine_folder(server)
    assert (folder / "engine.sock").exists()
    _kill_engine(server)
    assert not folder.exists(), sorted(p.name for p in folder.rglob("*"))


def test_a_drained_server_leaves_no_folder(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--front-ends", FRONT_ENDS)
    folder = _engine_folder(server)
    assert folder.is_dir()
    assert server.terminate() == 0
    assert not folder.exists()


def test_sigterm_under_load_through_front_ends_answers_every_accepted_call(serve_start, serve_export_dir):
    # each client on a connection of its own, so the load reaches every front end
    assert_sigterm_under_load_answers_every_accepted_request(serve_start, serve_export_dir, "--front-ends",
                                                             FRONT_ENDS, connect=Connection)
