"""The floor under the server-latency target: the thinnest gRPC Encode server Python allows.

`python -m bench.bare_server --export-dir D --graph G --threads N --port-file F` serves
encoder.v1.EncoderService/Encode on 127.0.0.1 with grpcio's sync server, and its handler does only
this: read `sequences[0]` as token ids, pad them into the graph inputs (serve.backend.feeds.pad_batch, one
bidirectional row), `session.run`, and answer the pooled embedding. No validation, no batcher, no metrics,
no interceptors, no health service. The benchmark times it beside the real server and an in-process
`session.run` (bench/model_and_server.py), so one run shows how much of the real server's overhead is gRPC in
Python itself and how much is ours. A measuring tool only: it trusts its input.
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_server", description=__doc__)
    parser.add_argument("--export-dir", required=True)
    parser.add_argument("--graph", default="optimized")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args(argv)

    import grpc
    import numpy as np
    import onnxruntime as ort

    from model.export_format import read_metadata
    from model.mask_kinds import MaskKind
    from serve.assembly.app import write_port_file
    from serve.backend.feeds import Rows, pad_batch
    from serve.protocols.pb import pb, pb_grpc
    from serve.protocols.tensors import from_numpy, to_numpy

    metadata = read_metadata(args.export_dir)
    config = metadata.config
    if config.input_kind != "tokens":
        parser.error("the bare server takes token models only")
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    graph_path, _ = metadata.graph_file(args.export_dir, args.graph, verify=False)
    session = ort.InferenceSession(str(graph_path), options,
                                   providers=["CPUExecutionProvider"])

    class Bare(pb_grpc.EncoderServiceServicer):
        def Encode(self, request, context):
            ids = to_numpy(request.sequences[0], "sequences[0]")
            rows = Rows(ids.astype(np.int64)[None], np.array([len(ids)]), int(MaskKind.BIDIRECTIONAL))
            pooled = session.run(["mean_pooled"], pad_batch([(rows, None)], len(ids), config))[0]
            response = pb.EncodeResponse(request_id=request.request_id)
            response.results.add().embedding.CopyFrom(from_numpy(pooled[0]))
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_EncoderServiceServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    write_port_file(args.port_file, port=port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
