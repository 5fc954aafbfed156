"""KServe v2 REST on the real server (a subprocess), called with tritonclient.http (JSON and binary
tensors) and curl; answers equal gRPC Encode's for the same ids; bad requests get v2 error bodies."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest

from client import EncoderClient

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

ATOL = 1e-6
IDS = np.array([[5, 17, 42, 7, 9], [3, 4, 8, 0, 0]], dtype=np.int64)
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64)


@pytest.fixture(scope="module")
def server(serve_start, serve_export_dir):
    return serve_start(serve_export_dir)


@pytest.fixture(scope="module")
def triton(server):
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")


@pytest.fixture(scope="module")
def model_name(triton):
    return triton.get_model_metadata("serve-test")["name"]


@pytest.fixture(scope="module")
def expected(server):
    with EncoderClient(server.target, timeout=60) as client:
        return client.encode([IDS[0], IDS[1, :3]], pooling="mean")


def infer(triton, binary: bool):
    ids, mask = httpclient.InferInput("input_ids", list(IDS.shape), "INT64"), \
        httpclient.InferInput("attention_mask", list(MASK.shape), "INT64")
    ids.set_data_from_numpy(IDS, binary_data=binary)
    mask.set_data_from_numpy(MASK, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("embeddings", binary_data=binary)]
    return triton.infer("serve-test", [ids, mask], outputs=outputs, parameters={"pooling": "mean"})


def test_health_and_metadata(triton, model_name):
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready(model_name)
    names = [t["name"] for t in triton.get_model_metadata(model_name)["inputs"]]
    assert names[:2] == ["input_ids", "attention_mask"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_http_infer_equals_grpc_encode(triton, expected, binary):
    got = infer(triton, binary).as_numpy("embeddings")
    assert got.shape == expected.embeddings.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected.embeddings, atol=ATOL, rtol=0)


def test_unknown_model_is_404(server):
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/models/nope", timeout=10)
    assert error.value.code == 404 and "nope" in json.loads(error.value.read())["error"]


def test_bad_tensor_is_400_with_grpc_modelinfer_message(triton):
    ids = httpclient.InferInput("input_ids", [1, 3], "FP16")
    ids.set_data_from_numpy(np.zeros((1, 3), np.float16), binary_data=False)
    with pytest.raises(InferenceServerException) as error:
        triton.infer("serve-test", [ids])
    assert "inputs[input_ids].datatype" in str(error.value)


def test_curl_v2_infer(server, expected):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = {"inputs": [{"name": "input_ids", "shape": [1, 5], "datatype": "INT64", "data": IDS[0].tolist()}],
            "outputs": [{"name": "embeddings"}], "parameters": {"pooling": "mean"}}
    out = subprocess.run([curl, "-sS", "-f", f"http://127.0.0.1:{server.http_port}/v2/models/serve-test/infer",
                          "-d", json.dumps(body)], check=True, capture_output=True, timeout=60).stdout
    got = np.asarray(json.loads(out)["outputs"][0]["data"], np.float32)
    np.testing.assert_allclose(got, expected.embeddings[0], atol=ATOL, rtol=0)


def test_a_lone_http_client_is_answered_by_express_runs_with_the_same_numbers(serve_start, serve_export_dir):
    """One client, one request at a time, over HTTP: each request after the model's first run (which measures its
    seconds per token) runs on the HTTP transport's thread (serve/core/express.py), seen in /metrics, and its answer
    equals the batcher's (express runs off). The budget is set high so a busy machine's slower runs still qualify."""
    answers, runs = {}, {}
    for budget in ("1000", "0"):
        started = serve_start(serve_export_dir, "--express-run-ms", budget)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{started.http_port}")
        answers[budget] = [infer(client, binary).as_numpy("embeddings") for binary in (True, False, True, False)]
        runs[budget] = next(float(line.split()[1]) for line in started.metrics().splitlines()
                            if line.startswith("encoder_express_runs_total "))
        client.close()
        assert started.terminate() == 0
    assert runs == {"1000": 3.0, "0": 0.0}
    for express, queued in zip(answers["1000"], answers["0"]):
        np.testing.assert_allclose(express, queued, atol=ATOL, rtol=0)
