"""Hugging Face references built locally at random initialisation (nothing comes from a hub): a
word-level tokenizer and a ModernBERT embedding model as sentence-transformers saves it, and a
SentenceTransformer saved, exported and served (`export_and_serve`). Shared by the tests of the checkpoint
families and of sentence-transformers' modules."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

# ModernBERT's own layout (global every third layer, window 128 = |i - j| <= 64, θ 160k / 10k) at a
# small width; 4 layers: global, local, local, global.
MODERNBERT = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                  local_attention=128, max_position_embeddings=8192)
# RoBERTa / XLM-RoBERTa at a small width: pad id 1, positions numbered from 2 (140 - 2 tokens at most).
ROBERTA = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=140, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               layer_norm_eps=1e-5)
WORDS = "the a of and to in is that it for on with as was by this be are long document encoder".split()


def redraw(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights at a scale where attention is far from uniform: N(0, 1/fan_in) matrices, norms near 1.

    transformers initialises linears with std 0.02, which makes attention almost uniform and hides
    position and window mistakes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
            elif "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


BERT_SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")


def word_tokenizer(specials: tuple[str, ...] = BERT_SPECIALS, begin: str = "[CLS]", end: str = "[SEP]",
                   unk: str = "[UNK]", pair_separator: str = ""):
    """(a word-level tokenizers.Tokenizer with `begin` ... `end` around each text, its vocabulary size): the
    `specials` take the first ids, in order; a pair is begin A end [pair_separator] B end (RoBERTa, MPNet: a
    second </s> between the two)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{begin} $A {end}", pair=f"{begin} $A {end} {pair_separator} $B {end}".replace("  ", " "),
        special_tokens=[(begin, vocab[begin]), (end, vocab[end])])
    return tokenizer, len(vocab)


def modernbert_embedding_model(base: Path, directory: Path, max_seq_length: int, seed: int = 2):
    """A ModernBERT + mean pooling + Normalize SentenceTransformer (as gte-modernbert-base and
    modernbert-embed-base are built), saved by sentence-transformers into `directory`; returns it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from transformers import ModernBertConfig, ModernBertModel, PreTrainedTokenizerFast

    tokenizer, vocab_size = word_tokenizer()
    config = ModernBertConfig(**{**MODERNBERT, "vocab_size": vocab_size})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    redraw(ModernBertModel(config), seed=seed).save_pretrained(str(base))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            unk_token="[UNK]", mask_token="[MASK]").save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=max_seq_length,
                                        model_kwargs={"attn_implementation": "eager"})
    model = SentenceTransformer(modules=[transformer, st_models.Pooling(MODERNBERT["hidden_size"], "mean"),
                                         st_models.Normalize()], device="cpu")
    model.save(str(directory))
    return model


def cosines(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two [n, D] arrays."""
    return (actual * expected).sum(-1) / (np.linalg.norm(actual, axis=-1) * np.linalg.norm(expected, axis=-1))


def openai_embeddings(server, model: str, texts: list[str], **fields) -> np.ndarray:
    """[n, D] from the server's POST /v1/embeddings (`fields`: more of the body, e.g. truncate=True), in input order."""
    import json
    import urllib.request

    body = json.dumps({"model": model, "input": texts, **fields}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/embeddings", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        data = json.loads(response.read())["data"]
    return np.array([item["embedding"] for item in sorted(data, key=lambda d: d["index"])], np.float32)


def export_and_serve(model, tmp_path_factory, serve_start, name: str, graphs: str = "fp32"):
    """`model` (a SentenceTransformer) saved by sentence-transformers, exported (`python -m export
    --from-pretrained`, `graphs`) and served: (its export directory, its server)."""
    from export.cli import main as export_main

    directory, out = tmp_path_factory.mktemp(f"{name}-st"), tmp_path_factory.mktemp(f"{name}-export")
    model.save(str(directory))
    assert export_main(["--from-pretrained", str(directory), "--out-dir", str(out), "--name", name,
                        "--graphs", graphs, "--quiet"]) == 0
    return out / name, serve_start(out / name)
