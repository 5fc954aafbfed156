"""DeBERTa-v2 / v3 on the one encoder (model/hf_deberta.py): post-norm layers, no absolute positions (v3) and
disentangled attention (model/disentangled_attention.py: c2p and p2c terms from one shared relative position
table in log buckets), against transformers' DebertaV2Model (eager, fp32, random weights redrawn at a telling
scale) through every graph the export writes (fp32, optimized within 1e-4; int8, fp16 by cosine; no long-input
graph); the controls (each position term, the table's LayerNorm and the log buckets removed in turn move the
hidden states); the ContextPooler classifier; a DeBERTa-v3-shaped cross-encoder served end to end, /v1/rerank
equal to sentence-transformers' CrossEncoder.predict; and the refusals."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.cli import main as export_main
from model.attention_paths import SPARSE, long_path
from model.checkpoint import fit_encoder
from model.encoder import Encoder
from model.hf_pretrained import load_pretrained
from model.masks import default_mask_inputs
from tests.hf_references import redraw

ATOL = 1e-4  # hidden states at real positions, max abs
TELLING = 1e-2  # a missing part moves the hidden states by more than this at this scale
SCORE_ATOL = 1e-4  # served rerank scores (sigmoid of the logit) against CrossEncoder.predict
# DeBERTa-v3's layout (share_att_key, LayerNorm on the table, p2c|c2p, no absolute positions, no token types) at a
# small width; its 256 buckets up to 512 scaled down to 32 up to 128 so that a few hundred tokens reach past both.
DEBERTA = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, relative_attention=True, position_buckets=32, max_relative_positions=128,
               norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type="p2c|c2p", position_biased_input=False,
               type_vocab_size=0, layer_norm_eps=1e-7, pad_token_id=0)
EXACT_GRAPHS = ("model.onnx", "model.optimized.onnx")  # within ATOL of transformers
CONVERTED_GRAPHS = {"model.int8.onnx": 0.998, "model.fp16.onnx": 0.9999}  # min cosine per real token


def reference_model(seed: int = 0, model_class: str = "DebertaV2Model", **changes):
    import transformers

    config = transformers.DebertaV2Config(**{**DEBERTA, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(getattr(transformers, model_class)(config), seed=seed)


@pytest.fixture(scope="module")
def deberta(tmp_path_factory):
    """(transformers reference, our loaded model, {graph file: CPU session}, export directory)."""
    reference = reference_model()
    checkpoint = tmp_path_factory.mktemp("deberta")
    reference.save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp("deberta-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "d",
                        "--graphs", "fp32,optimized,int8,fp16,long", "--quiet"]) == 0
    sessions = {name: ort.InferenceSession(str(out / "d" / name), providers=["CPUExecutionProvider"])
                for name in (*EXACT_GRAPHS, *CONVERTED_GRAPHS)}
    return reference, load_pretrained(checkpoint), sessions, out / "d"


def batch(lengths: list[int], seed: int = 0, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): rows of random non-special ids, the pad id 0 in the padding (right or left)."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(5, DEBERTA["vocab_size"], (len(lengths), length), generator=generator)
    mask = torch.zeros(len(lengths), length, dtype=torch.int64)
    for row, n in enumerate(lengths):
        if left:
            mask[row, length - n:] = 1
        else:
            mask[row, :n] = 1
    return torch.where(mask.bool(), ids, torch.zeros_like(ids)), mask


def transformers_hidden(reference, ids, mask, token_type_ids=None) -> np.ndarray:
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids).last_hidden_state.numpy()


def ours_hidden(encoder, ids, mask, token_type_ids=None) -> np.ndarray:
    with torch.no_grad():
        return encoder(ids, mask, **default_mask_inputs(mask), token_type_ids=token_type_ids)[0].numpy()


def graph_hidden(session, ids, mask) -> np.ndarray:
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
             **{k: v.numpy() for k, v in default_mask_inputs(mask).items()}}
    return session.run(["last_hidden_state"], feeds)[0]


def max_error(actual, expected, mask) -> float:
    valid = mask.numpy().astype(bool)
    return float(np.abs(actual[valid] - expected[valid]).max())


def min_token_cosine(actual, expected, mask) -> float:
    valid = mask.numpy().astype(bool)
    a, b = actual[valid], expected[valid]
    return float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())


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


def test_the_export_has_no_long_input_graph_and_refuses_one_by_name(deberta, tmp_path):
    reference, loaded, _, directory = deberta
    graphs = json.loads((directory / "metadata.json").read_text())["graphs"]
    assert set(graphs) == {"fp32", "optimized", "int8", "fp16"}  # "long" named none: the terms are dense only
    assert long_path(loaded.config) is None
    with pytest.raises(ValueError, match="sparse"):
        Encoder(loaded.config, SPARSE)
    reference.save_pretrained(str(tmp_path / "checkpoint"))
    assert export_main(["--from-pretrained", str(tmp_path / "checkpoint"), "--out-dir", str(tmp_path / "out"),
                        "--graphs", "fp32,sparse", "--quiet"]) != 0
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_the_optimizer_leaves_the_disentangled_attention_unfused(deberta):
    """optimize.fuse_attention's pattern (scores = MatMul · scale straight into the masked softmax) does not match
    scores with the position terms added, so contrib Attention, which would drop them, is never written."""
    import onnx

    _, _, _, directory = deberta
    ops = {node.op_type for node in onnx.load(str(directory / "model.optimized.onnx")).graph.node}
    assert "Softmax" in ops and "GatherElements" in ops and "Attention" not in ops


# --- parity with transformers, every graph ------------------------------------------------------------------

@pytest.mark.parametrize("lengths,left", [([1], False), ([13], False), ([40], False), ([300], False),
                                          ([13, 1, 40], False), ([300, 57, 0, 129], False),
                                          ([13, 1, 40], True)], ids=str)
def test_hidden_states_match_transformers_on_every_graph(deberta, lengths, left):
    reference, loaded, sessions, _ = deberta
    ids, mask = batch(lengths, seed=len(lengths), left=left)
    expected = transformers_hidden(reference, ids, mask)
    assert max_error(ours_hidden(loaded.encoder, ids, mask), expected, mask) <= ATOL
    for name in EXACT_GRAPHS:
        error = max_error(graph_hidden(sessions[name], ids, mask), expected, mask)
        assert error <= ATOL, f"{name}: {error}"
    for name, limit in CONVERTED_GRAPHS.items():
        cosine = min_token_cosine(graph_hidden(sessions[name], ids, mask), expected, mask)
        assert cosine >= limit, f"{name}: {cosine}"


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
