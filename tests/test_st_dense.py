"""sentence-transformers Dense modules after the Pooling (model/hf_dense.py reads them, model/projection.py holds
them, serve/core/pooling.py applies them): an EmbeddingGemma-shaped SentenceTransformer (a small bidirectional
Gemma3TextModel, mean Pooling, Dense d -> 4d and 4d -> d without bias or activation, Normalize) and a LaBSE-like
one (Dense d -> 48 with a bias and tanh), saved by sentence-transformers itself, exported and served: their
embeddings equal `SentenceTransformer.encode`, at the projected width everywhere a client sees it; what we do not
compute is refused naming it, and a projection file changed after export is refused at start."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import torch

from client import EncodeOutput, EncoderClient
from export.cli import main as export_main
from export.triton import TritonRepoError, write_triton_repo
from model.checkpoint import CheckpointError
from model.export_format import read_metadata, sha256_file
from model.hf_pretrained import load_pretrained
from tests.hf_references import WORDS, cosines, export_and_serve, openai_embeddings, redraw, word_tokenizer
from tests.test_decoder_families import GEMMA3, gemma3_reference

MIN_COSINE = 0.99999
D = GEMMA3["hidden_size"]
TANH_WIDTH = 48  # the LaBSE-like model's Dense: d -> 48, another width than the hidden size
TANH_MAX_LENGTH = 24  # its max_seq_length: LONG_TEXT takes several windows when chunked
IDENTITY, TANH = torch.nn.Identity, torch.nn.Tanh
TEXTS = ["the encoder", "A long document, with punctuation; and UNKNOWN words!", "it is that of this"]
LONG_TEXT = " ".join(WORDS[(5 * i) % len(WORDS)] for i in range(60))


def gemma_base(directory):
    """A small Gemma3TextModel (bidirectional, as EmbeddingGemma) with a word-level tokenizer, saved in `directory`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer, vocab_size = word_tokenizer(("<pad>", "<eos>", "<bos>", "<unk>"), begin="<bos>", end="<eos>",
                                           unk="<unk>")
    gemma3_reference(seed=5, vocab_size=vocab_size).save_pretrained(str(directory))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(str(directory))
    return directory


def dense(in_features: int, out_features: int, activation: type, *, bias: bool, seed: int):
    """A sentence-transformers Dense with weights at a telling scale (N(0, 1/in), biases 0.1)."""
    from sentence_transformers import models as st_models

    return redraw(st_models.Dense(in_features, out_features, bias=bias, activation_function=activation()), seed=seed)


def sentence_transformer(base, max_seq_length: int, *projection):
    """Transformer, mean Pooling, `projection` (Dense modules), Normalize: a SentenceTransformer on `base`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models

    transformer = st_models.Transformer(str(base), max_seq_length=max_seq_length,
                                        model_kwargs={"attn_implementation": "eager"})
    return SentenceTransformer(modules=[transformer, st_models.Pooling(D, "mean"), *projection, st_models.Normalize()],
                               device="cpu")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return gemma_base(tmp_path_factory.mktemp("gemma-base"))


@pytest.fixture(scope="module")
def embedding_gemma(base, tmp_path_factory, serve_start):
    """(EmbeddingGemma's layout: Dense d -> 4d -> d, no bias, Identity; its export; its server)."""
    model = sentence_transformer(base, 256, dense(D, 4 * D, IDENTITY, bias=False, seed=11),
                                 dense(4 * D, D, IDENTITY, bias=False, seed=12))
    return (model, *export_and_serve(model, tmp_path_factory, serve_start, "embedding-gemma"))


@pytest.fixture(scope="module")
def tanh_dense(base, tmp_path_factory, serve_start):
    """(LaBSE's kind of Dense: d -> 48 with a bias and tanh; its export; its server)."""
    model = sentence_transformer(base, TANH_MAX_LENGTH, dense(D, TANH_WIDTH, TANH, bias=True, seed=13))
    return (model, *export_and_serve(model, tmp_path_factory, serve_start, "tanh-dense"))


@pytest.fixture
def saved(base, tmp_path):
    """A fresh EmbeddingGemma-shaped directory as sentence-transformers saves it (for refusals to edit)."""
    sentence_transformer(base, 256, dense(D, 4 * D, IDENTITY, bias=False, seed=11),
                         dense(4 * D, D, IDENTITY, bias=False, seed=12)).save(str(tmp_path / "st"))
    return tmp_path / "st"


def window_embedding(model, ids: list[int], projected: bool = True) -> np.ndarray:
    """sentence-transformers' pooled embedding of one window of token ids, through its Dense module when
    `projected`, never normalised (the modules of `model` before its Normalize)."""
    from sentence_transformers import SentenceTransformer

    modules = [model[0], model[1], model[2]] if projected else [model[0], model[1]]
    features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    with torch.no_grad():
        return SentenceTransformer(modules=modules, device="cpu")(features)["sentence_embedding"][0].numpy()


def grpc_embeddings(server, texts, **options) -> EncodeOutput:
    with EncoderClient(server.target, timeout=120) as client:
        return client.embed(texts, **options)


# --- served exactly -------------------------------------------------------------------------------------------------

def test_grpc_embeddings_through_two_dense_layers_equal_sentence_transformers(embedding_gemma):
    model, _, server = embedding_gemma
    out = grpc_embeddings(server, TEXTS)
    assert out.embeddings.shape == (len(TEXTS), D) and out.embeddings.dtype == np.float32
    assert cosines(out.embeddings, model.encode(TEXTS, convert_to_numpy=True)).min() >= MIN_COSINE


def test_openai_embeddings_through_two_dense_layers_equal_sentence_transformers(embedding_gemma):
    model, _, server = embedding_gemma
    served = openai_embeddings(server, "embedding-gemma", TEXTS)
    assert served.shape == (len(TEXTS), D)
    assert cosines(served, model.encode(TEXTS, convert_to_numpy=True)).min() >= MIN_COSINE


def test_without_its_projection_the_served_mean_would_not_match(embedding_gemma):
    """Control: the hidden states a client gets stay un-projected; their mean is sentence-transformers' Pooling
    output (its model without the Dense modules), far from its embedding."""
    from sentence_transformers import SentenceTransformer

    model, _, server = embedding_gemma
    out = grpc_embeddings(server, TEXTS, hidden_states=True)
    means = np.stack([hidden.mean(axis=0) for hidden in out.hidden_states])
    unprojected = SentenceTransformer(modules=[model[0], model[1], model[4]], device="cpu")
    assert cosines(means, unprojected.encode(TEXTS, convert_to_numpy=True)).min() >= MIN_COSINE
    assert cosines(means, model.encode(TEXTS, convert_to_numpy=True)).max() < 0.9


def test_a_biased_tanh_dense_to_another_width_is_served_exactly(tanh_dense):
    model, _, server = tanh_dense
    expected = model.encode(TEXTS, convert_to_numpy=True)
    out = grpc_embeddings(server, TEXTS, hidden_states=True)
    assert out.embeddings.shape == (len(TEXTS), TANH_WIDTH) and out.hidden_states[0].shape[1] == D
    assert cosines(out.embeddings, expected).min() >= MIN_COSINE
    assert cosines(openai_embeddings(server, "tanh-dense", TEXTS), expected).min() >= MIN_COSINE


def test_a_chunked_text_projects_each_window_before_the_token_weighted_mean(tanh_dense, base):
    """Each window's mean through Dense + tanh (sentence-transformers' model without its Normalize), then the
    windows' token-weighted mean, normalised; not the projection of the windows' mean (tanh does not commute)."""
    from transformers import PreTrainedTokenizerFast

    model, _, server = tanh_dense
    windows = PreTrainedTokenizerFast.from_pretrained(str(base))(
        LONG_TEXT, truncation=True, max_length=TANH_MAX_LENGTH, stride=TANH_MAX_LENGTH // 8,
        return_overflowing_tokens=True)["input_ids"]
    lengths = np.array([len(ids) for ids in windows], np.float64)[:, None]
    means = np.stack([window_embedding(model, ids, projected=False) for ids in windows])
    expected = (lengths * np.stack([window_embedding(model, ids) for ids in windows])).sum(0) / lengths.sum()
    with torch.no_grad():
        mean_projected = model[2]({"sentence_embedding": torch.tensor((lengths * means).sum(0) / lengths.sum(),
                                                                      dtype=torch.float32)[None]})
    out = grpc_embeddings(server, [LONG_TEXT], chunk=True)
    assert len(windows) >= 3 and out.chunks == (len(windows),)
    assert out.embeddings.shape == (1, TANH_WIDTH)
    assert cosines(out.embeddings, expected[None]).min() >= MIN_COSINE
    assert cosines(out.embeddings, mean_projected["sentence_embedding"].numpy()).min() < MIN_COSINE


@pytest.mark.parametrize("route, body", [("/v1/embeddings", {"input": TEXTS[:1]}), ("/embed", {"inputs": TEXTS[:1]})],
                         ids=["openai", "tei"])
def test_dimensions_range_over_the_projected_width(tanh_dense, route, body):
    _, _, server = tanh_dense
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
        assert http.post(route, json={**body, "model": "tanh-dense", "dimensions": TANH_WIDTH}).status_code == 200
        refused = http.post(route, json={**body, "model": "tanh-dense", "dimensions": TANH_WIDTH + 1})
    assert refused.status_code == 400 and f"out of range [1, {TANH_WIDTH}]" in refused.text


def test_kserve_metadata_gives_the_projected_width(tanh_dense):
    _, _, server = tanh_dense
    answer = httpx.get(f"http://127.0.0.1:{server.http_port}/v2/models/tanh-dense", timeout=60).json()
    shapes = {output["name"]: output["shape"] for output in answer["outputs"]}
    assert shapes == {"last_hidden_state": [-1, -1, D], "embeddings": [-1, TANH_WIDTH]}


def test_model_info_gives_the_projected_width_beside_d_model(tanh_dense):
    _, _, server = tanh_dense
    with EncoderClient(server.target, timeout=60.0) as client:
        info = client.model_info()
    assert (info.embedding_width, info.d_model) == (TANH_WIDTH, D)


# --- the export -----------------------------------------------------------------------------------------------------

def test_the_export_lists_each_dense_layer_with_its_widths_activation_and_file_hashes(embedding_gemma, tanh_dense):
    for (_, export, _), layers in ((embedding_gemma, [(D, 4 * D, "identity", False), (4 * D, D, "identity", False)]),
                                   (tanh_dense, [(D, TANH_WIDTH, "tanh", True)])):
        dense_entries = read_metadata(export).pooling["dense"]
        assert [(e["in"], e["out"], e["activation"], e["bias"] is not None) for e in dense_entries] == layers
        for file in (f for e in dense_entries for f in (e["weight"], e["bias"]) if f):
            assert sha256_file(export / file["file"]) == file["sha256"]


def test_a_triton_repository_is_refused_for_an_export_with_a_projection(embedding_gemma, tmp_path):
    _, export, _ = embedding_gemma
    with pytest.raises(TritonRepoError, match="pooling.dense has 2 Dense layer"):
        write_triton_repo(export, tmp_path / "repo")


def test_an_export_with_a_triton_repository_is_refused_before_anything_is_written(saved, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_main(["--from-pretrained", str(saved), "--out-dir", str(out), "--graphs", "fp32", "--quiet",
                        "--triton-repo", str(tmp_path / "repo")]) == 2
    assert "pooling.dense has 2 Dense layer" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "repo").exists()


# --- refusals -------------------------------------------------------------------------------------------------------

def test_a_dense_with_an_unsupported_activation_is_refused_naming_it(saved):
    settings = json.loads((saved / "2_Dense" / "config.json").read_text())
    (saved / "2_Dense" / "config.json").write_text(
        json.dumps({**settings, "activation_function": "torch.nn.modules.activation.ReLU"}))
    with pytest.raises(CheckpointError, match=r"2_Dense: activation_function 'torch.nn.modules.activation.ReLU' is not "
                                              r"supported; supported: torch.nn.modules.linear.Identity, "
                                              r"torch.nn.modules.activation.Tanh"):
        load_pretrained(saved)


def test_dense_layers_whose_widths_do_not_chain_are_refused_naming_both(base, tmp_path):
    sentence_transformer(base, 256, dense(D, 4 * D, IDENTITY, bias=False, seed=11),
                         dense(2 * D, D, IDENTITY, bias=False, seed=12)).save(str(tmp_path / "st"))
    with pytest.raises(CheckpointError, match=rf"3_Dense: in_features {2 * D} does not match {4 * D}, "
                                              r"the out_features of .*2_Dense"):
        load_pretrained(tmp_path / "st")


def test_a_dense_module_before_the_pooling_is_refused(saved):
    modules = json.loads((saved / "modules.json").read_text())
    modules[1], modules[2] = modules[2], modules[1]  # Transformer, Dense, Pooling, Dense, Normalize
    (saved / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="Dense modules must directly follow the Pooling"):
        load_pretrained(saved)


def test_a_projection_file_changed_after_export_is_refused_at_start(embedding_gemma, serve_start, tmp_path):
    _, export, _ = embedding_gemma
    copy = tmp_path / "embedding-gemma"
    shutil.copytree(export, copy)
    weight = copy / "dense_0.weight.npy"
    np.save(weight, 2 * np.load(weight), allow_pickle=False)  # same shape and dtype, other values
    server = serve_start(copy, wait=False)
    assert server.proc.wait(60) == 1
    log = server.log()
    assert "startup_failed" in log and "dense_0.weight.npy: sha256" in log and "does not match metadata.json" in log
