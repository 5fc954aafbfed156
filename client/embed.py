"""The client CLI's `embed` command: texts in, sentence embeddings out (models with a tokenizer).

    python -m client embed "some text" "more"              # prints a summary
    python -m client embed - < lines.txt --out vectors.npy  # one text per non-empty line
    python -m client embed "a" "b" --out vectors.jsonl --truncate

Texts come from the arguments, or from stdin when there are none or the only one is `-` (one text
per line; empty lines are skipped, so row i of the output is the i-th non-empty line). They are
sent in requests of at most --batch-size texts (default: the server's max_sequences_per_request).
`--out` ending in .npy saves float32 [N, D]; .jsonl writes {"index", "text", "tokens",
"embedding"} per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

OUT_SUFFIXES = (".npy", ".jsonl")


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("embed", help="embed texts (server-side tokenizer); print a summary or save them")
    parser.add_argument("texts", nargs="*", help="texts to embed; none or `-`: read lines from stdin")
    parser.add_argument("--truncate", action="store_true",
                        help="cut texts over the model's max_text_tokens instead of failing")
    parser.add_argument("--chunk", action="store_true",
                        help="encode texts over max_text_tokens as overlapping windows, pooled into one embedding")
    parser.add_argument("--pooling", choices=["default", "mean", "first"], default="default")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="L2-normalise (default: the export's setting)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="texts per request (default: the server's max_sequences_per_request)")
    parser.add_argument("--out", type=Path, help="save the vectors: FILE.npy (float32 [N, D]) or FILE.jsonl")
    return parser


def read_texts(arguments: list[str], stdin: TextIO) -> list[str]:
    """The arguments, or stdin's non-empty lines (without their line ending) for none or `-`."""
    if arguments and arguments != ["-"]:
        return list(arguments)
    return [line.rstrip("\r\n") for line in stdin if line.rstrip("\r\n")]


def run(client, args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if args.out is not None and args.out.suffix not in OUT_SUFFIXES:
        print(f"error: --out {args.out}: use a .npy or .jsonl file", file=sys.stderr)
        return 2
    texts = read_texts(args.texts, stdin)
    if not texts:
        print("error: no texts (give them as arguments, or as lines on stdin)", file=sys.stderr)
        return 2
    size = args.batch_size or client.model_info().limits.max_sequences_per_request or 32
    vectors, counts, cut, metadata = [], [], [], None
    for start in range(0, len(texts), size):
        out = client.embed(texts[start:start + size], truncate=args.truncate, chunk=args.chunk,
                           pooling=args.pooling, normalize=args.normalize)
        vectors.append(out.embeddings)
        counts.extend(out.token_counts)
        cut.extend(out.truncated)
        metadata = out.metadata
    embeddings = np.concatenate(vectors).astype(np.float32, copy=False)  # (N, D)
    if args.out is not None:
        save(args.out, texts, embeddings, counts, cut)
    m = metadata
    print(f"model={m.model_name} provider={m.execution_provider} texts={len(texts)} dims={embeddings.shape[1]} "
          f"tokens={sum(counts)} truncated={sum(cut)}" + (f" saved={args.out}" if args.out is not None else ""),
          file=stdout)
    if args.out is None:
        for i, (text, vector, count) in enumerate(zip(texts, embeddings, counts)):
            shown = text if len(text) <= 40 else text[:37] + "..."
            head = [round(float(x), 4) for x in vector[:4]]
            flag = " truncated" if i < len(cut) and cut[i] else ""
            print(f"text[{i}] tokens={count}{flag} norm={np.linalg.norm(vector):.4f} head={head} {shown!r}",
                  file=stdout)
    return 0


def save(path: Path, texts: list[str], embeddings: np.ndarray, counts: list[int], cut: list[bool]) -> None:
    if path.suffix == ".npy":
        np.save(path, embeddings)
        return
    with open(path, "w", encoding="utf-8") as handle:
        for i, (text, vector, count, truncated) in enumerate(zip(texts, embeddings, counts, cut)):
            record = {"index": i, "text": text, "tokens": int(count), "truncated": bool(truncated),
                      "embedding": [float(x) for x in vector]}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
