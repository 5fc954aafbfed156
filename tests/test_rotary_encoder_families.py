"""Rotary BERTs on the one encoder: NomicBERT (model/hf_nomic_bert.py) and GTE's "new" architecture
(model/hf_gte.py), against transformers' own NomicBertModel / GteModel (eager, fp32, random weights redrawn at a
telling scale) through every graph the export writes, the long-input (sparse) one included; the hub's
remote-code layouts of both (fused q/k/v) loaded to the same encoder; linear rotary scaling and its control;
what they do not compute refused by name; and a nomic-embed-shaped and a gte-shaped sentence-transformers model
served end to end, equal to `SentenceTransformer.encode`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from client import EncoderClient
from export.cases import MaskSpec, make_feeds
from export.cli import main as export_main
from model.checkpoint import CheckpointError
from model.encoder import Encoder
from model.hf_pretrained import family_for, load_pretrained, map_names
from model.mask_kinds import MaskKind
from tests.hf_references import WORDS, cosines, export_and_serve, openai_embeddings, redraw, word_tokenizer

ATOL = 1e-4  # hidden states at real positions, max abs
TELLING = 1e-2  # a missing part moves the hidden states by more than this at this scale
MIN_COSINE = 0.99999
SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
# nomic-embed-text's layout (θ 1000, two token types) at a small width; GTE's (θ 160k, one token type) with
# transformers' linear rotary scaling, so every graph computes the scaled positions.
SHAPES = {"nomic_bert": SHAPE,
          "gte": dict(SHAPE, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 160_000.0})}
# the sparse graph is the long-input path: what a long row runs on when the dense T x T does not fit the budget
GRAPHS = ("model.onnx", "model.optimized.onnx", "model.sparse.onnx")


def reference_model(model_type: str, seed: int = 0, **changes):
    from transformers import GteConfig, GteModel, NomicBertConfig, NomicBertModel

    config_class, model_class = {"nomic_bert": (NomicBertConfig, NomicBertModel),
                                 "gte": (GteConfig, GteModel)}[model_type]
    config = config_class(**{**SHAPES[model_type], **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(model_class(config), seed=seed)


@pytest.fixture(scope="module", params=["nomic_bert", "gte"])
def rotary(request, tmp_path_factory):
    """(model type, transformers reference, our loaded model, {graph file: CPU session}) of one exported checkpoint."""
    reference = reference_model(request.param)
    checkpoint = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp(f"{request.param}-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "r",
                        "--graphs", "fp32,optimized,long", "--quiet"]) == 0
    sessions = {name: ort.InferenceSession(str(out / "r" / name), providers=["CPUExecutionProvider"])
                for name in GRAPHS}
    return request.param, reference, load_pretrained(checkpoint), sessions


def feeds_for(config, lengths: list[int], seed: int = 0) -> dict:
    return make_feeds(config, lengths, MaskSpec(MaskKind.BIDIRECTIONAL), seed=seed)


def transformers_hidden(reference, feeds: dict) -> np.ndarray:
    types = feeds.get("token_type_ids")
    with torch.no_grad():
        return reference(input_ids=torch.from_numpy(feeds["input_ids"]),
                         attention_mask=torch.from_numpy(feeds["attention_mask"]),
                         token_type_ids=None if types is None else torch.from_numpy(types)).last_hidden_state.numpy()


def graph_hidden(session, feeds: dict) -> np.ndarray:
    names = {i.name for i in session.get_inputs()}
    return session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in names})[0]


def ours_hidden(encoder, feeds: dict) -> np.ndarray:
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    with torch.no_grad():
        return encoder(t["input_ids"], t["attention_mask"], t["mask_kind"], t["mask_causal"], t["mask_window"],
                       t["mask_step"], t["custom_mask"], t.get("token_type_ids"))[0].numpy()


def max_error_at_real_positions(actual, expected, attention_mask) -> float:
    valid = attention_mask.astype(bool)
    return float(np.abs(actual[valid] - expected[valid]).max())


def loaded_from(state: dict, settings: dict, directory: Path):
    """Our model loaded from a checkpoint directory of `state` (safetensors) and config.json `settings`."""
    directory.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(settings))
    return load_pretrained(directory)


def error_against(reference, encoder, lengths=(40, 13)) -> float:
    feeds = feeds_for(encoder.config, list(lengths), seed=5)
    return max_error_at_real_positions(ours_hidden(encoder, feeds), transformers_hidden(reference, feeds),
                                       feeds["attention_mask"])


# --- config.json -> the encoder's parts -----------------------------------------------------------------------

def test_the_config_reads_post_norm_rotary_a_gated_mlp_and_each_familys_biases_types_and_scaling(rotary):
    model_type, _, loaded, _ = rotary
    c = loaded.config
    assert (c.norm_placement, c.positional, c.ffn, c.embedding_layer_norm, c.head_dim) == \
        ("post", "rotary", "gated", True, 8)
    if model_type == "nomic_bert":
        assert (c.activation, c.linear_bias, c.has_ffn_in_bias, c.norm_bias, c.type_vocab_size) == \
            ("silu", False, False, True, 2)
        assert (c.rope_theta, c.rope_scale) == (1000.0, 1.0)
    else:  # GTE: q/k/v/o and down_proj biased, gate/up not; the exact GELU; one token type; linear scaling
        assert (c.activation, c.linear_bias, c.has_qkv_bias, c.has_ffn_in_bias, c.type_vocab_size) == \
            ("gelu", True, True, False, 1)
        assert (c.rope_theta, c.rope_scale) == (160_000.0, 4.0)


# --- parity with transformers, every graph ------------------------------------------------------------------

@pytest.mark.parametrize("lengths", [[1], [13], [300], [13, 1, 40], [257, 57, 0]], ids=str)
def test_hidden_states_match_transformers_on_every_graph(rotary, lengths):
    """Random token types too (nomic's 2 types; GTE's 1), padded batches, and a 300-token row on the long path."""
    _, reference, loaded, sessions = rotary
    feeds = feeds_for(loaded.config, lengths, seed=len(lengths))
    expected = transformers_hidden(reference, feeds)
    assert max_error_at_real_positions(ours_hidden(loaded.encoder, feeds), expected, feeds["attention_mask"]) <= ATOL
    for name, session in sessions.items():
        error = max_error_at_real_positions(graph_hidden(session, feeds), expected, feeds["attention_mask"])
        assert error <= ATOL, f"{name}: {error}"


def test_a_gte_without_token_types_has_none(tmp_path):
    """gte-base-en-v1.5 has type_vocab_size 0: no token-type table, no token_type_ids input."""
    reference = reference_model("gte", type_vocab_size=0)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert loaded.config.type_vocab_size == 0
    assert error_against(reference, loaded.encoder) <= ATOL


# --- controls: the parts the parity depends on ---------------------------------------------------------------

def test_without_its_linear_rotary_scaling_gte_would_not_match():
    reference = reference_model("gte")
    ours, *_ = map_names(reference.state_dict(), family_for("gte"))
    config = family_for("gte").config(reference.config.to_dict(), "g", {})
    scaled, unscaled = Encoder(config).eval(), Encoder(config.replace(rope_scale=1.0)).eval()
    scaled.load_state_dict(ours)
    unscaled.load_state_dict(ours)
    assert error_against(reference, scaled, (300,)) <= ATOL
    assert error_against(reference, unscaled, (300,)) > TELLING


def test_token_types_are_added_as_nomic_adds_them(tmp_path):
    """Every row of type 1 against transformers given the same types (and not the all-zero default)."""
    reference = reference_model("nomic_bert")
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    feeds = feeds_for(loaded.config, [40, 13])
    feeds["token_type_ids"] = np.ones_like(feeds["token_type_ids"])
    expected = transformers_hidden(reference, feeds)
    ours = ours_hidden(loaded.encoder, feeds)
    assert max_error_at_real_positions(ours, expected, feeds["attention_mask"]) <= ATOL
    zeros = dict(feeds, token_type_ids=np.zeros_like(feeds["token_type_ids"]))
    assert max_error_at_real_positions(ours_hidden(loaded.encoder, zeros), expected, feeds["attention_mask"]) > TELLING


# --- the hub's remote-code layouts ------------------------------------------------------------------------------

def fused(state: dict, layer: int, parts: tuple[str, ...], suffix: str = "weight") -> torch.Tensor:
    return torch.cat([state.pop(f"layers.{layer}.{p}.{suffix}") for p in parts])


def nomic_hub_checkpoint(reference) -> tuple[dict, dict]:
    """(state, config.json) of `reference` as nomic-ai's remote code saves it: n_embd ... keys, Wqkv, fc11/fc12."""
    state = dict(reference.state_dict())
    hub = {"embeddings.word_embeddings.weight": state.pop("embeddings.word_embeddings.weight"),
           "embeddings.token_type_embeddings.weight": state.pop("embeddings.token_type_embeddings.weight"),
           "emb_ln.weight": state.pop("embeddings.LayerNorm.weight"),
           "emb_ln.bias": state.pop("embeddings.LayerNorm.bias")}
    renames = {"self_attn.o_proj": "attn.out_proj", "mlp.up_proj": "mlp.fc11", "mlp.gate_proj": "mlp.fc12",
               "mlp.down_proj": "mlp.fc2", "post_attention_layernorm": "norm1", "post_mlp_layernorm": "norm2"}
    c = reference.config
    for i in range(c.num_hidden_layers):
        hub[f"encoder.layers.{i}.attn.Wqkv.weight"] = fused(state, i, ("self_attn.q_proj", "self_attn.k_proj",
                                                                        "self_attn.v_proj"))
        for key in [k for k in state if k.startswith(f"layers.{i}.")]:
            module, suffix = key[len(f"layers.{i}."):].rsplit(".", 1)
            hub[f"encoder.layers.{i}.{renames[module]}.{suffix}"] = state.pop(key)
    assert not state
    settings = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "n_embd": c.hidden_size,
                "n_head": c.num_attention_heads, "n_layer": c.num_hidden_layers, "n_inner": c.intermediate_size,
                "n_positions": 8192, "vocab_size": c.vocab_size, "type_vocab_size": 2, "layer_norm_epsilon": 1e-12,
                "activation_function": "swiglu", "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
                "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
                "prenorm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
                "use_rms_norm": False, "parallel_block": False, "causal": False}
    return hub, settings


def gte_hub_checkpoint(reference) -> tuple[dict, dict]:
    """(state, config.json) of `reference` as Alibaba-NLP/new-impl saves it: model_type "new", fused qkv_proj and
    up_gate_proj."""
    state = dict(reference.state_dict())
    hub = {k: state.pop(k) for k in list(state) if k.startswith("embeddings.")}
    renames = {"self_attn.o_proj": "attention.o_proj", "mlp.down_proj": "mlp.down_proj",
               "post_attention_layernorm": "attn_ln", "post_mlp_layernorm": "mlp_ln"}
    c = reference.config
    for i in range(c.num_hidden_layers):
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        hub[f"encoder.layer.{i}.attention.qkv_proj.weight"] = fused(state, i, qkv)
        hub[f"encoder.layer.{i}.attention.qkv_proj.bias"] = fused(state, i, qkv, "bias")
        hub[f"encoder.layer.{i}.mlp.up_gate_proj.weight"] = fused(state, i, ("mlp.up_proj", "mlp.gate_proj"))
        for key in [k for k in state if k.startswith(f"layers.{i}.")]:
            module, suffix = key[len(f"layers.{i}."):].rsplit(".", 1)
            hub[f"encoder.layer.{i}.{renames[module]}.{suffix}"] = state.pop(key)
    assert not state
    settings = {"model_type": "new", "architectures": ["NewModel"], "hidden_size": c.hidden_size,
                "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
                "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "type_vocab_size": 1,
                "hidden_act": "gelu", "layer_norm_eps": 1e-12, "max_position_embeddings": 8192, "pad_token_id": 1,
                "position_embedding_type": "rope", "rope_theta": 160_000.0,
                "rope_scaling": {"type": "linear", "factor": 4.0}, "layer_norm_type": "layer_norm",
                "logn_attention_scale": False, "logn_attention_clip1": False, "pack_qkv": True}
    return hub, settings


HUB_LAYOUTS = {"nomic_bert": nomic_hub_checkpoint, "gte": gte_hub_checkpoint}


@pytest.mark.parametrize("model_type", HUB_LAYOUTS)
def test_the_hubs_remote_code_layout_loads_to_the_same_encoder(tmp_path, model_type):
    reference = reference_model(model_type)
    loaded = loaded_from(*HUB_LAYOUTS[model_type](reference), tmp_path)
    assert error_against(reference, loaded.encoder, (300, 57)) <= ATOL


# --- refused, by name ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,field,value,named", [
    ("nomic_bert", "num_experts", 8, "MoE variant"),
    ("nomic_bert", "rotary_scaling_factor", 2.0, "rotary_scaling_factor 2.0"),
    ("nomic_bert", "rotary_emb_interleaved", True, "rotary_emb_interleaved True"),
    ("nomic_bert", "rotary_emb_fraction", 0.5, "rotary_emb_fraction 0.5"),
    ("nomic_bert", "prenorm", True, "prenorm True"),
    ("nomic_bert", "hidden_act", "gelu_new", "hidden_act 'gelu_new'"),
    ("nomic_bert", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0},
     "rope_type 'dynamic'"),
    ("nomic_bert", "rope_parameters", {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5"),
    ("gte", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type 'yarn'"),
    ("gte", "rope_parameters", {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}, "rope_type 'longrope'"),
    ("gte", "layer_norm_type", "rms_norm", "layer_norm_type 'rms_norm'"),
    ("gte", "logn_attention_scale", True, "logn_attention_scale True")])
def test_what_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, model_type, field, value, named):
    reference_model(model_type).save_pretrained(str(tmp_path))
    settings = json.loads((tmp_path / "config.json").read_text())
    settings[field] = value
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


def test_gte_base_en_v1_5s_fixed_ntk_equals_transformers_at_theta_times_f_and_a_linear_scale(tmp_path):
    """The hub's rope_scaling {"type": "ntk", "factor": f} (gte-base-en-v1.5: f 2, θ 500k), by the hub's code,
    always takes base θ·f and divides every frequency by f^(2/head_dim): transformers' GteModel with that θ and
    that linear factor is the reference."""
    factor, theta, head_dim = 2.0, 500_000.0, SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    reference = reference_model("gte", rope_parameters={"rope_type": "linear", "factor": factor ** (2 / head_dim),
                                                        "rope_theta": theta * factor})
    state, settings = gte_hub_checkpoint(reference)
    loaded = loaded_from(state, dict(settings, rope_theta=theta, rope_scaling={"type": "ntk", "factor": factor}),
                         tmp_path)
    assert error_against(reference, loaded.encoder, (300, 57)) <= ATOL
    plain = reference_model("gte", rope_parameters={"rope_type": "default", "rope_theta": theta})
    assert error_against(plain, loaded.encoder, (300, 57)) > TELLING  # the scaling is not a no-op here


def test_the_hubs_mixed_ntk_is_refused_naming_it(tmp_path):
    state, settings = gte_hub_checkpoint(reference_model("gte"))
    with pytest.raises(CheckpointError, match="mixed_b 0.5"):
        loaded_from(state, dict(settings, rope_scaling={"type": "ntk", "factor": 2.0, "mixed_b": 0.5}), tmp_path)


# --- a nomic-embed-shaped and a gte-shaped model, served --------------------------------------------------------

NOMIC_PROMPTS = {"query": "search_query: ", "document": "search_document: "}
TEXTS = ["the encoder", "A long document, with punctuation; and UNKNOWN words!",
         " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(250))]


def embedding_model(model_type: str, base: Path, pooling: str, prompts: dict | None = None):
    """A SentenceTransformer: transformers' model (random, redrawn) + `pooling` + Normalize, a word tokenizer."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from transformers import PreTrainedTokenizerFast

    tokenizer, vocab_size = word_tokenizer()
    reference_model(model_type, seed=3, vocab_size=vocab_size, pad_token_id=0).save_pretrained(str(base))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            unk_token="[UNK]", mask_token="[MASK]").save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=512, model_kwargs={"attn_implementation": "eager"})
    return SentenceTransformer(modules=[transformer, st_models.Pooling(SHAPE["hidden_size"], pooling),
                                        st_models.Normalize()], prompts=prompts, device="cpu")


@pytest.fixture(scope="module")
def nomic_embed(tmp_path_factory, serve_start):
    """nomic-embed-text's shape: mean pooling, Normalize, search_query / search_document prompts; its server."""
    model = embedding_model("nomic_bert", tmp_path_factory.mktemp("nomic-base"), "mean", NOMIC_PROMPTS)
    return model, export_and_serve(model, tmp_path_factory, serve_start, "nomic-embed")[1]


@pytest.fixture(scope="module")
def gte_embed(tmp_path_factory, serve_start):
    """gte-base-en-v1.5's / gte-multilingual-base's shape: CLS pooling, Normalize; its server."""
    model = embedding_model("gte", tmp_path_factory.mktemp("gte-base"), "cls")
    return model, export_and_serve(model, tmp_path_factory, serve_start, "gte-embed")[1]


def test_nomic_openai_embeddings_equal_sentence_transformers(nomic_embed):
    model, server = nomic_embed
    expected = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    assert cosines(openai_embeddings(server, "nomic-embed", TEXTS), expected).min() >= MIN_COSINE


@pytest.mark.parametrize("prompt_name", list(NOMIC_PROMPTS))
def test_nomic_embeddings_with_a_prompt_per_request_equal_sentence_transformers(nomic_embed, prompt_name):
    model, server = nomic_embed
    expected = model.encode(TEXTS, prompt_name=prompt_name, batch_size=len(TEXTS), convert_to_numpy=True)
    with EncoderClient(server.target, timeout=120) as client:
        assert dict(client.model_info().prompts) == NOMIC_PROMPTS
        out = client.embed(TEXTS, prompt_name=prompt_name)
    assert cosines(out.embeddings, expected).min() >= MIN_COSINE
    unprompted = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    assert cosines(out.embeddings, unprompted).min() < 0.999  # the prompt is what made them equal


def test_gte_openai_embeddings_equal_sentence_transformers(gte_embed):
    model, server = gte_embed
    expected = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    with EncoderClient(server.target, timeout=60) as client:
        assert client.model_info().default_pooling == "first"  # the CLS token
    assert cosines(openai_embeddings(server, "gte-embed", TEXTS), expected).min() >= MIN_COSINE


# --- the sequence classifier ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["nomic_bert", "gte"])
def test_a_sequence_classifier_is_loaded_with_its_head_and_matches_transformers_logits(tmp_path, model_type):
    from transformers import GteForSequenceClassification, NomicBertForSequenceClassification

    model_class = {"nomic_bert": NomicBertForSequenceClassification, "gte": GteForSequenceClassification}[model_type]
    config = reference_model(model_type).config
    config.num_labels = 3
    torch.manual_seed(4)
    classifier = redraw(model_class(config), seed=4)
    classifier.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert (loaded.config.head, loaded.config.num_labels, loaded.config.head_pooling) == ("classification", 3, "cls")
    feeds = feeds_for(loaded.config, [40, 13, 1], seed=6)
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    with torch.no_grad():
        expected = classifier(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                              token_type_ids=t.get("token_type_ids")).logits.numpy()
        logits = loaded.encoder(t["input_ids"], t["attention_mask"], t["mask_kind"], t["mask_causal"],
                                t["mask_window"], t["mask_step"], t["custom_mask"], t.get("token_type_ids"))[2].numpy()
    assert float(np.abs(logits - expected).max()) <= ATOL
