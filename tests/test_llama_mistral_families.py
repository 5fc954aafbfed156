"""Llama and Mistral as decoder embedders on the one encoder (model/hf_llama.py): the shared SwiGLU decoder
(RMSNorm, grouped-query attention with its own head_dim, rotary positions, causal as the natural mask),
Llama's attention_bias / mlp_bias, Mistral's sliding window as an attention plan of local layers, and NVIDIA's
bidirectional Llama (model_type llama_bidirec), against transformers' LlamaModel / MistralModel (eager, fp32,
random weights redrawn at a telling scale) through every graph the export writes; a 7B-class checkpoint the
host cannot hold refused before its weights are read; and a Mistral-shaped and a Llama-shaped
sentence-transformers model (last-token pooling, Normalize, a query prompt, a left-padding tokenizer) served
end to end, equal to `SentenceTransformer.encode`."""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnxruntime as ort
import pytest
import torch

from client import EncoderClient
from export.cases import MaskSpec, make_feeds
from export.cli import EXIT_BAD_INPUT
from export.cli import main as export_main
from model.checkpoint import CheckpointError
from model.encoder import Encoder
from model.export_format import read_metadata
from model.hf_llama import FAMILY as LLAMA_FAMILY
from model.hf_llama import llama_config
from model.hf_pretrained import PretrainedModel, load_pretrained, map_names
from model.mask_kinds import MaskKind
from tests.hf_references import cosines, export_and_serve, openai_embeddings, redraw
from tests.test_decoder_families import (ATOL, MIN_COSINE, PROMPTS, TELLING, TEXTS, eos_tokenizer, graph_hidden,
                                         max_error_at_real_positions, ours_hidden, transformers_hidden)

# A Llama 3 / Mistral layout at a small width: GQA (4 query heads, 2 key/value heads), a head_dim (32) that is not
# hidden / heads (16), as Mistral-Nemo's 128 is not 5120 / 32.
SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=5e5, rms_norm_eps=1e-5)
# What each checkpoint adds: Llama a bias on every projection, Mistral a window of 4 (e5-mistral's 4096 made small:
# rows of 13 to 300 tokens, and the served texts with their prompt, run far past it)
CHANGES = {"llama": dict(attention_bias=True, mlp_bias=True), "mistral": dict(sliding_window=4)}
GRAPHS = ("model.onnx", "model.optimized.onnx", "model.sparse.onnx")


def reference_model(model_type: str, seed: int = 0, **changes):
    from transformers import LlamaConfig, LlamaModel, MistralConfig, MistralModel

    classes = {"llama": (LlamaConfig, LlamaModel), "mistral": (MistralConfig, MistralModel)}
    config_class, model_class = classes[model_type]
    config = config_class(**{**SHAPE, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(model_class(config), seed=seed)


@dataclass(frozen=True)
class Exported:
    model_type: str
    reference: torch.nn.Module  # transformers' LlamaModel / MistralModel
    loaded: PretrainedModel  # the checkpoint through our loader
    sessions: dict  # graph file -> CPU session of the export
    model: object  # the SentenceTransformer around the reference: lasttoken Pooling, Normalize, prompts
    name: str  # the served model's name
    server: object


@pytest.fixture(scope="module", params=["llama", "mistral"])
def decoder(request, tmp_path_factory, serve_start) -> Exported:
    """One checkpoint of CHANGES[model type] as a decoder embedding model as e5-mistral is built (last-token pooling
    after [EOS], Normalize, a query prompt, a left-padding tokenizer), exported with every graph and served."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from transformers import PreTrainedTokenizerFast

    tokenizer, vocab_size = eos_tokenizer()
    base = tmp_path_factory.mktemp(f"{request.param}-base")
    reference = reference_model(request.param, vocab_size=vocab_size, pad_token_id=0, **CHANGES[request.param])
    reference.save_pretrained(str(base))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]",
                            padding_side="left").save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=256, model_kwargs={"attn_implementation": "eager"})
    model = SentenceTransformer(modules=[transformer, st_models.Pooling(SHAPE["hidden_size"], "lasttoken"),
                                         st_models.Normalize()], prompts=PROMPTS, device="cpu")
    name = f"{request.param}-embedding"
    export, server = export_and_serve(model, tmp_path_factory, serve_start, name, graphs="fp32,optimized,long")
    sessions = {graph: ort.InferenceSession(str(export / graph), providers=["CPUExecutionProvider"])
                for graph in GRAPHS}
    return Exported(request.param, reference, load_pretrained(base), sessions, model, name, server)


def feeds_of(config, lengths: list[int], kind: MaskKind = MaskKind.CAUSAL, *, seed: int = 0, left_pad: bool = False):
    return make_feeds(config, lengths, MaskSpec(kind), seed=seed, left_pad=left_pad)


def error_against(reference, encoder, feeds: dict, kind: MaskKind | None = None) -> float:
    """Our encoder's (with mask `kind`, default the feeds') worst error against `reference` at real positions."""
    expected = transformers_hidden(reference, feeds)
    return max_error_at_real_positions(ours_hidden(encoder, feeds, kind), expected, feeds["attention_mask"])


def with_config_json(directory, **changes) -> None:
    """config.json of a saved checkpoint with `changes` (None: the key removed)."""
    settings = json.loads((directory / "config.json").read_text())
    settings.update(changes)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))


# --- config.json -> the encoder's parts -----------------------------------------------------------------------

def test_a_llama_config_reads_gqa_its_head_dim_rms_norms_swiglu_its_biases_and_its_causal_mask(decoder):
    c = decoder.loaded.config
    assert (c.n_heads, c.kv_heads, c.head_dim, c.norm, c.ffn, c.activation, c.positional, c.rope_theta) == \
        (4, 2, 32, "rms", "gated", "silu", "rotary", 5e5)
    assert (c.natural_mask, c.qk_norm, c.linear_bias, c.has_qkv_bias) == \
        ("causal", False, *((True, True) if decoder.model_type == "llama" else (False, False)))


def test_mistrals_sliding_window_is_every_layer_local_one_short_of_it(decoder):
    expected = ((0, 1), 3) if decoder.model_type == "mistral" else ((), 0)  # i − j < 4 on top of the causal mask
    assert (decoder.loaded.config.local_layers, decoder.loaded.config.local_window) == expected


def test_a_mistral_without_a_window_has_no_local_layer(tmp_path):
    reference_model("mistral", sliding_window=None).save_pretrained(str(tmp_path))
    assert load_pretrained(tmp_path).config.local_layers == ()


@pytest.mark.parametrize("model_type,field,value,named", [
    ("llama", "attention_bias", True, "attention_bias=True with mlp_bias=False"),
    ("llama", "mlp_bias", True, "attention_bias=False with mlp_bias=True"),
    ("llama", "rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5},
     "rope_type 'llama3' needs numeric low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling and rope_parameters disagree"),
    ("llama", "rope_parameters", {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'longrope'"),
    ("mistral", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'yarn'"),
    ("llama", "hidden_act", "gelu", "hidden_act 'gelu'"),
    ("mistral", "is_causal", False, "is_causal=false"),
])
def test_what_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, model_type, field, value, named):
    reference_model(model_type).save_pretrained(str(tmp_path))
    with_config_json(tmp_path, **{field: value})
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


# --- parity with transformers, every graph ------------------------------------------------------------------

@pytest.mark.parametrize("lengths,left_pad", [([1], False), ([13], False), ([300], False), ([13, 1, 40], False),
                                              ([200, 57, 0], False), ([40, 13, 1], True)], ids=str)
def test_hidden_states_match_transformers_on_every_graph(decoder, lengths, left_pad):
    """Rows of 1 to 300 tokens (Mistral's window is 4), right- and left-padded (decoder embedders' tokenizers pad
    left), on the dense graphs and on the sparse one (Mistral's local layers banded, Llama's in tiles)."""
    feeds = feeds_of(decoder.loaded.config, lengths, seed=len(lengths), left_pad=left_pad)
    expected = transformers_hidden(decoder.reference, feeds)
    ours = ours_hidden(decoder.loaded.encoder, feeds)
    assert max_error_at_real_positions(ours, expected, feeds["attention_mask"]) <= ATOL
    for name, session in decoder.sessions.items():
        error = max_error_at_real_positions(graph_hidden(session, feeds), expected, feeds["attention_mask"])
        assert error <= ATOL, f"{name}: {error}"


# --- controls: the parts the parity depends on ---------------------------------------------------------------

def test_a_bidirectional_mask_is_not_what_llama_and_mistral_compute(decoder):
    feeds = feeds_of(decoder.loaded.config, [40, 13])
    assert error_against(decoder.reference, decoder.loaded.encoder, feeds, MaskKind.BIDIRECTIONAL) > TELLING


@pytest.mark.parametrize("window", [None, 4, 5], ids=["no window", "one wider", "two wider"])
def test_mistral_matches_only_with_its_window_exactly(window):
    """The same weights with Mistral's window left out, or one or two keys wider (i − j <= 4, 5 instead of
    transformers' i − j < 4), no longer match: the window and its exclusive bound are what the parity rests on."""
    reference = reference_model("mistral", **CHANGES["mistral"])
    config = llama_config(reference.config.to_dict(), "d", {})
    ours, *_ = map_names(reference.state_dict(), LLAMA_FAMILY)
    right = Encoder(config).eval()
    right.load_state_dict(ours)
    wrong = Encoder(config.replace(local_layers=(), local_window=0) if window is None
                    else config.replace(local_window=window)).eval()
    wrong.load_state_dict(ours)
    feeds = feeds_of(config, [40, 13])
    assert error_against(reference, right, feeds) <= ATOL
    assert error_against(reference, wrong, feeds) > TELLING


# Llama 3.1's rotary scaling at a small original context (64): with θ 5e5 and head_dim 32 the wavelengths run from
# 6 to ~10^6, so some frequencies are kept (< 16), some interpolated (16..64) and the rest divided by the factor
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 5e5}


def test_llama_3_1s_rotary_scaling_equals_transformers_and_matters(tmp_path):
    """Llama 3.1 / 3.2 checkpoints (and the retrievers built on them) carry rope_type llama3: our export's graph and
    our encoder equal LlamaModel's; the same weights without the scaling do not."""
    reference = reference_model("llama", rope_parameters=LLAMA3_ROPE)
    reference.save_pretrained(str(tmp_path / "checkpoint"))
    loaded = load_pretrained(tmp_path / "checkpoint")
    assert loaded.config.rope_llama3 == (8.0, 1.0, 4.0, 64.0)
    feeds = feeds_of(loaded.config, [300, 40])
    assert error_against(reference, loaded.encoder, feeds) <= ATOL
    assert export_main(["--from-pretrained", str(tmp_path / "checkpoint"), "--out-dir", str(tmp_path / "out"),
                        "--name", "l3", "--graphs", "fp32", "--quiet"]) == 0
    session = ort.InferenceSession(str(tmp_path / "out" / "l3" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert max_error_at_real_positions(graph_hidden(session, feeds), transformers_hidden(reference, feeds),
                                       feeds["attention_mask"]) <= ATOL
    unscaled = Encoder(loaded.config.replace(rope_llama3=())).eval()
    unscaled.load_state_dict(loaded.encoder.state_dict())
    assert error_against(reference, unscaled, feeds) > TELLING


# --- bidirectional Llama (NVIDIA's LlamaBidirectionalModel) -------------------------------------------------------

@pytest.mark.parametrize("marker", [dict(model_type="llama_bidirec", architectures=["LlamaBidirectionalModel"]),
                                    dict(is_causal=False)], ids=["llama_bidirec", "is_causal false"])
def test_a_bidirectional_llama_equals_the_bidirectional_reference_not_the_causal_one(tmp_path, marker):
    """A checkpoint of NVIDIA's LlamaBidirectionalConfig (model_type llama_bidirec) or a Llama config.json with
    is_causal false (transformers 5 then masks bidirectionally) is bidirectional by nature; its hidden states are
    the bidirectional reference's, and move by more than a telling margin from those of the same weights causal."""
    causal = reference_model("llama")
    bidirectional = reference_model("llama", is_causal=False)
    causal.save_pretrained(str(tmp_path))
    with_config_json(tmp_path, **{"is_causal": None, **marker})
    loaded = load_pretrained(tmp_path)
    assert loaded.config.natural_mask == "bidirectional"
    feeds = feeds_of(loaded.config, [40, 13, 1], MaskKind.BIDIRECTIONAL)
    assert error_against(bidirectional, loaded.encoder, feeds) <= ATOL
    assert error_against(causal, loaded.encoder, feeds) > TELLING


def test_a_bidirectional_llama_export_declares_its_mask_and_its_graph_equals_the_bidirectional_reference(tmp_path):
    """What the server reads (metadata.json's config: natural_mask, the mask a request naming none gets) and
    computes (the fp32 graph) for a llama_bidirec checkpoint."""
    reference_model("llama").save_pretrained(str(tmp_path / "checkpoint"))
    with_config_json(tmp_path / "checkpoint", model_type="llama_bidirec", architectures=["LlamaBidirectionalModel"])
    assert export_main(["--from-pretrained", str(tmp_path / "checkpoint"), "--out-dir", str(tmp_path / "out"),
                        "--name", "nv", "--graphs", "fp32", "--quiet"]) == 0
    metadata = read_metadata(tmp_path / "out" / "nv")
    assert (metadata.config.natural_mask, metadata.config.source["model_type"]) == ("bidirectional", "llama_bidirec")
    session = ort.InferenceSession(str(tmp_path / "out" / "nv" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = feeds_of(metadata.config, [40, 13, 1], MaskKind.BIDIRECTIONAL)
    expected = transformers_hidden(reference_model("llama", is_causal=False), feeds)
    assert max_error_at_real_positions(graph_hidden(session, feeds), expected, feeds["attention_mask"]) <= ATOL


def test_a_plain_llama_is_causal(tmp_path):
    reference_model("llama").save_pretrained(str(tmp_path))
    assert load_pretrained(tmp_path).config.natural_mask == "causal"


# --- a 7B-class checkpoint: refused before its weights are read ---------------------------------------------------

# e5-mistral-7b-instruct's config.json (Mistral-7B-v0.1): 7.1 G parameters, 26.5 GiB in float32, 14 GB in fp16
E5_MISTRAL = dict(architectures=["MistralModel"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                  max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                  hidden_act="silu", torch_dtype="float16")


@pytest.fixture
def big_checkpoint(tmp_path):
    """A directory with e5-mistral's config.json and no weights at all."""
    directory = tmp_path / "e5-mistral"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(E5_MISTRAL))
    return directory


def test_a_7b_checkpoint_the_host_cannot_hold_is_refused_before_its_weights_naming_the_need(
        big_checkpoint, tmp_path, capsys, monkeypatch):
    import export.exporter

    monkeypatch.setattr(export.exporter, "available_memory", lambda: 24 << 30)  # a 24 GiB host
    out = tmp_path / "out"
    assert export_main(["--from-pretrained", str(big_checkpoint), "--out-dir", str(out), "--name", "e5",
                        "--quiet"]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert "exporting e5 needs about 132.4 GiB" in error and "26.49 GiB of float32 weights" in error
    assert "24.0 GiB available" in error
    assert not out.exists() or not any(out.iterdir())


def test_on_a_host_that_holds_it_the_same_directory_gets_as_far_as_its_missing_weights(
        big_checkpoint, tmp_path, capsys, monkeypatch):
    """The control: with memory enough the check passes and the loader goes on to read the weights, which this
    directory lacks; so the refusal above came before any weight was looked for."""
    import export.exporter

    monkeypatch.setattr(export.exporter, "available_memory", lambda: 1 << 40)
    assert export_main(["--from-pretrained", str(big_checkpoint), "--out-dir", str(tmp_path / "out"),
                        "--quiet"]) == EXIT_BAD_INPUT
    assert "has none of model.safetensors" in capsys.readouterr().err


# --- the Mistral- and Llama-shaped embedding models, served ----------------------------------------------------

def test_the_export_declares_last_token_pooling_normalisation_the_prompts_and_the_causal_mask(decoder):
    with EncoderClient(decoder.server.target, timeout=60) as client:
        info = client.model_info()
    assert (info.default_pooling, info.default_normalize, info.natural_mask) == ("last", True, "causal")
    assert dict(info.prompts) == decoder.model.prompts


def test_served_embeddings_with_a_prompt_equal_sentence_transformers(decoder):
    expected = decoder.model.encode(TEXTS, prompt_name="query", batch_size=len(TEXTS), convert_to_numpy=True)
    with EncoderClient(decoder.server.target, timeout=120) as client:
        out = client.embed(TEXTS, prompt_name="query")
    assert cosines(out.embeddings, expected).min() >= MIN_COSINE


def test_openai_embeddings_equal_sentence_transformers(decoder):
    expected = decoder.model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    assert cosines(openai_embeddings(decoder.server, decoder.name, TEXTS), expected).min() >= MIN_COSINE
