"""Hugging Face references built locally at random initialisation (nothing comes from a hub): a
word-level tokenizer and a ModernBERT embedding model as sentence-transformers saves it, and a
SentenceTransformer saved, exported and served (`export_and_serve`); a Qwen3-Reranker-shaped Qwen3ForCausalLM
with a Qwen-like tokenizer and the model card's transformers recipe (`CardRecipe`). Shared by the tests of the
checkpoint families and of sentence-transformers' modules, and by bench/llm_rerank_bench.py."""

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


# --- an LLM reranker (Qwen3-Reranker) and its model card's recipe -------------------------------------------------

# the card's strings, written here as the card has them (model/tasks.py holds the export's copy)
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker-0.6B's layout at a small width (GQA, a head_dim of its own, q/k norms), untied lm_head.
QWEN3_RERANKER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
RERANKER_MAX_LENGTH = 160  # the tokenizer's model_max_length: the export's max_text_tokens
RERANKER_QUERY = "what is the long document encoder"
RERANKER_DOCUMENTS = ["the encoder is a long document encoder", "a dog barks at the mailman",
                      "it is the one that is long", "yes",
                      "the a of and to in is that it for on with as was by this be"]


def qwen_tokenizer():
    """A byte-level BPE (as Qwen's) trained on the template's texts: <|endoftext|>, <|im_start|>, <|im_end|>
    special, <think> and </think> added, "yes" and "no" single tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [QWEN3_PREFIX, QWEN3_BODY, QWEN3_SUFFIX, QWEN3_INSTRUCTION, " ".join(WORDS), RERANKER_QUERY,
              *RERANKER_DOCUMENTS] * 5 + ["yes", "no"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    return tokenizer


def save_qwen3_reranker(directory, seed: int = 0, max_length: int = RERANKER_MAX_LENGTH, **changes):
    """A random Qwen3ForCausalLM and its tokenizer (model_max_length `max_length`), saved as transformers saves
    them; `changes` to QWEN3_RERANKER (vocab_size: the tokenizer's unless given); returns the model."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer()
    config = Qwen3Config(**{"vocab_size": tokenizer.get_vocab_size(), **QWEN3_RERANKER, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = redraw(Qwen3ForCausalLM(config), seed=seed)
    model.save_pretrained(str(directory))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                            model_max_length=max_length).save_pretrained(str(directory))
    return model


class CardRecipe:
    """Qwen3-Reranker-0.6B's model card recipe (transformers), on a checkpoint directory."""

    def __init__(self, directory, max_length: int = RERANKER_MAX_LENGTH, prefix: str = QWEN3_PREFIX,
                 suffix: str = QWEN3_SUFFIX, swap: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(directory), padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(str(directory)).eval()  # the card: default attention
        self.token_false_id = self.tokenizer.convert_tokens_to_ids("no")
        self.token_true_id = self.tokenizer.convert_tokens_to_ids("yes")
        if swap:  # the control: the rows the other way round
            self.token_false_id, self.token_true_id = self.token_true_id, self.token_false_id
        self.max_length = max_length
        self.prefix_tokens = self.tokenizer.encode(prefix, add_special_tokens=False)
        self.suffix_tokens = self.tokenizer.encode(suffix, add_special_tokens=False)

    @staticmethod
    def format_instruction(instruction, query, doc):
        if instruction is None:
            instruction = "Given a web search query, retrieve relevant passages that answer the query"
        return "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
            instruction=instruction, query=query, doc=doc)

    def process_inputs(self, pairs):
        inputs = self.tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                                max_length=self.max_length - len(self.prefix_tokens) - len(self.suffix_tokens))
        for i, ele in enumerate(inputs["input_ids"]):
            inputs["input_ids"][i] = self.prefix_tokens + ele + self.suffix_tokens
        return self.tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=self.max_length)

    @torch.no_grad()
    def compute_logits(self, inputs):
        batch_scores = self.model(**inputs).logits[:, -1, :]
        true_vector = batch_scores[:, self.token_true_id]
        false_vector = batch_scores[:, self.token_false_id]
        batch_scores = torch.stack([false_vector, true_vector], dim=1)
        batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
        return batch_scores[:, 1].exp().tolist()

    def scores(self, query, documents, instruction=None) -> np.ndarray:
        pairs = [self.format_instruction(instruction, query, doc) for doc in documents]
        return np.asarray(self.compute_logits(self.process_inputs(pairs)), np.float64)


# --- bge-reranker-v2-gemma's recipe on a Gemma3ForCausalLM ---------------------------------------------------------

BGE_GEMMA_PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query "
                    "by providing a prediction of either 'Yes' or 'No'.")
# Gemma3's parts at a small width, causal (a CausalLM), sliding layers around a full one, tied lm_head (Gemma3's).
GEMMA3_RERANKER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                       max_position_embeddings=1024)


def gemma_tokenizer():
    """A byte-level BPE trained on the bge prompt and the test texts: <pad>, <eos>, <bos> special, "Yes" one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [BGE_GEMMA_PROMPT, "A: B: \n", " ".join(WORDS), RERANKER_QUERY, *RERANKER_DOCUMENTS] * 5 + ["Yes"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def save_gemma3_reranker(directory, seed: int = 0, max_length: int = RERANKER_MAX_LENGTH, **changes):
    """A random Gemma3ForCausalLM and its tokenizer (left padding, as the recipe needs), saved as transformers
    saves them; returns the model."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    tokenizer = gemma_tokenizer()
    ids = {name: tokenizer.token_to_id(name) for name in ("<pad>", "<eos>", "<bos>")}
    config = Gemma3TextConfig(**{"vocab_size": tokenizer.get_vocab_size(), **GEMMA3_RERANKER, **changes},
                              pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = redraw(Gemma3ForCausalLM(config), seed=seed)
    model.save_pretrained(str(directory))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            padding_side="left", model_max_length=max_length).save_pretrained(str(directory))
    return model


class BgeGemmaRecipe:
    """bge-reranker-v2-gemma's model card recipe (transformers: get_inputs, the "Yes" logit at the last token)."""

    def __init__(self, directory, max_length: int = 1024) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.model = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
        self.yes_loc = self.tokenizer("Yes", add_special_tokens=False)["input_ids"][0]
        self.max_length = max_length

    def get_inputs(self, pairs, prompt=None):
        tokenizer, max_length = self.tokenizer, self.max_length
        if prompt is None:
            prompt = BGE_GEMMA_PROMPT
        sep = "\n"
        prompt_inputs = tokenizer(prompt, return_tensors=None, add_special_tokens=False)["input_ids"]
        sep_inputs = tokenizer(sep, return_tensors=None, add_special_tokens=False)["input_ids"]
        inputs = []
        for query, passage in pairs:
            query_inputs = tokenizer(f"A: {query}", return_tensors=None, add_special_tokens=False,
                                     max_length=max_length * 3 // 4, truncation=True)
            passage_inputs = tokenizer(f"B: {passage}", return_tensors=None, add_special_tokens=False,
                                       max_length=max_length, truncation=True)
            # the card's tokenizer.prepare_for_model(first, second, truncation="only_second", max_length=...,
            # add_special_tokens=False), which transformers 5's tokenizers no longer have: the pair joined, the
            # second cut from its end to fit
            first = [tokenizer.bos_token_id] + query_inputs["input_ids"]
            second = sep_inputs + passage_inputs["input_ids"]
            item = {"input_ids": first + second[:max(0, max_length - len(first))]}
            item["input_ids"] = item["input_ids"] + sep_inputs + prompt_inputs
            item["attention_mask"] = [1] * len(item["input_ids"])
            inputs.append(item)
        return tokenizer.pad(inputs, padding=True, max_length=max_length + len(sep_inputs) + len(prompt_inputs),
                             pad_to_multiple_of=8, return_tensors="pt")

    @torch.no_grad()
    def logits(self, query, documents, prompt=None) -> np.ndarray:
        inputs = self.get_inputs([[query, doc] for doc in documents], prompt)
        scores = self.model(**inputs, return_dict=True).logits[:, -1, self.yes_loc].view(-1, ).float()
        return scores.numpy().astype(np.float64)
