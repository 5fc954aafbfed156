"""Late interaction (ColBERT) served: a PyLate ColBERT (a small random BERT + PyLate's Dense to 16, saved by PyLate)
exported with its multivector head and served beside a plain embedder of the same BERT. Each text's token vectors
(TEI /embed_all, encoder.v1 Encode) equal PyLate's ColBERT.encode, queries with their [MASK] expansion and
documents without their skiplist tokens; MaxSim rerank scores (TEI /rerank, Cohere's /v1/rerank, Encode) equal
PyLate's colbert_scores. What does not fit is refused naming the field or the task.

Reference: PyLate 1.6.0 in process (tests/pylate_reference.py: the sentence-transformers 6 bridge)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from model.export_format import read_metadata
from serve.protocols.pb import pb
from tests.pylate_reference import pylate_colbert

pytest.importorskip("pylate")

ATOL = 1e-4
QUERIES = ["the long document?", "a", "what is this encoder for, and by what?"]
DOCUMENTS = ["the document, of it.", "a long encoder; it was!", "encoder", "this is that, and the long one."]
QUERY_LENGTH, DOCUMENT_LENGTH = 12, 20


def _export(source, out, name):
    from export.cli import main

    assert main(["--from-pretrained", str(source), "--out-dir", str(out), "--name", name, "--graphs", "fp32",
                 "--quiet"]) == 0
    return out / name


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """(PyLate's model, the directory it saved)."""
    return pylate_colbert(tmp_path_factory.mktemp("pylate"), query_length=QUERY_LENGTH,
                          document_length=DOCUMENT_LENGTH)


# PyLate's other query settings: every token attending to the expansion; no expansion at all
VARIANTS = {"attending": dict(attend_to_expansion_tokens=True), "unexpanded": dict(do_query_expansion=False)}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """name -> (PyLate's model, its directory) of each of VARIANTS."""
    return {name: pylate_colbert(tmp_path_factory.mktemp(name), query_length=QUERY_LENGTH,
                                 document_length=DOCUMENT_LENGTH, seed=i + 1, **settings)
            for i, (name, settings) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def repository(colbert, variants, tmp_path_factory):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    out = tmp_path_factory.mktemp("colbert-repository")
    _export(colbert[1], out, "colbert")
    for name, (_, directory) in variants.items():
        _export(directory, out, name)
    embedder = tmp_path_factory.mktemp("embedder") / "st"
    base = colbert[1].parent / "bert"
    SentenceTransformer(modules=[Transformer(str(base)), Pooling(32, "mean")], device="cpu").save(str(embedder))
    _export(embedder, out, "embedder")
    return out


@pytest.fixture(scope="module")
def server(serve_start, repository):
    return serve_start(repository / "colbert", "--model-repository", str(repository), "--default-model", "colbert",
                       timeout=120)


def _pylate(colbert, texts, is_query):
    return [np.asarray(v) for v in colbert[0].encode(list(texts), is_query=is_query)]


def _maxsim(colbert, query, documents):
    """PyLate's colbert_scores of the query against each document alone (a batch of documents would pad the
    shorter ones with zero vectors, which count as a dot product of 0)."""
    from pylate import scores

    q = colbert[0].encode([query], is_query=True)
    return np.asarray([float(scores.colbert_scores(q, [d])[0, 0]) for d in colbert[0].encode(documents,
                                                                                            is_query=False)])


def _assert_vectors_equal(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got = np.asarray(got, np.float32)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


# -- the export ------------------------------------------------------------------------------------------------

def test_the_export_records_pylates_markers_lengths_expansion_and_skiplist(colbert, repository):
    model = colbert[0]
    task = read_metadata(repository / "colbert").task
    assert task["kind"] == "multivector" and task["output"] == "token_vectors"
    assert (task["query_marker_id"], task["document_marker_id"]) == (model.query_prefix_id, model.document_prefix_id)
    assert (task["query_length"], task["document_length"]) == (QUERY_LENGTH, DOCUMENT_LENGTH)
    assert task["query_expansion"] is True and task["attend_to_expansion_tokens"] is False
    assert task["expansion_id"] == model.tokenizer.mask_token_id
    assert task["skiplist_ids"] == sorted(set(model.skiplist))


# -- token vectors ---------------------------------------------------------------------------------------------

def test_query_vectors_with_mask_expansion_equal_pylate_encode(http, colbert):
    answer = http.post("/embed_all", json={"inputs": QUERIES[:2], "is_query": True})
    assert answer.status_code == 200, answer.text
    _assert_vectors_equal(answer.json(), _pylate(colbert, QUERIES[:2], True))
    assert all(len(v) == QUERY_LENGTH for v in answer.json())


def test_a_query_over_its_length_is_cut_with_truncate_as_pylate_cuts_it(http, colbert):
    answer = http.post("/embed_all", json={"inputs": [QUERIES[2]], "is_query": True, "truncate": True})
    assert answer.status_code == 200, answer.text
    _assert_vectors_equal(answer.json(), _pylate(colbert, [QUERIES[2]], True))


@pytest.mark.parametrize("name", VARIANTS)
def test_query_vectors_under_pylates_other_query_settings_equal_its_encode(http, variants, name):
    answer = http.post("/embed_all", json={"model": name, "inputs": QUERIES[:2], "is_query": True})
    assert answer.status_code == 200, answer.text
    _assert_vectors_equal(answer.json(), _pylate(variants[name], QUERIES[:2], True))


def test_document_vectors_without_skiplist_tokens_equal_pylate_encode(http, colbert):
    answer = http.post("/embed_all", json={"inputs": DOCUMENTS})
    assert answer.status_code == 200, answer.text
    _assert_vectors_equal(answer.json(), _pylate(colbert, DOCUMENTS, False))


def test_grpc_encode_answers_token_vectors_as_hidden_states(stub, colbert):
    response = stub.Encode(pb.EncodeRequest(texts=DOCUMENTS[:2], output=pb.OutputOptions(hidden_states=True)))
    got = [np.frombuffer(r.hidden_states.data, "<f4").reshape(list(r.hidden_states.shape)) for r in response.results]
    _assert_vectors_equal(got, _pylate(colbert, DOCUMENTS[:2], False))


def test_grpc_encode_of_queries_expands_them_as_pylate(stub, colbert):
    response = stub.Encode(pb.EncodeRequest(texts=QUERIES[:2], is_query=True,
                                            output=pb.OutputOptions(hidden_states=True)))
    got = [np.frombuffer(r.hidden_states.data, "<f4").reshape(list(r.hidden_states.shape)) for r in response.results]
    _assert_vectors_equal(got, _pylate(colbert, QUERIES[:2], True))


def test_kserve_v2_answers_documents_token_vectors_as_its_one_output(http, colbert):
    """v2 has no query: a text is a document, its vectors as PyLate's (the rest of its row zeros)."""
    assert [o["name"] for o in http.get("/v2/models/colbert").json()["outputs"]] == ["last_hidden_state"]
    answer = http.post("/v2/models/colbert/infer", json={
        "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [len(DOCUMENTS)], "data": DOCUMENTS}]})
    assert answer.status_code == 200, answer.text
    (out,) = answer.json()["outputs"]
    got = np.asarray(out["data"], np.float32).reshape(out["shape"])
    want = _pylate(colbert, DOCUMENTS, False)
    _assert_vectors_equal([row[:len(w)] for row, w in zip(got, want)], want)
    assert all(not row[len(w):].any() for row, w in zip(got, want))


# -- MaxSim ----------------------------------------------------------------------------------------------------

def test_tei_rerank_scores_are_pylates_maxsim_best_first(http, colbert):
    answer = http.post("/rerank", json={"query": QUERIES[0], "texts": DOCUMENTS})
    assert answer.status_code == 200, answer.text
    want = _maxsim(colbert, QUERIES[0], DOCUMENTS)
    assert [r["index"] for r in answer.json()] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in answer.json()], np.sort(want)[::-1], atol=ATOL, rtol=0)


def test_cohere_client_reranks_by_maxsim(server, colbert):
    import cohere

    client = cohere.Client(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}")
    response = client.rerank(model="colbert", query=QUERIES[1], documents=DOCUMENTS, top_n=2)
    want = _maxsim(colbert, QUERIES[1], DOCUMENTS)
    assert [r.index for r in response.results] == list(np.argsort(-want, kind="stable")[:2])
    np.testing.assert_allclose([r.relevance_score for r in response.results], np.sort(want)[::-1][:2], atol=ATOL)


def test_grpc_encode_with_a_maxsim_query_scores_each_text_as_pylate(stub, colbert):
    response = stub.Encode(pb.EncodeRequest(texts=DOCUMENTS, maxsim_query=QUERIES[0]))
    np.testing.assert_allclose([r.maxsim_score for r in response.results], _maxsim(colbert, QUERIES[0], DOCUMENTS),
                               atol=ATOL, rtol=0)
    assert not any(r.HasField("hidden_states") for r in response.results)


def test_grpc_rerank_orders_by_maxsim(stub, colbert):
    response = stub.Rerank(pb.RerankRequest(query=QUERIES[0], documents=DOCUMENTS, top_n=3))
    want = _maxsim(colbert, QUERIES[0], DOCUMENTS)
    assert [r.index for r in response.results] == list(np.argsort(-want, kind="stable")[:3])
    np.testing.assert_allclose([r.score for r in response.results], np.sort(want)[::-1][:3], atol=ATOL, rtol=0)


# -- what does not fit ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("route, body", [
    ("/embed", {"inputs": "x"}),
    ("/v1/embeddings", {"input": "x"}),
])
def test_a_pooled_embedding_of_a_colbert_is_refused_naming_its_task(http, route, body):
    answer = http.post(route, json={"model": "colbert", **body})
    assert answer.status_code == 400
    payload = answer.json()
    message = payload["error"]["message"] if isinstance(payload["error"], dict) else payload["error"]
    assert "task 'multivector'" in message and "Routes that fit it:" in message and "POST /embed_all" in message


def test_is_query_on_a_model_without_the_head_is_refused_naming_it(http):
    answer = http.post("/embed_all", json={"model": "embedder", "inputs": ["x"], "is_query": True})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("is_query:") and "task 'embed'" in answer.json()["error"]


def test_maxsim_rerank_on_an_embedder_is_refused_naming_the_routes_that_fit(http):
    answer = http.post("/rerank", json={"model": "embedder", "query": "a", "texts": ["b"]})
    assert answer.status_code == 400
    assert "task 'embed'" in answer.json()["error"] and "Routes that fit it:" in answer.json()["error"]


@pytest.mark.parametrize("body, field", [
    ({"inputs": [QUERIES[2]], "is_query": True}, "texts[0]"),  # over query_length, no truncate
    ({"inputs": [" ".join(["the"] * DOCUMENT_LENGTH)]}, "texts[0]"),  # over document_length
    ({"inputs": ["a"], "prompt_name": "query"}, "prompt_name"),
    ({"inputs": ["a", ""]}, "texts[1]"),
])
def test_bad_token_vector_bodies_are_refused_naming_the_field(http, body, field):
    answer = http.post("/embed_all", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith(f"{field}:"), answer.json()


@pytest.mark.parametrize("body, field", [
    ({"query": QUERIES[2], "texts": ["a"], "truncate": True}, "query:"),  # a query is never cut
    ({"query": "a", "texts": ["b", " ".join(["the"] * DOCUMENT_LENGTH)]}, "texts[1]:"),
    ({"query": "a", "texts": []}, "texts:"),
    ({"query": "a", "texts": ["b"] * 32}, "texts:"),  # 32 documents and the query: 33 sequences, over the limit
])
def test_bad_maxsim_rerank_bodies_are_refused_naming_the_field(http, body, field):
    answer = http.post("/rerank", json={"model": "colbert", **body})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith(f"{field}"), answer.json()


@pytest.mark.parametrize("request_, field", [
    (dict(texts=["a"]), "hidden_states"),  # neither token vectors nor MaxSim asked for
    (dict(texts=["a"], maxsim_query="q", is_query=True), "is_query"),
    (dict(texts=["a"], maxsim_query=""), "maxsim_query"),
    (dict(texts=["a"], output=pb.OutputOptions(pooling=pb.POOLING_MEAN)), "pooling"),
    (dict(texts=["a"], output=pb.OutputOptions(hidden_states=True, encoding=pb.EMBEDDING_ENCODING_INT8)),
     "output.encoding"),  # token vectors are float; the encodings are a pooled embedding's
    (dict(model="embedder", texts=["a"], maxsim_query="q"), "maxsim_query"),
])
def test_grpc_encode_requests_that_do_not_fit_are_invalid_argument_naming_the_field(stub, request_, field):
    with pytest.raises(grpc.RpcError) as refused:
        stub.Encode(pb.EncodeRequest(**request_))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}:"), refused.value.details()
