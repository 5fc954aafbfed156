"""Decoder embedders on the one encoder (model/hf_qwen.py): Qwen3 and Qwen2 as config choices (RMSNorm,
grouped-query attention, SwiGLU, Qwen3's own head_dim and q/k norms, Qwen2's q/k/v-only bias, causal
attention as the model's natural mask), against transformers' Qwen3Model / Qwen2Model (eager, fp32,
random weights redrawn at a telling scale) through every graph the export writes; and a
Qwen3-Embedding-shaped sentence-transformers model (last-token pooling, Normalize, a query prompt, a
left-padding tokenizer) served end to end, equal to `SentenceTransformer.encode`."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from client import EncoderClient
from export.cases import MaskSpec, make_feeds
from export.cli import main as export_main
from model.checkpoint import CheckpointError
from model.encoder import Encoder
from model.hf_pretrained import load_pretrained
from model.mask_kinds import MaskKind
from tests.hf_references import WORDS, cosines, export_and_serve, openai_embeddings, redraw

ATOL = 1e-4  # hidden states at real positions, max abs
TELLING = 1e-2  # a wrong mask or a missing part moves the hidden states by more than this at this scale
MIN_COSINE = 0.99999
# Qwen3-0.6B's layout at a small width: GQA (4 query heads, 2 key/value heads) and a head_dim (32) that is not
# hidden / heads (16), as Qwen3-0.6B's 128 is not 1024 / 16.
QWEN3 = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6)
QWEN2 = {k: v for k, v in QWEN3.items() if k != "head_dim"}
# the sparse graph computes causal rows too (its layers in query tiles): what a 32k-token row runs on when the
# dense graph's T x T does not fit the server's budget (serve/core/attention_budget.py)
GRAPHS = ("model.onnx", "model.optimized.onnx", "model.sparse.onnx")


def reference_model(model_type: str, seed: int = 0, **changes):
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model

    config_class, model_class, shape = {"qwen3": (Qwen3Config, Qwen3Model, QWEN3),
                                        "qwen2": (Qwen2Config, Qwen2Model, QWEN2)}[model_type]
    config = config_class(**{**shape, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(model_class(config), seed=seed)


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def qwen(request, tmp_path_factory):
    """(model type, transformers reference, our loaded model, {graph file: CPU session}) of one exported checkpoint."""
    reference = reference_model(request.param)
    checkpoint = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp(f"{request.param}-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "q",
                        "--graphs", "fp32,optimized,long", "--quiet"]) == 0
    sessions = {name: ort.InferenceSession(str(out / "q" / name), providers=["CPUExecutionProvider"])
                for name in GRAPHS}
    return request.param, reference, load_pretrained(checkpoint), sessions


def causal_feeds(config, lengths: list[int], seed: int = 0) -> dict:
    return make_feeds(config, lengths, MaskSpec(MaskKind.CAUSAL), seed=seed)


def transformers_hidden(reference, feeds: dict) -> np.ndarray:
    with torch.no_grad():
        return reference(input_ids=torch.from_numpy(feeds["input_ids"]),
                         attention_mask=torch.from_numpy(feeds["attention_mask"])).last_hidden_state.numpy()


def graph_hidden(session, feeds: dict) -> np.ndarray:
    names = {i.name for i in session.get_inputs()}
    return session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in names})[0]


def ours_hidden(encoder, feeds: dict, kind: MaskKind | None = None) -> np.ndarray:
    feeds = dict(feeds)
    if kind is not None:
        feeds["mask_kind"] = np.full_like(feeds["mask_kind"], int(kind))
    with torch.no_grad():
        t = {k: torch.from_numpy(v) for k, v in feeds.items()}
        return encoder(t["input_ids"], t["attention_mask"], t["mask_kind"], t["mask_causal"], t["mask_window"],
                       t["mask_step"], t.get("custom_mask"))[0].numpy()


def max_error_at_real_positions(actual, expected, attention_mask) -> float:
    valid = attention_mask.astype(bool)
    return float(np.abs(actual[valid] - expected[valid]).max())


# --- config.json -> the encoder's parts -----------------------------------------------------------------------

def test_a_qwen3_config_reads_gqa_its_head_dim_rms_norms_swiglu_and_its_causal_mask(qwen):
    model_type, _, loaded, _ = qwen
    c = loaded.config
    assert (c.n_heads, c.kv_heads, c.norm, c.ffn, c.activation, c.natural_mask, c.positional) == \
        (4, 2, "rms", "gated", "silu", "causal", "rotary")
    assert (c.head_dim, c.qk_norm, c.has_qkv_bias, c.linear_bias) == \
        ((32, True, False, False) if model_type == "qwen3" else (16, False, True, False))


@pytest.mark.parametrize("field,value,named", [
    ("use_sliding_window", True, "sliding-window"), ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'yarn'"),
    ("attention_bias", True, "attention_bias")])
def test_what_the_encoder_does_not_compute_is_refused_naming_it(tmp_path, field, value, named):
    reference = reference_model("qwen3")
    reference.save_pretrained(str(tmp_path))
    settings = json.loads((tmp_path / "config.json").read_text())
    settings[field] = value
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=named):
        load_pretrained(tmp_path)


# --- parity with transformers, every graph ------------------------------------------------------------------

@pytest.mark.parametrize("lengths", [[1], [13], [512], [13, 1, 40], [200, 57, 0]], ids=str)
def test_hidden_states_match_transformers_on_every_graph(qwen, lengths):
    _, reference, loaded, sessions = qwen
    feeds = causal_feeds(loaded.config, lengths, seed=len(lengths))
    expected = transformers_hidden(reference, feeds)
    assert max_error_at_real_positions(ours_hidden(loaded.encoder, feeds), expected, feeds["attention_mask"]) <= ATOL
    for name, session in sessions.items():
        error = max_error_at_real_positions(graph_hidden(session, feeds), expected, feeds["attention_mask"])
        assert error <= ATOL, f"{name}: {error}"


# --- controls: the parts the parity depends on ---------------------------------------------------------------

def test_a_bidirectional_mask_is_not_what_qwen_computes(qwen):
    _, reference, loaded, _ = qwen
    feeds = causal_feeds(loaded.config, [40, 13])
    expected = transformers_hidden(reference, feeds)
    wrong = ours_hidden(loaded.encoder, feeds, MaskKind.BIDIRECTIONAL)
    assert max_error_at_real_positions(wrong, expected, feeds["attention_mask"]) > TELLING


def test_without_its_q_k_norms_qwen3_would_not_match():
    from model.hf_pretrained import map_names
    from model.hf_qwen import FAMILY, qwen_config

    reference = reference_model("qwen3")
    config = qwen_config(reference.config.to_dict(), "q", {})
    bare, full = Encoder(config.replace(qk_norm=False)).eval(), Encoder(config).eval()
    ours, *_ = map_names(reference.state_dict(), FAMILY)
    full.load_state_dict(ours)
    bare.load_state_dict({k: v for k, v in ours.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))})
    feeds = causal_feeds(config, [40])
    expected = transformers_hidden(reference, feeds)
    assert max_error_at_real_positions(ours_hidden(full, feeds), expected, feeds["attention_mask"]) <= ATOL
    assert max_error_at_real_positions(ours_hidden(bare, feeds), expected, feeds["attention_mask"]) > TELLING


# --- a Qwen3-Embedding-shaped model, served -------------------------------------------------------------------

PROMPTS = {"query": "Instruct: find the document for this query\nQuery: "}
TEXTS = ["the encoder", "A long document, with punctuation; and UNKNOWN words!",
         " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(70))]


def eos_tokenizer():
    """A word-level tokenizer ending each text with [EOS] (Qwen3-Embedding's tokenizer ends it with
    <|endoftext|>, the token whose hidden state it pools), and its vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tokens = ["[PAD]", "[EOS]", "[UNK]", *WORDS, "instruct", "find", "query"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 1)])
    return tokenizer, len(vocab)


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory, serve_start):
    """(the SentenceTransformer: Qwen3Model + lasttoken Pooling + Normalize, prompts; its server)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from transformers import PreTrainedTokenizerFast

    tokenizer, vocab_size = eos_tokenizer()
    base = tmp_path_factory.mktemp("qwen3-base")
    reference_model("qwen3", seed=3, vocab_size=vocab_size, pad_token_id=0).save_pretrained(str(base))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]",
                            padding_side="left").save_pretrained(str(base))  # as Qwen3-Embedding pads: left
    transformer = st_models.Transformer(str(base), max_seq_length=256, model_kwargs={"attn_implementation": "eager"})
    model = SentenceTransformer(modules=[transformer, st_models.Pooling(QWEN3["hidden_size"], "lasttoken"),
                                         st_models.Normalize()], prompts=PROMPTS, device="cpu")
    return model, export_and_serve(model, tmp_path_factory, serve_start, "qwen3-embedding")[1]


def test_the_export_declares_last_token_pooling_normalisation_the_prompts_and_the_causal_mask(qwen3_embedding):
    model, server = qwen3_embedding
    with EncoderClient(server.target, timeout=60) as client:
        info = client.model_info()
    assert (info.default_pooling, info.default_normalize, info.natural_mask) == ("last", True, "causal")
    assert dict(info.prompts) == model.prompts and info.prompts["query"] == PROMPTS["query"]


def test_served_embeddings_with_a_prompt_equal_sentence_transformers(qwen3_embedding):
    model, server = qwen3_embedding
    expected = model.encode(TEXTS, prompt_name="query", batch_size=len(TEXTS), convert_to_numpy=True)
    with EncoderClient(server.target, timeout=120) as client:
        out = client.embed(TEXTS, prompt_name="query")
    assert cosines(out.embeddings, expected).min() >= MIN_COSINE


def test_openai_embeddings_equal_sentence_transformers(qwen3_embedding):
    model, server = qwen3_embedding
    expected = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    assert cosines(openai_embeddings(server, "qwen3-embedding", TEXTS), expected).min() >= MIN_COSINE


def test_a_request_may_still_choose_a_bidirectional_mask(qwen3_embedding):
    model, server = qwen3_embedding
    expected = model.encode(TEXTS[:1], convert_to_numpy=True)
    with EncoderClient(server.target, timeout=60) as client:
        natural = client.embed(TEXTS[:1])
        bidirectional = client.embed(TEXTS[:1], mask="bidirectional")
    assert cosines(natural.embeddings, expected).min() >= MIN_COSINE
    assert cosines(bidirectional.embeddings, expected).min() < 0.999


# --- Gemma3 text (model/hf_gemma3.py): EmbeddingGemma's layout, bidirectional ------------------------------------

# EmbeddingGemma-300m's parts at a small width: Gemma RMSNorm (1 + w), sandwich norms, embeddings times
# sqrt(hidden), GQA with a head_dim of its own, q/k norms, query_pre_attn_scalar, tanh-GELU gates, sliding
# layers around full ones (θ 10k / 1M), bidirectional attention with sliding_window 16 (|i - j| <= 8).
GEMMA3 = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              use_bidirectional_attention=True, max_position_embeddings=1024)
GEMMA3_GRAPHS = ("model.onnx", "model.optimized.onnx", "model.sparse.onnx")


def gemma3_reference(seed: int = 0, **changes):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(**{**GEMMA3, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(Gemma3TextModel(config), seed=seed)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers Gemma3TextModel, our loaded model, {graph file: CPU session})."""
    reference = gemma3_reference()
    checkpoint = tmp_path_factory.mktemp("gemma3")
    reference.save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp("gemma3-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "g",
                        "--graphs", "fp32,optimized,long", "--quiet"]) == 0
    sessions = {name: ort.InferenceSession(str(out / "g" / name), providers=["CPUExecutionProvider"])
                for name in GEMMA3_GRAPHS}
    return reference, load_pretrained(checkpoint), sessions


def test_a_gemma3_config_reads_its_norms_scales_plan_and_bidirectional_mask(gemma3):
    _, loaded, _ = gemma3
    c = loaded.config
    assert (c.norm, c.norm_placement, c.embedding_scale, c.scaling, c.temperature) == \
        ("rms_gemma", "sandwich", 8.0, "temperature", 24 ** 0.5)
    assert (c.head_dim, c.kv_heads, c.qk_norm, c.activation, c.natural_mask) == (32, 2, True, "gelu_tanh", "bidirectional")
    assert (c.local_layers, c.local_window, c.rope_theta, c.rope_theta_local) == ((0, 1, 3), 8, 1e6, 1e4)


@pytest.mark.parametrize("lengths", [[1], [9], [17], [512], [200, 57, 0]], ids=str)
def test_gemma3_hidden_states_match_transformers_on_every_graph(gemma3, lengths):
    """Lengths around the sliding window (|i - j| <= 8) and far past it, on the dense graphs and on the sparse
    one (sliding layers banded, the full layer in the fused kernel)."""
    reference, loaded, sessions = gemma3
    feeds = make_feeds(loaded.config, lengths, MaskSpec(MaskKind.BIDIRECTIONAL), seed=len(lengths))
    expected = transformers_hidden(reference, feeds)
    assert max_error_at_real_positions(ours_hidden(loaded.encoder, feeds), expected, feeds["attention_mask"]) <= ATOL
    for name, session in sessions.items():
        error = max_error_at_real_positions(graph_hidden(session, feeds), expected, feeds["attention_mask"])
        assert error <= ATOL, f"{name}: {error}"


def test_a_causal_mask_is_not_what_embedding_gemma_computes(gemma3):
    reference, loaded, _ = gemma3
    feeds = make_feeds(loaded.config, [40, 13], MaskSpec(MaskKind.BIDIRECTIONAL))
    wrong = ours_hidden(loaded.encoder, feeds, MaskKind.CAUSAL)
    assert max_error_at_real_positions(wrong, transformers_hidden(reference, feeds), feeds["attention_mask"]) > TELLING


def test_a_causal_gemma3_is_causal_with_its_window_one_short(tmp_path):
    """Without use_bidirectional_attention Gemma3 is a causal model whose sliding layers see i - j < 16."""
    reference = gemma3_reference(use_bidirectional_attention=False)
    reference.save_pretrained(str(tmp_path))
    loaded = load_pretrained(tmp_path)
    assert (loaded.config.natural_mask, loaded.config.local_window) == ("causal", 15)
    feeds = causal_feeds(loaded.config, [40, 13])
    error = max_error_at_real_positions(ours_hidden(loaded.encoder, feeds), transformers_hidden(reference, feeds),
                                        feeds["attention_mask"])
    assert error <= ATOL


def test_gemma3_with_soft_capped_attention_is_refused(tmp_path):
    reference = gemma3_reference()
    reference.save_pretrained(str(tmp_path))
    settings = json.loads((tmp_path / "config.json").read_text())
    settings["attn_logit_softcapping"] = 50.0
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        load_pretrained(tmp_path)
