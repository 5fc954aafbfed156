"""Output encodings chosen per request (serve/core/encodings.py): float, base64, int8, uint8, binary and ubinary
over Cohere's /v2/embed and /v1/embed (the real `cohere` client), OpenAI's base64, encoder.v1 Encode (INT8 /
UINT8 tensors) and KServe v2 (gRPC through tritonclient, REST through httpx), against one real server process
serving a tiny sentence-transformers embedder (normalised, with query and document prompts) and a classifier,
exported from checkpoints the libraries saved.

References: sentence-transformers' `quantize_embeddings(float, precision, ranges=<[-1, 1] per dimension>)` of
the float embeddings the same answer carries, and `SentenceTransformer.encode` for the float embeddings.
"""

from __future__ import annotations

import base64
import shutil

import grpc
import numpy as np
import pytest

from serve.protocols.pb import pb

ATOL = 1e-4  # float embeddings against SentenceTransformer.encode
TEXTS = ["I love this film.", "The plot made no sense at all.", "It was fine, I guess.", "Paris is in France."]
QUANTIZED = ("int8", "uint8", "binary", "ubinary")
TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=512)
WIDTH = TINY["hidden_size"]


def _ranges(dimensions: int) -> np.ndarray:
    """The documented int8 / uint8 ranges (docs/serving.md "Output encodings"): [-1, 1] in every dimension."""
    return np.array([[-1.0] * dimensions, [1.0] * dimensions], np.float32)


def _quantized(floats, precision: str) -> np.ndarray:
    from sentence_transformers.util.quantization import quantize_embeddings

    floats = np.asarray(floats, np.float32)
    return quantize_embeddings(floats, precision, ranges=_ranges(floats.shape[-1]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A sentence-transformers embedder (mean pooling, Normalize, query and document prompts) and a 2-label
    classifier, as their libraries save them, with the packaged MiniLM's tokenizer."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    from model.hf_pretrained import minilm_path

    root = tmp_path_factory.mktemp("encoding-checkpoints")
    torch.manual_seed(0)

    def tokenizer_files(directory):
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if (minilm_path() / name).is_file():
                shutil.copy(minilm_path() / name, directory / name)

    base, classifier = root / "base", root / "classifier"
    BertModel(BertConfig(**TINY)).eval().save_pretrained(base)
    tokenizer_files(base)
    BertForSequenceClassification(BertConfig(**TINY, num_labels=2)).eval().save_pretrained(classifier)
    tokenizer_files(classifier)
    embedder = root / "embedder"
    SentenceTransformer(modules=[Transformer(str(base), max_seq_length=128), Pooling(WIDTH, "mean"), Normalize()],
                        device="cpu", prompts={"query": "query: ", "document": "passage: "}).save(str(embedder))
    return {"embedder": embedder, "classifier": classifier}


@pytest.fixture(scope="module")
def server(serve_start, checkpoints, tmp_path_factory):
    from export.cli import main

    repository = tmp_path_factory.mktemp("encoding-repository")
    for name, path in checkpoints.items():
        assert main(["--from-pretrained", str(path), "--out-dir", str(repository), "--name", name,
                     "--graphs", "fp32", "--quiet"]) == 0
    return serve_start(repository / "embedder", "--model-repository", str(repository), "--default-model", "embedder",
                       timeout=180)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """SentenceTransformer.encode of the embedder checkpoint (`prompt_name` as the request's input type)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(checkpoints["embedder"]), device="cpu")
    return lambda texts, **kw: model.encode(texts, convert_to_numpy=True, **kw)


@pytest.fixture(scope="module")
def cohere_v2(server):
    import cohere

    return cohere.ClientV2(base_url=f"http://127.0.0.1:{server.http_port}", api_key="x")


# -- every encoding equals quantize_embeddings on the documented ranges ---------------------------------------

def test_cohere_client_v2_embed_gets_every_type_as_quantize_embeddings(cohere_v2, reference):
    got = cohere_v2.embed(model="embedder", texts=TEXTS, input_type="search_query",
                          embedding_types=["float", "int8", "uint8", "binary", "ubinary", "base64"])
    floats = np.asarray(got.embeddings.float_, np.float32)
    np.testing.assert_allclose(floats, reference(TEXTS, prompt_name="query"), atol=ATOL)
    for precision in QUANTIZED:
        want = _quantized(floats, precision)
        answer = np.asarray(getattr(got.embeddings, precision))
        assert answer.shape == want.shape, precision
        np.testing.assert_array_equal(answer, want.astype(np.int64), err_msg=precision)
    decoded = np.stack([np.frombuffer(base64.b64decode(b), "<f4") for b in got.embeddings.base64])
    np.testing.assert_array_equal(decoded, floats)
    assert got.texts == TEXTS and got.response_type == "embeddings_by_type"
    assert got.meta.billed_units.input_tokens > len(TEXTS)


def test_binary_of_a_width_not_a_multiple_of_8_is_ceil_d_over_8_bytes(http):
    body = {"model": "embedder", "texts": TEXTS, "input_type": "search_document", "output_dimension": 20,
            "embedding_types": ["float", "binary", "ubinary", "int8"]}
    got = http.post("/v2/embed", json=body).json()["embeddings"]
    floats = np.asarray(got["float"], np.float32)
    assert floats.shape == (len(TEXTS), 20)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)  # re-normalised after the cut
    for precision in ("binary", "ubinary", "int8"):
        want = _quantized(floats, precision)
        assert want.shape[1] == (3 if "binary" in precision else 20)
        np.testing.assert_array_equal(np.asarray(got[precision]), want.astype(np.int64), err_msg=precision)


def test_one_text_alone_gets_int8_and_uint8(http):
    """quantize_embeddings calibrates on the batch when given no ranges, which one text cannot be: the server's
    fixed ranges make a lone text's vector what the documented ranges make of it."""
    got = http.post("/v2/embed", json={"model": "embedder", "texts": TEXTS[:1], "input_type": "search_query",
                                       "embedding_types": ["float", "int8", "uint8"]}).json()["embeddings"]
    for precision in ("int8", "uint8"):
        np.testing.assert_array_equal(np.asarray(got[precision]), _quantized(got["float"], precision).astype(np.int64))


def test_input_type_picks_the_models_prompt(http, reference):
    for input_type, prompt in (("search_query", "query"), ("search_document", "document")):
        got = http.post("/v2/embed", json={"model": "embedder", "texts": TEXTS, "input_type": input_type}).json()
        np.testing.assert_allclose(got["embeddings"]["float"], reference(TEXTS, prompt_name=prompt), atol=ATOL,
                                   err_msg=input_type)


def test_cohere_v1_embed_without_types_answers_floats(server, reference):
    import cohere

    client = cohere.Client(base_url=f"http://127.0.0.1:{server.http_port}", api_key="x")
    got = client.embed(model="embedder", texts=TEXTS, input_type="search_document")
    assert got.response_type == "embeddings_floats"
    np.testing.assert_allclose(got.embeddings, reference(TEXTS, prompt_name="document"), atol=ATOL)


def test_truncate_none_refuses_a_long_text_and_end_cuts_it(http):
    body = {"model": "embedder", "texts": ["word " * 600], "input_type": "search_query"}
    refused = http.post("/v2/embed", json={**body, "truncate": "NONE"})
    assert refused.status_code == 400 and refused.json()["message"].startswith("texts[0]:")
    assert http.post("/v2/embed", json={**body, "truncate": "END"}).status_code == 200


def _first_or_last_tokens(checkpoints, text: str, tokens: int, end: str) -> str:
    """`text` cut to its first (END) or last (START) `tokens` tokens by transformers' own tokenizer of the
    checkpoint (its offsets; special tokens not counted): Cohere's max_tokens, computed apart from the server."""
    from transformers import AutoTokenizer

    offsets = AutoTokenizer.from_pretrained(str(checkpoints["embedder"]))(
        text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) > tokens
    return text[: offsets[tokens - 1][1]] if end == "END" else text[offsets[len(offsets) - tokens][0]:]


@pytest.mark.parametrize("end", ["END", "START"])
def test_cohere_max_tokens_embeds_each_texts_first_or_last_tokens(cohere_v2, checkpoints, reference, end):
    texts = ["The plot made no sense at all, and the ending was worse than the middle.", "Paris is in France."]
    got = cohere_v2.embed(model="embedder", texts=texts, input_type="search_query", embedding_types=["float"],
                          max_tokens=6, truncate=end)
    cut = [_first_or_last_tokens(checkpoints, texts[0], 6, end), texts[1]]  # the second is shorter: kept whole
    np.testing.assert_allclose(got.embeddings.float_, reference(cut, prompt_name="query"), atol=ATOL)
    whole = reference(texts[:1], prompt_name="query")[0]
    assert not np.allclose(got.embeddings.float_[0], whole, atol=ATOL)  # control: the cut changed the embedding


def test_cohere_max_tokens_with_truncate_none_refuses_a_longer_text_naming_it(http):
    answer = http.post("/v2/embed", json={"model": "embedder", "texts": ["short", "one two three four five six"],
                                          "input_type": "search_query", "max_tokens": 3, "truncate": "NONE"})
    assert answer.status_code == 400
    message = answer.json()["message"]
    assert message.startswith("texts[1]: 6 tokens exceed max_tokens=3"), message


def test_openai_client_base64_still_equals_float(server):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)
    floats = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float").data
    packed = client.embeddings.create(model="embedder", input=TEXTS).data  # the client asks base64, decodes it
    np.testing.assert_array_equal(np.asarray([d.embedding for d in packed], np.float32),
                                  np.asarray([d.embedding for d in floats], np.float32))


# -- Encode over gRPC: INT8 / UINT8 tensors -----------------------------------------------------------------

@pytest.mark.parametrize("precision, dtype, width", [
    ("int8", pb.DATA_TYPE_INT8, WIDTH), ("uint8", pb.DATA_TYPE_UINT8, WIDTH),
    ("binary", pb.DATA_TYPE_INT8, WIDTH // 8), ("ubinary", pb.DATA_TYPE_UINT8, WIDTH // 8)])
def test_grpc_encode_answers_typed_tensors(stub, precision, dtype, width):
    from serve.protocols.tensors import to_numpy

    floats = stub.Encode(pb.EncodeRequest(model="embedder", texts=TEXTS))
    encoded = stub.Encode(pb.EncodeRequest(model="embedder", texts=TEXTS, output=pb.OutputOptions(
        encoding=getattr(pb, f"EMBEDDING_ENCODING_{precision.upper()}"))))
    want = _quantized(np.stack([to_numpy(r.embedding, "e") for r in floats.results]), precision)
    for result, row in zip(encoded.results, want):
        assert result.embedding.dtype == dtype and list(result.embedding.shape) == [width]
        np.testing.assert_array_equal(to_numpy(result.embedding, "embedding", answer=True), row)


def test_grpc_encode_stream_answers_typed_tensors(stub):
    from serve.protocols.tensors import to_numpy

    requests = [pb.EncodeRequest(model="embedder", texts=TEXTS),
                pb.EncodeRequest(model="embedder", texts=TEXTS, output=pb.OutputOptions(
                    encoding=pb.EMBEDDING_ENCODING_UBINARY))]
    floats, packed = (item.response for item in stub.EncodeStream(iter(requests)))
    want = _quantized(np.stack([to_numpy(r.embedding, "e") for r in floats.results]), "ubinary")
    np.testing.assert_array_equal(np.stack([to_numpy(r.embedding, "e", answer=True) for r in packed.results]), want)


# -- KServe v2: typed outputs ---------------------------------------------------------------------------------

def _v2_texts(module):
    texts = module.InferInput("texts", [len(TEXTS)], "BYTES")
    texts.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    return texts


def test_kserve_v2_grpc_embeddings_in_int8_and_ubinary(server):
    grpcclient = pytest.importorskip("tritonclient.grpc")

    client = grpcclient.InferenceServerClient(server.target)
    outputs = [grpcclient.InferRequestedOutput("embeddings")]
    floats = client.infer("embedder", [_v2_texts(grpcclient)], outputs=outputs).as_numpy("embeddings")
    for precision, datatype in (("int8", "INT8"), ("ubinary", "UINT8")):
        answer = client.infer("embedder", [_v2_texts(grpcclient)], outputs=outputs,
                              parameters={"encoding": precision})
        assert answer.get_output("embeddings").datatype == datatype
        np.testing.assert_array_equal(answer.as_numpy("embeddings"), _quantized(floats, precision))


def test_kserve_v2_rest_embeddings_in_uint8_and_binary(http):
    def infer(**parameters):
        return http.post("/v2/models/embedder/infer", json={
            "inputs": [{"name": "texts", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}],
            "outputs": [{"name": "embeddings"}], "parameters": parameters}).json()["outputs"][0]

    floats = infer()
    floats = np.asarray(floats["data"], np.float32).reshape(floats["shape"])
    for precision, datatype in (("uint8", "UINT8"), ("binary", "INT8")):
        answer = infer(encoding=precision)
        want = _quantized(floats, precision)
        assert answer["datatype"] == datatype and answer["shape"] == list(want.shape)
        np.testing.assert_array_equal(np.asarray(answer["data"]).reshape(want.shape), want)


# -- bad input: 400 / INVALID_ARGUMENT naming the field and what fits ----------------------------------------

@pytest.mark.parametrize("body, field, fits", [
    ({"embedding_types": ["int4"]}, "embedding_types[0]:", "ubinary"),
    ({"embedding_types": "float"}, "embedding_types:", "base64"),
    ({"input_type": "image"}, "input_type:", "search_document"),
    ({"truncate": "MIDDLE"}, "truncate:", "START"),
    ({"max_tokens": 0}, "max_tokens:", "a positive integer"),
    ({"max_tokens": "8"}, "max_tokens:", "a positive integer"),
    ({"output_dimension": 5000}, "output_dimension:", "out of range [1, "),
])
def test_bad_cohere_embed_bodies_are_refused_naming_the_field(http, body, field, fits):
    answer = http.post("/v2/embed", json={"model": "embedder", "texts": TEXTS, "input_type": "search_query", **body})
    assert answer.status_code in (400, 501)
    assert answer.json()["message"].startswith(field) and fits in answer.json()["message"]


def test_openai_encoding_format_names_what_fits(http):
    answer = http.post("/v1/embeddings", json={"model": "embedder", "input": "x", "encoding_format": "int8"})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith("encoding_format: 'int8' is not one of float, base64")


def test_grpc_encode_unknown_encoding_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as error:
        stub.Encode(pb.EncodeRequest(model="embedder", texts=TEXTS, output=pb.OutputOptions(encoding=9)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("output.encoding: unknown value 9")


def test_a_quantized_encoding_on_a_classifier_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as error:
        stub.Encode(pb.EncodeRequest(model="classifier", texts=TEXTS, output=pb.OutputOptions(
            encoding=pb.EMBEDDING_ENCODING_BINARY)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("output.encoding: binary") and "float" in error.value.details()


def test_int8_of_unnormalised_embeddings_is_refused_but_binary_is_not(stub):
    options = dict(normalize=False)
    with pytest.raises(grpc.RpcError) as error:
        stub.Encode(pb.EncodeRequest(model="embedder", texts=TEXTS, output=pb.OutputOptions(
            encoding=pb.EMBEDDING_ENCODING_INT8, **options)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("output.encoding: int8") and "[-1, 1]" in error.value.details()
    answer = stub.Encode(pb.EncodeRequest(model="embedder", texts=TEXTS, output=pb.OutputOptions(
        encoding=pb.EMBEDDING_ENCODING_BINARY, **options)))
    assert answer.results[0].embedding.dtype == pb.DATA_TYPE_INT8


def test_kserve_v2_unknown_encoding_is_400_naming_the_parameter(http):
    answer = http.post("/v2/models/embedder/infer", json={
        "inputs": [{"name": "texts", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
        "parameters": {"encoding": "base64"}})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("parameters.encoding: 'base64' is not one of float, int8")
