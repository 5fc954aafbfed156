"""One big checkpoint against sentence-transformers in process, and served (issue 32's per-model report):

    python -m bench.big_model --checkpoint ST_DIR --export EXPORT_DIR [--int8 EXPORT_DIR] [--threads 2]
        [--parts in_process,server] [--json OUT]

  weights     the checkpoint's weight files, in bytes
  in process  tokens/s at batch 8 x 256 and the time of one 1 x 128 call: SentenceTransformer.forward (its
              Transformer, pooling and normalisation; eager attention, torch threads = --threads) against
              session.run of each graph (fp32, optimized, and int8 from --int8 when given) at the same thread
              count, the engines taking turns (bench.model_bench.time_interleaved), every row full length on
              the model's natural mask
  agreement   per graph, the lowest cosine of its pooled embedding (the export's pooling and normalisation,
              read off its outputs) to sentence-transformers' over the 8 x 256 batch
  server      `python -m serve --export-dir EXPORT`: RSS once SERVING, after one 1 x 128 request (dense graph)
              and, where the export has a sparse graph, after one request of a 2,048-token sliding-window row
              (which runs on it), each against the weights; the p50 of sequential 1 x 128 Encode calls
Nothing here is asserted: it reports. Random token ids (the checkpoint's vocabulary); 127.0.0.1 only.

    python -m bench.big_model --make qwen3-0.6b|bge-m3 --checkpoint DIR

writes a random-init checkpoint of that model's exact shape (transformers' own initialisation, seed 0) as
sentence-transformers saves it (Qwen3-Embedding: lasttoken Pooling, Normalize, its query prompt; bge-m3: CLS
Pooling, Normalize), with a word-level tokenizer (no hub: nothing is downloaded), then exits.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.harness import peak_rss_mib, rss_bytes, running_server, token_ids
from bench.model_bench import time_interleaved
from export.cases import MaskSpec, make_feeds
from model.export_format import read_metadata
from model.mask_kinds import MaskKind

BATCH, LENGTH, SINGLE, LONG_ROW, WINDOW = 8, 256, 128, 2048, 128


SHAPES = {  # the exact shapes of the checkpoints' config.json
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True, use_sliding_window=False, pad_token_id=0),
                   "lasttoken", {"query": "Instruct: Given a web search query, retrieve relevant passages that "
                                          "answer the query\nQuery:", "document": ""}),
    "bge-m3": ("xlm-roberta", dict(vocab_size=250002, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                   num_attention_heads=16, max_position_embeddings=8194, type_vocab_size=1,
                                   pad_token_id=1, layer_norm_eps=1e-5), "cls", {}),
}


def make_checkpoint(shape: str, directory: Path) -> None:
    """A random-init checkpoint of SHAPES[shape] saved by sentence-transformers into `directory`."""
    import tempfile

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoConfig, AutoModel, PreTrainedTokenizerFast

    model_type, fields, pooling, prompts = SHAPES[shape]
    torch.manual_seed(0)
    words = ["[PAD]", "[EOS]", "[UNK]"] + [f"w{i}" for i in range(1000)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 1)])
    with tempfile.TemporaryDirectory() as base:
        AutoModel.from_config(AutoConfig.for_model(model_type, **fields)).save_pretrained(base)
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]",
                                padding_side="left" if pooling == "lasttoken" else "right").save_pretrained(base)
        transformer = st_models.Transformer(base, max_seq_length=8192)
        SentenceTransformer(modules=[transformer, st_models.Pooling(fields["hidden_size"], pooling),
                                     st_models.Normalize()], prompts=prompts, device="cpu").save(str(directory))


def weight_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.iterdir() if p.suffix in (".safetensors", ".bin"))


def natural_feeds(config, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    kind = MaskKind.CAUSAL if config.natural_mask == "causal" else MaskKind.BIDIRECTIONAL
    return make_feeds(config, [length] * batch, MaskSpec(kind), seed=seed, padded_to=length)


def pooled(outputs: list[np.ndarray], pooling: dict) -> np.ndarray:
    """The export's pooled embedding of full-length rows: mean (the graph's), first or last token."""
    hidden, mean = outputs
    vectors = {"mean": mean, "cls": hidden[:, 0], "first": hidden[:, 0], "last": hidden[:, -1]}[pooling["mode"]]
    if pooling.get("normalize"):
        vectors = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors


def in_process(checkpoint: Path, graphs: dict[str, Path], config, pooling: dict, threads: int) -> dict:
    import onnxruntime as ort
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(checkpoint), device="cpu").eval()  # as users load it: sdpa attention
    sessions = {}
    for name, path in graphs.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    report: dict = {}
    for label, batch, length in (("batch", BATCH, LENGTH), ("single", 1, SINGLE)):
        feeds = natural_feeds(config, batch, length, seed=batch)
        st_inputs = {"input_ids": torch.from_numpy(feeds["input_ids"]),
                     "attention_mask": torch.from_numpy(feeds["attention_mask"])}

        def st_run(inputs=st_inputs):
            with torch.inference_mode():
                return model.forward(dict(inputs))["sentence_embedding"].numpy()

        runners = {"sentence_transformers": st_run}
        for name, session in sessions.items():
            wanted = {i.name for i in session.get_inputs()}
            runners[name] = (lambda s=session, f={k: v for k, v in feeds.items() if k in wanted}:
                             s.run(["last_hidden_state", "mean_pooled"], f))
        timing = time_interleaved(runners, warmup=1, repeats=3 if batch > 1 else 9, budget_s=600, rounds=3)
        report[label] = {name: {**t, "tokens_per_s": batch * length / (t["median_ms"] / 1e3)}
                         for name, t in timing.items()}
        if label == "batch":
            reference = st_run()
            for name in sessions:
                ours = pooled(runners[name](), pooling)
                cos = (ours * reference).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1))
                report[label][name]["min_cosine_to_st"] = float(cos.min())
    return report


def served(export: Path, config, weights: int, has_sparse: bool) -> dict:
    from client import EncoderClient, build_request

    ids = token_ids(config.vocab_size, SINGLE, seed=1)
    with running_server(str(export), [], start_timeout_s=900) as handle:
        report = {"rss_serving_gib": rss_bytes(handle.pid) / (1 << 30)}
        with EncoderClient(handle.target, timeout=600.0, retries=0) as client:
            request = build_request([ids])
            client.stub.Encode(request, timeout=600)
            report["rss_after_dense_request_gib"] = rss_bytes(handle.pid) / (1 << 30)
            latencies = []
            for _ in range(12):
                started = time.perf_counter()
                client.stub.Encode(request, timeout=600)
                latencies.append(1e3 * (time.perf_counter() - started))
            report["single_p50_ms"] = float(np.median(latencies))
            if has_sparse:
                long_ids = token_ids(config.vocab_size, LONG_ROW, seed=2)
                started = time.perf_counter()
                client.stub.Encode(build_request([long_ids], mask="sliding_window", window=WINDOW), timeout=900)
                report["long_row_s"] = time.perf_counter() - started
                report["rss_after_long_request_gib"] = rss_bytes(handle.pid) / (1 << 30)
        report["vm_hwm_gib"] = (peak_rss_mib(handle.pid) or 0) / 1024
    for key in [k for k in report if k.startswith("rss_")]:
        report[key.replace("_gib", "_x_weights")] = report[key] * (1 << 30) / weights
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="the sentence-transformers directory")
    parser.add_argument("--export", type=Path, help="its export (python -m export --from-pretrained)")
    parser.add_argument("--make", choices=sorted(SHAPES), help="write a random-init checkpoint of this shape and exit")
    parser.add_argument("--int8", type=Path, help="an export of the same checkpoint with an int8 graph")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="in_process,server", help="comma-separated: in_process, server")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.make:
        make_checkpoint(args.make, args.checkpoint)
        return 0
    if args.export is None:
        parser.error("--export is required unless --make")
    metadata = read_metadata(args.export)
    graphs = {name: args.export / entry.file for name, entry in metadata.graphs.items()
              if name in ("fp32", "optimized")}
    if args.int8:
        graphs["int8"] = args.int8 / read_metadata(args.int8).graphs["int8"].file
    weights = weight_bytes(args.checkpoint)
    parts = args.parts.split(",")
    report = {"checkpoint": str(args.checkpoint), "weights_bytes": weights, "threads": args.threads}
    if "in_process" in parts:
        report["in_process"] = in_process(args.checkpoint, graphs, metadata.config, metadata.pooling, args.threads)
    if "server" in parts:
        report["server"] = served(args.export, metadata.config, weights, "sparse" in metadata.graphs)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
