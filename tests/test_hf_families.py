"""ModernBERT and RoBERTa / XLM-RoBERTa checkpoints: strict loading, parity with transformers' own
ModernBertModel / XLMRobertaModel / RobertaModel (the `reference` extra; fp32, eager attention), and
the ONNX export of them through `python -m export --from-pretrained`.

Every reference is built from a small config at random initialisation (nothing comes from a hub) and
saved with save_pretrained. transformers initialises linears with std 0.02, which makes attention
almost uniform and hides position and window mistakes; the weights are redrawn at a scale where
they show (a wrong θ or window moves the hidden states by > 1e-2, see the last tests).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.cli import main as export_main
from model.checkpoint import CheckpointError, fit_encoder
from model.hf_pretrained import encoder_config_from_hf, load_pretrained, tokenize
from model.mask_kinds import MaskKind
from model.masks import default_mask_inputs
from model.pooling import l2_normalize
from tests.hf_references import MODERNBERT, ROBERTA, WORDS, modernbert_embedding_model, redraw

HIDDEN_ATOL = 1e-4  # the project's tolerance: hidden states at valid positions, max abs

# Around ModernBERT's window (64) and its 2 windows, one token, and a padded batch.
LENGTHS = [[1], [63], [64], [65], [129], [129, 65, 1, 64]]


def saved(reference, directory: Path):
    reference.save_pretrained(str(directory))
    assert (directory / "model.safetensors").is_file()
    return directory, reference


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(**MODERNBERT)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return saved(redraw(ModernBertModel(config)), tmp_path_factory.mktemp("modernbert"))


def roberta_family(model_type: str, directory: Path):
    from transformers import RobertaConfig, RobertaModel, XLMRobertaConfig, XLMRobertaModel

    config_class, model_class = {"xlm-roberta": (XLMRobertaConfig, XLMRobertaModel),
                                 "roberta": (RobertaConfig, RobertaModel)}[model_type]
    config = config_class(**ROBERTA)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    return saved(redraw(model_class(config, add_pooling_layer=False), seed=1), directory)


@pytest.fixture(scope="module", params=["xlm-roberta", "roberta"])
def roberta(request, tmp_path_factory):
    return roberta_family(request.param, tmp_path_factory.mktemp(request.param))


def batch(lengths: list[int], vocab: int, pad: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): right-padded rows of random non-padding ids, pad id in the padding."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), length), generator=generator)
    mask = torch.zeros(len(lengths), length, dtype=torch.int64)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return torch.where(mask.bool(), ids, torch.full_like(ids, pad)), mask


def ours(encoder, ids: torch.Tensor, mask: torch.Tensor, kind: MaskKind = MaskKind.BIDIRECTIONAL, **extra):
    feeds = default_mask_inputs(mask, kind, **extra)
    args = [ids, mask, feeds["mask_kind"], feeds["mask_causal"], feeds["mask_window"], feeds["mask_step"],
            feeds["custom_mask"]]
    if encoder.config.type_vocab_size:
        args.append(torch.zeros_like(ids))
    with torch.no_grad():
        return encoder(*args)[0]


def assert_hidden_close(actual, expected, mask) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == np.float32
    valid = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(actual[valid], expected[valid], atol=HIDDEN_ATOL, rtol=0)


# ------------------------------------------------------------------ ModernBERT


def test_modernbert_config_gives_its_plan_rotary_thetas_and_parts(modernbert):
    config = load_pretrained(modernbert[0]).config
    assert config.local_layers == (1, 2) and config.local_window == 64
    assert (config.positional, config.rope_theta, config.rope_theta_local) == ("rotary", 160000.0, 10000.0)
    assert (config.ffn, config.activation, config.linear_bias, config.norm_bias) == ("gated", "gelu", False, False)
    assert (config.norm_placement, config.first_attention_norm) == ("pre", False)
    assert config.position_limit is None and config.max_positions == 8192


def test_modernbert_legacy_config_keys_give_the_same_config(modernbert):
    hf = json.loads((modernbert[0] / "config.json").read_text())
    legacy = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
    assert encoder_config_from_hf(legacy, name="x") == encoder_config_from_hf(hf, name="x")


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_modernbert_hidden_states_match_transformers(modernbert, lengths):
    directory, reference = modernbert
    loaded = load_pretrained(directory)
    ids, mask = batch(lengths, MODERNBERT["vocab_size"], MODERNBERT["pad_token_id"])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_hidden_close(ours(loaded.encoder, ids, mask), expected, mask)


def test_modernbert_plan_and_thetas_matter_at_this_scale(modernbert):
    """The parity above would catch a wrong window or θ: each moves the hidden states past 1e-2."""
    directory, reference = modernbert
    loaded = load_pretrained(directory)
    ids, mask = batch([129], MODERNBERT["vocab_size"], 0)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    for change in (dict(local_window=63), dict(rope_theta_local=160000.0), dict(local_layers=())):
        other = fit_encoder(loaded.config.replace(**change), loaded.encoder.state_dict(), origin="test")
        assert (ours(other, ids, mask) - expected).abs().max() > 1e-2, change


def test_modernbert_checkpoint_without_a_fused_qkv_lists_it_by_its_name(modernbert, tmp_path):
    from safetensors.torch import load_file, save_file

    target = tmp_path / "broken"
    shutil.copytree(modernbert[0], target)
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["layers.2.attn.Wqkv.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \(3\): layers\.2\.attn\.Wqkv\.weight \(q rows\)") as info:
        load_pretrained(target)
    assert "layers.2.attention.q_proj.weight" in str(info.value)


def test_modernbert_with_scaled_rotary_positions_is_refused(modernbert):
    hf = json.loads((modernbert[0] / "config.json").read_text())
    hf["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 2.0}
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        encoder_config_from_hf(hf, name="x")


def test_modernbert_export_answers_as_transformers_on_the_dense_and_sparse_graphs(modernbert, tmp_path):
    directory, reference = modernbert
    assert export_main(["--from-pretrained", str(directory), "--out-dir", str(tmp_path), "--name", "mb",
                        "--graphs", "fp32,long", "--quiet"]) == 0
    meta = json.loads((tmp_path / "mb" / "metadata.json").read_text())
    assert {name: g["attention_path"] for name, g in meta["graphs"].items()} == {"fp32": "dense", "sparse": "sparse"}
    assert meta["config"]["local_layers"] == [1, 2] and meta["config"]["positional"] == "rotary"
    ids, mask = batch([150, 65, 1], MODERNBERT["vocab_size"], 0, seed=3)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    feeds = {k: v.numpy() for k, v in default_mask_inputs(mask).items()}
    feeds.update(input_ids=ids.numpy(), attention_mask=mask.numpy())
    for graph in ("model.onnx", "model.sparse.onnx"):
        session = ort.InferenceSession(str(tmp_path / "mb" / graph), providers=["CPUExecutionProvider"])
        wanted = {i.name for i in session.get_inputs()}
        hidden = session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in wanted})[0]
        assert_hidden_close(hidden, expected, mask)


# ------------------------------------------------------------------ a ModernBERT embedding model

TEXTS = [
    "the encoder",
    "A long document, with punctuation; and UNKNOWN words!",
    " ".join(WORDS[i % len(WORDS)] for i in range(300)),  # past the window (64) and 2 of them
    "",
    " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(70)),
]
ST_MAX_LENGTH = 256  # the long text is truncated to it


@pytest.fixture(scope="module")
def modernbert_embedding(tmp_path_factory):
    """(directory as sentence-transformers saves it, the SentenceTransformer)."""
    directory = tmp_path_factory.mktemp("modernbert-embed")
    return directory, modernbert_embedding_model(tmp_path_factory.mktemp("modernbert-base"), directory, ST_MAX_LENGTH)


def test_modernbert_embedding_model_reads_pooling_normalize_and_length(modernbert_embedding):
    loaded = load_pretrained(modernbert_embedding[0])
    assert loaded.pooling == {"mode": "mean", "normalize": True} and loaded.max_length == ST_MAX_LENGTH
    assert loaded.tokenizer_file is not None and loaded.config.local_layers == (1, 2)


def test_modernbert_sentence_embeddings_match_sentence_transformers(modernbert_embedding):
    directory, model = modernbert_embedding
    loaded = load_pretrained(directory)
    tokens = {k: torch.from_numpy(v) for k, v in tokenize(loaded.tokenizer(), TEXTS).items()}
    expected_tokens = model.tokenize(TEXTS)
    np.testing.assert_array_equal(tokens["input_ids"].numpy(), expected_tokens["input_ids"].numpy())
    assert tokens["input_ids"].shape[1] == ST_MAX_LENGTH
    feeds = default_mask_inputs(tokens["attention_mask"])
    with torch.no_grad():
        _, pooled = loaded.encoder(tokens["input_ids"], tokens["attention_mask"], feeds["mask_kind"],
                                   feeds["mask_causal"], feeds["mask_window"], feeds["mask_step"], feeds["custom_mask"])
    actual = l2_normalize(pooled).numpy()
    expected = model.encode(TEXTS, batch_size=len(TEXTS), normalize_embeddings=True, convert_to_numpy=True)
    assert actual.shape == expected.shape == (len(TEXTS), MODERNBERT["hidden_size"])
    cosine = (actual * expected).sum(-1) / (np.linalg.norm(actual, axis=-1) * np.linalg.norm(expected, axis=-1))
    assert cosine.min() >= 0.99999, cosine


# ------------------------------------------------------------------ RoBERTa / XLM-RoBERTa


def test_roberta_config_numbers_positions_after_the_padding_id(roberta):
    config = load_pretrained(roberta[0]).config
    assert (config.position_ids, config.pad_token_id, config.type_vocab_size) == ("after_padding", 1, 1)
    assert config.position_limit == ROBERTA["max_position_embeddings"] - 2


@pytest.mark.parametrize("lengths", [[1], [63], [138], [138, 65, 1]], ids=str)
def test_roberta_hidden_states_match_transformers(roberta, lengths):
    directory, reference = roberta
    loaded = load_pretrained(directory)
    ids, mask = batch(lengths, ROBERTA["vocab_size"], ROBERTA["pad_token_id"], seed=len(lengths))
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_hidden_close(ours(loaded.encoder, ids, mask), expected, mask)


def test_roberta_positions_from_zero_would_not_match(roberta):
    directory, reference = roberta
    loaded = load_pretrained(directory)
    ids, mask = batch([63], ROBERTA["vocab_size"], ROBERTA["pad_token_id"])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    plain = fit_encoder(loaded.config.replace(position_ids="range"), loaded.encoder.state_dict(), origin="test")
    assert (ours(plain, ids, mask) - expected).abs().max() > 1e-2


def test_xlm_roberta_export_answers_as_transformers(tmp_path):
    directory, reference = roberta_family("xlm-roberta", tmp_path / "checkpoint")
    assert export_main(["--from-pretrained", str(directory), "--out-dir", str(tmp_path), "--name", "xlmr",
                        "--graphs", "fp32", "--quiet"]) == 0
    ids, mask = batch([138, 40, 1], ROBERTA["vocab_size"], ROBERTA["pad_token_id"], seed=4)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    feeds = {k: v.numpy() for k, v in default_mask_inputs(mask).items()}
    feeds.update(input_ids=ids.numpy(), attention_mask=mask.numpy(), token_type_ids=np.zeros_like(ids.numpy()))
    session = ort.InferenceSession(str(tmp_path / "xlmr" / "model.onnx"), providers=["CPUExecutionProvider"])
    hidden = session.run(["last_hidden_state"], feeds)[0]
    assert_hidden_close(hidden, expected, mask)


# ------------------------------------------------------------------ ModernBERT-base shape, long rows

@pytest.fixture(scope="module")
def modernbert_base_shape(tmp_path_factory):
    """ModernBERT-base's widths (768, 12 heads, d_ff 1152, window 128, θ 160k / 10k) in 3 layers
    (global, local, local): the long-length parity stays affordable in the suite."""
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(num_hidden_layers=3, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(5)
    return saved(redraw(ModernBertModel(config), seed=5), tmp_path_factory.mktemp("modernbert-base-shape"))


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[1000], [4096], [1000, 517]], ids=str)
def test_modernbert_base_shape_matches_transformers_on_long_rows(modernbert_base_shape, lengths):
    directory, reference = modernbert_base_shape
    loaded = load_pretrained(directory)
    ids, mask = batch(lengths, 50368, 0, seed=7)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_hidden_close(ours(loaded.encoder, ids, mask), expected, mask)


def test_export_refuses_an_unknown_architecture_naming_it(tmp_path, capsys):
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert export_main(["--from-pretrained", str(directory), "--out-dir", str(tmp_path / "out"), "--quiet"]) == 2
    message = capsys.readouterr().err
    assert "model_type 'gpt2' (architectures: GPT2LMHeadModel) is not supported" in message
    assert "bert, roberta, xlm-roberta, modernbert" in message
    assert not (tmp_path / "out" / "gpt2").exists()


def test_fp16_graph_of_a_rotary_model_is_refused_before_any_export(modernbert, tmp_path, capsys):
    code = export_main(["--from-pretrained", str(modernbert[0]), "--out-dir", str(tmp_path), "--name", "mb",
                        "--graphs", "fp32,fp16", "--quiet"])
    assert code == 2 and "fp16 is not built for positional='rotary'" in capsys.readouterr().err
    assert not (tmp_path / "mb").exists()
