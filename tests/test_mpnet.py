"""MPNet on the one encoder (model/hf_mpnet.py): BERT's post-norm layers, RoBERTa's position ids after id 1, and
relative position buckets as an additive per-head bias (model/relative_positions.py), against transformers'
MPNetModel (eager, fp32, random weights redrawn at a telling scale) through every graph the export writes; an
all-mpnet-base-v2-shaped sentence-transformers model (mean pooling, Normalize) served end to end, equal to
`SentenceTransformer.encode`; and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from client import EncoderClient
from model.attention_paths import SPARSE, long_path
from model.checkpoint import CheckpointError, fit_encoder
from model.config import ConfigError, EncoderConfig
from model.encoder import Encoder
from model.hf_pretrained import load_pretrained
from model.masks import default_mask_inputs
from tests import dense_parity
from tests.dense_parity import (assert_every_graph_matches, exported, max_error, optimized_ops, ours_hidden,
                                 transformers_hidden)
from tests.hf_references import WORDS, cosines, export_and_serve, openai_embeddings, word_tokenizer

ATOL = 1e-4  # hidden states at real positions, max abs
TELLING = 1e-2  # a missing part moves the hidden states by more than this at this scale
MIN_COSINE = 0.99999
PAD = 1  # MPNet's padding id (transformers' MPNetEmbeddings.padding_idx)
# all-mpnet-base-v2's layout at a small width: 514 positions (512 tokens after the pad id), 32 buckets.
MPNET = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=514, layer_norm_eps=1e-5, pad_token_id=PAD, bos_token_id=0, eos_token_id=2)


def reference_model(seed: int = 0, model_class: str = "MPNetModel", **changes):
    return dense_parity.reference_model("MPNetConfig", model_class, MPNET, seed, **changes)


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory):
    """(transformers reference, our loaded model, {graph file: CPU session}, export directory)."""
    return exported(reference_model(), tmp_path_factory, "m")


def batch(lengths: list[int], seed: int = 0, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): rows of random non-special ids, the pad id in the padding (right or left)."""
    return dense_parity.batch(lengths, MPNET["vocab_size"], PAD, seed, left)


# --- config.json -> the encoder's parts -----------------------------------------------------------------------

def test_an_mpnet_config_reads_post_norm_positions_after_id_1_and_32_relative_buckets(mpnet):
    _, loaded, _, _ = mpnet
    c = loaded.config
    assert (c.norm_placement, c.positional, c.position_ids, c.pad_token_id, c.type_vocab_size) == \
        ("post", "learned", "after_padding", 1, 0)
    assert (c.relative_attention_buckets, c.relative_attention_max_distance) == (32, 128)
    assert c.position_limit == 512
    assert tuple(loaded.encoder.relative_attention_bias.weight.shape) == (32, MPNET["num_attention_heads"])


def test_the_bucket_of_every_distance_is_transformers(mpnet):
    """The graph looks buckets up by distance clamped to 128 (model/relative_positions.py); beyond it the formula
    gives the last bucket of each half, so the table is transformers' formula at every distance."""
    reference, loaded, _, _ = mpnet
    relative = torch.arange(-5000, 5001)
    bias = loaded.encoder.relative_attention_bias
    ours = bias.buckets[relative.clamp(-bias.max_distance, bias.max_distance) + bias.max_distance]
    assert torch.equal(ours, reference.encoder.relative_position_bucket(relative))


def test_the_export_has_no_long_input_graph_and_serves_dense(mpnet):
    _, loaded, _, directory = mpnet
    graphs = json.loads((directory / "metadata.json").read_text())["graphs"]
    assert set(graphs) == {"fp32", "optimized", "int8", "fp16"}  # "long" named none: the bias is dense only
    assert long_path(loaded.config) is None
    with pytest.raises(ValueError, match="sparse"):
        Encoder(loaded.config, SPARSE)


def test_the_optimizer_leaves_the_biased_attention_unfused(mpnet):
    """optimize.fuse_attention's pattern (scores = MatMul · scale straight into the masked softmax) does not
    match scores with the bias added, so contrib Attention, which would drop it, is never written."""
    ops = optimized_ops(mpnet[3])
    assert "Softmax" in ops and "Attention" not in ops


# --- parity with transformers, every graph ------------------------------------------------------------------

@pytest.mark.parametrize("lengths,left", [([1], False), ([13], False), ([128], False), ([512], False),
                                          ([13, 1, 40], False), ([200, 57, 0, 129], False),
                                          ([13, 1, 40], True)], ids=str)
def test_hidden_states_match_transformers_on_every_graph(mpnet, lengths, left):
    ids, mask = batch(lengths, seed=len(lengths), left=left)
    assert_every_graph_matches(mpnet, ids, mask, ATOL)


def test_without_its_relative_bias_mpnet_would_not_match(mpnet):
    """The control: the same weights with relative_attention_buckets=0 (no bias) are far from transformers."""
    reference, loaded, _, _ = mpnet
    state = {k: v for k, v in loaded.encoder.state_dict().items() if not k.startswith("relative_attention_bias.")}
    bare = fit_encoder(loaded.config.replace(relative_attention_buckets=0), state, origin="test")
    ids, mask = batch([200, 57])
    expected = transformers_hidden(reference, ids, mask)
    assert max_error(ours_hidden(loaded.encoder, ids, mask), expected, mask) <= ATOL
    assert max_error(ours_hidden(bare, ids, mask), expected, mask) > TELLING


def test_a_masked_lm_checkpoint_loads_its_encoder_under_mpnet_prefix(tmp_path):
    reference = reference_model(seed=4, model_class="MPNetForMaskedLM")
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert any(name.startswith("lm_head.") for name in loaded.config.source["ignored_tensors"])
    ids, mask = batch([40, 13])
    expected = transformers_hidden(reference.mpnet, ids, mask)
    assert max_error(ours_hidden(loaded.encoder, ids, mask), expected, mask) <= ATOL


def test_a_sequence_classification_checkpoint_gives_transformers_logits(tmp_path):
    """MPNet's classifier is RoBERTa's (classifier.dense, tanh, classifier.out_proj on the first token)."""
    reference = reference_model(seed=5, model_class="MPNetForSequenceClassification", num_labels=3)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    ids, mask = batch([40, 13, 1])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits.numpy()
        logits = loaded.encoder(ids, mask, **default_mask_inputs(mask))[2].numpy()
    assert np.abs(logits - expected).max() <= ATOL


# --- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,named", [
    ("relative_attention_num_buckets", 64, "relative_attention_num_buckets 64"),
    ("pad_token_id", 0, "pad_token_id 0"),
    ("hidden_act", "gelu_new", "hidden_act 'gelu_new'")])
def test_what_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, field, value, named):
    reference_model(seed=1).save_pretrained(str(tmp_path))
    settings = json.loads((tmp_path / "config.json").read_text())
    settings[field] = value
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("change,named", [
    (dict(relative_attention_buckets=2), "relative_attention_buckets"),
    (dict(relative_attention_buckets=-1), "relative_attention_buckets"),
    (dict(relative_attention_buckets=32, relative_attention_max_distance=8), "relative_attention_max_distance"),
    (dict(relative_attention_buckets=32, attention="additive"), "relative_attention_buckets")])
def test_invalid_relative_bucket_settings_are_config_errors_naming_the_field(change, named):
    with pytest.raises(ConfigError, match=named):
        EncoderConfig(**change)


# --- an all-mpnet-base-v2-shaped model, served ------------------------------------------------------------------

TEXTS = ["the encoder", "A long document, with punctuation; and UNKNOWN words!",
         " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(150)),
         " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(400))]  # past max_seq_length: truncated
MAX_SEQ_LENGTH = 384  # all-mpnet-base-v2's


MPNET_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, as MPNetTokenizer's


@pytest.fixture(scope="module")
def mpnet_embedding(tmp_path_factory, serve_start):
    """(the SentenceTransformer: MPNetModel + mean Pooling + Normalize, as all-mpnet-base-v2; its server)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from transformers import PreTrainedTokenizerFast

    tokenizer, vocab_size = word_tokenizer(MPNET_SPECIALS, "<s>", "</s>", "<unk>", pair_separator="</s>")
    base = tmp_path_factory.mktemp("mpnet-base")
    reference_model(seed=3, vocab_size=vocab_size).save_pretrained(str(base))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                            sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_SEQ_LENGTH,
                                        model_kwargs={"attn_implementation": "eager"})
    model = SentenceTransformer(modules=[transformer, st_models.Pooling(MPNET["hidden_size"], "mean"),
                                         st_models.Normalize()], device="cpu")
    return model, export_and_serve(model, tmp_path_factory, serve_start, "all-mpnet", graphs="fp32,optimized")[1]


def test_the_export_declares_mean_pooling_normalisation_and_the_max_length(mpnet_embedding):
    _, server = mpnet_embedding
    with EncoderClient(server.target, timeout=60) as client:
        info = client.model_info()
    assert (info.default_pooling, info.default_normalize) == ("mean", True)
    assert info.limits.max_text_tokens == MAX_SEQ_LENGTH and info.limits.max_sequence_length == 512


def test_served_embeddings_equal_sentence_transformers(mpnet_embedding):
    model, server = mpnet_embedding
    expected = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    with EncoderClient(server.target, timeout=120) as client:
        out = client.embed(TEXTS, truncate=True)  # the last text, as encode() does
    assert cosines(out.embeddings, expected).min() >= MIN_COSINE


def test_openai_embeddings_equal_sentence_transformers(mpnet_embedding):
    model, server = mpnet_embedding
    expected = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    assert cosines(openai_embeddings(server, "all-mpnet", TEXTS, truncate=True), expected).min() >= MIN_COSINE
