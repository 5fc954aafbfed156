"""LLM rerankers (model/heads.py answer_tokens, model/tasks.py RERANK_TEMPLATES): a Qwen3ForCausalLM saved by
transformers with a Qwen-like byte-level BPE tokenizer (the template's chat tokens, "yes" and "no"), exported
with `--reranker-template qwen3`, served by a real server process and called on /v1/rerank (the cohere client),
TEI's /rerank and gRPC Rerank. The reference is Qwen/Qwen3-Reranker-0.6B's model card recipe, written as the card
has it (tests/hf_references.py CardRecipe: format_instruction, process_inputs, compute_logits on
AutoModelForCausalLM, left padding). Beside it a Gemma3ForCausalLM exported with `--reranker-template bge-gemma`
against bge-reranker-v2-gemma's card recipe (BgeGemmaRecipe: get_inputs, the "Yes" logit at the last token).
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

from tests.hf_references import (QWEN3_BODY, QWEN3_INSTRUCTION, QWEN3_PREFIX, QWEN3_RERANKER, QWEN3_SUFFIX,
                                  RERANKER_DOCUMENTS, RERANKER_MAX_LENGTH, RERANKER_QUERY, BgeGemmaRecipe, CardRecipe,
                                  qwen_tokenizer, save_gemma3_reranker, save_qwen3_reranker)

SCORE_ATOL = 1e-4
TELLING = 1e-2  # a wrong row, a missing template or a wrong instruction moves a score by more than this
QUERY, DOCUMENTS, MAX_LENGTH, QWEN3 = RERANKER_QUERY, RERANKER_DOCUMENTS, RERANKER_MAX_LENGTH, QWEN3_RERANKER


def _export(source, out_dir, name, *flags):
    from export.cli import main

    assert main(["--from-pretrained", str(source), "--out-dir", str(out_dir), "--name", name, "--graphs", "fp32",
                 "--quiet", *flags]) == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-reranker")
    save_qwen3_reranker(directory)
    return directory


@pytest.fixture(scope="module")
def card(checkpoint):
    return CardRecipe(checkpoint)


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3-reranker")
    save_gemma3_reranker(directory)
    return directory


@pytest.fixture(scope="module")
def repository(checkpoint, gemma_checkpoint, tmp_path_factory):
    """The checkpoint as an LLM reranker and, without the template, as the embedder it also is; a Gemma3
    reranker in bge-reranker-v2-gemma's recipe and a BERT cross-encoder beside them."""
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    from tests.hf_references import word_tokenizer

    out = tmp_path_factory.mktemp("llm-rerank-repository")
    _export(checkpoint, out, "qwen3-reranker", "--reranker-template", "qwen3")
    _export(checkpoint, out, "qwen3-embedder")
    _export(gemma_checkpoint, out, "gemma-reranker", "--reranker-template", "bge-gemma")
    cross = tmp_path_factory.mktemp("cross-encoder")
    tokenizer, vocab = word_tokenizer()
    BertForSequenceClassification(BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1,
                                             max_position_embeddings=128)).save_pretrained(str(cross))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            unk_token="[UNK]").save_pretrained(str(cross))
    _export(cross, out, "cross-encoder")
    return out


@pytest.fixture(scope="module")
def server(serve_start, repository):
    return serve_start(repository / "qwen3-reranker", "--model-repository", str(repository), "--default-model",
                       "qwen3-reranker", timeout=180)


def _tei_scores(http, query, texts, **fields) -> np.ndarray:
    answer = http.post("/rerank", json={"model": "qwen3-reranker", "query": query, "texts": texts, **fields})
    assert answer.status_code == 200, answer.text
    scores = np.zeros(len(texts))
    for item in answer.json():
        scores[item["index"]] = item["score"]
    return scores


# --- the export ------------------------------------------------------------------------------------------------

def test_the_export_records_the_cards_template_and_the_answer_token_ids(repository, card):
    metadata = json.loads((repository / "qwen3-reranker" / "metadata.json").read_text())
    task = metadata["task"]
    assert (task["kind"], task["output"], task["activation"], task["labels"]) == ("rerank", "logits", "sigmoid",
                                                                                  ["yes"])
    assert task["template"]["parts"] == [QWEN3_PREFIX, QWEN3_BODY.replace("{doc}", "{document}"), QWEN3_SUFFIX]
    assert task["template"]["instruction"] == QWEN3_INSTRUCTION
    assert task["template"]["answer_ids"] == [card.token_false_id, card.token_true_id]
    assert metadata["config"]["head_tokens"] == [card.token_false_id, card.token_true_id]


def test_the_graph_holds_two_lm_head_rows_never_the_vocabulary_projection(repository, card):
    graph = onnx.load(str(repository / "qwen3-reranker" / "model.onnx"))
    vocab, hidden = card.model.lm_head.weight.shape
    head = {tuple(t.dims) for t in graph.graph.initializer if "head" in t.name}
    assert head == {(2, hidden)} or head == {(hidden, 2)}
    rows = card.model.lm_head.weight.detach().numpy()[[card.token_false_id, card.token_true_id]]
    weights = [onnx.numpy_helper.to_array(t) for t in graph.graph.initializer if "head" in t.name][0]
    np.testing.assert_array_equal(weights if weights.shape == rows.shape else weights.T, rows)
    assert not any(tuple(t.dims) in ((vocab, hidden), (hidden, vocab)) and "head" in t.name
                   for t in graph.graph.initializer)


def test_a_tied_checkpoint_takes_the_rows_from_its_word_embeddings(tmp_path):
    from transformers import AutoTokenizer

    from model.hf_pretrained import load_pretrained

    model = save_qwen3_reranker(tmp_path, tie_word_embeddings=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    rows = [tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")]
    loaded = load_pretrained(tmp_path, reranker_template="qwen3")
    np.testing.assert_array_equal(loaded.encoder.head.out.weight.detach().numpy(),
                                  model.model.embed_tokens.weight.detach().numpy()[rows])


def test_a_template_on_a_checkpoint_that_is_not_a_causal_lm_is_refused_naming_it(tmp_path):
    from transformers import Qwen3Config, Qwen3Model

    from model.checkpoint import CheckpointError
    from model.hf_pretrained import load_pretrained

    Qwen3Model(Qwen3Config(**QWEN3, vocab_size=400)).save_pretrained(str(tmp_path))
    qwen_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="ForCausalLM.*Qwen3Model"):
        load_pretrained(tmp_path, reranker_template="qwen3")


@pytest.mark.parametrize("fields, named", [
    (dict(head="answer_tokens"), "head_tokens"),
    (dict(head_tokens=(1, 2)), "head_tokens"),
    (dict(head="answer_tokens", head_tokens=(1, 400)), "vocab_size"),
    (dict(head="answer_tokens", head_tokens=(1, 2), num_labels=2), "num_labels"),
])
def test_answer_tokens_settings_that_do_not_fit_are_refused_naming_the_field(fields, named):
    from model.config import ConfigError, EncoderConfig

    with pytest.raises(ConfigError, match=named):
        EncoderConfig(vocab_size=400, **fields)


@pytest.mark.parametrize("change, named", [
    (lambda task: task["template"].update(answer_ids=task["template"]["answer_ids"][::-1]), "answer_ids"),
    (lambda task: task["template"].update(parts=["<Query>: {query}"]), "{document}"),
    (lambda task: task.pop("template"), "template"),
])
def test_metadata_whose_template_does_not_fit_its_head_is_refused(repository, tmp_path, change, named):
    import shutil

    from model.export_format import ExportError, read_metadata

    copy = tmp_path / "copy"
    shutil.copytree(repository / "qwen3-reranker", copy)
    metadata = json.loads((copy / "metadata.json").read_text())
    change(metadata["task"])
    (copy / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(ExportError, match=f"task.*{re.escape(named)}"):
        read_metadata(copy)


def test_a_template_whose_answer_token_the_vocabulary_lacks_is_refused_naming_it(checkpoint):
    from model.checkpoint import CheckpointError
    from model.hf_pretrained import load_pretrained

    with pytest.raises(CheckpointError, match="'bge-gemma' answers with token\\(s\\) \\['Yes'\\]"):
        load_pretrained(checkpoint, reranker_template="bge-gemma")


# --- served scores against the card's recipe -----------------------------------------------------------------

def test_cohere_v1_rerank_scores_equal_the_model_cards_recipe(server, card):
    import cohere

    client = cohere.Client(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}")
    response = client.rerank(model="qwen3-reranker", query=QUERY, documents=DOCUMENTS)
    want = card.scores(QUERY, DOCUMENTS)
    assert [r.index for r in response.results] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([r.relevance_score for r in response.results], np.sort(want)[::-1], atol=SCORE_ATOL)


def test_tei_rerank_scores_equal_the_model_cards_recipe(http, card):
    np.testing.assert_allclose(_tei_scores(http, QUERY, DOCUMENTS), card.scores(QUERY, DOCUMENTS), atol=SCORE_ATOL)


def test_raw_scores_are_the_yes_logit_minus_the_no_logit(http, card):
    p = card.scores(QUERY, DOCUMENTS)
    np.testing.assert_allclose(_tei_scores(http, QUERY, DOCUMENTS, raw_scores=True), np.log(p / (1 - p)),
                               atol=1e-3)


def test_a_request_instruction_replaces_the_default_as_the_card_does(http, card):
    instruction = "Given a question, retrieve the document that answers it"
    got = _tei_scores(http, QUERY, DOCUMENTS, instruction=instruction)
    np.testing.assert_allclose(got, card.scores(QUERY, DOCUMENTS, instruction), atol=SCORE_ATOL)
    assert np.abs(got - card.scores(QUERY, DOCUMENTS)).max() > TELLING


def test_grpc_rerank_scores_equal_the_model_cards_recipe(server, card):
    import grpc

    from serve.protocols.pb import pb, pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.EncoderServiceStub(channel).Rerank(
            pb.RerankRequest(model="qwen3-reranker", query=QUERY, documents=DOCUMENTS), timeout=60)
    got = np.zeros(len(DOCUMENTS))
    for result in response.results:
        got[result.index] = result.score
    np.testing.assert_allclose(got, card.scores(QUERY, DOCUMENTS), atol=SCORE_ATOL)


def test_grpc_rerank_takes_an_instruction_as_the_card_does(server, card):
    import grpc

    from serve.protocols.pb import pb, pb_grpc

    instruction = "Given a question, retrieve the document that answers it"
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.EncoderServiceStub(channel).Rerank(
            pb.RerankRequest(model="qwen3-reranker", query=QUERY, documents=DOCUMENTS, instruction=instruction),
            timeout=60)
    got = np.zeros(len(DOCUMENTS))
    for result in response.results:
        got[result.index] = result.score
    np.testing.assert_allclose(got, card.scores(QUERY, DOCUMENTS, instruction), atol=SCORE_ATOL)
    assert np.abs(got - card.scores(QUERY, DOCUMENTS)).max() > TELLING


def test_swapped_rows_or_no_template_move_the_scores(http, checkpoint, card):
    """The controls: the recipe with "yes" and "no" the other way round, or without the prompt template."""
    got = _tei_scores(http, QUERY, DOCUMENTS)
    swapped = CardRecipe(checkpoint, swap=True).scores(QUERY, DOCUMENTS)
    bare = CardRecipe(checkpoint, prefix="", suffix="").scores(QUERY, DOCUMENTS)
    assert np.abs(got - swapped).max() > TELLING and np.abs(got - bare).max() > TELLING


def test_a_long_document_is_cut_as_the_card_truncates_never_the_template_or_query(http, card):
    long = " ".join(DOCUMENTS * 8)
    assert len(card.tokenizer(card.format_instruction(None, QUERY, long))["input_ids"]) > MAX_LENGTH
    got = _tei_scores(http, QUERY, [long, DOCUMENTS[0]], truncate=True)
    np.testing.assert_allclose(got, card.scores(QUERY, [long, DOCUMENTS[0]]), atol=SCORE_ATOL)
    refused = http.post("/rerank", json={"query": QUERY, "texts": [long], "truncate": False})
    assert refused.status_code == 400 and refused.json()["error"].startswith("texts[0]:"), refused.text


def test_cut_from_the_left_a_document_keeps_its_longest_end_that_fits(http, card):
    """truncation_direction left: the served score is the card's on the document's last words that fit (words
    that are one token each, so every cut falls between words)."""
    words = [w for w in DOCUMENTS[-1].split() if len(card.tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
    long = " ".join(words * 12)

    def fits(document):
        body = card.tokenizer(card.format_instruction(None, QUERY, document))["input_ids"]
        return len(card.prefix_tokens) + len(body) + len(card.suffix_tokens) <= MAX_LENGTH

    kept = next(long.split()[k:] for k in range(len(long.split())) if fits(" ".join(long.split()[k:])))
    got = _tei_scores(http, QUERY, [long], truncate=True, truncation_direction="left")
    np.testing.assert_allclose(got, card.scores(QUERY, [" ".join(kept)]), atol=SCORE_ATOL)
    assert np.abs(got - card.scores(QUERY, [long])).max() > TELLING  # the card's own cut keeps the start


def test_a_query_too_long_for_any_document_is_refused_naming_it(http):
    answer = http.post("/rerank", json={"query": " ".join([QUERY] * 40), "texts": ["yes"], "truncate": True})
    assert answer.status_code == 400 and answer.json()["error"].startswith("query:"), answer.text


# --- bge-reranker-v2-gemma's recipe on Gemma3ForCausalLM ----------------------------------------------------------

def test_bge_gemma_scores_are_the_cards_yes_logit_and_its_sigmoid(http, gemma_checkpoint):
    recipe = BgeGemmaRecipe(gemma_checkpoint)
    want = recipe.logits(QUERY, DOCUMENTS)
    raw = http.post("/v1/rerank", json={"model": "gemma-reranker", "query": QUERY, "documents": DOCUMENTS,
                                        "raw_scores": True})
    scored = http.post("/v1/rerank", json={"model": "gemma-reranker", "query": QUERY, "documents": DOCUMENTS})
    assert raw.status_code == scored.status_code == 200, raw.text + scored.text
    got_raw, got = np.zeros(len(DOCUMENTS)), np.zeros(len(DOCUMENTS))
    for row in raw.json()["results"]:
        got_raw[row["index"]] = row["relevance_score"]
    for row in scored.json()["results"]:
        got[row["index"]] = row["relevance_score"]
    np.testing.assert_allclose(got_raw, want, atol=SCORE_ATOL, rtol=1e-5)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-want)), atol=SCORE_ATOL)
    assert np.abs(got_raw - recipe.logits(QUERY, DOCUMENTS, prompt="Is B about A?")).max() > TELLING


def test_the_gemma_graph_holds_the_yes_row_of_its_tied_embeddings(repository, gemma_checkpoint):
    recipe = BgeGemmaRecipe(gemma_checkpoint)
    graph = onnx.load(str(repository / "gemma-reranker" / "model.onnx"))
    head = [onnx.numpy_helper.to_array(t) for t in graph.graph.initializer if "head" in t.name]
    row = recipe.model.model.embed_tokens.weight.detach().numpy()[[recipe.yes_loc]]
    assert len(head) == 1
    np.testing.assert_array_equal(head[0] if head[0].shape == row.shape else head[0].T, row)


def test_a_soft_capped_gemma_lm_head_is_refused_naming_it(tmp_path):
    from model.checkpoint import CheckpointError
    from model.hf_pretrained import load_pretrained

    save_gemma3_reranker(tmp_path, final_logit_softcapping=30.0)
    with pytest.raises(CheckpointError, match="final_logit_softcapping"):
        load_pretrained(tmp_path, reranker_template="bge-gemma")


# --- what does not fit ----------------------------------------------------------------------------------------

def test_an_instruction_for_a_cross_encoder_is_refused_naming_it(http):
    answer = http.post("/v1/rerank", json={"model": "cross-encoder", "query": "the a", "documents": ["is it"],
                                           "instruction": "judge"})
    assert answer.status_code == 400 and answer.json()["message"].startswith("instruction:"), answer.text
    assert "LLM reranker" in answer.json()["message"]


def test_rerank_on_the_same_checkpoint_exported_as_an_embedder_is_refused_naming_its_task(http):
    answer = http.post("/v1/rerank", json={"model": "qwen3-embedder", "query": QUERY, "documents": DOCUMENTS})
    assert answer.status_code == 400, answer.text
    message = answer.json()["message"]
    assert "task 'embed'" in message and "/v1/embeddings" in message


def test_predict_on_an_llm_reranker_is_refused_naming_the_rerank_routes(http):
    answer = http.post("/predict", json={"model": "qwen3-reranker", "inputs": [[QUERY, DOCUMENTS[0]]]})
    assert answer.status_code == 400 and "/rerank" in answer.json()["error"], answer.text


def test_encode_with_texts_on_an_llm_reranker_is_refused_naming_the_rerank_routes(server):
    import grpc

    from serve.protocols.pb import pb, pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(model="qwen3-reranker", texts=[QUERY]),
                                                       timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("texts:") and "Rerank" in caught.value.details()
