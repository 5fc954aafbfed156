"""DeBERTa-v2 / v3 on the one encoder (model/hf_deberta.py): post-norm layers, no absolute positions (v3) and
disentangled attention (model/disentangled_attention.py: c2p and p2c terms from one shared relative position
table in log buckets), against transformers' DebertaV2Model (eager, fp32, random weights redrawn at a telling
scale) through every graph the export writes (fp32, optimized within 1e-4; int8, fp16 by cosine; no long-input
graph); the controls (each position term, the table's LayerNorm and the log buckets removed in turn move the
hidden states); the ContextPooler classifier; a DeBERTa-v3-shaped cross-encoder served end to end, /v1/rerank
equal to sentence-transformers' CrossEncoder.predict; and the refusals."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from export.cli import main as export_main
from model.attention_paths import DENSE, SPARSE, RowMask, attention_bytes, long_path
from model.checkpoint import CheckpointError, fit_encoder
from model.config import ConfigError, EncoderConfig, from_dict, to_dict
from model.encoder import Encoder
from model.hf_pretrained import load_pretrained
from model.mask_kinds import MaskKind
from model.masks import default_mask_inputs
from tests import dense_parity
from tests.dense_parity import (assert_every_graph_matches, exported, max_error, optimized_ops, ours_hidden,
                                 transformers_hidden)
from tests.hf_references import WORDS, word_tokenizer

ATOL = 1e-4  # hidden states at real positions, max abs
TELLING = 1e-2  # a missing part moves the hidden states by more than this at this scale
SCORE_ATOL = 1e-4  # served rerank scores (sigmoid of the logit) against CrossEncoder.predict
# DeBERTa-v3's layout (share_att_key, LayerNorm on the table, p2c|c2p, no absolute positions, no token types) at a
# small width; its 256 buckets up to 512 scaled down to 32 up to 128 so that a few hundred tokens reach past both.
DEBERTA = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, relative_attention=True, position_buckets=32, max_relative_positions=128,
               norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type="p2c|c2p", position_biased_input=False,
               type_vocab_size=0, layer_norm_eps=1e-7, pad_token_id=0)


def reference_model(seed: int = 0, model_class: str = "DebertaV2Model", **changes):
    return dense_parity.reference_model("DebertaV2Config", model_class, DEBERTA, seed, **changes)


@pytest.fixture(scope="module")
def deberta(tmp_path_factory):
    """(transformers reference, our loaded model, {graph file: CPU session}, export directory)."""
    return exported(reference_model(), tmp_path_factory, "d")


def batch(lengths: list[int], seed: int = 0, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): rows of random non-special ids, the pad id in the padding (right or left)."""
    return dense_parity.batch(lengths, DEBERTA["vocab_size"], 0, seed, left)


# --- config.json -> the encoder's parts -----------------------------------------------------------------------

def test_a_deberta_v3_config_reads_disentangled_attention_in_log_buckets_without_absolute_positions(deberta):
    _, loaded, _, _ = deberta
    c = loaded.config
    assert (c.norm_placement, c.positional, c.type_vocab_size, c.activation) == ("post", "none", 0, "gelu")
    assert (c.disentangled_terms, c.disentangled_buckets, c.disentangled_max_distance) == (("c2p", "p2c"), 32, 128)
    assert (c.disentangled_share_key, c.disentangled_norm) == (True, True)
    assert (c.scaling, c.temperature) == ("temperature", pytest.approx((8 * 3) ** 0.5))  # sqrt(head_dim · 3)
    assert c.position_limit is None  # relative positions only: no table stops the length
    assert tuple(loaded.encoder.relative_embeddings.weight.shape) == (2 * 32, DEBERTA["hidden_size"])


def test_the_table_row_of_every_distance_is_transformers(deberta):
    """The graph looks rows up by distance clamped to the table's reach (model/disentangled_attention.py); past it
    transformers' buckets give the table's ends, so the rows are transformers' at every distance."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    _, loaded, _, _ = deberta
    relative = torch.arange(-5000, 5001)
    table = loaded.encoder.relative_embeddings
    index = relative.clamp(-table.reach, table.reach) + table.reach
    bucket = make_log_bucket_position(relative, 32, 128).to(torch.long)
    assert torch.equal(table.c2p_rows[index], torch.clamp(bucket + 32, 0, 63))
    assert torch.equal(table.p2c_rows[index], torch.clamp(-bucket + 32, 0, 63))
    assert table.reach < 5000


def test_the_export_has_no_long_input_graph_and_refuses_one_by_name(deberta, tmp_path, capsys):
    reference, loaded, _, directory = deberta
    graphs = json.loads((directory / "metadata.json").read_text())["graphs"]
    assert set(graphs) == {"fp32", "optimized", "int8", "fp16"}  # "long" named none: the terms are dense only
    assert long_path(loaded.config) is None
    with pytest.raises(ValueError, match="sparse"):
        Encoder(loaded.config, SPARSE)
    reference.save_pretrained(str(tmp_path / "checkpoint"))
    assert export_main(["--from-pretrained", str(tmp_path / "checkpoint"), "--out-dir", str(tmp_path / "out"),
                        "--graphs", "fp32,sparse", "--quiet"]) != 0
    assert "graph variant(s) sparse do not apply" in capsys.readouterr().err
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_the_memory_budget_counts_the_position_terms_beside_the_scores(deberta):
    """A dense row of a disentangled model holds about twice a plain one's bytes per score (model/attention_paths.py
    DISENTANGLED_SCORE_FACTOR), which the server's admission estimate counts."""
    _, loaded, _, _ = deberta
    plain = loaded.config.replace(disentangled_terms=())
    row = RowMask(MaskKind.BIDIRECTIONAL)
    assert attention_bytes(DENSE, 1, 4096, row, loaded.config) > 2 * attention_bytes(DENSE, 1, 4096, row, plain)


def test_the_optimizer_leaves_the_disentangled_attention_unfused(deberta):
    """optimize.fuse_attention's pattern (scores = MatMul · scale straight into the masked softmax) does not match
    scores with the position terms added, so contrib Attention, which would drop them, is never written."""
    ops = optimized_ops(deberta[3])
    assert "Softmax" in ops and "Attention" not in ops


# --- parity with transformers, every graph ------------------------------------------------------------------

@pytest.mark.parametrize("lengths,left", [([1], False), ([13], False), ([40], False), ([300], False),
                                          ([13, 1, 40], False), ([300, 57, 0, 129], False),
                                          ([13, 1, 40], True)], ids=str)
def test_hidden_states_match_transformers_on_every_graph(deberta, lengths, left):
    ids, mask = batch(lengths, seed=len(lengths), left=left)
    assert_every_graph_matches(deberta, ids, mask, ATOL)


@pytest.mark.parametrize("changes", [
    dict(share_att_key=False),  # the layers' own pos_key_proj / pos_query_proj
    dict(pos_att_type="c2p", share_att_key=False),
    dict(pos_att_type=["p2c"]),
    dict(position_buckets=-1, max_relative_positions=24, norm_rel_ebd="none"),  # exact distances, clamped at 24
    dict(position_buckets=256, max_relative_positions=-1),  # v3's own: 256 buckets up to max_position_embeddings
    dict(position_biased_input=True, type_vocab_size=2, share_att_key=False),  # v2's absolute positions, types
    dict(relative_attention=False, norm_rel_ebd="none"),  # no terms; pos_att_type still sets the scale
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_other_deberta_layouts_match_transformers(tmp_path, changes):
    reference = reference_model(seed=6, **changes)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    ids, mask = batch([300, 57, 1], seed=2)
    types = torch.randint(0, 2, ids.shape) if changes.get("type_vocab_size") else None
    expected = transformers_hidden(reference, ids, mask, types)
    assert max_error(ours_hidden(loaded.encoder, ids, mask, types), expected, mask) <= ATOL


# --- controls: each part of the disentangled attention is needed --------------------------------------------

def without(loaded, **changes):
    """The loaded model's weights under a config with `changes` (tensors it no longer has dropped)."""
    config = loaded.config.replace(**changes)
    expected = Encoder(config).state_dict().keys()
    state = {k: v for k, v in loaded.encoder.state_dict().items() if k in expected}
    return fit_encoder(config, state, origin="test")


@pytest.mark.parametrize("removed", [
    dict(disentangled_terms=("p2c",)),  # c2p off
    dict(disentangled_terms=("c2p",)),  # p2c off
    dict(disentangled_terms=()),  # both off: content attention alone
    dict(disentangled_norm=False),  # the table without its LayerNorm
    dict(disentangled_max_distance=1 << 16),  # the same buckets, log-spaced to another distance
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_without_each_part_of_its_disentangled_attention_deberta_would_not_match(deberta, removed):
    """The control: the same weights with one part of the position terms removed are far from transformers."""
    reference, loaded, _, _ = deberta
    ids, mask = batch([300, 57])
    expected = transformers_hidden(reference, ids, mask)
    assert max_error(ours_hidden(loaded.encoder, ids, mask), expected, mask) <= ATOL
    assert max_error(ours_hidden(without(loaded, **removed), ids, mask), expected, mask) > TELLING


# --- the classification head ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pooler_hidden_act", ["gelu", "tanh"])
def test_a_sequence_classification_checkpoint_gives_transformers_logits(tmp_path, pooler_hidden_act):
    """ContextPooler (the first token, pooler.dense, pooler_hidden_act) then the classifier: the head's dense ->
    activation -> out (model/heads.py)."""
    reference = reference_model(seed=5, model_class="DebertaV2ForSequenceClassification", num_labels=3,
                                pooler_hidden_act=pooler_hidden_act)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert (loaded.config.head, loaded.config.head_pooling, loaded.config.head_activation) == \
        ("classification", "cls", pooler_hidden_act)
    ids, mask = batch([300, 13, 1])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits.numpy()
        logits = loaded.encoder(ids, mask, **default_mask_inputs(mask))[2].numpy()
    assert np.abs(logits - expected).max() <= ATOL
    assert np.abs(expected).max() > TELLING  # logits that tell


def test_a_masked_lm_checkpoint_loads_its_encoder_under_deberta_prefix(tmp_path):
    reference = reference_model(seed=4, model_class="DebertaV2ForMaskedLM")
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert loaded.config.head == "none"
    assert any(name.startswith(("cls.", "lm_predictions.")) for name in loaded.config.source["ignored_tensors"])
    ids, mask = batch([40, 13])
    expected = transformers_hidden(reference.deberta, ids, mask)
    assert max_error(ours_hidden(loaded.encoder, ids, mask), expected, mask) <= ATOL


# --- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,named", [
    ("embedding_size", 16, "embedding_size 16"),
    ("conv_kernel_size", 3, "conv_kernel_size 3"),
    ("attention_head_size", 4, "attention_head_size 4"),
    ("pos_att_type", "p2c|p2p", "pos_att_type 'p2p'"),
    ("pos_att_type", None, "relative_attention without pos_att_type"),
    ("relative_attention", False, "norm_rel_ebd 'layer_norm' without relative_attention"),
    ("hidden_act", "gelu_new", "hidden_act 'gelu_new'")])
def test_what_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, field, value, named):
    reference_model(seed=1).save_pretrained(str(tmp_path))
    settings = json.loads((tmp_path / "config.json").read_text())
    settings[field] = value
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("field,value,named", [
    ("pooler_hidden_size", 16, "pooler_hidden_size 16"),
    ("pooler_hidden_act", "gelu_new", "pooler_hidden_act 'gelu_new'")])
def test_a_classifier_head_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, field, value, named):
    reference_model(seed=1, model_class="DebertaV2ForSequenceClassification", num_labels=1).save_pretrained(
        str(tmp_path))
    settings = json.loads((tmp_path / "config.json").read_text())
    settings[field] = value
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("change,named", [
    (dict(disentangled_terms=("c2p", "p2p")), "disentangled_terms"),
    (dict(disentangled_terms=("c2p", "c2p")), "disentangled_terms"),
    (dict(disentangled_terms=("c2p",), disentangled_buckets=2), "disentangled_buckets"),
    (dict(disentangled_terms=("c2p",), disentangled_buckets=32, disentangled_max_distance=17),
     "disentangled_max_distance"),
    (dict(disentangled_terms=("c2p",), attention="additive"), "disentangled_terms"),
    (dict(disentangled_terms=("c2p",), relative_attention_buckets=32), "disentangled_terms")])
def test_invalid_disentangled_settings_are_config_errors_naming_the_field(change, named):
    with pytest.raises(ConfigError, match=named):
        EncoderConfig(**change)


def test_the_disentangled_fields_round_trip_and_old_configs_load_without_them():
    config = EncoderConfig(disentangled_terms=("c2p", "p2c"), disentangled_buckets=32, disentangled_max_distance=128,
                           disentangled_share_key=True, disentangled_norm=True)
    assert from_dict(json.loads(json.dumps(to_dict(config)))) == config
    assert from_dict({**to_dict(EncoderConfig()), "disentangled_terms": "c2p,p2c"}).disentangled_terms == \
        ("c2p", "p2c")  # `--set disentangled_terms=c2p,p2c`
    old = {k: v for k, v in to_dict(EncoderConfig()).items() if not k.startswith("disentangled_")}
    assert from_dict(old) == EncoderConfig()


# --- a DeBERTa-v3-shaped cross-encoder, served ----------------------------------------------------------------

QUERY = "what is the encoder"
DOCUMENTS = ["the encoder", "A long document, with punctuation; and UNKNOWN words!",
             " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(150)),  # past the log buckets' start and reach
             "it is a document of the encoder"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, serve_start):
    """(the CrossEncoder directory: DebertaV2ForSequenceClassification with one label and DeBERTa-v3's special ids
    [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3, saved by sentence-transformers; its server)."""
    from sentence_transformers import CrossEncoder
    from transformers import PreTrainedTokenizerFast

    tokenizer, vocab_size = word_tokenizer()
    base = tmp_path_factory.mktemp("deberta-ce-base")
    reference_model(seed=7, model_class="DebertaV2ForSequenceClassification", num_labels=1,
                    vocab_size=vocab_size).save_pretrained(str(base))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            unk_token="[UNK]", mask_token="[MASK]", model_max_length=512).save_pretrained(str(base))
    directory = tmp_path_factory.mktemp("deberta-ce")
    CrossEncoder(str(base), device="cpu").save(str(directory))
    out = tmp_path_factory.mktemp("deberta-ce-export")
    assert export_main(["--from-pretrained", str(directory), "--out-dir", str(out), "--name", "deberta-ce",
                        "--graphs", "fp32", "--quiet"]) == 0
    return directory, serve_start(out / "deberta-ce")


def test_v1_rerank_scores_equal_cross_encoder_predict(cross_encoder):
    from sentence_transformers import CrossEncoder

    directory, server = cross_encoder
    expected = CrossEncoder(str(directory), device="cpu").predict([(QUERY, d) for d in DOCUMENTS],
                                                                   convert_to_numpy=True)
    body = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/rerank", timeout=60,
                      json={"model": "deberta-ce", "query": QUERY, "documents": DOCUMENTS}).json()
    scores = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert sorted(scores) == list(range(len(DOCUMENTS)))
    np.testing.assert_allclose([scores[i] for i in range(len(DOCUMENTS))], expected, atol=SCORE_ATOL, rtol=0)
    assert [r["index"] for r in body["results"]] == list(np.argsort(-expected, kind="stable"))
    assert np.ptp(expected) > 10 * SCORE_ATOL  # scores that tell the documents apart
