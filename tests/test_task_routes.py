"""Every encoder task behind the APIs its users already call: a re-ranker, a classifier, a SPLADE sparse
encoder and an embedder, exported from checkpoints saved by transformers / sentence-transformers with a
real tokenizer, served side by side by one real server process, called with the real clients (cohere,
huggingface_hub, Haystack, LlamaIndex, openai), httpx for the routes, and the gRPC stubs.

References: sentence-transformers' CrossEncoder.predict (rerank, classify) and SparseEncoder.encode
(sparse) on the same checkpoint directories, in process.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import grpc
import numpy as np
import pytest

from serve.protocols.pb import pb, pb_grpc

SCORE_ATOL = 1e-4
QUERY = "What is deep learning?"
DOCUMENTS = [
    "Deep learning is a kind of machine learning with neural networks of many layers.",
    "Paris is the capital of France.",
    "A dog barks at the mailman every morning.",
    "Neural networks learn representations from data.",
]
TEXTS = ["I love this film.", "The plot made no sense at all.", "It was fine, I guess."]
LABELS = ["negative", "neutral", "positive"]
TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=512)


def _tokenizer_files(directory):
    from model.hf_pretrained import minilm_path

    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_path() / name).is_file():
            shutil.copy(minilm_path() / name, directory / name)


def _export(source, out_dir, name, *flags):
    """`python -m export --from-pretrained` (its main, in this process: one torch import for the four)."""
    from export.cli import main

    assert main(["--from-pretrained", str(source), "--out-dir", str(out_dir), "--name", name, "--graphs", "fp32",
                 "--quiet", *flags]) == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint directories as their libraries save them: a cross-encoder (one logit), a 3-label
    classifier, a SPLADE sparse encoder and a sentence-transformers embedder with a query prompt."""
    import torch
    from sentence_transformers import SentenceTransformer, SparseEncoder
    from sentence_transformers.models import Pooling, Transformer
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel

    root = tmp_path_factory.mktemp("task-checkpoints")
    torch.manual_seed(0)
    paths = {}
    for name, labels in (("reranker", None), ("classifier", LABELS)):
        config = BertConfig(**TINY, num_labels=1 if labels is None else len(labels),
                            **({} if labels is None else {"id2label": dict(enumerate(labels)),
                                                         "label2id": {v: k for k, v in enumerate(labels)}}))
        model = BertForSequenceClassification(config).eval()
        with torch.no_grad():  # weights drawn large enough that scores differ visibly between inputs
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else None
        paths[name] = root / name
        model.save_pretrained(paths[name])
        _tokenizer_files(paths[name])
    mlm_dir = root / "mlm"
    BertForMaskedLM(BertConfig(**TINY)).eval().save_pretrained(mlm_dir)
    _tokenizer_files(mlm_dir)
    paths["splade"] = root / "splade"
    SparseEncoder(modules=[MLMTransformer(str(mlm_dir)), SpladePooling("max")], device="cpu").save(str(paths["splade"]))
    base_dir = root / "base"
    BertModel(BertConfig(**TINY)).eval().save_pretrained(base_dir)
    _tokenizer_files(base_dir)
    paths["embedder"] = root / "embedder"
    transformer = Transformer(str(base_dir), max_seq_length=128)
    SentenceTransformer(modules=[transformer, Pooling(32, "mean")], device="cpu",
                        prompts={"query": "query: ", "document": ""}).save(str(paths["embedder"]))
    return paths


@pytest.fixture(scope="module")
def repository(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("task-repository")
    for name, path in checkpoints.items():
        _export(path, out, name)
    return out


@pytest.fixture(scope="module")
def server(serve_start, repository):
    """The four models in one server; the re-ranker is the default (what a client naming no model gets:
    Haystack's ranker posts to <host>/rerank whatever its URL's path)."""
    return serve_start(repository / "reranker", "--model-repository", str(repository), "--default-model", "reranker",
                       timeout=180)


@pytest.fixture(scope="module")
def cross_encoder(checkpoints):
    from sentence_transformers import CrossEncoder

    return lambda name: CrossEncoder(str(checkpoints[name]), device="cpu")


def _reference_scores(cross_encoder, name, pairs, raw=False):
    """CrossEncoder.predict of query-document pairs: its sigmoid for one label (raw: the logits)."""
    import torch

    model = cross_encoder(name)
    return model.predict(pairs, activation_fn=torch.nn.Identity() if raw else None, convert_to_numpy=True)


def _classifier_scores(checkpoints, texts, pairs=None):
    """transformers' BertForSequenceClassification on the checkpoint, softmax over the labels (what TEI
    answers a classifier's /predict with; CrossEncoder leaves more than one label raw)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoints["classifier"]))
    model = AutoModelForSequenceClassification.from_pretrained(str(checkpoints["classifier"]),
                                                               attn_implementation="eager").eval()
    features = tokenizer(list(texts), pairs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return torch.softmax(model(**features).logits, dim=-1).numpy()


@pytest.fixture
def hub_online(monkeypatch):
    """huggingface_hub refuses every URL in offline mode (the suite sets HF_HUB_OFFLINE): this server is local."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def _max_text_tokens(server, model):
    with grpc.insecure_channel(server.target) as channel:
        info = pb_grpc.EncoderServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(model=model))
    return info.limits.max_text_tokens


# -- rerank ----------------------------------------------------------------------------------------------

def test_tei_rerank_scores_equal_cross_encoder_predict_best_first(http, cross_encoder):
    ranks = http.post("/rerank", json={"model": "reranker", "query": QUERY, "texts": DOCUMENTS}).json()
    want = _reference_scores(cross_encoder, "reranker", [(QUERY, d) for d in DOCUMENTS])
    assert [r["index"] for r in ranks] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in ranks], np.sort(want)[::-1], atol=SCORE_ATOL)


def test_tei_rerank_raw_scores_are_the_logits(http, cross_encoder):
    ranks = http.post("/rerank", json={"model": "reranker", "query": QUERY, "texts": DOCUMENTS,
                                       "raw_scores": True, "return_text": True}).json()
    want = _reference_scores(cross_encoder, "reranker", [(QUERY, d) for d in DOCUMENTS], raw=True)
    np.testing.assert_allclose([r["score"] for r in ranks], [want[r["index"]] for r in ranks], atol=SCORE_ATOL)
    assert [r["text"] for r in ranks] == [DOCUMENTS[r["index"]] for r in ranks]


def test_cohere_client_reranks_against_v1_rerank(server, cross_encoder):
    import cohere

    client = cohere.Client(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}")
    response = client.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=2)
    want = _reference_scores(cross_encoder, "reranker", [(QUERY, d) for d in DOCUMENTS])
    assert [r.index for r in response.results] == list(np.argsort(-want, kind="stable")[:2])
    np.testing.assert_allclose([r.relevance_score for r in response.results], np.sort(want)[::-1][:2], atol=SCORE_ATOL)


def test_cohere_v2_client_reranks_against_v2_rerank(server):
    import cohere

    client = cohere.ClientV2(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}")
    response = client.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=3)
    assert len(response.results) == 3
    assert [r.relevance_score for r in response.results] == sorted((r.relevance_score for r in response.results),
                                                                   reverse=True)


def test_cohere_v2_max_tokens_per_doc_scores_each_documents_first_tokens(server, checkpoints, cross_encoder):
    import cohere
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoints["reranker"]))
    cut = []  # each document's first 4 tokens by transformers' offsets (special tokens not counted)
    for document in DOCUMENTS:
        offsets = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        cut.append(document[: offsets[min(4, len(offsets)) - 1][1]])
    assert cut != list(DOCUMENTS)  # control: some document is longer than 4 tokens
    client = cohere.ClientV2(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}")
    response = client.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=4)
    want = _reference_scores(cross_encoder, "reranker", [(QUERY, d) for d in cut])
    np.testing.assert_allclose([r.relevance_score for r in response.results],
                               [want[r.index] for r in response.results], atol=SCORE_ATOL)


def test_jina_shaped_rerank_returns_documents_as_objects(http):
    body = http.post("/v1/rerank", json={"model": "reranker", "query": QUERY,
                                         "documents": [{"text": d} for d in DOCUMENTS], "return_documents": True}).json()
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[r["index"]] for r in body["results"]]
    assert body["usage"]["total_tokens"] > 0


def test_infinity_rerank_shape_with_top_n(http):
    body = http.post("/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                      "return_documents": True}).json()
    assert body["object"] == "rerank" and len(body["results"]) == 2
    assert all(r["document"] == DOCUMENTS[r["index"]] for r in body["results"])


def test_rerank_top_n_under_one_is_refused_naming_the_field(http):
    answer = http.post("/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 0})
    assert answer.status_code == 400 and answer.json()["error"] == "top_n: expected a positive integer, got 0"


def test_haystack_tei_ranker_orders_documents(server, cross_encoder):
    from haystack import Document
    from haystack.components.rankers import HuggingFaceTEIRanker

    ranker = HuggingFaceTEIRanker(url=f"http://127.0.0.1:{server.http_port}", top_k=4)
    ranked = ranker.run(query=QUERY, documents=[Document(content=d) for d in DOCUMENTS])["documents"]
    want = _reference_scores(cross_encoder, "reranker", [(QUERY, d) for d in DOCUMENTS])
    assert [d.content for d in ranked] == [DOCUMENTS[i] for i in np.argsort(-want, kind="stable")]


def test_grpc_rerank_top_n_and_documents(stub, cross_encoder):
    response = stub.Rerank(pb.RerankRequest(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=2,
                                            return_documents=True))
    want = _reference_scores(cross_encoder, "reranker", [(QUERY, d) for d in DOCUMENTS])
    assert [r.index for r in response.results] == list(np.argsort(-want, kind="stable")[:2])
    assert [r.document for r in response.results] == [DOCUMENTS[r.index] for r in response.results]
    assert len(response.metadata.token_counts) == len(DOCUMENTS)


def test_a_long_document_is_cut_on_its_side_only_when_truncating(server, http, cross_encoder):
    limit = _max_text_tokens(server, "reranker")
    long_document = " ".join(["neural"] * (limit + 50))
    refused = http.post("/rerank", json={"model": "reranker", "query": QUERY, "texts": [long_document]})
    assert refused.status_code == 400 and "texts[0]" in refused.json()["error"]
    assert "truncate" in refused.json()["error"]
    ranks = http.post("/rerank", json={"model": "reranker", "query": QUERY, "texts": [long_document],
                                       "truncate": True, "raw_scores": True}).json()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder("reranker").model.name_or_path))
    features = tokenizer(QUERY, long_document, truncation="only_second", max_length=limit, return_tensors="pt")
    import torch

    with torch.no_grad():
        want = cross_encoder("reranker").model(**features).logits[0, 0].item()
    assert ranks[0]["score"] == pytest.approx(want, abs=SCORE_ATOL)


@pytest.mark.parametrize("truncate", [True, False])
def test_a_query_too_long_for_any_document_is_refused_naming_it(server, http, truncate):
    query = " ".join(["deep"] * (_max_text_tokens(server, "reranker") + 50))
    answer = http.post("/rerank", json={"model": "reranker", "query": query, "texts": ["a"], "truncate": truncate})
    assert answer.status_code == 400 and answer.json()["error"].startswith("query:")


@pytest.mark.parametrize("body, field", [
    ({"query": QUERY, "texts": []}, "texts"),
    ({"query": QUERY, "texts": ["ok", ""]}, "texts[1]"),
    ({"texts": ["a"]}, "query"),
    ({"query": QUERY, "texts": ["d"] * 40}, "texts"),
])
def test_bad_rerank_bodies_are_refused_naming_the_field(http, body, field):
    answer = http.post("/rerank", json={"model": "reranker", **body})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith(f"{field}:"), answer.json()


# -- classify --------------------------------------------------------------------------------------------

def test_tei_predict_scores_every_label_as_transformers_softmax(http, checkpoints):
    got = http.post("/predict", json={"model": "classifier", "inputs": [[t] for t in TEXTS]}).json()
    want = _classifier_scores(checkpoints, TEXTS)
    for row, expected in zip(got, want):
        assert [p["score"] for p in row] == sorted((p["score"] for p in row), reverse=True)
        np.testing.assert_allclose([p["score"] for p in sorted(row, key=lambda p: LABELS.index(p["label"]))],
                                   expected, atol=SCORE_ATOL)


def test_tei_predict_takes_a_pair(http, checkpoints):
    got = http.post("/predict", json={"model": "classifier", "inputs": [TEXTS[0], TEXTS[1]]}).json()
    want = _classifier_scores(checkpoints, [TEXTS[0]], [TEXTS[1]])[0]
    np.testing.assert_allclose([p["score"] for p in sorted(got, key=lambda p: LABELS.index(p["label"]))], want,
                               atol=SCORE_ATOL)


def test_huggingface_hub_text_classification_against_a_models_root(server, checkpoints, hub_online):
    from huggingface_hub import InferenceClient

    # huggingface_hub posts to its base URL and names no model: the path names it
    client = InferenceClient(base_url=f"http://127.0.0.1:{server.http_port}/models/classifier")
    got = client.text_classification(TEXTS[0], top_k=3)
    scores = {p.label: p.score for p in got}
    want = _classifier_scores(checkpoints, [TEXTS[0]])[0]
    np.testing.assert_allclose([scores[label] for label in LABELS], want, atol=SCORE_ATOL)
    assert [p.score for p in got] == sorted(scores.values(), reverse=True)


def test_infinity_classify_shape(http):
    body = http.post("/classify", json={"model": "classifier", "input": TEXTS}).json()
    assert body["object"] == "classify" and len(body["data"]) == len(TEXTS)
    assert {p["label"] for p in body["data"][0]} == set(LABELS)


def test_grpc_classify_texts_and_pairs(stub, checkpoints):
    texts = stub.Classify(pb.ClassifyRequest(model="classifier", texts=TEXTS))
    want = _classifier_scores(checkpoints, TEXTS)
    for result, expected in zip(texts.results, want):
        got = {s.label: s.score for s in result.labels}
        np.testing.assert_allclose([got[label] for label in LABELS], expected, atol=SCORE_ATOL)
    pairs = stub.Classify(pb.ClassifyRequest(model="classifier", pairs=[pb.TextPair(first="a", second="b")]))
    assert len(pairs.results) == 1 and len(pairs.results[0].labels) == len(LABELS)


def test_tei_info_names_the_labels_of_a_classifier(http):
    info = http.get("/models/classifier/info").json()
    assert info["model_type"] == {"classifier": {"id2label": {str(i): label for i, label in enumerate(LABELS)},
                                                 "label2id": {label: i for i, label in enumerate(LABELS)}}}


def test_grpc_model_info_names_the_task_and_labels(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(model="classifier"))
    assert info.task == "classify" and list(info.labels) == LABELS


def test_a_body_naming_another_model_than_its_path_is_refused(http):
    answer = http.post("/models/classifier/predict", json={"model": "reranker", "inputs": "a"})
    assert answer.status_code == 400 and answer.json()["error"].startswith("model:")


# -- sparse ----------------------------------------------------------------------------------------------

def test_tei_embed_sparse_equals_sparse_encoder_encode(http, checkpoints):
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(checkpoints["splade"]), device="cpu")
    want = model.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    got = http.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS}).json()
    for row, expected in zip(got, want):
        assert [e["index"] for e in row] == np.flatnonzero(expected).tolist()
        np.testing.assert_allclose([e["value"] for e in row], expected[np.flatnonzero(expected)], atol=SCORE_ATOL)


def test_grpc_embed_sparse_gives_indices_and_values(stub):
    response = stub.EmbedSparse(pb.EmbedSparseRequest(model="splade", texts=TEXTS[:2]))
    assert len(response.results) == 2
    for result in response.results:
        assert list(result.indices) == sorted(result.indices) and len(result.values) == len(result.indices)
        assert all(v > 0 for v in result.values)


# -- embeddings, prompts, tokenize ------------------------------------------------------------------------

def test_llamaindex_tei_embeddings_equal_sentence_transformers(server, checkpoints):
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference
    from sentence_transformers import SentenceTransformer

    # TEI's clients name no model: the base URL's path does (/models/<name>)
    embedder = TextEmbeddingsInference(model_name="embedder",
                                       base_url=f"http://127.0.0.1:{server.http_port}/models/embedder", timeout=60)
    got = np.asarray(embedder.get_text_embedding_batch(TEXTS))
    want = SentenceTransformer(str(checkpoints["embedder"]), device="cpu").encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(got, want, atol=SCORE_ATOL)


def test_huggingface_hub_feature_extraction_with_a_prompt(server, checkpoints, hub_online):
    from huggingface_hub import InferenceClient
    from sentence_transformers import SentenceTransformer

    client = InferenceClient(base_url=f"http://127.0.0.1:{server.http_port}/models/embedder")
    got = np.asarray(client.feature_extraction(TEXTS[0], normalize=True, prompt_name="query"))
    want = SentenceTransformer(str(checkpoints["embedder"]), device="cpu").encode(
        [TEXTS[0]], prompt_name="query", normalize_embeddings=True)
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=SCORE_ATOL)


def test_an_unknown_prompt_name_is_refused_naming_the_prompts(http):
    answer = http.post("/embed", json={"model": "embedder", "inputs": "x", "prompt_name": "passage"})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("prompt_name:") and "query" in answer.json()["error"]


def test_openai_client_embeds_unchanged(server, checkpoints):
    import openai
    from sentence_transformers import SentenceTransformer

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model="embedder", input=TEXTS).data
    want = SentenceTransformer(str(checkpoints["embedder"]), device="cpu").encode(TEXTS)
    for item, expected in zip(got, want):
        cosine = np.dot(item.embedding, expected) / np.linalg.norm(item.embedding) / np.linalg.norm(expected)
        assert cosine > 0.99999


def test_token_ids_outside_the_vocabulary_are_refused_naming_its_size(http):
    answer = http.post("/v1/embeddings", json={"model": "embedder", "input": [[100257, 15339]]})
    assert answer.status_code == 400 and "30522" in answer.json()["error"]["message"]


def test_tokenize_and_decode_round_trip(http):
    tokens = http.post("/models/embedder/tokenize", json={"inputs": ["Hello world!"]}).json()[0]
    assert tokens[0]["special"] and tokens[-1]["special"]
    assert [t["text"] for t in tokens[1:-1]] == ["Hello", "world", "!"]
    assert tokens[1]["start"] == 0 and tokens[1]["stop"] == 5
    assert http.post("/decode", json={"ids": [t["id"] for t in tokens]}).json() == ["hello world!"]


def test_grpc_tokenize_without_special_tokens(stub):
    response = stub.Tokenize(pb.TokenizeRequest(texts=["Hello world"], add_special_tokens=False))
    assert [t.text for t in response.results[0].tokens] == ["Hello", "world"]


# -- a route that does not fit the model's task ----------------------------------------------------------

@pytest.mark.parametrize("route, body, task", [
    ("/embed", {"model": "reranker", "inputs": "x"}, "rerank"),
    ("/v1/embeddings", {"model": "classifier", "input": "x"}, "classify"),
    ("/rerank", {"model": "embedder", "query": "q", "texts": ["a"]}, "embed"),
    ("/embed_sparse", {"model": "reranker", "inputs": "x"}, "rerank"),
    ("/predict", {"model": "splade", "inputs": "x"}, "sparse"),
])
def test_a_route_that_does_not_fit_the_task_names_it_and_the_routes_that_do(http, route, body, task):
    answer = http.post(route, json=body)
    assert answer.status_code == 400
    payload = answer.json()
    message = payload["error"]["message"] if isinstance(payload["error"], dict) else payload["error"]
    assert f"task {task!r}" in message and "Routes that fit it:" in message


def test_grpc_method_that_does_not_fit_the_task_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as refused:
        stub.Rerank(pb.RerankRequest(model="classifier", query="q", documents=["a"]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Classify" in refused.value.details()


def test_the_root_route_dispatches_by_the_models_task(http):
    assert isinstance(http.post("/", json={"model": "reranker", "query": "q", "texts": ["a", "b"]}).json()[0]["index"],
                      int)
    assert http.post("/", json={"model": "classifier", "inputs": "a"}).json()[0]["label"] in LABELS
    assert len(http.post("/", json={"model": "embedder", "inputs": "a"}).json()[0]) == 32
    assert http.post("/models/classifier", json={"inputs": "a"}).json()[0]["label"] in LABELS
    assert "index" in http.post("/", json={"model": "splade", "inputs": "a"}).json()[0][0]


def test_curl_rerank_route_from_the_readme(server):
    out = subprocess.run(["curl", "-sS", f"http://127.0.0.1:{server.http_port}/rerank", "-H",
                          "content-type: application/json", "-d",
                          json.dumps({"model": "reranker", "query": QUERY, "texts": DOCUMENTS[:2]})],
                         capture_output=True, text=True, timeout=60)
    assert sorted(r["index"] for r in json.loads(out.stdout)) == [0, 1]
