"""Many models in one server (`--model-repository`) and Triton's model repository extension
(serve/protocols/repository_api.py), against `python -m serve` subprocesses with real clients:
encoder.v1 Encode, tritonclient.grpc, tritonclient.http and the `openai` client.

Two DIFFERENT models (the session's token export, and one of the same shape from another seed) are
served as `a` and `b`; each must answer, over every protocol, exactly (bit for bit) what it answers
when served alone (`--export-dir`). Servers are module-scoped and started together; the tests that
load and unload use their own server and leave both models loaded. Threads are ordered by events,
never by sleeps."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from client import build_request, parse_response  # noqa: E402
from serve.protocols.pb import admin_pb, admin_pb_grpc, pb_grpc  # noqa: E402
from tests.conftest import _wait_serving  # noqa: E402
from tests.reliability_common import corrupt_export  # noqa: E402

IDS = np.array([[5, 17, 42, 7, 9, 3]], np.int64)
TIMEOUT = 60
ATOL = 1e-5  # one model's answer alone vs batched with other requests (a and b differ by far more)


# -- exports and repositories ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def export_b(tmp_path_factory) -> Path:
    """A second token model, the shape of serve_export_dir's, other weights (seed 1)."""
    from export.exporter import export_model
    from model.config import EncoderConfig

    config = EncoderConfig(name="serve-test-b", d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=100,
                           max_positions=128, positional="learned", seed=1)
    return Path(export_model(config, tmp_path_factory.mktemp("export-b")).directory)


def _padded(source: Path, dest: Path, size: int) -> Path:
    """A copy of an export whose fp32 graph carries `size` bytes of doc_string (a valid, bigger graph)."""
    import onnx

    shutil.copytree(source, dest)
    meta = json.loads((dest / "metadata.json").read_text())
    graph = dest / meta["graphs"]["fp32"]["file"]
    model = onnx.load(str(graph))
    model.doc_string = "x" * size
    onnx.save(model, str(graph))
    meta["graphs"]["fp32"]["sha256"] = hashlib.sha256(graph.read_bytes()).hexdigest()
    (dest / "metadata.json").write_text(json.dumps(meta))
    return dest


@pytest.fixture(scope="module")
def repositories(tmp_path_factory, serve_export_dir, export_b) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repositories")
    two, broken, budget = root / "two", root / "with-broken", root / "budget"
    for repo in (two, broken, budget):
        repo.mkdir()
        (repo / "a").symlink_to(serve_export_dir, target_is_directory=True)
    for repo in (two, broken):
        (repo / "b").symlink_to(export_b, target_is_directory=True)
    corrupt_export(serve_export_dir, broken / "broken", "truncated")
    _padded(serve_export_dir, budget / "big", 2 << 20)  # its graph alone is over a 1 MiB budget
    return {"two": two, "with-broken": broken, "budget": budget}


@pytest.fixture(scope="module")
def servers(serve_start, serve_export_dir, export_b, repositories):
    """Every server of this module, started at once (their start-ups overlap), once SERVING:
    shared   a, b and a broken export (read-only tests)
    alone_a, alone_b   each model alone (--export-dir): the answers to match
    changing a and b, --default-model b, --admin (the tests that load and unload)
    budget   a and a graph over --memory-budget-mb 1"""
    http = ("--http-port", "0")
    flags = {
        "shared": ("--model-repository", str(repositories["with-broken"]), *http),
        "alone_a": http,
        "alone_b": http,
        "changing": ("--model-repository", str(repositories["two"]), "--default-model", "b", "--admin", "true", *http),
        "budget": ("--model-repository", str(repositories["budget"]), "--memory-budget-mb", "1",
                   "--graph", "fp32"),
    }
    export = {"alone_b": export_b}
    started = {name: serve_start(export.get(name, serve_export_dir), *f, wait=False) for name, f in flags.items()}
    for server in started.values():
        _wait_serving(server.target, TIMEOUT)
    return started


# -- clients --------------------------------------------------------------------------------------

def encode(server, model: str, ids=IDS):
    """Encode's answer from `server` for `model`: (model_name, embedding float32 [1, D])."""
    with grpc.insecure_channel(server.target) as channel:
        request = build_request(list(ids))
        request.model = model
        response = pb_grpc.EncoderServiceStub(channel).Encode(request, timeout=TIMEOUT)
    return response.metadata.model_name, parse_response(response).embeddings


def v2_grpc(server, model: str, ids=IDS):
    client = grpcclient.InferenceServerClient(server.target)
    try:
        inputs = [grpcclient.InferInput("input_ids", list(ids.shape), "INT64")]
        inputs[0].set_data_from_numpy(ids)
        result = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput("embeddings")])
        return result.get_response().model_name, result.as_numpy("embeddings")
    finally:
        client.close()


def v2_http(server, model: str, ids=IDS):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        inputs = [httpclient.InferInput("input_ids", list(ids.shape), "INT64")]
        inputs[0].set_data_from_numpy(ids, binary_data=True)
        result = client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("embeddings", binary_data=True)])
        return result.get_response()["model_name"], result.as_numpy("embeddings")
    finally:
        client.close()


def openai_embeddings(server, model: str, ids=IDS):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0)
    try:
        response = client.embeddings.create(model=model, input=ids.tolist())
        return response.model, np.array([d.embedding for d in response.data], np.float32)
    finally:
        client.close()


PROTOCOLS = {"encode": encode, "v2_grpc": v2_grpc, "v2_http": v2_http, "openai": openai_embeddings}


def index_grpc(server, ready: bool = False) -> dict[str, tuple[str, str, str]]:
    """RepositoryIndex through tritonclient's own stub and messages: name -> (version, state, reason)."""
    with grpc.insecure_channel(server.target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
            service_pb2.RepositoryIndexRequest(ready=ready), timeout=TIMEOUT)
    return {m.name: (m.version, m.state, m.reason) for m in response.models}


def post(server, path: str, body: bytes = b"") -> tuple[int, object]:
    """A raw POST to the v2 REST API: (status, parsed JSON body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def both_loaded(servers):
    """The `changing` server with a and b served (a test before may have unloaded one)."""
    server = servers["changing"]
    client = grpcclient.InferenceServerClient(server.target)
    for name, (_, state, _) in index_grpc(server).items():
        if state != "READY":
            client.load_model(name)
    client.close()
    assert {s for _, s, _ in index_grpc(server).values()} == {"READY"}
    return server


# -- two models at once ---------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_models_served_at_once_each_answer_exactly_as_served_alone(servers, protocol):
    call = PROTOCOLS[protocol]
    shared = servers["shared"]
    got = {model: call(shared, model) for model in ("a", "b")}
    alone = {"a": call(servers["alone_a"], "serve-test"), "b": call(servers["alone_b"], "serve-test-b")}
    for model in ("a", "b"):
        name, embedding = got[model]
        assert name == model
        assert embedding.shape == (1, 32) and embedding.dtype == np.float32
        assert np.array_equal(embedding, alone[model][1]), (protocol, model)
    assert not np.allclose(got["a"][1], got["b"][1], atol=1e-3)  # two different models


def test_an_empty_model_name_beside_two_models_is_invalid_argument_naming_them(servers):
    with pytest.raises(grpc.RpcError) as info:
        encode(servers["shared"], "")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "serves 2 models ('a', 'b'); name one (or start the server with --default-model)" in info.value.details()
    with pytest.raises(InferenceServerException) as v2:
        v2_grpc(servers["shared"], "")
    assert v2.value.status() == "StatusCode.INVALID_ARGUMENT" and "('a', 'b')" in v2.value.message()


def test_an_empty_model_name_goes_to_the_default_model(servers, both_loaded):
    named, default = encode(both_loaded, "b"), encode(both_loaded, "")
    assert default[0] == "b" and np.array_equal(default[1], named[1])
    named, default = v2_grpc(both_loaded, "b"), v2_grpc(both_loaded, "")
    assert default[0] == "b" and np.array_equal(default[1], named[1])


def test_an_unknown_model_is_not_found_naming_the_served_ones(servers):
    with pytest.raises(grpc.RpcError) as info:
        encode(servers["shared"], "nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "model 'nope' is not served here; this server serves 'a', 'b'"
    with pytest.raises(InferenceServerException) as v2:
        v2_http(servers["shared"], "nope")
    assert v2.value.status() == "404" and "this server serves 'a', 'b'" in v2.value.message()


def test_a_broken_export_is_refused_alone_and_the_index_says_why(servers):
    shared = servers["shared"]
    index = index_grpc(shared)
    assert {name: state for name, (_, state, _) in index.items()} == {
        "a": "READY", "b": "READY", "broken": "UNAVAILABLE"}
    assert "cannot load" in index["broken"][2] and "broken" in index["broken"][2]
    assert encode(shared, "a")[0] == "a" and encode(shared, "b")[0] == "b"
    client = grpcclient.InferenceServerClient(shared.target)
    assert not client.is_model_ready("broken")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("broken")  # tried again: refused again, with the reason; nothing else changes
    client.close()
    assert info.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert "load 'broken' refused" in info.value.message() and "cannot load" in info.value.message()
    assert index_grpc(shared, ready=True).keys() == {"a", "b"}


# -- the repository API ---------------------------------------------------------------------------

def test_server_metadata_lists_the_model_repository_extension(servers):
    client = grpcclient.InferenceServerClient(servers["shared"].target)
    assert "model_repository" in client.get_server_metadata().extensions
    client.close()


def test_tritonclient_grpc_unload_index_and_load(both_loaded):
    client = grpcclient.InferenceServerClient(both_loaded.target)
    try:
        client.unload_model("a")
        assert index_grpc(both_loaded) == {"a": ("1", "UNAVAILABLE", "unloaded"), "b": ("1", "READY", "")}
        assert index_grpc(both_loaded, ready=True).keys() == {"b"}
        assert {m["name"]: m["state"] for m in client.get_model_repository_index(as_json=True)["models"]} == {
            "a": "UNAVAILABLE", "b": "READY"}
        assert not client.is_model_ready("a") and client.is_model_ready("b")
        with pytest.raises(InferenceServerException) as gone:
            v2_grpc(both_loaded, "a")
        assert gone.value.status() == "StatusCode.NOT_FOUND"
        assert "model 'a' is not served here; this server serves 'b'" in gone.value.message()
        with pytest.raises(InferenceServerException) as again:
            client.unload_model("a")
        assert again.value.status() == "StatusCode.NOT_FOUND" and "not loaded" in again.value.message()
        client.load_model("a")
        assert index_grpc(both_loaded) == {"a": ("1", "READY", ""), "b": ("1", "READY", "")}
        assert v2_grpc(both_loaded, "a")[0] == "a"
    finally:
        client.close()


def test_tritonclient_http_unload_index_and_load(both_loaded):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{both_loaded.http_port}")
    try:
        client.unload_model("b")
        assert client.get_model_repository_index() == [
            {"name": "a", "version": "1", "state": "READY", "reason": ""},
            {"name": "b", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
        assert post(both_loaded, "/v2/repository/index", b'{"ready": true}') == (
            200, [{"name": "a", "version": "1", "state": "READY", "reason": ""}])
        assert not client.is_model_ready("b")
        with pytest.raises(InferenceServerException) as gone:
            v2_http(both_loaded, "b")
        assert gone.value.status() == "404" and "model 'b' is not served here" in gone.value.message()
        client.load_model("b")
        assert client.is_model_ready("b") and v2_http(both_loaded, "b")[0] == "b"
        assert post(both_loaded, "/v2/repository/models/b/load", b"{}") == (200, {})  # a loaded one: reloaded
    finally:
        client.close()


def test_admin_service_lists_unloads_loads_and_reloads_models_by_name(both_loaded, serve_export_dir, export_b):
    sha = {name: json.loads((path / "metadata.json").read_text())["graphs"]["fp32"]["sha256"]
           for name, path in (("a", serve_export_dir), ("b", export_b))}
    with grpc.insecure_channel(both_loaded.target) as channel:
        admin = admin_pb_grpc.AdminServiceStub(channel)
        listed = lambda ready=False: [(m.name, m.version, m.state, m.reason)  # noqa: E731
                                      for m in admin.ListModels(admin_pb.ListModelsRequest(ready=ready)).models]
        admin.UnloadModel(admin_pb.UnloadModelRequest(model="a"), timeout=TIMEOUT)
        assert listed() == [("a", "1", "UNAVAILABLE", "unloaded"), ("b", "1", "READY", "")]
        assert listed(ready=True) == [("b", "1", "READY", "")]
        loaded = admin.LoadModel(admin_pb.LoadModelRequest(model="a"), timeout=TIMEOUT)
        assert (loaded.model_name, loaded.previous_sha256, loaded.sha256) == ("a", "", sha["a"])
        reloaded = admin.ReloadModel(admin_pb.ReloadModelRequest(model="b"), timeout=TIMEOUT)  # not the default's
        assert (reloaded.model_name, reloaded.previous_sha256, reloaded.sha256) == ("b", sha["b"], sha["b"])
        assert listed() == [("a", "1", "READY", ""), ("b", "1", "READY", "")]


@pytest.mark.parametrize("path,body,status,message", [
    ("/v2/repository/models/nope/load", b"", 404, "model 'nope' is not in the repository"),
    ("/v2/repository/models/nope/unload", b"", 404, "model 'nope' is not loaded; loaded: 'a', 'b'"),
    ("/v2/repository/models/a/load", b'{"parameters": {"config": "{}"}}', 501, "override config or files"),
    ("/v2/repository/models/a/unload", b'{"parameters": {"force": true}}', 400, "unknown parameter 'force'"),
    ("/v2/repository/index", b'{"ready": "yes"}', 400, "ready: expected true or false, got 'yes'"),
    ("/v2/repository/index", b"[", 400, "not valid JSON"),
], ids=["load-unknown", "unload-not-loaded", "load-config", "unload-unknown-parameter", "index-ready", "bad-json"])
def test_repository_rest_errors_are_v2_error_bodies_with_the_mapped_status(both_loaded, path, body, status, message):
    got_status, got = post(both_loaded, path, body)
    assert got_status == status and set(got) == {"error"} and message in got["error"], (got_status, got)


def test_load_and_unload_are_refused_failed_precondition_on_a_one_export_server(servers):
    alone = servers["alone_a"]
    client = grpcclient.InferenceServerClient(alone.target)
    try:
        for change in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException) as info:
                change("serve-test")
            assert info.value.status() == "StatusCode.FAILED_PRECONDITION"
            assert "serves one export (--export-dir); start it with --model-repository" in info.value.message()
        assert index_grpc(alone) == {"serve-test": ("1", "READY", "")}
        assert v2_grpc(alone, "serve-test")[0] == "serve-test"
    finally:
        client.close()


def test_load_and_unload_need_the_auth_token_like_every_other_call(repositories):
    from tests.reliability_common import InProcessServer

    token = "repository-token-0123456789"
    server = InProcessServer(repositories["two"], model_repository=str(repositories["two"]), auth_token=token)
    granted = {"authorization": f"Bearer {token}"}
    http = f"127.0.0.1:{server.server.http.port}"
    try:
        for client in (grpcclient.InferenceServerClient(server.target), httpclient.InferenceServerClient(http)):
            for change in (client.unload_model, client.load_model):
                with pytest.raises(InferenceServerException) as refused:
                    change("a")
                assert refused.value.status() in ("StatusCode.UNAUTHENTICATED", "401")
            client.unload_model("a", headers=granted)
            client.load_model("a", headers=granted)
            client.close()
        assert [e.state for e in server.server.repository.index()] == ["READY", "READY"]
    finally:
        server.stop()


def test_a_model_past_the_memory_budget_is_unavailable_and_its_load_resource_exhausted(servers):
    budget = servers["budget"]
    index = index_grpc(budget)
    assert index["a"] == ("1", "READY", "")
    _, state, reason = index["big"]
    assert state == "UNAVAILABLE" and "load 'big': needs about" in reason
    assert "the memory budget (--memory-budget-mb) is 1.0 MiB" in reason
    client = grpcclient.InferenceServerClient(budget.target)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("big")
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "the memory budget (--memory-budget-mb) is 1.0 MiB" in info.value.message()
        assert "in use by a " in info.value.message()
    finally:
        client.close()
    assert encode(budget, "a")[0] == "a"


def test_unload_under_load_loses_no_admitted_request_of_either_model(servers, both_loaded):
    """Clients call a and b without pause; once every one has been answered, a is unloaded. Every call
    to a is answered or refused NOT_FOUND / UNAVAILABLE naming it (none cancelled, failed or lost); every
    call to b succeeds; after the unload returns, a is NOT_FOUND."""
    expected = {"a": encode(servers["alone_a"], "serve-test")[1], "b": encode(servers["alone_b"], "serve-test-b")[1]}
    unloaded, stop = threading.Event(), threading.Event()
    clients = [("a", i) for i in range(3)] + [("b", i) for i in range(2)]
    answered = {c: threading.Event() for c in clients}  # a first answer: the client is under way
    after = {c: threading.Event() for c in clients}  # a call sent after the unload returned was answered
    outcomes: dict[tuple, list] = {c: [] for c in clients}  # (sent after the unload?, code, details)

    def run(key) -> None:
        model = key[0]
        with grpc.insecure_channel(both_loaded.target) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            request = build_request(list(IDS))
            request.model = model
            while not stop.is_set():
                late = unloaded.is_set()
                try:
                    response = stub.Encode(request, timeout=TIMEOUT)
                    ok = (response.metadata.model_name == model  # batched with others: float noise only
                          and np.allclose(parse_response(response).embeddings, expected[model], atol=ATOL, rtol=ATOL))
                    outcomes[key].append((late, "OK" if ok else "WRONG ANSWER", ""))
                except grpc.RpcError as error:
                    outcomes[key].append((late, error.code().name, error.details()))
                answered[key].set()
                if late:
                    after[key].set()

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(TIMEOUT) for e in answered.values())
        client = grpcclient.InferenceServerClient(both_loaded.target)
        client.unload_model("a")
        client.close()
        unloaded.set()
        assert all(e.wait(TIMEOUT) for e in after.values())
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
    for (model, _), seen in outcomes.items():
        if model == "b":
            assert {code for _, code, _ in seen} == {"OK"}, seen[:5]
            continue
        for late, code, details in seen:
            assert code in ("OK", "NOT_FOUND", "UNAVAILABLE"), (code, details)
            if code != "OK":
                assert "model 'a'" in details, details
            if late:
                assert code == "NOT_FOUND", (code, details)
        assert seen[0][1] == "OK" and seen[-1][1] == "NOT_FOUND"
    unloads = [line for line in both_loaded.log().splitlines() if "event=model_unloaded" in line]
    assert "model=a" in unloads[-1] and "drained=True" in unloads[-1], unloads
