"""What the per-row mask choice costs a run: an export's dense graph against the same model exported for the padding
mask alone.

    python -m bench.padding_graph EXPORT_DIR [--shapes 1x16,1x128,8x128,1x512] [--rounds 3] [--runs 1000]
                                  [--work-dir DIR] [--json FILE]

The dense graph computes every mask kind for every row and selects each row's by its `mask_kind` input
(model/masks.py `build_allowed`). This exports EXPORT_DIR's model twice with the project's exporter and optimizer
(symbolic batch and length): as it is, and with `build_allowed` replaced by the padding rule alone (a row's query
may see each of its own tokens: `attention_mask[:, None, :] != 0`), the graph a request with the model's
bidirectional mask and no custom mask would need. Both are run on one ONNX Runtime thread (no spinning, as the
server) at each (batch, length) with that mask; reported: the node counts after optimization, the best of
`--rounds` rounds of `--runs` runs, their ratio, and the largest difference between the two graphs' outputs (0:
the same arithmetic), there and on one batch of rows of unequal lengths. The weights are a fresh model of the
export's configuration (seed 0): the cost of a run does not depend on them. An experiment for planning
(docs/performance.md "The lone call against its floor, again"): the server does not serve such a graph.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

SHAPES = "1x16,1x128,8x128,1x512"
MIXED_LENGTHS = [7, 2, 5]  # one batch with padding inside it, for the outputs' comparison


def padding_rule(attention_mask, mask_kind, mask_causal, mask_window, mask_step, custom_mask):
    """`build_allowed` for a padding mask alone: every row's query sees each of its own tokens."""
    length = attention_mask.shape[1]
    return (attention_mask[:, None, :] != 0).expand(-1, length, -1)


def export_graphs(config, out_dir: Path) -> dict[str, Path]:
    """{"full": the dense graph, "padding": the padding-mask graph}, each optimized as the export's served graph."""
    import torch

    import model.encoder as encoder
    from export import exporter
    from export.contract import ExportContract
    from export.optimize import build_optimized

    torch.manual_seed(0)
    model = encoder.build_encoder(config).eval()
    contract = ExportContract(config)
    dense = exporter.with_path(model, contract.path)
    kwargs, dynamic = exporter.trace_arguments(contract)
    graphs = {}
    for name in ("full", "padding"):
        plain, optimized = out_dir / f"{name}.onnx", out_dir / f"{name}.optimized.onnx"
        # traced directly, not through export/trace_cache.py: its key (the configuration) is the same for both
        patched = name == "padding"
        with mock.patch.object(encoder, "build_allowed", padding_rule) if patched else contextlib.nullcontext():
            exporter._trace(dense, contract, plain, kwargs, dynamic, False)
        build_optimized(str(plain), str(optimized), config)
        graphs[name] = optimized
    return graphs


def time_runs(session, feeds: dict, rounds: int, runs: int) -> float:
    """The best round's seconds per run."""
    for _ in range(min(runs, 100)):
        session.run(None, feeds)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(runs):
            session.run(None, feeds)
        best = min(best, (time.perf_counter() - started) / runs)
    return best


def measure(config, graphs: dict[str, Path], shapes: list[tuple[int, int]], rounds: int, runs: int) -> dict:
    """Per shape: both graphs' time per run, node counts and their outputs' largest difference; and that difference
    on one batch of rows of unequal lengths."""
    import onnx
    import onnxruntime as ort

    from export.cases import MaskSpec, make_feeds

    sessions, nodes = {}, {}
    for name, path in graphs.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        nodes[name] = len(onnx.load(str(path), load_external_data=False).graph.node)

    def taken(name: str, feeds: dict) -> dict:  # the padding graph has no mask-choice inputs
        names = {i.name for i in sessions[name].get_inputs()}
        return {k: v for k, v in feeds.items() if k in names}

    def outputs_of(name: str, feeds: dict) -> list:
        return sessions[name].run(None, taken(name, feeds))

    # rows of unequal lengths (padding inside the batch): the two graphs' outputs, compared once
    mixed = make_feeds(config, MIXED_LENGTHS, MaskSpec(), seed=2)
    mixed_difference = max(float(np.abs(a - b).max())
                           for a, b in zip(outputs_of("full", mixed), outputs_of("padding", mixed)))
    rows = []
    for batch, length in shapes:
        feeds = make_feeds(config, [length] * batch, MaskSpec(), seed=1)
        seconds = {name: time_runs(session, taken(name, feeds), rounds, runs) for name, session in sessions.items()}
        difference = max(float(np.abs(a - b).max()) for a, b in zip(outputs_of("full", feeds),
                                                                      outputs_of("padding", feeds)))
        rows.append({"batch": batch, "length": length, "full_us": seconds["full"] * 1e6,
                     "padding_us": seconds["padding"] * 1e6, "ratio": seconds["padding"] / seconds["full"],
                     "full_nodes": nodes["full"], "padding_nodes": nodes["padding"], "max_abs_difference": difference})
    return {"rows": rows, "mixed_lengths": MIXED_LENGTHS, "mixed_max_abs_difference": mixed_difference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.padding_graph", description=__doc__.split("\n")[0])
    parser.add_argument("export_dir")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated BATCHxLENGTH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--work-dir", help="where the two graphs are written (default: a temporary folder)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from model.config import from_json

    metadata = json.loads((Path(args.export_dir) / "metadata.json").read_text())
    config = from_json(json.dumps(metadata["config"]))
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(config, export_graphs(config, work), shapes, args.rounds, args.runs)
    for row in result["rows"]:
        print(f"({row['batch']}, {row['length']}): full {row['full_us']:9.1f} µs ({row['full_nodes']} nodes), "
              f"padding mask alone {row['padding_us']:9.1f} µs ({row['padding_nodes']} nodes), "
              f"{row['ratio']:.2f}x, outputs differ by {row['max_abs_difference']:.1e}")
    print(f"rows of lengths {MIXED_LENGTHS} in one batch: outputs differ by {result['mixed_max_abs_difference']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"export_dir": args.export_dir, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
