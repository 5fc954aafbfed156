"""The floor under the server-latency target: the thinnest gRPC Encode server Python allows.

`python -m bench.bare_server --export-dir D --graph G --threads N --port-file F` serves
encoder.v1.EncoderService/Encode on 127.0.0.1 with grpcio's sync server, and its handler does only
this: read `sequences[0]` as token ids, build the graph inputs with numpy (bidirectional mask, every
token real), `session.run`, and answer the pooled embedding. No validation, no batcher, no metrics,
no interceptors, no health service. The benchmark times it beside the real server and an in-process
`session.run` (bench/run.py), so one run shows how much of the real server's overhead is gRPC in
Python itself and how much is ours. A measuring tool only: it trusts its input.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import numpy as np


def bare_feeds(ids: np.ndarray, input_names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Graph inputs for one token sequence: bidirectional mask, no padding."""
    length = ids.shape[0]
    feeds = {
        "input_ids": ids.astype(np.int64, copy=False)[None, :],
        "attention_mask": np.ones((1, length), np.int64),
        "mask_kind": np.zeros(1, np.int64),
        "mask_causal": np.zeros(1, bool),
        "mask_window": np.zeros(1, np.int64),
        "mask_step": np.ones(1, np.int64),
        "custom_mask": np.ones((1, length, length), bool),
        "token_type_ids": np.zeros((1, length), np.int64),
    }
    return {name: feeds[name] for name in input_names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_server", description=__doc__)
    parser.add_argument("--export-dir", required=True)
    parser.add_argument("--graph", default="optimized")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args(argv)

    import grpc
    import onnxruntime as ort

    from serve.pb import pb, pb_grpc
    from serve.tensors import from_numpy, to_numpy

    meta = json.loads((Path(args.export_dir) / "metadata.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(Path(args.export_dir) / meta["graphs"][args.graph]["file"]), options,
                                   providers=["CPUExecutionProvider"])
    names = tuple(i.name for i in session.get_inputs())
    if names[0] != "input_ids":
        parser.error("the bare server takes token models only")

    class Bare(pb_grpc.EncoderServiceServicer):
        def Encode(self, request, context):
            ids = to_numpy(request.sequences[0], "sequences[0]")
            pooled = session.run(["mean_pooled"], bare_feeds(ids, names))[0]
            response = pb.EncodeResponse(request_id=request.request_id)
            response.results.add().embedding.CopyFrom(from_numpy(pooled[0]))
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_EncoderServiceServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = f"{args.port_file}.tmp"
    Path(tmp).write_text(json.dumps({"port": port}))
    os.replace(tmp, args.port_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
