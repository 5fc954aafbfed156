"""bge-m3's three outputs from one encoder run: a small random XLM-RoBERTa with colbert_linear.pt and sparse_linear.pt
beside it (bge-m3's layout), exported with its m3 head and served. The dense embedding (TEI /embed, OpenAI
/v1/embeddings, Encode), the lexical weights (TEI /embed_sparse, EmbedSparse) and the ColBERT vectors (TEI /embed_all,
Encode's hidden states) equal FlagEmbedding's BGEM3FlagModel.encode (return_dense, return_sparse,
return_colbert_vecs) on the same directory, in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.checkpoint import CheckpointError
from model.export_format import read_metadata
from model.hf_pretrained import load_pretrained
from serve.protocols.pb import pb
from tests.hf_references import ROBERTA, redraw, word_tokenizer

pytest.importorskip("FlagEmbedding")

ATOL = 1e-4
TEXTS = ["the long document, of it.", "a", "this is that, and the long one!", "encoder of the document?"]
D = ROBERTA["hidden_size"]


def _m3_directory(directory):
    """An XLM-RoBERTa (ROBERTA's shape) with a word-level tokenizer, and bge-m3's two head files (sparse bias
    raised so that most tokens weigh more than 0)."""
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaModel

    tokenizer, _ = word_tokenizer(specials=("<s>", "<pad>", "</s>", "<unk>", "<mask>"), begin="<s>", end="</s>",
                                  unk="<unk>", pair_separator="</s>")
    tokenizer.add_tokens(list(".,?!"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", cls_token="<s>", eos_token="</s>",
                            sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                            model_max_length=138).save_pretrained(directory)
    model = XLMRobertaModel(XLMRobertaConfig(**{**ROBERTA, "vocab_size": 40}), add_pooling_layer=False)
    redraw(model).save_pretrained(directory)
    generator = torch.Generator().manual_seed(3)
    torch.save({"weight": torch.randn(D, D, generator=generator) / D ** 0.5,
                "bias": torch.randn(D, generator=generator) / 10}, directory / "colbert_linear.pt")
    torch.save({"weight": torch.randn(1, D, generator=generator) / D ** 0.5,
                "bias": torch.full((1,), 0.5)}, directory / "sparse_linear.pt")
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _m3_directory(tmp_path_factory.mktemp("bge-m3"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """BGEM3FlagModel.encode of TEXTS: dense_vecs, lexical_weights, colbert_vecs."""
    from FlagEmbedding import BGEM3FlagModel

    model = BGEM3FlagModel(str(checkpoint), use_fp16=False, devices="cpu")
    return model.encode(TEXTS, return_dense=True, return_sparse=True, return_colbert_vecs=True, max_length=64)


@pytest.fixture(scope="module")
def export_dir(checkpoint, tmp_path_factory):
    from export.cli import main

    out = tmp_path_factory.mktemp("bge-m3-export")
    assert main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "m3", "--graphs", "fp32",
                 "--quiet"]) == 0
    return out / "m3"


@pytest.fixture(scope="module")
def server(serve_start, export_dir):
    return serve_start(export_dir, timeout=120)


def _weights(rows) -> list[dict[str, float]]:
    """Our sparse rows ([{index, value}] per text) in FlagEmbedding's shape ({str(id): weight})."""
    return [{str(entry["index"]): entry["value"] for entry in row} for row in rows]


def _assert_weights_equal(actual: list[dict], expected: list[dict]) -> None:
    assert [sorted(a) for a in actual] == [sorted(e) for e in expected]
    assert any(expected), "the reference has no weight above 0: the test would prove nothing"
    for a, e in zip(actual, expected):
        np.testing.assert_allclose([a[k] for k in sorted(a)], [float(e[k]) for k in sorted(e)], atol=ATOL, rtol=0)


def _assert_vectors_equal(actual, expected) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got = np.asarray(got, np.float32)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_the_export_names_the_special_tokens_the_lexical_weights_leave_out(export_dir, checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    unused = sorted({tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id})
    assert read_metadata(export_dir).task == {"kind": "m3", "output": "m3_tokens", "unused_ids": unused}


def test_dense_embeddings_equal_bgem3_dense_vecs(http, reference):
    answer = http.post("/embed", json={"inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(np.asarray(answer.json(), np.float32), reference["dense_vecs"], atol=ATOL, rtol=0)


def test_openai_embeddings_are_the_dense_embeddings(http, reference):
    answer = http.post("/v1/embeddings", json={"input": TEXTS[:2]})
    assert answer.status_code == 200, answer.text
    got = [d["embedding"] for d in sorted(answer.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(np.asarray(got, np.float32), reference["dense_vecs"][:2], atol=ATOL, rtol=0)


def test_cohere_embed_encodes_the_dense_embeddings_as_quantize_embeddings(http, reference):
    from sentence_transformers.util.quantization import quantize_embeddings

    answer = http.post("/v2/embed", json={"texts": TEXTS[:2], "embedding_types": ["float", "ubinary"]})
    assert answer.status_code == 200, answer.text
    by_type = answer.json()["embeddings"]
    floats = np.asarray(by_type["float"], np.float32)
    np.testing.assert_allclose(floats, reference["dense_vecs"][:2], atol=ATOL, rtol=0)
    assert by_type["ubinary"] == quantize_embeddings(floats, "ubinary").tolist()


def test_kserve_v2_answers_the_dense_embeddings_and_the_colbert_vectors(http, reference):
    (model,) = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert [o["name"] for o in http.get(f"/v2/models/{model}").json()["outputs"]] == ["last_hidden_state", "embeddings"]
    answer = http.post(f"/v2/models/{model}/infer", json={
        "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}]})
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in answer.json()["outputs"]}
    np.testing.assert_allclose(outputs["embeddings"], reference["dense_vecs"], atol=ATOL, rtol=0)
    colbert = reference["colbert_vecs"]
    _assert_vectors_equal([row[:len(c)] for row, c in zip(outputs["last_hidden_state"], colbert)], colbert)


def test_lexical_weights_equal_bgem3_lexical_weights(http, reference):
    answer = http.post("/embed_sparse", json={"inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    _assert_weights_equal(_weights(answer.json()), reference["lexical_weights"])


def test_colbert_vectors_equal_bgem3_colbert_vecs(http, reference):
    answer = http.post("/embed_all", json={"inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    _assert_vectors_equal(answer.json(), reference["colbert_vecs"])


def test_grpc_encode_answers_dense_and_colbert_vectors_of_one_run(stub, reference):
    response = stub.Encode(pb.EncodeRequest(texts=TEXTS, output=pb.OutputOptions(hidden_states=True)))
    vectors = [np.frombuffer(r.hidden_states.data, "<f4").reshape(list(r.hidden_states.shape))
               for r in response.results]
    dense = np.stack([np.frombuffer(r.embedding.data, "<f4") for r in response.results])
    _assert_vectors_equal(vectors, reference["colbert_vecs"])
    np.testing.assert_allclose(dense, reference["dense_vecs"], atol=ATOL, rtol=0)


def test_grpc_embed_sparse_gives_the_lexical_weights(stub, reference):
    response = stub.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS))
    got = [{str(i): v for i, v in zip(r.indices, r.values)} for r in response.results]
    _assert_weights_equal(got, reference["lexical_weights"])


@pytest.mark.parametrize("route, body, field", [
    ("/embed", {"inputs": "x", "normalize": False}, "normalize"),
    ("/rerank", {"query": "q", "texts": ["a"]}, "model"),
    ("/predict", {"inputs": "x"}, "model"),
])
def test_what_bge_m3_does_not_answer_is_refused_naming_it(http, route, body, field):
    answer = http.post(route, json=body)
    assert answer.status_code == 400
    message = answer.json()["error"]
    assert message.startswith(f"{field}:"), message
    if field == "model":
        assert "task 'm3'" in message and "Routes that fit it:" in message and "POST /embed_sparse" in message


def test_a_head_file_that_does_not_fit_the_encoder_is_refused_naming_it(checkpoint, tmp_path):
    import shutil

    broken = shutil.copytree(checkpoint, tmp_path / "broken")
    torch.save({"weight": torch.zeros(1, D + 1), "bias": torch.zeros(1)}, broken / "sparse_linear.pt")
    with pytest.raises(CheckpointError, match=r"sparse_linear.pt weight: \[1, 33\] \(expected \[1, 32\]\)"):
        load_pretrained(broken)
