"""metadata.json's "task": what an export's model is for, and how its head output becomes an answer.
Torch-free: the exporter writes it, the server reads it (docs/export-format.md "task").

  {"kind": "embed"}                                              no head (the default; older exports)
  {"kind": "rerank", "output": "logits", "labels": [...],        classification head of one label
   "activation": "sigmoid" | "softmax" | "none", "pair": true}   (as text-embeddings-inference decides)
  {"kind": "classify", ...the same fields}                      classification head of > 1 label
  {"kind": "sparse", "output": "sparse_embedding"}              SPLADE head
  {"kind": "multivector", "output": "token_vectors",             late interaction (ColBERT, PyLate checkpoints):
   "query_marker_id": 30 | null, "document_marker_id": 31 | null,  one L2-normalised vector per token
   "query_length": 32, "document_length": 180,
   "query_expansion": true, "attend_to_expansion_tokens": false,
   "expansion_id": 103, "skiplist_ids": [...]}
  {"kind": "m3", "output": "m3_tokens", "unused_ids": [0, 1, 2, 3]}  bge-m3: dense, lexical weights, ColBERT
  {"kind": "rerank", "output": "logits", "labels": ["yes"],       an LLM reranker (answer_tokens head), whose
   "activation": "sigmoid", "pair": true, "template": {...}}     texts go through its prompt template

"activation" turns logits into scores when a client does not ask for raw ones: a sentence-transformers
CrossEncoder's own activation_fn when it names one, else the checkpoint's problem_type, else sigmoid for one
label and softmax for more. "pair": the model takes a text or a text pair (a pair is tokenized as the
tokenizer's post-processor joins two texts, with token_type_ids where the family has them).

"multivector" (PyLate's ColBERT.tokenize and encode): a text is tokenized to at most (query|document)_length
tokens, its marker (PyLate's query_prefix / document_prefix token, when it has one) counted and put right after
the first token. With query_expansion a query is padded with expansion_id ([MASK]) up to query_length; the padding
is answered (every query vector counts) but attended to only with attend_to_expansion_tokens. A document loses the
vectors of its skiplist_ids tokens (PyLate's skiplist_words: punctuation). Score: MaxSim, the sum over the query's
vectors of the largest dot product with a document's vectors (PyLate's colbert_scores).

"template" (an LLM reranker: Qwen3-Reranker, bge-reranker-v2-gemma's recipe): how a query and a document become
the token row the model reads, as its model card builds it: {"name", "parts", "instruction", "answers",
"answer_ids"}. A row is the tokens of each of "parts" in order, each part tokenized alone without special tokens
(a special token's own text, "<bos>", is its id); across the parts {query} and {document} appear once each and
{instruction} (a request's, else "instruction", the default) at most once. Only the document's tokens are ever
cut. "answers" are the answer tokens (the positive one last) and "answer_ids" their vocabulary ids, the head's
head_tokens: the score is softmax over their logits at the last token, taken at the last answer (sigmoid of the
head's one logit; one answer: sigmoid of its logit).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from model.config import EncoderConfig
from model.signature import head_output

TASK_KINDS = ("embed", "rerank", "classify", "sparse", "multivector", "m3")
# the heads whose output is per token (the server reads it as the hidden states); their task kind is the head's name
PER_TOKEN_KINDS = ("multivector", "m3")
# a multivector task's fields besides kind and output: name -> the types it may hold (None: null allowed)
MULTIVECTOR_FIELDS: Mapping[str, tuple] = {
    "query_marker_id": (int, type(None)), "document_marker_id": (int, type(None)), "query_length": (int,),
    "document_length": (int,), "query_expansion": (bool,), "attend_to_expansion_tokens": (bool,),
    "expansion_id": (int,), "skiplist_ids": (list,)}
SCORE_ACTIVATIONS = ("sigmoid", "softmax", "none")
EMBED: Mapping[str, Any] = {"kind": "embed"}
# LLM rerankers' prompt templates by name (export --reranker-template), each as its model card writes it.
RERANK_TEMPLATES: Mapping[str, Mapping[str, Any]] = {
    # Qwen/Qwen3-Reranker-0.6B (4B, 8B alike): P("yes") of softmax over the "no" and "yes" logits
    # (prefix tokens + the formatted pair + suffix tokens, as its process_inputs joins them)
    "qwen3": {
        "parts": ["<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                  "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                  "<|im_start|>user\n",
                  "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
                  "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"],
        "instruction": "Given a web search query, retrieve relevant passages that answer the query",
        "answers": ["no", "yes"],
    },
    # BAAI/bge-reranker-v2-gemma's get_inputs (bos, "A: query", sep, "B: passage", sep, prompt; each tokenized
    # alone): the raw "Yes" logit at the last token (FlagLLMReranker's compute_score; normalize=True: sigmoid)
    "bge-gemma": {
        "parts": ["<bos>", "A: {query}", "\n", "B: {document}", "\n", "{instruction}"],
        "instruction": "Given a query A and a passage B, determine whether the passage contains an answer to the "
                       "query by providing a prediction of either 'Yes' or 'No'.",
        "answers": ["Yes"],
    },
}
# sentence-transformers' CrossEncoder stores activation_fn as a class path (torch.nn.modules.activation.Sigmoid,
# torch.nn.modules.linear.Identity, ...): its class name -> our activation.
ST_ACTIVATION_CLASSES: Mapping[str, str] = {"Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax"}
# transformers' problem_type -> the activation its loss implies.
PROBLEM_TYPE_ACTIVATIONS: Mapping[str, str] = {"multi_label_classification": "sigmoid", "regression": "none",
                                               "single_label_classification": "softmax"}


class TaskError(ValueError):
    """A task that cannot be written or read as this module says; the message names the field."""


def score_activation(num_labels: int, *, activation_fn: str | None = None, problem_type: str | None = None) -> str:
    """The activation that turns a classifier's logits into scores (the precedence: module docstring)."""
    if activation_fn is not None:
        module, _, name = str(activation_fn).rpartition(".")
        if not module.startswith("torch.") or name not in ST_ACTIVATION_CLASSES:
            raise TaskError(f"activation_fn {activation_fn!r} is not one of the torch activations "
                            f"{', '.join(ST_ACTIVATION_CLASSES)}")
        return ST_ACTIVATION_CLASSES[name]
    if problem_type is not None:
        if problem_type not in PROBLEM_TYPE_ACTIVATIONS:
            raise TaskError(f"problem_type {problem_type!r} is not one of {', '.join(PROBLEM_TYPE_ACTIVATIONS)}")
        return PROBLEM_TYPE_ACTIVATIONS[problem_type]
    return "sigmoid" if num_labels == 1 else "softmax"


def default_labels(num_labels: int) -> list[str]:
    """The label names of a head whose checkpoint names none: LABEL_0, LABEL_1, ... (transformers' default)."""
    return [f"LABEL_{i}" for i in range(num_labels)]


def labels_of(task: Mapping[str, Any], num_labels: int) -> list[str]:
    """A task's label names in the order of its logits: its own, else `default_labels`."""
    return [str(v) for v in task.get("labels") or ()] or default_labels(num_labels)


def template_entry(name: str, answer_ids: Sequence[int]) -> dict:
    """The task's "template" of RERANK_TEMPLATES[name] with its answers' vocabulary ids."""
    if name not in RERANK_TEMPLATES:
        raise TaskError(f"reranker template {name!r} is not one of {', '.join(RERANK_TEMPLATES)}")
    return {"name": name, **RERANK_TEMPLATES[name], "answer_ids": [int(i) for i in answer_ids]}


def task_for(config: EncoderConfig, *, labels: Sequence[str] | None = None, activation: str | None = None,
             template: Mapping[str, Any] | None = None) -> dict:
    """The "task" of a model with `config`: labels default to LABEL_0, LABEL_1, ... and the activation to
    score_activation(num_labels); an answer_tokens head's (an LLM reranker) is a rerank task with its
    `template` (template_entry), scored by sigmoid."""
    head = head_output(config)
    if head is None:
        return dict(EMBED)
    if config.head == "answer_tokens":
        if template is None:
            raise TaskError("task template: an answer_tokens head needs its prompt template")
        return check_task({"kind": "rerank", "output": head[0], "labels": [str(template["answers"][-1])],
                           "activation": "sigmoid", "pair": True, "template": dict(template)}, config)
    if config.head == "sparse":
        return {"kind": "sparse", "output": head[0]}
    if config.head in PER_TOKEN_KINDS:
        raise TaskError(f"a {config.head} task needs its checkpoint's settings (model/hf_colbert.py colbert_task, "
                        f"model/hf_m3.py m3_task)")
    labels = default_labels(config.num_labels) if labels is None else [str(v) for v in labels]
    return check_task({"kind": "rerank" if config.num_labels == 1 else "classify", "output": head[0],
                       "labels": labels, "activation": activation or score_activation(config.num_labels),
                       "pair": True}, config)


def check_task(task: Mapping[str, Any], config: EncoderConfig) -> dict:
    """`task` checked against the model it describes (kind, output, labels, activation); a TaskError naming the
    field otherwise. Returns a plain dict copy."""
    if not isinstance(task, Mapping) or task.get("kind") not in TASK_KINDS:
        raise TaskError(f"task kind {task.get('kind') if isinstance(task, Mapping) else task!r} is not one of "
                        f"{', '.join(TASK_KINDS)}")
    head = head_output(config)
    kind = task["kind"]
    expected = "embed" if head is None else config.head if config.head in ("sparse", *PER_TOKEN_KINDS) else \
        "rerank" if config.num_labels == 1 else "classify"
    if kind != expected:
        raise TaskError(f"task kind {kind!r} does not fit head={config.head!r} with num_labels={config.num_labels} "
                        f"(expected {expected!r})")
    if head is not None and task.get("output") != head[0]:
        raise TaskError(f"task output {task.get('output')!r} is not the head's output {head[0]!r}")
    if (config.head == "answer_tokens") != ("template" in task):
        raise TaskError(f"task template goes with an answer_tokens head (an LLM reranker) only; head={config.head!r}")
    if config.head == "answer_tokens":
        check_template(task["template"], config)
    if config.head in ("classification", "answer_tokens"):
        labels = task.get("labels")
        if not isinstance(labels, (list, tuple)) or len(labels) != config.num_labels:
            raise TaskError(f"task labels {labels!r} are not {config.num_labels} label name(s)")
        if task.get("activation") not in SCORE_ACTIVATIONS:
            raise TaskError(f"task activation {task.get('activation')!r} is not one of {', '.join(SCORE_ACTIVATIONS)}")
        if not isinstance(task.get("pair"), bool):
            raise TaskError(f"task pair {task.get('pair')!r} is not true or false")
    if config.head == "multivector":
        check_multivector(task, config)
    if config.head == "m3":
        ids = task.get("unused_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < config.vocab_size for i in ids):
            raise TaskError(f"task unused_ids {ids!r} are not token ids within the vocabulary")
    return {k: (list(v) if isinstance(v, (list, tuple)) else dict(v) if isinstance(v, Mapping) else v)
            for k, v in task.items()}


def check_multivector(task: Mapping[str, Any], config: EncoderConfig) -> None:
    """A multivector task's fields: each present with its type, lengths within the model's positions, ids within
    its vocabulary; a TaskError naming the field otherwise."""
    for name, types in MULTIVECTOR_FIELDS.items():
        value = task.get(name, ...)
        if value is ... or not isinstance(value, types) or (isinstance(value, int) and isinstance(value, bool)
                                                             and bool not in types):
            raise TaskError(f"task {name} {None if value is ... else value!r} is missing or not "
                            f"{' or '.join('null' if t is type(None) else t.__name__ for t in types)}")
    for name in ("query_length", "document_length"):
        if not 2 <= task[name] <= config.max_positions:
            raise TaskError(f"task {name} {task[name]} is outside 2..{config.max_positions} (the model's positions)")
    ids = [task["query_marker_id"], task["document_marker_id"], task["expansion_id"], *task["skiplist_ids"]]
    if not all(isinstance(i, int) and 0 <= i < config.vocab_size for i in ids if i is not None):
        raise TaskError(f"task token ids {ids} are not all within the vocabulary (0..{config.vocab_size - 1})")


def check_template(template: Any, config: EncoderConfig) -> None:
    """An LLM reranker's "template" (module docstring) against its head; a TaskError naming the field."""
    if not isinstance(template, Mapping):
        raise TaskError(f"task template {template!r} is not an object")
    parts = template.get("parts")
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, str) for p in parts):
        raise TaskError(f"task template.parts {parts!r} is not a list of texts")
    if not isinstance(template.get("instruction"), str):
        raise TaskError(f"task template.instruction {template.get('instruction')!r} is not a text")
    for field, least in (("{query}", 1), ("{document}", 1), ("{instruction}", 0)):
        if not least <= sum(p.count(field) for p in parts) <= 1:
            raise TaskError(f"task template.parts {list(parts)!r} must hold {field} {'once' if least else 'at most once'}")
    answers, ids = template.get("answers"), template.get("answer_ids")
    if not isinstance(answers, (list, tuple)) or not isinstance(ids, (list, tuple)) or len(answers) != len(ids) \
            or list(ids) != list(config.head_tokens):
        raise TaskError(f"task template answers {answers!r} / answer_ids {ids!r} are not the head's head_tokens "
                        f"{list(config.head_tokens)}")
