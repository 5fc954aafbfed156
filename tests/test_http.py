"""HTTP (serve/transport/http.py, serve/protocols/openai.py): OpenAI's embeddings API on the same core,
called with the real `openai` client and curl against a real server process; the numbers equal gRPC
Encode's for the same inputs, and the MiniLM export answers as sentence-transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from client import EncoderClient  # noqa: E402
from tests.test_text_serving import (  # noqa: E402  (the MiniLM export and reference, one home)
    assert_matches_sentence_transformers,
    sentence_model,  # noqa: F401  (a fixture)
    text_export_dir,  # noqa: F401  (a fixture)
)

ATOL = 1e-6  # the same server, graph and batch shapes: HTTP and gRPC agree to float noise
TEXTS = ["A first sentence.", "Une deuxième phrase, un peu plus longue que la première.", "x"]


@pytest.fixture(scope="module")
def text_server(serve_start, text_export_dir):  # noqa: F811
    return serve_start(text_export_dir)


@pytest.fixture(scope="module")
def token_server(serve_start, serve_export_dir):
    return serve_start(serve_export_dir, "--max-sequences-per-request", "4")


def oai(server, **options):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                         **options)


def post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=body, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def model_name(server) -> str:
    return EncoderClient(server.target).model_info().name


def test_strings_equal_grpc_texts_and_sentence_transformers(text_server, sentence_model):  # noqa: F811
    got = oai(text_server).embeddings.create(model=model_name(text_server), input=TEXTS)
    vectors = np.array([d.embedding for d in got.data], np.float32)
    assert [d.index for d in got.data] == [0, 1, 2]
    with EncoderClient(text_server.target) as grpc_client:
        np.testing.assert_allclose(vectors, grpc_client.embed(TEXTS).embeddings, atol=ATOL, rtol=0)
    assert_matches_sentence_transformers(vectors, sentence_model.encode(TEXTS, normalize_embeddings=True))
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)


def test_one_string_gives_one_embedding(text_server):
    got = oai(text_server).embeddings.create(model=model_name(text_server), input=TEXTS[0])
    assert len(got.data) == 1 and len(got.data[0].embedding) == 384


def test_token_id_lists_equal_grpc_encode(token_server):
    ids = [[5, 17, 42, 7], [9, 10, 11]]
    got = oai(token_server).embeddings.create(model=model_name(token_server), input=ids)
    with EncoderClient(token_server.target) as grpc_client:
        expected = grpc_client.encode([np.array(x) for x in ids]).embeddings
    np.testing.assert_allclose(np.array([d.embedding for d in got.data], np.float32), expected, atol=ATOL, rtol=0)
    assert got.usage.prompt_tokens == 7


def test_base64_encoding_carries_the_same_floats(token_server):
    client, name = oai(token_server), model_name(token_server)
    floats = client.embeddings.create(model=name, input=[[5, 17, 42]], encoding_format="float")
    # the openai client decodes base64 itself; ask with raw HTTP to see the wire form too
    status, _, raw = post(token_server, "/v1/embeddings", json.dumps(
        {"model": name, "input": [[5, 17, 42]], "encoding_format": "base64"}).encode())
    assert status == 200 and isinstance(raw["data"][0]["embedding"], str)
    import base64

    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.array(floats.data[0].embedding, np.float32))


def test_dimensions_cut_then_renormalise(text_server):
    client, name = oai(text_server), model_name(text_server)
    full = np.array(client.embeddings.create(model=name, input=TEXTS[1]).data[0].embedding)
    cut = np.array(client.embeddings.create(model=name, input=TEXTS[1], dimensions=64).data[0].embedding)
    assert cut.shape == (64,)
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6, rtol=0)


def test_dimensions_above_d_model_are_refused_naming_the_limit(text_server):
    with pytest.raises(openai.BadRequestError, match=r"dimensions: 385 out of range \[1, 384\]"):
        oai(text_server).embeddings.create(model=model_name(text_server), input="x", dimensions=385)


def test_models_lists_the_served_model(text_server):
    models = oai(text_server).models.list()
    assert [m.id for m in models.data] == [model_name(text_server)]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_gets_embeddings(token_server):
    body = json.dumps({"model": model_name(token_server), "input": [[1, 2, 3]]})
    out = subprocess.run(["curl", "-sS", "-X", "POST", f"http://127.0.0.1:{token_server.http_port}/v1/embeddings",
                          "-H", "content-type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    answer = json.loads(out)
    assert answer["object"] == "list" and len(answer["data"][0]["embedding"]) == 32


@pytest.mark.parametrize("body,status,message", [
    (b"{not json", 400, "request body: not valid JSON"),
    (b"[1, 2]", 400, "request body: expected a JSON object"),
    (b'{"input": 5}', 400, "input: expected a string, a list of strings"),
    (b'{"input": []}', 400, "input: expected a string, a list of strings, a list of token ids or a list of "
                            "token-id lists, got an empty list"),
    (b'{"input": [[1, 2], "text"]}', 400, "input[1]: expected a string or a list of integer token ids"),
    (b'{"input": [[1], [2], [3], [4], [5]]}', 400, "max_sequences_per_request=4"),
    (b'{"input": [[1, 99999]]}', 400, "sequences[0]: token id 99999 out of range"),
    (b'{"input": [[1]], "encoding_format": "hex"}', 400, "encoding_format: 'hex' is not"),
    (b'{"input": [[1]], "dimensions": "8"}', 400, "dimensions: expected a positive integer"),
    (b'{"input": [[1]], "model": "gpt-4"}', 404, "model 'gpt-4' is not served here"),
    (b'{"model": "x"}', 404, "model 'x' is not served here"),
    (b'{}', 400, "input: missing"),
])
def test_bad_input_gets_a_clear_error_and_the_server_stays_healthy(token_server, body, status, message):
    got, _, answer = post(token_server, "/v1/embeddings", body)
    assert got == status, answer
    assert message in answer["error"]["message"]
    assert answer["error"]["type"] in ("invalid_request_error", "not_found_error")
    with urllib.request.urlopen(f"http://127.0.0.1:{token_server.http_port}/v2/health/ready", timeout=10) as ok:
        assert ok.status == 200


def test_a_body_over_the_limit_is_refused_413_before_it_is_read(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--max-request-bytes", "1000")
    got, _, answer = post(server, "/v1/embeddings", b'{"input": "' + b"a" * 5000 + b'"}')
    assert got == 413 and "max_request_bytes=1000" in answer["error"]["message"]


def test_a_wrong_token_is_401_and_health_stays_open(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--auth-token", "s3cret")
    with pytest.raises(openai.AuthenticationError):
        oai(server, default_headers={"authorization": "Bearer wrong"}).models.list()
    assert oai(server, default_headers={"authorization": "Bearer s3cret"}).models.list().data
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/live", timeout=10) as live:
        assert live.status == 200


def test_an_unknown_path_is_404_and_a_wrong_method_405(token_server):
    got, _, _ = post(token_server, "/v1/nothing", b"{}")
    assert got == 404
    got, _, _ = post(token_server, "/v1/models", b"{}")
    assert got == 405


def test_overload_is_429_with_retry_after(serve_export_dir):
    """The queue holds one request while a batch runs (held at a gate): the next gets 429 and Retry-After."""
    import threading

    from tests.reliability_common import wait_until
    from tests.test_serve_lifecycle import GatedServer

    gated = GatedServer(serve_export_dir, max_queue_size=1)
    server = type("S", (), {"http_port": gated.server.http.port})()
    name = gated.server.engine().export.name
    body = json.dumps({"model": name, "input": [[1, 2, 3]]}).encode()
    results: list = []
    try:
        first = threading.Thread(target=lambda: results.append(post(server, "/v1/embeddings", body)))
        first.start()
        assert gated.entered.wait(30)  # running, held at the gate
        second = threading.Thread(target=lambda: results.append(post(server, "/v1/embeddings", body)))
        second.start()
        assert wait_until(lambda: gated.server.engine().batcher.queue_depth() == 1, 30)
        status, headers, answer = post(server, "/v1/embeddings", body)
        assert status == 429 and "max_queue_size=1" in answer["error"]["message"]
        assert headers.get("retry-after") == "1"
        gated.release.set()
        first.join(30)
        second.join(30)
        assert [r[0] for r in results] == [200, 200]
    finally:
        gated.release.set()
        gated.server.shutdown(5)


def test_http_calls_are_counted_in_metrics(token_server):
    oai(token_server).embeddings.create(model=model_name(token_server), input=[[1, 2]])
    assert 'encoder_requests_total{code="OK",method="openai.Embeddings"}' in token_server.metrics()


def test_a_call_during_a_drain_is_503_with_retry_after(serve_start, serve_export_dir):
    import signal

    from tests.reliability_common import wait_until

    server = serve_start(serve_export_dir, "--drain-quiet-ms", "20000", "--grace-s", "30")
    ready = f"http://127.0.0.1:{server.http_port}/v2/health/ready"

    def not_ready() -> bool:  # readiness turns 503 when the drain starts (what a load balancer watches)
        try:
            urllib.request.urlopen(ready, timeout=10).close()
            return False
        except urllib.error.HTTPError as error:
            return error.code == 503

    body = json.dumps({"input": [[1, 2, 3]]}).encode()
    # an answered call first: the drain keeps listening until --drain-quiet-ms have passed without one (with
    # no call at all it stops listening at once, however slowly this test's first probe arrives)
    assert post(server, "/v1/embeddings", body)[0] == 200
    server.proc.send_signal(signal.SIGTERM)
    assert wait_until(not_ready, 30)
    status, headers, answer = post(server, "/v1/embeddings", body)
    assert status == 503 and headers.get("retry-after") == "1"
    assert "shutting down" in answer["error"]["message"]
    server.proc.kill()
