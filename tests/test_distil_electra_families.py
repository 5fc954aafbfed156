"""DistilBERT and ELECTRA on the one encoder (model/hf_distilbert.py, model/hf_electra.py): BERT's post-norm layers
under DistilBERT's names and config keys; ELECTRA's BERT layout with factorised embeddings (config embedding_size:
embeddings embedding_size wide, then embeddings_project to hidden_size). Against transformers' DistilBertModel /
ElectraModel (eager, fp32, random weights redrawn at a telling scale) through every graph the export writes, at
several lengths and in padded batches; both classification heads against transformers' logits; an ELECTRA
cross-encoder and a DistilBERT classifier, saved as their libraries save them, exported and served, their
/v1/rerank and /predict scores equal to sentence-transformers' CrossEncoder.predict and transformers' softmax; and
the refusals."""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.cli import main as export_main
from model.checkpoint import CheckpointError, fit_encoder
from model.config import ConfigError, EncoderConfig
from model.hf_pretrained import load_pretrained
from model.masks import default_mask_inputs
from tests.hf_references import BERT_SPECIALS, WORDS, redraw, word_tokenizer

ATOL = 1e-4  # hidden states at real positions and logits, max abs
SCORE_ATOL = 1e-4  # served scores against the library's, max abs
TELLING = 1e-2
GRAPHS = ("model.onnx", "model.optimized.onnx", "model.sparse.onnx")  # fp32, optimized, long: the default export
VOCAB = 101
MAX_POSITIONS = 300
DISTILBERT = dict(vocab_size=VOCAB, dim=32, n_heads=4, n_layers=2, hidden_dim=48,
                  max_position_embeddings=MAX_POSITIONS, pad_token_id=0)
# electra-small's shape at a small width: embeddings 16 wide, projected to the layers' 32.
ELECTRA = dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
               intermediate_size=48, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, pad_token_id=0)
LENGTHS = [[1], [17], [128], [MAX_POSITIONS], [200, 57, 1, 129]]


def reference_model(model_class: str, seed: int = 0, **changes):
    import transformers

    shape = DISTILBERT if model_class.startswith("DistilBert") else ELECTRA
    config_class = transformers.DistilBertConfig if model_class.startswith("DistilBert") else transformers.ElectraConfig
    config = config_class(**{**shape, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(getattr(transformers, model_class)(config), seed=seed)


def exported(reference, tmp_path_factory, name: str, graphs: str = "fp32,optimized,long"):
    """(the reference, our loaded model, {graph file: CPU session}, export directory) of a saved checkpoint."""
    checkpoint, out = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-export")
    reference.save_pretrained(str(checkpoint))
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", name,
                        "--graphs", graphs, "--quiet"]) == 0
    files = [g for g in GRAPHS if (out / name / g).is_file()]
    sessions = {g: ort.InferenceSession(str(out / name / g), providers=["CPUExecutionProvider"]) for g in files}
    return reference, load_pretrained(checkpoint), sessions, out / name


@pytest.fixture(scope="module")
def distilbert(tmp_path_factory):
    return exported(reference_model("DistilBertModel"), tmp_path_factory, "distilbert")


@pytest.fixture(scope="module")
def electra(tmp_path_factory):
    return exported(reference_model("ElectraModel", seed=1), tmp_path_factory, "electra")


def batch(lengths: list[int], seed: int = 0, types: bool = False) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask (right-padded rows of random non-special ids, the pad id 0 in the padding) and,
    with `types`, token_type_ids: 0 for a row's first half, 1 for the rest."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), length), generator=generator)
    mask = torch.zeros(len(lengths), length, dtype=torch.int64)
    kinds = torch.zeros(len(lengths), length, dtype=torch.int64)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        kinds[row, n // 2:n] = 1
    feeds = {"input_ids": torch.where(mask.bool(), ids, torch.zeros_like(ids)), "attention_mask": mask}
    return {**feeds, "token_type_ids": kinds} if types else feeds


def transformers_outputs(reference, feeds):
    with torch.no_grad():
        return reference(**feeds)


def ours(encoder, feeds) -> tuple[np.ndarray, ...]:
    mask = feeds["attention_mask"]
    with torch.no_grad():
        outputs = encoder(feeds["input_ids"], mask, **default_mask_inputs(mask),
                          token_type_ids=feeds.get("token_type_ids"))
    return tuple(o.numpy() for o in outputs)


def graph_hidden(session, feeds) -> np.ndarray:
    mask = feeds["attention_mask"]
    wanted = {i.name for i in session.get_inputs()}
    inputs = {k: v.numpy() for k, v in {**feeds, **default_mask_inputs(mask)}.items() if k in wanted}
    return session.run(["last_hidden_state"], inputs)[0]


def max_error(actual, expected, mask) -> float:
    valid = mask.numpy().astype(bool)
    return float(np.abs(np.asarray(actual)[valid] - np.asarray(expected)[valid]).max())


# --- config.json -> the encoder's parts -----------------------------------------------------------------------

def test_a_distilbert_config_reads_its_own_keys_post_norm_and_no_token_types(distilbert):
    c = distilbert[1].config
    assert (c.d_model, c.n_heads, c.n_layers, c.d_ff, c.max_positions) == (32, 4, 2, 48, MAX_POSITIONS)
    assert (c.norm_placement, c.positional, c.position_ids, c.type_vocab_size, c.embedding_size) == \
        ("post", "learned", "range", 0, 0)
    assert (c.activation, c.layer_norm_eps, c.embedding_layer_norm) == ("gelu", 1e-12, True)


def test_an_electra_small_config_reads_bert_layout_with_factorised_embeddings(electra):
    c = electra[1].config
    assert (c.d_model, c.embedding_size, c.type_vocab_size, c.norm_placement) == (32, 16, 2, "post")
    assert tuple(electra[1].encoder.embeddings.project.weight.shape) == (32, 16)
    assert tuple(electra[1].encoder.embeddings.norm.weight.shape) == (16,)


def test_electra_with_embeddings_as_wide_as_its_layers_has_no_projection(tmp_path):
    """ElectraModel has embeddings_project only when embedding_size != hidden_size; neither has ours then."""
    reference = reference_model("ElectraModel", seed=2, embedding_size=32)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert loaded.config.embedding_size == 0 and loaded.encoder.embeddings.project is None
    feeds = batch([40, 13], types=True)
    expected = transformers_outputs(reference, feeds).last_hidden_state
    assert max_error(ours(loaded.encoder, feeds)[0], expected, feeds["attention_mask"]) <= ATOL


# --- parity with transformers, every graph ------------------------------------------------------------------

def test_the_exports_write_dense_optimized_and_long_input_graphs(distilbert, electra):
    for family in (distilbert, electra):
        graphs = json.loads((family[3] / "metadata.json").read_text())["graphs"]
        assert set(graphs) == {"fp32", "optimized", "sparse"} and set(family[2]) == set(GRAPHS)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_distilbert_hidden_states_match_transformers_on_every_graph(distilbert, lengths):
    reference, loaded, sessions, _ = distilbert
    feeds = batch(lengths, seed=len(lengths))
    expected = transformers_outputs(reference, feeds).last_hidden_state
    mask = feeds["attention_mask"]
    assert max_error(ours(loaded.encoder, feeds)[0], expected, mask) <= ATOL
    for name, session in sessions.items():
        error = max_error(graph_hidden(session, feeds), expected, mask)
        assert error <= ATOL, f"{name}: {error}"


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_electra_hidden_states_match_transformers_on_every_graph(electra, lengths):
    reference, loaded, sessions, _ = electra
    feeds = batch(lengths, seed=len(lengths), types=True)
    expected = transformers_outputs(reference, feeds).last_hidden_state
    mask = feeds["attention_mask"]
    assert max_error(ours(loaded.encoder, feeds)[0], expected, mask) <= ATOL
    for name, session in sessions.items():
        error = max_error(graph_hidden(session, feeds), expected, mask)
        assert error <= ATOL, f"{name}: {error}"


def test_without_its_embedding_projection_electra_small_does_not_load(electra):
    """The control: with embedding_size=0 (no projection) electra-small's 16-wide embeddings fit no 32-wide layer,
    and its embeddings_project has no home: the strict loader names both."""
    _, loaded, _, _ = electra
    unexpected = r"unexpected \(2\): embeddings\.project\.weight, embeddings\.project\.bias;"
    narrow = r"embeddings\.tokens\.weight: checkpoint \(101, 16\) vs encoder \(101, 32\)"
    with pytest.raises(CheckpointError, match=f"{unexpected}.*{narrow}"):
        fit_encoder(loaded.config.replace(embedding_size=0), loaded.encoder.state_dict(), origin="test")


def test_a_projection_applied_before_the_norm_would_not_match(electra):
    """The control on the projection's place: ELECTRA projects after the embeddings' LayerNorm. The same weights
    with the projection moved before a d_model-wide norm (its weights the first half of ours, tiled) are far."""
    reference, loaded, _, _ = electra
    feeds = batch([200, 57], types=True)
    expected = transformers_outputs(reference, feeds).last_hidden_state
    embeddings = loaded.encoder.embeddings
    norm = torch.nn.LayerNorm(32, eps=loaded.config.layer_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(embeddings.norm.weight.repeat(2))
        norm.bias.copy_(embeddings.norm.bias.repeat(2))
    swapped = torch.nn.Sequential(embeddings.project, norm)
    original = embeddings.norm, embeddings.project
    try:
        embeddings.norm, embeddings.project = swapped, None
        moved = ours(loaded.encoder, feeds)[0]
    finally:
        embeddings.norm, embeddings.project = original
    mask = feeds["attention_mask"]
    assert max_error(ours(loaded.encoder, feeds)[0], expected, mask) <= ATOL
    assert max_error(moved, expected, mask) > TELLING


def test_a_distilbert_sinusoidal_position_table_is_read_from_the_checkpoint(tmp_path):
    """sinusoidal_pos_embds: transformers fills the position table with sines and saves it; ours reads it."""
    import transformers

    config = transformers.DistilBertConfig(**DISTILBERT, sinusoidal_pos_embds=True)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    reference = transformers.DistilBertModel(config).eval()
    table = reference.embeddings.position_embeddings.weight
    table = table.detach()
    assert abs(float(table[5, 0]) - np.sin(5.0)) < 1e-6 and abs(float(table[5, 1]) - np.cos(5.0)) < 1e-6
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    feeds = batch([MAX_POSITIONS, 90, 1])
    expected = transformers_outputs(reference, feeds).last_hidden_state
    assert max_error(ours(loaded.encoder, feeds)[0], expected, feeds["attention_mask"]) <= ATOL


@pytest.mark.parametrize("model_class,prefix", [("DistilBertForMaskedLM", "vocab_"),
                                                ("ElectraForPreTraining", "discriminator_predictions."),
                                                ("ElectraForMaskedLM", "generator_")])
def test_a_pretraining_checkpoint_loads_its_encoder_and_ignores_its_heads(tmp_path, model_class, prefix):
    reference = reference_model(model_class, seed=4)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert any(n.startswith(prefix) for n in loaded.config.source["ignored_tensors"])
    body = reference.distilbert if model_class.startswith("DistilBert") else reference.electra
    feeds = batch([40, 13], types=model_class.startswith("Electra"))
    expected = transformers_outputs(body, feeds).last_hidden_state
    assert max_error(ours(loaded.encoder, feeds)[0], expected, feeds["attention_mask"]) <= ATOL


# --- classification heads --------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_class", ["DistilBertForSequenceClassification", "ElectraForSequenceClassification"])
def test_a_sequence_classifier_gives_transformers_logits(tmp_path, model_class):
    """DistilBERT: first token -> pre_classifier -> ReLU -> classifier; ELECTRA: first token -> classifier.dense ->
    GELU -> classifier.out_proj."""
    reference = reference_model(model_class, seed=5, num_labels=3)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    activation = "relu" if model_class.startswith("DistilBert") else "gelu"
    assert (loaded.config.head, loaded.config.num_labels, loaded.config.head_activation) == \
        ("classification", 3, activation)
    feeds = batch([200, 57, 1], types=model_class.startswith("Electra"))
    expected = transformers_outputs(reference, feeds).logits.numpy()
    assert np.abs(ours(loaded.encoder, feeds)[2] - expected).max() <= ATOL
    # the head's activation is the one transformers applies: the other one is far at this scale
    other = fit_encoder(loaded.config.replace(head_activation="tanh"), loaded.encoder.state_dict(), origin="test")
    assert np.abs(ours(other, feeds)[2] - expected).max() > TELLING


def test_a_distilbert_masked_lm_gives_splade_weights(tmp_path):
    """The MLM head (vocab_transform, activation, vocab_layer_norm, vocab_projector tied to the word embeddings) as
    the sparse head: max over valid tokens of log1p(relu(transformers' MLM logits))."""
    reference = reference_model("DistilBertForMaskedLM", seed=6)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path, head="sparse")
    feeds = batch([40, 13, 1])
    logits = transformers_outputs(reference, feeds).logits
    valid = feeds["attention_mask"].bool()[:, :, None]
    expected = torch.where(valid, torch.log1p(torch.relu(logits)), torch.zeros_like(logits)).amax(dim=1).numpy()
    assert np.abs(ours(loaded.encoder, feeds)[2] - expected).max() <= ATOL


# --- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_class,field,value,named", [
    ("DistilBertModel", "activation", "gelu_new", "activation 'gelu_new'"),
    ("ElectraModel", "hidden_act", "gelu_new", "hidden_act 'gelu_new'"),
    ("ElectraModel", "position_embedding_type", "relative_key", "position_embedding_type 'relative_key'"),
    ("ElectraModel", "is_decoder", True, "decoder")])
def test_what_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, model_class, field, value, named):
    reference_model(model_class, seed=7).save_pretrained(str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, field: value}))
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


def test_a_distilbert_config_without_its_sizes_is_refused_naming_them(tmp_path):
    reference_model("DistilBertModel", seed=7).save_pretrained(str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "hidden_dim"}))
    with pytest.raises(CheckpointError, match="lacks hidden_dim"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("change,named", [(dict(embedding_size=-1), "embedding_size must be >= 0"),
                                          (dict(embedding_size=16, input_kind="features"), "embedding_size needs")])
def test_invalid_embedding_sizes_are_config_errors_naming_the_field(change, named):
    with pytest.raises(ConfigError, match=named):
        EncoderConfig(d_model=32, n_heads=4, **change)


def test_an_old_export_config_without_embedding_size_loads_unchanged():
    from model.config import from_dict, to_dict

    old = {k: v for k, v in to_dict(EncoderConfig()).items() if k != "embedding_size"}
    assert from_dict(old) == EncoderConfig() and from_dict(old).embedding_size == 0


# --- an ELECTRA cross-encoder and a DistilBERT classifier, served --------------------------------------------

QUERY = "what is the encoder"
DOCUMENTS = ["the encoder is a long document", "a", "it is on the document encoder",
             " ".join(WORDS[(5 * i) % len(WORDS)] for i in range(120)), "that was by this"]
TEXTS = ["the encoder", "a long document for the encoder", " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(90))]
LABELS = ["negative", "neutral", "positive"]


def save_tokenizer(directory, types: bool) -> int:
    """A word-level BERT-style tokenizer saved into `directory` (pairs: [CLS] a [SEP] b [SEP], segment 1 for b);
    `types`: whether the model takes token_type_ids (DistilBERT does not). Returns its vocabulary size."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tokenizer, size = word_tokenizer()
    cls, sep = BERT_SPECIALS.index("[CLS]"), BERT_SPECIALS.index("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    names = ["input_ids", "token_type_ids", "attention_mask"] if types else ["input_ids", "attention_mask"]
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            unk_token="[UNK]", mask_token="[MASK]", model_max_length=256,
                            model_input_names=names).save_pretrained(str(directory))
    return size


@pytest.fixture(scope="module")
def served(tmp_path_factory, serve_start):
    """(checkpoint directories, server): an ELECTRA-small-shaped cross-encoder (1 label) saved by
    sentence-transformers' CrossEncoder and a 3-label DistilBERT classifier saved by transformers, each with its
    tokenizer, exported into one repository and served by one server."""
    from sentence_transformers import CrossEncoder

    base, classifier = tmp_path_factory.mktemp("electra-ce-base"), tmp_path_factory.mktemp("distilbert-classifier")
    size = save_tokenizer(base, types=True)
    reference_model("ElectraForSequenceClassification", seed=8, vocab_size=size, num_labels=1).save_pretrained(
        str(base))
    reranker = tmp_path_factory.mktemp("electra-ce")
    CrossEncoder(str(base), device="cpu").save(str(reranker))
    save_tokenizer(classifier, types=False)
    reference_model("DistilBertForSequenceClassification", seed=9, vocab_size=size, num_labels=3,
                    id2label=dict(enumerate(LABELS)), label2id={v: k for k, v in enumerate(LABELS)}).save_pretrained(
        str(classifier))
    out = tmp_path_factory.mktemp("families-repository")
    for name, directory in (("reranker", reranker), ("classifier", classifier)):
        assert export_main(["--from-pretrained", str(directory), "--out-dir", str(out), "--name", name,
                            "--graphs", "fp32", "--quiet"]) == 0
    server = serve_start(out / "reranker", "--model-repository", str(out), "--default-model", "reranker",
                         timeout=180)
    return {"reranker": reranker, "classifier": classifier}, server


def test_v1_rerank_scores_of_an_electra_cross_encoder_equal_cross_encoder_predict(served):
    from sentence_transformers import CrossEncoder

    directories, server = served
    body = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/rerank", timeout=60,
                      json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS}).json()
    want = CrossEncoder(str(directories["reranker"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.sort(want)[::-1],
                               atol=SCORE_ATOL, rtol=0)
    assert np.ptp(want) > 0.05  # the documents score visibly apart: the order above is telling


def test_predict_of_a_distilbert_classifier_equals_transformers_softmax(served):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directories, server = served
    got = httpx.post(f"http://127.0.0.1:{server.http_port}/predict", timeout=60,
                     json={"model": "classifier", "inputs": [[t] for t in TEXTS]}).json()
    tokenizer = AutoTokenizer.from_pretrained(str(directories["classifier"]))
    model = AutoModelForSequenceClassification.from_pretrained(str(directories["classifier"]),
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch.softmax(model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits, dim=-1).numpy()
    for row, expected in zip(got, want):
        scores = sorted(row, key=lambda p: LABELS.index(p["label"]))
        np.testing.assert_allclose([p["score"] for p in scores], expected, atol=SCORE_ATOL, rtol=0)
    assert np.ptp(want[:, 0]) > 0.05  # the texts score visibly apart
