"""PyLate 1.6.0 (the ColBERT reference) on this venv's sentence-transformers 6.2. PyLate 1.6.0 was written against
sentence-transformers 5.3 and is installed without its dependencies (Makefile `setup`): three of the
sentence-transformers internals it calls changed in 6.x, and `pylate_colbert` puts back exactly their 5.3
behaviour, nothing of PyLate's own:

  - Transformer.tokenize(texts, padding=...) became a deprecated alias of `preprocess`, which ignores `padding`
    and `max_seq_length`: PyLate's query expansion (padding="max_length") and its length cut would silently not
    happen. Put back: 5.3's body, the tokenizer with truncation="longest_first" to max_seq_length and the padding
    asked for.
  - SentenceTransformer._text_length was renamed _input_length (PyLate's encode sorts by it).
  - SentenceTransformer._model_config is gone (PyLate's save copies it); `_get_model_config()` gives it.

A ColBERT saved by PyLate cannot be loaded back by PyLate under sentence-transformers 6.2 (its Dense.load takes
no module_input_name), so the reference is the in-memory model that saved the directory."""

from __future__ import annotations

import string
from pathlib import Path

import torch

from tests.hf_references import redraw, word_tokenizer

PUNCTUATION = tuple(".,?!;")  # in the vocabulary; the rest of string.punctuation maps to [UNK] (also skipped)


def _st53_tokenize(module):
    def tokenize(texts, padding=True, **_):
        features = dict(module.tokenizer(list(texts), padding=padding, truncation="longest_first",
                                         return_tensors="pt", max_length=module.max_seq_length))
        features["modality"] = "text"
        return features
    return tokenize


def pylate_colbert(root: Path, *, vector_dim: int = 16, query_length: int = 12, document_length: int = 20,
                   seed: int = 0, **settings):
    """(a PyLate ColBERT over a small random BERT with a word-level tokenizer, the directory PyLate saved it to).
    `settings`: more of ColBERT's arguments (do_query_expansion, attend_to_expansion_tokens, ...)."""
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tokenizer, _ = word_tokenizer()
    tokenizer.add_tokens(list(PUNCTUATION))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]", model_max_length=64)
    base = root / "bert"
    config = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=64)
    redraw(BertModel(config), seed=seed).save_pretrained(base)
    fast.save_pretrained(base)
    model, directory = colbert_over(base, root, vector_dim=vector_dim, query_length=query_length,
                                    document_length=document_length, seed=seed, **settings)
    assert model.skiplist_words == list(string.punctuation)
    return model, directory


def colbert_over(base: Path, root: Path, *, vector_dim: int, seed: int = 0, **settings):
    """(a PyLate ColBERT over the transformers checkpoint `base` with a new Dense to `vector_dim` drawn from `seed`,
    bridged to sentence-transformers 6; the directory under `root` PyLate saved it to)."""
    from pylate import models
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Transformer

    encoder = root / "encoder"  # a sentence-transformers directory of the Transformer alone: PyLate adds its Dense
    SentenceTransformer(modules=[Transformer(str(base))], device="cpu").save(str(encoder))
    models.ColBERT._text_length = lambda self, text: self._input_length(text)
    torch.manual_seed(seed)
    model = models.ColBERT(model_name_or_path=str(encoder), embedding_size=vector_dim, device="cpu", **settings)
    model._first_module().tokenize = _st53_tokenize(model._first_module())
    model._model_config = model._get_model_config()
    directory = root / "colbert"
    model.save(str(directory))
    return model, directory
