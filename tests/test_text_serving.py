"""Text in, sentence embeddings out: the packaged all-MiniLM-L6-v2 served by the real server.

References: sentence-transformers' `encode(..., normalize_embeddings=True)` for pooled embeddings
and transformers' BertModel for per-token hidden states, both on the same packaged files (offline).
"""

from __future__ import annotations

import io
import json
import shutil
import sys

import grpc
import numpy as np
import pytest

from client import EncoderClient, main as client_main
from serve.protocols.pb import pb

EMBEDDING_ATOL = 1e-4  # max abs difference of a pooled, normalised embedding
MIN_COSINE = 0.99999
HIDDEN_ATOL = 1e-4  # per-token hidden states at valid positions
MAX_TEXT_TOKENS = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2

# "hello" is one token, so n words are n + 2 tokens with [CLS] and [SEP].
AT_LIMIT = " ".join(["hello"] * (MAX_TEXT_TOKENS - 2))
OVER_LIMIT = " ".join(["hello"] * (MAX_TEXT_TOKENS - 1))
TEXTS = [
    "a",
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Wait... what?! (Really) -- yes: 'quoted' \"double\" [brackets] {braces} <angle> #hash @at $5.00 100% ;-)",
    "Café naïve façade, Straße, Ελληνικά, русский текст, 東京タワー, 한국어, עברית, emoji 🙂👍",
    "  leading and trailing spaces\tand\ttabs\nand a newline  ",
    " ".join(["Sentence embeddings map text to vectors so that similar meanings land close together."] * 8),
    AT_LIMIT,
]


@pytest.fixture(scope="session")
def text_export_dir(tmp_path_factory):
    """The packaged MiniLM exported once (as `python -m export --minilm` does), with its tokenizer."""
    from export.exporter import export_model
    from model.hf_pretrained import load_pretrained, minilm_path

    pretrained = load_pretrained(minilm_path())
    result = export_model(
        pretrained.config, tmp_path_factory.mktemp("text-export"), model=pretrained.encoder,
        extra_files={"tokenizer.json": pretrained.tokenizer_file},
        tokenizer=pretrained.tokenizer_metadata(), pooling=pretrained.pooling,
    )
    return result.directory


@pytest.fixture(scope="module")
def text_server(serve_start, text_export_dir):
    return serve_start(text_export_dir)


@pytest.fixture(scope="module")
def client(text_server):
    with EncoderClient(text_server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def sentence_model():
    from sentence_transformers import SentenceTransformer

    from model.hf_pretrained import minilm_path

    return SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="module")
def bert():
    """(tokenizer, BertModel) from transformers on the packaged files: the hidden-state reference."""
    from transformers import AutoTokenizer, BertModel

    from model.hf_pretrained import minilm_path

    path = str(minilm_path())
    return AutoTokenizer.from_pretrained(path), BertModel.from_pretrained(path).eval()


def reference_token_counts(bert, texts):
    tokenizer, _ = bert
    return [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=MAX_TEXT_TOKENS)["input_ids"]]


def assert_matches_sentence_transformers(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, atol=EMBEDDING_ATOL, rtol=0)
    cosine = np.sum(actual * expected, axis=1) / (np.linalg.norm(actual, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= MIN_COSINE, cosine
    print(f"max_abs={np.abs(actual - expected).max():.3g} min_cosine={cosine.min():.9f}")


def test_texts_fixture_spans_one_token_to_the_limit(bert):
    counts = reference_token_counts(bert, TEXTS)
    assert min(counts) == 3 and max(counts) == MAX_TEXT_TOKENS
    assert reference_token_counts(bert, [OVER_LIMIT]) == [MAX_TEXT_TOKENS]  # ...after truncation
    assert len(bert[0](OVER_LIMIT)["input_ids"]) == MAX_TEXT_TOKENS + 1


def test_model_info_advertises_the_tokenizer(client):
    info = client.model_info()
    assert info.has_tokenizer and info.limits.max_text_tokens == MAX_TEXT_TOKENS
    assert info.default_pooling == "mean" and info.default_normalize


def test_text_embeddings_match_sentence_transformers(client, sentence_model, bert):
    out = client.embed(TEXTS)  # one request: rows of 3..256 tokens padded into one batch
    expected = sentence_model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    assert_matches_sentence_transformers(out.embeddings, expected)
    np.testing.assert_allclose(np.linalg.norm(out.embeddings, axis=1), 1.0, atol=1e-6)
    assert list(out.token_counts) == reference_token_counts(bert, TEXTS)
    assert out.metadata.total_tokens == sum(out.token_counts)
    assert out.truncated == (False,) * len(TEXTS)  # AT_LIMIT fits exactly: 256 tokens, not cut


def test_each_text_alone_equals_the_batch(client):
    batch = client.embed(TEXTS[:4]).embeddings
    alone = np.stack([client.embed([t]).embeddings[0] for t in TEXTS[:4]])
    np.testing.assert_allclose(alone, batch, atol=1e-5, rtol=0)


def test_hidden_states_match_bert_model_at_valid_positions(client, bert):
    import torch

    tokenizer, model = bert
    out = client.embed(TEXTS, hidden_states=True, pooling="none")
    assert out.embeddings is None and len(out.hidden_states) == len(TEXTS)
    inputs = tokenizer(TEXTS, padding=True, truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state.numpy()
    lengths = inputs["attention_mask"].sum(1).tolist()
    worst = 0.0
    for i, (hidden, length) in enumerate(zip(out.hidden_states, lengths)):
        assert hidden.shape == (length, model.config.hidden_size) and hidden.dtype == np.float32
        np.testing.assert_allclose(hidden, expected[i, :length], atol=HIDDEN_ATOL, rtol=0, err_msg=f"text {i}")
        worst = max(worst, float(np.abs(hidden - expected[i, :length]).max()))
    print(f"hidden max_abs={worst:.3g}")


def test_token_ids_still_work_and_equal_the_text_route(client, bert):
    ids = bert[0](TEXTS[:3])["input_ids"]
    by_ids = client.encode(ids)  # default pooling and normalisation apply to token ids too
    by_text = client.embed(TEXTS[:3])
    np.testing.assert_allclose(by_ids.embeddings, by_text.embeddings, atol=1e-6, rtol=0)
    assert list(by_ids.token_counts) == [len(x) for x in ids]
    assert by_ids.truncated == ()  # a text-only flag


def test_pooling_and_normalize_can_be_overridden(client, sentence_model):
    raw = client.embed(TEXTS[:3], normalize=False).embeddings  # MiniLM's Normalize module skipped
    norms = np.linalg.norm(raw, axis=1, keepdims=True)
    assert not np.allclose(norms, 1.0)
    expected = sentence_model.encode(TEXTS[:3], normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(raw / norms, expected, atol=EMBEDDING_ATOL, rtol=0)
    first = client.embed(TEXTS[:3], pooling="first", normalize=False, hidden_states=True)
    np.testing.assert_array_equal(first.embeddings, np.stack([h[0] for h in first.hidden_states]))


def test_dimensions_keep_the_first_values_renormalised_as_on_http(client):
    full = client.embed(TEXTS[:2]).embeddings
    cut = client.embed(TEXTS[:2], dimensions=64).embeddings
    assert cut.shape == (2, 64)
    np.testing.assert_allclose(cut, full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True),
                               atol=1e-6, rtol=0)
    raw = client.embed(TEXTS[:2], dimensions=64, normalize=False).embeddings  # no normalisation asked: none
    np.testing.assert_allclose(raw, client.embed(TEXTS[:2], normalize=False).embeddings[:, :64], atol=1e-6, rtol=0)


def test_dimensions_past_the_embeddings_width_are_invalid_argument_naming_it(client):
    with pytest.raises(grpc.RpcError) as info:
        client.embed(["x"], dimensions=385)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dimensions: 385 out of range [1, 384]" in info.value.details()


def test_too_long_text_without_truncate_is_invalid_argument_naming_the_limit(client):
    with pytest.raises(grpc.RpcError) as info:
        client.embed(["fine", OVER_LIMIT])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "texts[1]" in details and f"{MAX_TEXT_TOKENS + 1} tokens" in details
    assert f"max_text_tokens={MAX_TEXT_TOKENS}" in details and "truncate" in details


def test_truncate_cuts_like_sentence_transformers(client, sentence_model):
    texts = [OVER_LIMIT, " ".join(TEXTS[2:6]) * 6, "short one"]
    out = client.embed(texts, truncate=True)
    expected = sentence_model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    assert_matches_sentence_transformers(out.embeddings, expected)
    assert out.token_counts[:2] == (MAX_TEXT_TOKENS, MAX_TEXT_TOKENS) and out.token_counts[2] == 4
    assert out.truncated == (True, True, False)


@pytest.mark.parametrize("texts, index", [([""], 0), (["ok", ""], 1)])
def test_empty_text_is_invalid_argument_naming_its_index(client, texts, index):
    with pytest.raises(grpc.RpcError) as info:
        client.embed(texts)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"texts[{index}]: empty text" in info.value.details()


def test_texts_and_sequences_together_are_invalid_argument(client):
    request = pb.EncodeRequest(texts=["hello"])
    request.sequences.add().CopyFrom(pb.Tensor(dtype=pb.DATA_TYPE_INT64, shape=[1], data=np.int64([7]).tobytes()))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Encode(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "either texts or sequences" in info.value.details()


def test_text_requests_stream(client, sentence_model):
    requests = [pb.EncodeRequest(request_id=str(i), texts=[t]) for i, t in enumerate(TEXTS[:3])]
    responses = list(client.stub.EncodeStream(iter(requests), timeout=30))
    assert [r.response.request_id for r in responses] == ["0", "1", "2"]
    assert all(r.error.code == 0 for r in responses)
    got = np.stack([np.frombuffer(r.response.results[0].embedding.data, np.float32) for r in responses])
    expected = sentence_model.encode(TEXTS[:3], normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(got, expected, atol=EMBEDDING_ATOL, rtol=0)


def test_cli_embeds_arguments_and_stdin_lines(text_server, client, tmp_path, monkeypatch, capsys):
    target = ["--target", text_server.target]
    assert client_main([*target, "embed", "some text", "more text"]) == 0
    summary = capsys.readouterr().out
    assert "texts=2 dims=384" in summary and "truncated=0" in summary and "text[1] tokens=4 norm=1.0000" in summary
    assert client_main([*target, "embed", "--truncate", "short", OVER_LIMIT]) == 0
    summary = capsys.readouterr().out
    assert "truncated=1" in summary and f"text[1] tokens={MAX_TEXT_TOKENS} truncated" in summary

    npy = tmp_path / "v.npy"
    monkeypatch.setattr(sys, "stdin", io.StringIO("some text\n\nmore text\r\n"))
    assert client_main([*target, "embed", "-", "--out", str(npy), "--batch-size", "1"]) == 0
    expected = client.embed(["some text", "more text"]).embeddings
    np.testing.assert_allclose(np.load(npy), expected, atol=1e-6, rtol=0)

    jsonl = tmp_path / "v.jsonl"
    monkeypatch.setattr(sys, "stdin", io.StringIO("some text\nmore text\n"))
    assert client_main([*target, "embed", "--out", str(jsonl)]) == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["index"], r["text"], r["tokens"], r["truncated"]) for r in records] == [
        (0, "some text", 4, False), (1, "more text", 4, False)]
    np.testing.assert_allclose(np.array([r["embedding"] for r in records]), expected, atol=1e-6, rtol=0)

    assert client_main([*target, "embed", ""]) == 1
    assert "INVALID_ARGUMENT: texts[0]: empty text" in capsys.readouterr().err


@pytest.fixture(scope="module")
def export_without_tokenizer(text_export_dir, tmp_path_factory):
    """The same graph with the tokenizer taken out of the export."""
    directory = tmp_path_factory.mktemp("no-tokenizer") / "minilm-ids-only"
    shutil.copytree(text_export_dir, directory)
    (directory / "tokenizer.json").unlink()
    meta = json.loads((directory / "metadata.json").read_text())
    meta["tokenizer"] = None
    (directory / "metadata.json").write_text(json.dumps(meta))
    return directory


def test_text_to_a_model_without_tokenizer_is_a_clear_error(serve_start, export_without_tokenizer):
    server = serve_start(export_without_tokenizer)
    with EncoderClient(server.target, timeout=30) as c:
        info = c.model_info()
        assert not info.has_tokenizer and info.limits.max_text_tokens == 0
        with pytest.raises(grpc.RpcError) as error:
            c.embed(["hello"])
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model has no tokenizer" in error.value.details()
        assert c.encode([[101, 7592, 102]]).token_counts == (3,)
    assert server.terminate() == 0


def test_server_refuses_a_tokenizer_that_changed_after_export(serve_start, text_export_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tampered") / "minilm"
    shutil.copytree(text_export_dir, directory)
    with open(directory / "tokenizer.json", "a") as handle:
        handle.write(" ")
    server = serve_start(directory, wait=False)
    assert server.proc.wait(60) == 1
    log = server.log()
    assert "startup_failed" in log and "tokenizer.json: sha256" in log and "does not match metadata.json" in log


# --- texts over KServe v2 (serve/protocols/kserve_v2.py): a BYTES input named `texts` -------------------------
@pytest.fixture(scope="module")
def v2(text_server, client):
    """(tritonclient.grpc client, the served model's name)."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    v2_client = grpcclient.InferenceServerClient(url=text_server.target)
    yield v2_client, client.model_info().name
    v2_client.close()


def _v2_texts(v2, texts, outputs=("embeddings",), **parameters):
    import tritonclient.grpc as grpcclient

    v2_client, name = v2
    tensor = grpcclient.InferInput("texts", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=np.object_))
    return v2_client.infer(name, [tensor], outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                           parameters=parameters or None)


def test_v2_model_metadata_lists_the_texts_input(v2):
    v2_client, name = v2
    inputs = {t.name: (t.datatype, list(t.shape)) for t in v2_client.get_model_metadata(name).inputs}
    assert inputs["texts"] == ("BYTES", [-1])


def test_v2_texts_give_encode_embeddings_and_match_sentence_transformers(v2, client, sentence_model):
    out = _v2_texts(v2, TEXTS, outputs=("embeddings", "last_hidden_state"))
    embeddings, hidden = out.as_numpy("embeddings"), out.as_numpy("last_hidden_state")
    expected = sentence_model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    assert_matches_sentence_transformers(embeddings, expected)
    by_encode = client.embed(TEXTS, hidden_states=True)
    np.testing.assert_allclose(embeddings, by_encode.embeddings, atol=1e-6, rtol=0)
    longest = max(by_encode.token_counts)
    assert hidden.shape == (len(TEXTS), longest, embeddings.shape[1])
    for row, (states, count) in enumerate(zip(by_encode.hidden_states, by_encode.token_counts)):
        np.testing.assert_allclose(hidden[row, :count], states, atol=1e-6, rtol=0)
        assert not hidden[row, count:].any()  # zeros at padding, as for input_ids


def test_v2_too_long_text_is_refused_unless_the_truncate_parameter_is_set(v2, sentence_model):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as error:
        _v2_texts(v2, ["fine", OVER_LIMIT])
    assert "INVALID_ARGUMENT" in str(error.value.status())
    assert "texts[1]" in error.value.message() and f"max_text_tokens={MAX_TEXT_TOKENS}" in error.value.message()
    out = _v2_texts(v2, ["fine", OVER_LIMIT], truncate=True)
    expected = sentence_model.encode(["fine", OVER_LIMIT], normalize_embeddings=True, convert_to_numpy=True)
    assert_matches_sentence_transformers(out.as_numpy("embeddings"), expected)


def test_v2_texts_with_input_ids_is_invalid_argument(v2):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    v2_client, name = v2
    texts = grpcclient.InferInput("texts", [1], "BYTES")
    texts.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    ids = grpcclient.InferInput("input_ids", [1, 3], "INT64")
    ids.set_data_from_numpy(np.array([[101, 7592, 102]], dtype=np.int64))
    with pytest.raises(InferenceServerException) as error:
        v2_client.infer(name, [texts, ids])
    assert "INVALID_ARGUMENT" in str(error.value.status()) and "either texts or input_ids" in error.value.message()


# --- long texts as overlapping windows (chunk=true) -----------------------------------------------------

LONG_TEXT = " ".join(TEXTS[2:7]) * 5  # ~600 tokens: three windows of MAX_TEXT_TOKENS


def _window_embeddings(bert, text):
    """transformers' own overflow windows (stride MAX_TEXT_TOKENS // 8) and each window's mean hidden state."""
    import torch

    tokenizer, model = bert
    windows = tokenizer(text, truncation=True, max_length=MAX_TEXT_TOKENS, stride=MAX_TEXT_TOKENS // 8,
                        return_overflowing_tokens=True)["input_ids"]
    with torch.no_grad():
        means = [model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0).numpy() for ids in windows]
    return [len(ids) for ids in windows], np.stack(means)


def test_chunk_embeds_a_long_text_as_the_token_weighted_mean_of_its_windows(client, bert):
    lengths, means = _window_embeddings(bert, LONG_TEXT)
    assert len(lengths) >= 3 and max(lengths) == MAX_TEXT_TOKENS
    weighted = (np.array(lengths, np.float64)[:, None] * means).sum(0) / sum(lengths)
    expected = weighted / np.linalg.norm(weighted)

    out = client.embed([LONG_TEXT, "short one"], chunk=True)
    assert out.chunks == (len(lengths), 1)
    assert out.token_counts[0] == sum(lengths) and out.truncated == (False, False)
    np.testing.assert_allclose(out.embeddings[0], expected, atol=EMBEDDING_ATOL, rtol=0)
    unpooled = client.embed([LONG_TEXT], chunk=True, normalize=False)
    np.testing.assert_allclose(unpooled.embeddings[0], weighted, atol=EMBEDDING_ATOL, rtol=0)


def test_chunk_leaves_a_text_within_the_limit_as_it_is(client):
    plain = client.embed(TEXTS[:3])
    chunked = client.embed(TEXTS[:3], chunk=True)
    assert chunked.chunks == (1, 1, 1)
    np.testing.assert_allclose(chunked.embeddings, plain.embeddings, atol=1e-6, rtol=0)


@pytest.mark.parametrize("options, words", [
    ({"truncate": True}, "chunk and truncate"),
    ({"hidden_states": True}, "pooling mean and no hidden_states"),
    ({"pooling": "first"}, "pooling mean and no hidden_states"),
])
def test_chunk_with_truncate_hidden_states_or_other_pooling_is_invalid_argument(client, options, words):
    with pytest.raises(grpc.RpcError) as info:
        client.embed([LONG_TEXT], chunk=True, **options)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()
