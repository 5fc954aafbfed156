"""Task heads (model/heads.py): cross-encoders / classifiers and SPLADE sparse encoders of every family,
exported and run in ONNX Runtime, against transformers (eager, fp32) and sentence-transformers.

Every reference is a small model at random initialisation with its weights redrawn at a telling scale
(tests/hf_references.py `redraw`), saved with save_pretrained / sentence-transformers' save. The
sentence-transformers ones carry the packaged all-MiniLM-L6-v2 tokenizer, so texts go through a real
tokenizer (model/text.py) on our side and theirs. One graph per checkpoint, shared by the tests of a
module-scoped fixture: the checkpoints whose metadata and validation are tested go through
`python -m export` (export_main), the others through `export_onnx` alone (the same graph the exporter writes,
without the validation the CLI exports exercise), as a torch.onnx export takes ~5-10 s here.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.cases import validation_cases
from export.cli import main as export_main
from export.contract import ExportContract
from export.exporter import export_onnx
from export.validate import ToleranceExceeded, compare, validate
from model.attention_paths import DENSE, SPARSE
from model.checkpoint import CheckpointError, fit_encoder
from model.config import ConfigError, EncoderConfig, from_dict, to_dict
from model.encoder import build_encoder
from model.export_format import Metadata, metadata_from_dict, read_metadata
from model.hf_pretrained import load_pretrained, minilm_path
from model.mask_kinds import MaskKind
from model.masks import default_mask_inputs
from model.tasks import TaskError, score_activation, task_for
from model.text import load_tokenizer, tokenize
from tests.hf_references import MODERNBERT, ROBERTA, redraw

ATOL = 1e-4  # logits and sparse_embedding against transformers / sentence-transformers, max abs
TELLING = 1e-2  # a wrong head moves the logits by more than this at this scale

BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)
MINILM_VOCAB = 30522  # the packaged MiniLM tokenizer's
# ModernBERT's layout in 2 layers (global, local; window 128 = |i - j| <= 64); hidden 64 for the sparse head
# at 8192 tokens.
MODERNBERT_2 = {**MODERNBERT, "num_hidden_layers": 2}
MODERNBERT_TINY = {**MODERNBERT_2, "hidden_size": 64, "intermediate_size": 96}
NLI_LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}


@dataclass
class Exported:
    checkpoint: Path  # what was exported
    reference: torch.nn.Module  # transformers' model of the same weights
    graphs: dict[str, ort.InferenceSession] = field(default_factory=dict)  # graph file -> session
    export_dir: Path | None = None  # the graphs' directory (with metadata.json from `python -m export`)


def reference_model(model_class, config_class, seed: int, **settings):
    config = config_class(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(model_class(config), seed=seed)


def with_minilm_tokenizer(directory: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copyfile(minilm_path() / name, directory / name)
    return directory


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def cli_export(checkpoint: Path, out: Path, name: str, *extra: str) -> Path:
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", name, "--quiet",
                        *extra]) == 0
    return out / name


GRAPH_FILES = {DENSE: "model.onnx", SPARSE: "model.sparse.onnx"}


def graph_only(checkpoint: Path, out: Path, path: str = DENSE, **load) -> dict[str, ort.InferenceSession]:
    """The graph of `checkpoint` on attention path `path`, as the exporter writes it (export_onnx), without
    the exporter's validation."""
    loaded = load_pretrained(checkpoint, **load)
    export_onnx(loaded.encoder, ExportContract(loaded.config, path=path), out / GRAPH_FILES[path])
    return {GRAPH_FILES[path]: session(out / GRAPH_FILES[path])}


def batch(lengths: list[int], vocab: int, pad: int, *, seed: int = 0, pairs: bool = False):
    """(input_ids, attention_mask, token_type_ids): right-padded rows of random ids; with `pairs`, the second
    half of each row is segment 1 (a sentence pair)."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), length), generator=generator)
    mask = torch.zeros(len(lengths), length, dtype=torch.int64)
    types = torch.zeros_like(mask)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        if pairs:
            types[row, n // 2:n] = 1
    return torch.where(mask.bool(), ids, torch.full_like(ids, pad)), mask, types


def run(graph: ort.InferenceSession, ids, mask, types=None, kind: MaskKind = MaskKind.BIDIRECTIONAL) -> dict:
    """The graph's outputs by name, every row with mask `kind`."""
    feeds = {k: v.numpy() for k, v in default_mask_inputs(mask, kind).items()}
    feeds.update(input_ids=ids.numpy(), attention_mask=mask.numpy(),
                 token_type_ids=(types if types is not None else torch.zeros_like(ids)).numpy())
    wanted = {i.name for i in graph.get_inputs()}
    names = [o.name for o in graph.get_outputs()]
    return dict(zip(names, graph.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def splade_reference(mlm: torch.nn.Module, ids, mask, types=None) -> np.ndarray:
    """SPLADE from transformers' MLM logits: log1p(relu(logits)), max over the valid tokens."""
    extra = {"token_type_ids": types} if types is not None else {}
    with torch.no_grad():
        logits = mlm(input_ids=ids, attention_mask=mask, **extra).logits  # (B, T, vocab)
    weights = torch.log1p(torch.relu(logits)).masked_fill(~mask.bool()[:, :, None], 0.0)
    return weights.amax(dim=1).numpy()


def logits_reference(model: torch.nn.Module, ids, mask, types=None) -> np.ndarray:
    extra = {"token_type_ids": types} if types is not None else {}
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits.numpy()


def assert_close(actual, expected) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0)


# ------------------------------------------------------------------ checkpoints, exported once each


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A BERT cross-encoder (1 label) saved by sentence-transformers' CrossEncoder with the MiniLM tokenizer,
    exported by `python -m export`."""
    from sentence_transformers import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification

    base = tmp_path_factory.mktemp("bert-cross-encoder-base")
    reference = reference_model(BertForSequenceClassification, BertConfig, 0, **BERT, vocab_size=MINILM_VOCAB,
                                num_labels=1)
    reference.save_pretrained(str(base))
    with_minilm_tokenizer(base)
    directory = tmp_path_factory.mktemp("bert-cross-encoder")
    CrossEncoder(str(base), device="cpu").save(str(directory))
    export = cli_export(directory, tmp_path_factory.mktemp("out"), "ce", "--graphs", "fp32")
    return Exported(directory, reference, {"model.onnx": session(export / "model.onnx")}, export)


@pytest.fixture(scope="module")
def bert_nli(tmp_path_factory):
    """BertForSequenceClassification with 3 labels (single-label classification)."""
    from transformers import BertConfig, BertForSequenceClassification

    directory = tmp_path_factory.mktemp("bert-nli")
    reference = reference_model(BertForSequenceClassification, BertConfig, 1, **BERT, vocab_size=101,
                                id2label=NLI_LABELS, label2id={v: k for k, v in NLI_LABELS.items()},
                                problem_type="single_label_classification")
    reference.save_pretrained(str(directory))
    out = tmp_path_factory.mktemp("out")
    return Exported(directory, reference, graph_only(directory, out), out)


@pytest.fixture(scope="module", params=["roberta", "xlm-roberta"])
def roberta_classifier(request, tmp_path_factory):
    from transformers import (RobertaConfig, RobertaForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)

    model_class, config_class = {"roberta": (RobertaForSequenceClassification, RobertaConfig),
                                 "xlm-roberta": (XLMRobertaForSequenceClassification, XLMRobertaConfig)}[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    reference = reference_model(model_class, config_class, 2, **ROBERTA, num_labels=2)
    reference.save_pretrained(str(directory))
    out = tmp_path_factory.mktemp("out")
    return Exported(directory, reference, graph_only(directory, out), out)


@pytest.fixture(scope="module", params=["cls", "mean"])
def modernbert_classifier(request, tmp_path_factory):
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    directory = tmp_path_factory.mktemp(f"modernbert-{request.param}")
    reference = reference_model(ModernBertForSequenceClassification, ModernBertConfig, 3, **MODERNBERT_2, num_labels=2,
                                classifier_pooling=request.param)
    reference.save_pretrained(str(directory))
    out = tmp_path_factory.mktemp("out")
    return Exported(directory, reference, graph_only(directory, out), out)


@pytest.fixture(scope="module")
def bert_splade(tmp_path_factory):
    """A BERT SPLADE model saved by sentence-transformers' SparseEncoder (Transformer fill-mask + SpladePooling)
    with the MiniLM tokenizer (the head declared by modules.json)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    base = tmp_path_factory.mktemp("bert-mlm")
    reference = reference_model(BertForMaskedLM, BertConfig, 4, **BERT, vocab_size=MINILM_VOCAB)
    reference.save_pretrained(str(base))
    with_minilm_tokenizer(base)
    directory = tmp_path_factory.mktemp("bert-splade")
    SparseEncoder(modules=[Transformer(str(base), transformer_task="fill-mask"), SpladePooling("max")],
                  device="cpu").save(str(directory))
    out = tmp_path_factory.mktemp("out")
    return Exported(directory, reference, graph_only(directory, out), out)


@pytest.fixture(scope="module")
def roberta_splade(tmp_path_factory):
    """RobertaForMaskedLM exported with `--head sparse`, with its optimized graph (attention fused)."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    directory = tmp_path_factory.mktemp("roberta-mlm")
    reference = reference_model(RobertaForMaskedLM, RobertaConfig, 5, **ROBERTA)
    reference.save_pretrained(str(directory))
    export = cli_export(directory, tmp_path_factory.mktemp("out"), "rs", "--head", "sparse", "--graphs", "fp32,optimized")
    graphs = {name: session(export / name) for name in ("model.onnx", "model.optimized.onnx")}
    return Exported(directory, reference, graphs, export)


@pytest.fixture(scope="module")
def modernbert_splade(tmp_path_factory):
    """A tiny ModernBertForMaskedLM with the sparse head (head="sparse"): its long-input (sparse path) graph."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    directory = tmp_path_factory.mktemp("modernbert-mlm")
    reference = reference_model(ModernBertForMaskedLM, ModernBertConfig, 6, **MODERNBERT_TINY)
    reference.save_pretrained(str(directory))
    out = tmp_path_factory.mktemp("out")
    return Exported(directory, reference, graph_only(directory, out, SPARSE, head="sparse"), out)


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("lengths", [[1], [13], [128], [512], [13, 1, 40]], ids=str)
def test_bert_cross_encoder_logits_match_transformers_on_sentence_pairs(cross_encoder, lengths):
    ids, mask, types = batch(lengths, MINILM_VOCAB, 0, seed=len(lengths), pairs=True)
    logits = run(cross_encoder.graphs["model.onnx"], ids, mask, types)["logits"]
    assert_close(logits, logits_reference(cross_encoder.reference, ids, mask, types))


def test_bert_three_label_logits_match_transformers_in_a_padded_batch(bert_nli):
    ids, mask, types = batch([20, 1, 7], 101, 0, seed=1, pairs=True)
    logits = run(bert_nli.graphs["model.onnx"], ids, mask, types)["logits"]
    assert logits.shape == (3, 3)
    assert_close(logits, logits_reference(bert_nli.reference, ids, mask, types))


def test_roberta_family_classifier_logits_match_transformers(roberta_classifier):
    ids, mask, _ = batch([138, 13, 1], ROBERTA["vocab_size"], ROBERTA["pad_token_id"], seed=2)
    logits = run(roberta_classifier.graphs["model.onnx"], ids, mask)["logits"]
    assert_close(logits, logits_reference(roberta_classifier.reference, ids, mask))


def test_modernbert_classifier_logits_match_transformers_with_its_pooling(modernbert_classifier):
    ids, mask, _ = batch([150, 65, 1, 13], MODERNBERT["vocab_size"], 0, seed=3)
    logits = run(modernbert_classifier.graphs["model.onnx"], ids, mask)["logits"]
    assert_close(logits, logits_reference(modernbert_classifier.reference, ids, mask))


def test_bert_splade_matches_transformers_mlm_logits_in_a_padded_batch_of_pairs(bert_splade):
    ids, mask, types = batch([13, 1, 64], MINILM_VOCAB, 0, seed=4, pairs=True)
    sparse = run(bert_splade.graphs["model.onnx"], ids, mask, types)["sparse_embedding"]
    assert sparse.shape == (3, MINILM_VOCAB)
    assert_close(sparse, splade_reference(bert_splade.reference, ids, mask, types))


@pytest.mark.parametrize("lengths", [[1], [13], [138], [138, 13, 1]], ids=str)
def test_roberta_splade_matches_transformers_mlm_logits(roberta_splade, lengths):
    ids, mask, _ = batch(lengths, ROBERTA["vocab_size"], ROBERTA["pad_token_id"], seed=5)
    sparse = run(roberta_splade.graphs["model.onnx"], ids, mask)["sparse_embedding"]
    assert_close(sparse, splade_reference(roberta_splade.reference, ids, mask))


def test_modernbert_splade_on_the_long_input_graph_matches_transformers_past_its_local_window(modernbert_splade):
    """Rows of 300 and 129 tokens (past the window of 128 = |i - j| <= 64, and 2 of them) in a padded batch."""
    ids, mask, _ = batch([300, 129, 1], MODERNBERT["vocab_size"], 0, seed=6)
    sparse = run(modernbert_splade.graphs["model.sparse.onnx"], ids, mask)["sparse_embedding"]
    assert_close(sparse, splade_reference(modernbert_splade.reference, ids, mask))


def test_the_long_input_graph_with_a_head_passes_the_exporters_validation(modernbert_splade):
    loaded = load_pretrained(modernbert_splade.checkpoint, head="sparse")
    # per mask kind the graph serves, its padded batch of 4 rows (67, 31, 0 and 7 tokens)
    cases = validation_cases(loaded.config, path=SPARSE)[3::4]
    report = validate(str(modernbert_splade.export_dir / "model.sparse.onnx"), loaded.encoder,
                      ExportContract(loaded.config, path=SPARSE), cases)
    assert report.passed and report.cases == len(cases) > 10


@pytest.mark.slow  # ~15 s
def test_modernbert_splade_at_8192_tokens_on_the_long_input_graph(modernbert_splade):
    ids, mask, _ = batch([8192], MODERNBERT["vocab_size"], 0, seed=7)
    sparse = run(modernbert_splade.graphs["model.sparse.onnx"], ids, mask)["sparse_embedding"]
    assert_close(sparse, splade_reference(modernbert_splade.reference, ids, mask))


def test_the_optimized_graph_carries_the_head_and_passes_validation(roberta_splade):
    meta = read_metadata(roberta_splade.export_dir)
    assert [o["name"] for o in meta.outputs] == ["last_hidden_state", "mean_pooled", "sparse_embedding"]
    assert set(meta.graphs) == {"fp32", "optimized"} and all(g.validation["passed"] for g in meta.graphs.values())
    ids, mask, _ = batch([40, 9], ROBERTA["vocab_size"], ROBERTA["pad_token_id"], seed=8)
    sparse = run(roberta_splade.graphs["model.optimized.onnx"], ids, mask)["sparse_embedding"]
    assert_close(sparse, splade_reference(roberta_splade.reference, ids, mask))


def test_int8_and_fp16_judge_logits_by_relative_error_not_by_the_sign_of_one_logit():
    """Under min_cosine the cosine of a one-logit row is its sign: logits are scored 1 - e²/2 instead, e the
    row's relative error (a norm below 1 counted as 1); sparse_embedding rows by their cosine."""
    feeds = {"attention_mask": np.ones((2, 3), np.int64)}
    pooled = np.ones((2, 4), np.float32)
    hidden = np.zeros((2, 3, 4), np.float32)
    expected = np.array([[0.01], [-5.0]], np.float32)
    close, flipped = np.array([[-0.01], [-5.0]], np.float32), np.array([[0.01], [5.0]], np.float32)
    scores = [compare([hidden, pooled, got], [hidden, pooled, expected], feeds, "min_cosine", head="classification")
              for got in (close, flipped)]
    assert scores[0] >= 0.9998 and scores[1] < 0.5
    sparse = np.array([[0.0, 1.0, 2.0]], np.float32)
    assert compare([hidden[:1], pooled[:1], 2 * sparse], [hidden[:1], pooled[:1], sparse],
                   {"attention_mask": feeds["attention_mask"][:1]}, "min_cosine", head="sparse") == pytest.approx(1.0)


# ------------------------------------------------------------------ sentence-transformers, through the tokenizer

PAIRS = [("what is an encoder?", "An encoder maps text to vectors."),
         ("a short query", "A much longer document, with punctuation; and some UNKNOWN words in it!"),
         ("who?", "")]
TEXTS = ["An encoder maps text to vectors.", "a", "Sparse lexical weights, one per vocabulary entry."]


def test_cross_encoder_scores_match_sentence_transformers_predict(cross_encoder):
    from sentence_transformers import CrossEncoder

    loaded = load_pretrained(cross_encoder.checkpoint)
    tokens = tokenize(load_tokenizer(loaded.tokenizer_file, loaded.max_length), PAIRS)
    assert tokens["token_type_ids"].max() == 1  # pairs: [CLS] a [SEP] b [SEP], segment 1 for b
    outputs = run(cross_encoder.graphs["model.onnx"], *(torch.from_numpy(tokens[k]) for k in
                                                        ("input_ids", "attention_mask", "token_type_ids")))
    scores = 1.0 / (1.0 + np.exp(-outputs["logits"][:, 0]))  # the task's activation: sigmoid
    expected = CrossEncoder(str(cross_encoder.checkpoint), device="cpu").predict(PAIRS)
    assert_close(scores.astype(np.float32), expected)


def test_sparse_encoder_embeddings_match_sentence_transformers_encode(bert_splade):
    from sentence_transformers import SparseEncoder

    loaded = load_pretrained(bert_splade.checkpoint)
    tokens = tokenize(load_tokenizer(loaded.tokenizer_file, loaded.max_length), TEXTS)
    outputs = run(bert_splade.graphs["model.onnx"], *(torch.from_numpy(tokens[k]) for k in
                                                      ("input_ids", "attention_mask", "token_type_ids")))
    actual = outputs["sparse_embedding"]
    expected = SparseEncoder(str(bert_splade.checkpoint), device="cpu").encode(
        TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False).numpy()
    for row in range(len(TEXTS)):
        np.testing.assert_array_equal(np.flatnonzero(actual[row]), np.flatnonzero(expected[row]))
    assert_close(actual, expected)


# ------------------------------------------------------------------ metadata.json "task"


def test_a_cross_encoder_export_says_rerank_with_its_sigmoid(cross_encoder):
    assert read_metadata(cross_encoder.export_dir).task == {
        "kind": "rerank", "output": "logits", "labels": ["LABEL_0"], "activation": "sigmoid", "pair": True}


def test_a_three_label_classifier_says_classify_with_its_labels_in_id_order(bert_nli):
    assert load_pretrained(bert_nli.checkpoint).task == {
        "kind": "classify", "output": "logits", "labels": ["contradiction", "entailment", "neutral"],
        "activation": "softmax", "pair": True}


def test_a_splade_export_says_sparse(roberta_splade):
    meta = read_metadata(roberta_splade.export_dir)
    assert meta.task == {"kind": "sparse", "output": "sparse_embedding"} and meta.config.head == "sparse"
    assert meta.outputs[-1] == {"name": "sparse_embedding", "dtype": "float32", "dims": ["batch", ROBERTA["vocab_size"]]}


def test_a_sparse_encoder_directory_declares_the_sparse_head(bert_splade):
    loaded = load_pretrained(bert_splade.checkpoint)
    assert (loaded.config.head, loaded.config.head_activation, loaded.config.head_norm) == ("sparse", "gelu", True)
    assert loaded.task == {"kind": "sparse", "output": "sparse_embedding"}


def test_score_activation_follows_the_cross_encoder_then_problem_type_then_label_count():
    assert score_activation(1, activation_fn="torch.nn.modules.linear.Identity") == "none"
    assert score_activation(3, activation_fn="torch.nn.modules.activation.Sigmoid") == "sigmoid"
    assert score_activation(1, problem_type="regression") == "none"
    assert score_activation(2, problem_type="multi_label_classification") == "sigmoid"
    assert score_activation(1) == "sigmoid" and score_activation(4) == "softmax"
    with pytest.raises(TaskError, match="my.module.Tanh"):
        score_activation(1, activation_fn="my.module.Tanh")


def test_metadata_without_a_task_reads_as_embed():
    config = EncoderConfig(name="old")
    written = Metadata(name="old", config=config, opset=18, inputs=(), outputs=(), graphs={}).as_dict()
    del written["task"]
    assert metadata_from_dict(written).task == {"kind": "embed"}
    assert task_for(config) == {"kind": "embed"}


# ------------------------------------------------------------------ the head is what makes the numbers


def test_a_wrong_pooling_or_activation_in_the_head_moves_the_logits(cross_encoder):
    """Controls: the parity above would catch mean pooling where BERT pools [CLS], or a missing tanh."""
    loaded = load_pretrained(cross_encoder.checkpoint)
    ids, mask, types = batch([13, 40], MINILM_VOCAB, 0, seed=9, pairs=True)
    expected = logits_reference(cross_encoder.reference, ids, mask, types)
    for change in ({}, dict(head_pooling="mean"), dict(head_activation="relu")):
        encoder = fit_encoder(loaded.config.replace(**change), loaded.encoder.state_dict(), origin="test")
        inputs = default_mask_inputs(mask)
        with torch.no_grad():
            logits = encoder(ids, mask, *inputs.values(), types)[2].numpy()
        error = np.abs(logits - expected).max()
        assert (error <= ATOL) if not change else (error > TELLING), (change, error)


def test_validation_refuses_a_graph_whose_logits_differ_from_pytorch(cross_encoder):
    loaded = load_pretrained(cross_encoder.checkpoint)
    state = loaded.encoder.state_dict()
    state["head.out.bias"] = state["head.out.bias"] + 1e-3
    other = fit_encoder(loaded.config, state, origin="test")
    contract = ExportContract(loaded.config)
    with pytest.raises(ToleranceExceeded, match="logits"):
        validate(str(cross_encoder.export_dir / "model.onnx"), other, contract, validation_cases(loaded.config)[:2])


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("setting", [{"pooling_strategy": "sum"}, {"activation_function": "log1p_relu"}], ids=str)
def test_an_unsupported_splade_pooling_is_refused_naming_it(bert_splade, tmp_path, setting):
    directory = shutil.copytree(bert_splade.checkpoint, tmp_path / "splade")
    path = directory / "1_SpladePooling" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **setting}))
    (key, value), = setting.items()
    with pytest.raises(CheckpointError, match=f"SpladePooling with {key}='{value}' is not supported"):
        load_pretrained(directory)


def test_a_classifier_without_its_head_weight_names_it(cross_encoder, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = shutil.copytree(cross_encoder.checkpoint, tmp_path / "broken")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["classifier.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \(1\): classifier\.weight \(-> head\.out\.weight\)"):
        load_pretrained(directory)


def test_an_approximate_gelu_in_a_modernbert_head_is_refused_naming_it(modernbert_classifier, tmp_path):
    directory = shutil.copytree(modernbert_classifier.checkpoint, tmp_path / "tanh-gelu")
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "classifier_activation": "gelu_pytorch_tanh"}))
    with pytest.raises(CheckpointError, match="classifier_activation 'gelu_pytorch_tanh' is not supported"):
        load_pretrained(directory)


def test_encoder_only_drops_a_classification_head_on_purpose(bert_nli):
    loaded = load_pretrained(bert_nli.checkpoint, drop_head=True)
    assert loaded.config.head == "none" and loaded.task == {"kind": "embed"}
    assert loaded.config.source["dropped_head"] == ["classifier.bias", "classifier.weight"]


# ------------------------------------------------------------------ the config


def test_the_default_config_has_no_head_and_old_configs_read_unchanged():
    config = EncoderConfig(name="x", d_model=32, n_heads=4, n_layers=1, d_ff=64, vocab_size=50)
    assert config.head == "none" and not any(k.startswith("head.") for k in build_encoder(config).state_dict())
    old = {k: v for k, v in to_dict(config).items() if not k.startswith("head") and k != "num_labels"}
    assert from_dict(old) == config


@pytest.mark.parametrize("change, field_name", [
    (dict(head="pooler"), "head="), (dict(head="classification", num_labels=0), "num_labels"),
    (dict(head_pooling="max"), "head_pooling="), (dict(head_activation="gelu_new"), "head_activation="),
    (dict(head="sparse", input_kind="features"), "head='sparse' needs input_kind='tokens'"),
], ids=str)
def test_an_invalid_head_setting_is_a_config_error_naming_the_field(change, field_name):
    with pytest.raises(ConfigError, match=field_name):
        EncoderConfig(**change)
