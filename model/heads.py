"""Task heads on the encoder's last hidden states (config.head; docs/export-format.md "Task heads").

The `Encoder` owns one as `self.head` when config.head != "none", so every graph of an export (dense,
the long-input paths, optimized, int8, fp16) carries it. Both heads have the same three parts, named
alike in the state dict:

  head.dense   Linear(D, D, bias=head_bias)     the transform, followed by head_activation
  head.norm    LayerNorm(D) when head_norm       (eps layer_norm_eps, bias norm_bias, as the encoder's)
  head.out     Linear(D, n, bias=head_out_bias)  n = num_labels (classification) or vocab_size (sparse)

  classification  pooled = hidden[:, 0] ("cls") or the mean over valid tokens ("mean")  # (B, D)
                  logits = out(norm(act(dense(pooled))))                                  # (B, num_labels)
                  BERT: pooler + tanh + classifier; RoBERTa: classifier.dense + tanh + out_proj;
                  ModernBERT: head (dense, act, norm) + classifier, pooled per classifier_pooling.
  sparse (SPLADE) logits = out(norm(act(dense(hidden))))                                  # (B, T, vocab)
                  sparse_embedding = max over valid tokens of log1p(relu(logits))         # (B, vocab)
                  The MLM head of BERT / RoBERTa / ModernBERT with sentence-transformers' SpladePooling
                  (max, relu). A row with no valid token gives zeros.
  answer_tokens   an LLM reranker (Qwen3-Reranker): no transform, only `head.out` = Linear(D, k, bias=False)
                  holding the lm_head rows of config.head_tokens (never the whole vocabulary's projection)
                  answers = out(hidden at the last real token)                            # (B, k)
                  logits = answers[:, -1] - logsumexp(answers[:, :-1])  (k = 1: answers) # (B, 1)
                  so sigmoid(logits) = softmax(answers)[:, -1]: Qwen3-Reranker's P("yes") over ["no", "yes"].

  multivector     token_vectors = normalize(out(hidden)) per token                        # (B, T, vector_dim)
  (ColBERT)       PyLate's Dense projection (no bias, no activation) then its L2 normalisation; only
                  head.out. Every position is answered (padding too): which tokens count is the task's
                  (query expansion, skiplist; model/tasks.py), applied by the server.

  m3 (bge-m3)     m3_tokens[:, :, :D] = normalize(colbert(hidden)), except position 0: normalize(hidden[:, 0])
                  (the dense embedding: FlagEmbedding's CLS pooling; it has no ColBERT vector of the CLS);
                  m3_tokens[:, :, D] = relu(sparse(hidden)), each token's lexical weight     # (B, T, D + 1)
                  head.colbert (D -> D) and head.sparse (D -> 1), both with bias (colbert_linear.pt,
                  sparse_linear.pt). Which tokens count is the server's (model/tasks.py "m3").

Raw logits leave the graph; what turns them into scores (sigmoid, softmax) is metadata.json's "task"
(model/tasks.py), applied by whoever reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.activations import ACTIVATION_FUNCTIONS
from model.config import EncoderConfig
from model.norms import make_norm
from model.pooling import first_token, last_token, mean_pool



class _Transform(nn.Module):
    """dense -> activation -> optional LayerNorm -> out: the parts both heads share."""

    def __init__(self, config: EncoderConfig, out_features: int) -> None:
        super().__init__()
        d = config.d_model
        self.dense = nn.Linear(d, d, bias=config.head_bias)
        self.activation = ACTIVATION_FUNCTIONS[config.head_activation]
        self.norm = make_norm(config) if config.head_norm else None
        self.out = nn.Linear(d, out_features, bias=config.head_out_bias)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., out_features)."""
        x = self.activation(self.dense(x))
        if self.norm is not None:
            x = self.norm(x)
        return self.out(x)


class ClassificationHead(_Transform):
    """Sequence classification: one row of logits per sequence, from its first token or its mean."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, config.num_labels)
        self.mean = config.head_pooling == "mean"

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = mean_pool(hidden, attention_mask) if self.mean else first_token(hidden)  # (B, D)
        return self.project(pooled)  # (B, num_labels)


class SparseHead(_Transform):
    """SPLADE: the MLM logits of every token, log1p(relu(.)), max over the valid tokens."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, config.vocab_size)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        weights = torch.log1p(F.relu(self.project(hidden)))  # (B, T, vocab), >= 0
        # >= 0 everywhere, so zeroing the padding and taking the max over all positions is the max over the
        # valid ones (and 0 for a row without any).
        valid = (attention_mask != 0).to(weights.dtype)[:, :, None]  # (B, T, 1)
        return (weights * valid).amax(dim=1)  # (B, vocab)


class MultiVectorHead(nn.Module):
    """Late interaction (ColBERT): each token's hidden state projected to vector_dim, L2-normalised."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.out = nn.Linear(config.d_model, config.vector_dim, bias=False)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.out(hidden), p=2, dim=-1)  # (B, T, vector_dim)


class M3Head(nn.Module):
    """bge-m3's dense, lexical and ColBERT outputs of one encoder run, in one per-token tensor."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.colbert = nn.Linear(config.d_model, config.d_model)
        self.sparse = nn.Linear(config.d_model, 1)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        vectors = F.normalize(self.colbert(hidden[:, 1:]), p=2, dim=-1)  # (B, T - 1, D)
        dense = F.normalize(hidden[:, :1], p=2, dim=-1)  # (B, 1, D)
        weights = F.relu(self.sparse(hidden))  # (B, T, 1)
        return torch.cat([torch.cat([dense, vectors], dim=1), weights], dim=-1)  # (B, T, D + 1)


class AnswerTokenHead(nn.Module):
    """An LLM reranker's score: a few answer tokens' logits at the last real token, as one logit."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.out = nn.Linear(config.d_model, len(config.head_tokens), bias=False)  # the lm_head's rows

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        answers = self.out(last_token(hidden, attention_mask))  # (B, k)
        if answers.shape[1] == 1:
            return answers  # (B, 1)
        return answers[:, -1:] - torch.logsumexp(answers[:, :-1], dim=1, keepdim=True)  # (B, 1)


def build_head(config: EncoderConfig) -> nn.Module | None:
    """The head config.head names, or None for a headless encoder."""
    if config.head == "classification":
        return ClassificationHead(config)
    if config.head == "sparse":
        return SparseHead(config)
    if config.head == "multivector":
        return MultiVectorHead(config)
    if config.head == "m3":
        return M3Head(config)
    if config.head == "answer_tokens":
        return AnswerTokenHead(config)
    return None
