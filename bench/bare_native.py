"""The floor under issue 40's lone-request target: our native transport with the least Python a server can have.

`python -m bench.bare_native --export-dir D [--port P] [--port-file F] [--hop]` serves KServe v2
`ModelInfer` on 127.0.0.1:P through the project's own gRPC C++ transport (native/transport.cc, the one
`python -m serve` uses) and does only this per call: parse the protobuf, take `input_ids` as sent, build the
graph's inputs (serve.backend.feeds.pad_batch, one bidirectional row per sequence), `session.run` on a 1-thread
session (the server's choice for a run this small, serve/backend/session.py), and answer the pooled embedding
as raw bytes. No checks, no batcher, no metrics, no deadlines: it trusts its input, so it is a measuring tool
and nothing else. By default the run happens on the transport's pump thread (no thread hop at all); `--hop`
hands each call to one worker thread, as any server that batches must (the real server has that hop).

`../shared/peers/triton-ort/compare.sh` measures it beside Triton and the real server in the same rounds through
bench/bare_native_python.sh (its header says how). Where this floor's lone p50 is over the target's ratio to
Triton, no trimming of the server's Python can close the gap; where it is under, the gap is the server's own
per-request Python (docs/performance.md, "The floor under the lone request").
"""

from __future__ import annotations

import argparse
import queue
import signal
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_native", description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", required=True)
    parser.add_argument("--graph", default="auto", help="as the server's --graph (auto: optimized, else fp32)")
    parser.add_argument("--port", type=int, default=0, help="0: one the OS picks (the port file says which)")
    parser.add_argument("--threads", type=int, default=1, help="the session's intra-op threads")
    parser.add_argument("--hop", action="store_true", help="run each call on a worker thread (one hand-off)")
    parser.add_argument("--finish-here", action="store_true",
                        help="send each answer on the thread that made it, not the transport's writer thread")
    # what compare.sh passes `python -m serve` (so `--python` may point at bench/bare_native_python.sh)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file")
    parser.add_argument("--metrics-port", help="ignored: the floor has no metrics")
    args = parser.parse_args(argv)

    import numpy as np
    import onnxruntime as ort

    from model.mask_kinds import MaskKind
    from serve.assembly.app import write_port_file
    from serve.backend.export_dir import load_export
    from serve.backend.feeds import Rows, pad_batch
    from serve.backend.session import spin_entries
    from serve.config import ServerConfig
    from serve.protocols.kserve_v2 import M
    from serve.transport.native import load_module

    export = load_export(args.export_dir, args.graph, verify=False, long_paths=False)  # "auto": as the server
    config = export.config
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    for key, value in spin_entries(ServerConfig.intra_op_spin):  # the server's default spin policy
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(export.graph_path), options, providers=["CPUExecutionProvider"])
    request_type, response_type = M["ModelInferRequest"], M["ModelInferResponse"]
    bidirectional = int(MaskKind.BIDIRECTIONAL)

    module = load_module()
    transport = module.Transport()
    port = transport.start(f"{args.host}:{args.port}", 64 << 20, None, [])

    def answer(call_id: int, payload: bytes) -> None:
        msg = request_type.FromString(payload)
        index = [t.name for t in msg.inputs].index("input_ids")
        shape = tuple(msg.inputs[index].shape)
        ids = np.frombuffer(msg.raw_input_contents[index], "<i8").reshape(shape)
        rows = Rows(ids, np.full(shape[0], shape[1], np.int64), bidirectional)
        pooled = session.run(["mean_pooled"], pad_batch([(rows, None)], shape[1], config))[0]
        out = response_type(model_name=msg.model_name, id=msg.id)
        out.outputs.add(name="embeddings", datatype="FP32", shape=list(pooled.shape))
        out.raw_output_contents.append(pooled.astype("<f4").tobytes())
        transport.finish(call_id, 0, "", out.SerializeToString(), args.finish_here)

    work: queue.SimpleQueue = queue.SimpleQueue()

    def worker() -> None:
        while (item := work.get()) is not None:
            answer(*item)

    if args.hop:
        threading.Thread(target=worker, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    write_port_file(args.port_file or "", port=port)
    print(f"event=serving model={config.name} sha256={export.sha256} port={port} hop={args.hop}", flush=True)
    while not stop.is_set():
        for event in transport.next(0.25):
            if event[0] != module.START:
                continue
            call_id, method, payload = event[1], event[2], event[3]
            if not method.endswith("/ModelInfer"):
                transport.finish(call_id, 12, f"{method}: not served by the bare floor", None)  # UNIMPLEMENTED
            elif args.hop:
                work.put((call_id, payload))
            else:
                answer(call_id, payload)
    work.put(None)
    transport.stop(1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
