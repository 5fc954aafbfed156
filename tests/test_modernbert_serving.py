"""A ModernBERT embedding model served end to end: exported by `python -m export --from-pretrained`
(dense + long-input graph), served by the real server (subprocess, 127.0.0.1), answering over gRPC and
KServe v2 as transformers / sentence-transformers do, texts included, up to 8,192 tokens, with
`metadata.attention_paths` naming the graph each sequence ran on (a long bidirectional row runs on
the sparse graph: local layers banded, global layers dense)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export.cli import main as export_main
from client import EncoderClient, build_request, parse_response
from tests.hf_references import MODERNBERT, WORDS, cosines, modernbert_embedding_model

HIDDEN_ATOL = 1e-4
MIN_COSINE = 0.99999
MAX_TOKENS = 8192
TEXTS = [
    "the encoder",
    "A long document, with punctuation; and UNKNOWN words!",
    " ".join(WORDS[i % len(WORDS)] for i in range(300)),  # 302 tokens: past 2 windows, sparse is cheaper
    " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(70)),
]


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    """(sentence-transformers directory, the SentenceTransformer) with max_seq_length 8192."""
    directory = tmp_path_factory.mktemp("mb-embed")
    return directory, modernbert_embedding_model(tmp_path_factory.mktemp("mb-base"), directory, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(serve_start, embedding_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("mb-export")
    assert export_main(["--from-pretrained", str(embedding_model[0]), "--out-dir", str(out), "--name", "mb",
                        "--graphs", "fp32,long", "--quiet"]) == 0
    return serve_start(out / "mb")


def test_model_info_admits_8192_tokens_and_texts_of_8192_tokens(server):
    with EncoderClient(server.target, timeout=60) as client:
        info = client.model_info()
    assert info.limits.max_sequence_length >= MAX_TOKENS and info.limits.max_text_tokens == MAX_TOKENS


def test_served_text_embeddings_match_sentence_transformers_and_name_their_paths(server, embedding_model):
    _, model = embedding_model
    with EncoderClient(server.target, timeout=120) as client:
        out = client.embed(TEXTS)
    expected = model.encode(TEXTS, batch_size=len(TEXTS), normalize_embeddings=True, convert_to_numpy=True)
    assert out.embeddings.shape == expected.shape
    assert cosines(out.embeddings, expected).min() >= MIN_COSINE
    # short texts are cheapest dense; the 302-token one on the plan's sparse graph
    assert out.attention_paths[0] == "dense" and out.attention_paths[2] == "sparse"


def test_an_8192_token_sequence_runs_sparse_and_equals_transformers(server, embedding_model):
    _, model = embedding_model
    reference = model[0].auto_model  # transformers' ModernBertModel, eager attention
    ids = np.random.default_rng(0).integers(5, MODERNBERT["vocab_size"] // 4, MAX_TOKENS)
    with EncoderClient(server.target, timeout=600) as client:
        response = client.stub.Encode(build_request([ids], hidden_states=True), timeout=600)
    out = parse_response(response)
    assert list(response.metadata.attention_paths) == ["sparse"]
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(ids)[None]).last_hidden_state[0].numpy()
    assert out.hidden_states[0].shape == expected.shape
    np.testing.assert_allclose(out.hidden_states[0], expected, atol=HIDDEN_ATOL, rtol=0)


def test_v2_texts_give_the_same_embeddings_as_encode(server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    with EncoderClient(server.target, timeout=120) as client:
        by_encode = client.embed(TEXTS)
        name = client.model_info().name
    v2 = grpcclient.InferenceServerClient(url=server.target)
    try:
        tensor = grpcclient.InferInput("texts", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
        result = v2.infer(name, [tensor], outputs=[grpcclient.InferRequestedOutput("embeddings")])
    finally:
        v2.close()
    np.testing.assert_allclose(result.as_numpy("embeddings"), by_encode.embeddings, atol=1e-6, rtol=0)
