"""LLM rerankers (model/heads.py answer_tokens, model/tasks.py RERANK_TEMPLATES): a Qwen3ForCausalLM saved by
transformers with a Qwen-like byte-level BPE tokenizer (the template's chat tokens, "yes" and "no"), exported
with `--reranker-template qwen3`, served by a real server process and called on /v1/rerank (the cohere client),
TEI's /rerank and gRPC Rerank. The reference is Qwen/Qwen3-Reranker-0.6B's model card recipe, written here as
the card has it (format_instruction, process_inputs, compute_logits on AutoModelForCausalLM, left padding).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnx
import pytest
import torch

from model.tasks import RERANK_TEMPLATES
from tests.hf_references import WORDS, redraw

SCORE_ATOL = 1e-4
TELLING = 1e-2  # a wrong row, a missing template or a wrong instruction moves a score by more than this
# Qwen3-Reranker-0.6B's layout at a small width (GQA, a head_dim of its own, q/k norms), untied lm_head.
QWEN3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
MAX_LENGTH = 160  # the tokenizer's model_max_length: the export's max_text_tokens
CARD = RERANK_TEMPLATES["qwen3"]
QUERY = "what is the long document encoder"
DOCUMENTS = ["the encoder is a long document encoder", "a dog barks at the mailman", "it is the one that is long",
             "yes", "the a of and to in is that it for on with as was by this be are"]


def qwen_tokenizer():
    """A byte-level BPE (as Qwen's) trained on the template's texts: <|endoftext|>, <|im_start|>, <|im_end|>
    special, <think> and </think> added, "yes" and "no" single tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [CARD["prefix"], CARD["body"], CARD["suffix"], CARD["instruction"], " ".join(WORDS), QUERY,
              *DOCUMENTS] * 5 + ["yes", "no"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    return tokenizer


def save_qwen3_reranker(directory, seed: int = 0, **changes):
    """A random Qwen3ForCausalLM and its tokenizer, saved as transformers saves them; returns the model."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer()
    config = Qwen3Config(**{**QWEN3, **changes}, vocab_size=tokenizer.get_vocab_size())
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = redraw(Qwen3ForCausalLM(config), seed=seed)
    model.save_pretrained(str(directory))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                            model_max_length=MAX_LENGTH).save_pretrained(str(directory))
    return model


class CardRecipe:
    """Qwen3-Reranker-0.6B's model card recipe (transformers), on a checkpoint directory."""

    def __init__(self, directory, max_length: int = MAX_LENGTH, prefix: str = CARD["prefix"],
                 suffix: str = CARD["suffix"], swap: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(directory), padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager").eval()
        self.token_false_id = self.tokenizer.convert_tokens_to_ids("no")
        self.token_true_id = self.tokenizer.convert_tokens_to_ids("yes")
        if swap:  # the control: the rows the other way round
            self.token_false_id, self.token_true_id = self.token_true_id, self.token_false_id
        self.max_length = max_length
        self.prefix_tokens = self.tokenizer.encode(prefix, add_special_tokens=False)
        self.suffix_tokens = self.tokenizer.encode(suffix, add_special_tokens=False)

    @staticmethod
    def format_instruction(instruction, query, doc):
        if instruction is None:
            instruction = "Given a web search query, retrieve relevant passages that answer the query"
        return "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
            instruction=instruction, query=query, doc=doc)

    def process_inputs(self, pairs):
        inputs = self.tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                                max_length=self.max_length - len(self.prefix_tokens) - len(self.suffix_tokens))
        for i, ele in enumerate(inputs["input_ids"]):
            inputs["input_ids"][i] = self.prefix_tokens + ele + self.suffix_tokens
        return self.tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=self.max_length)

    @torch.no_grad()
    def compute_logits(self, inputs):
        batch_scores = self.model(**inputs).logits[:, -1, :]
        true_vector = batch_scores[:, self.token_true_id]
        false_vector = batch_scores[:, self.token_false_id]
        batch_scores = torch.stack([false_vector, true_vector], dim=1)
        batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
        return batch_scores[:, 1].exp().tolist()

    def scores(self, query, documents, instruction=None) -> np.ndarray:
        pairs = [self.format_instruction(instruction, query, doc) for doc in documents]
        return np.asarray(self.compute_logits(self.process_inputs(pairs)), np.float64)


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
def repository(checkpoint, tmp_path_factory):
    """The checkpoint as an LLM reranker and, without the template, as the embedder it also is; a BERT
    cross-encoder beside them."""
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    from tests.hf_references import word_tokenizer

    out = tmp_path_factory.mktemp("llm-rerank-repository")
    _export(checkpoint, out, "qwen3-reranker", "--reranker-template", "qwen3")
    _export(checkpoint, out, "qwen3-embedder")
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


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as client:
        yield client


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
    assert {k: task["template"][k] for k in ("prefix", "body", "suffix", "instruction")} == \
        {"prefix": card.tokenizer.decode(card.prefix_tokens), "suffix": card.tokenizer.decode(card.suffix_tokens),
         "body": "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
         "instruction": "Given a web search query, retrieve relevant passages that answer the query"}
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


def test_a_query_too_long_for_any_document_is_refused_naming_it(http):
    answer = http.post("/rerank", json={"query": " ".join([QUERY] * 40), "texts": ["yes"], "truncate": True})
    assert answer.status_code == 400 and answer.json()["error"].startswith("query:"), answer.text


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
