"""The front end's and the core's own CPU per request, without the model: `python -m bench.core_cost`.

`bench/front_end.py` measures a real server, where the model's CPU is 95% of the total and the front
end's few percent drown in the noise of attributing pool threads. Here the same code a request runs
through (KServe v2 gRPC: parse the protobuf, `request_from_v2`, the Engine's checks, the batcher, the
answer; KServe v2 REST: the JSON/binary body instead) runs in one process on an Engine whose backend
returns zeros of the right shape at once, so what is measured is the serving code alone: CPU seconds
(process time) per request over N sequential requests, best of `--rounds`. The backend's own cost
(allocating its zeros) is measured apart and subtracted.

Load: one request of `--rows` x `--length` token ids (issue 27: 32 x 128), embeddings asked for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from model.attention_paths import DENSE


class NullBackend:
    """A backend that answers every batch with zeros at once (a finite answer of the right shape)."""

    def __init__(self, export, config) -> None:
        from serve.backend.session import BackendInfo

        self.info = BackendInfo(("CPUExecutionProvider",), ("CPUExecutionProvider",))
        self.d_model = export.config.d_model

    def health(self) -> None:
        pass

    def encode(self, batch, path: str = DENSE, *, wide: bool = False, hidden: bool = True):
        first = batch.get("input_ids", batch.get("inputs_embeds"))
        n, t = first.shape[:2]
        states = np.zeros((n, t, self.d_model), np.float32) if hidden else None
        return states, np.zeros((n, self.d_model), np.float32)


def _v2_grpc_bytes(ids: np.ndarray, model: str) -> bytes:
    from serve.protocols.kserve_v2 import M

    msg = M["ModelInferRequest"](model_name=model)
    tensor = msg.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    del tensor
    msg.outputs.add(name="embeddings")
    msg.raw_input_contents.append(ids.astype("<i8").tobytes())
    return msg.SerializeToString()


def _v2_rest_body(ids: np.ndarray) -> tuple[bytes, int]:
    raw = ids.astype("<i8").tobytes()
    header = json.dumps({"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "embeddings", "parameters": {"binary_data": True}}]}).encode()
    return header + raw, len(header)


def measure(export_dir: str, rows: int, length: int, requests: int, rounds: int) -> dict:
    from serve.assembly.loading import build_engine
    from serve.config import ServerConfig
    from serve.protocols import kserve_rest, kserve_v2

    config = ServerConfig(export_dir=export_dir, warmup=False, length_split=False, http_port=-1)
    engine, _ = build_engine(export_dir, "auto", config, NullBackend)
    try:
        ids = np.random.default_rng(0).integers(1, engine.export.config.vocab_size, (rows, length))
        grpc_bytes = _v2_grpc_bytes(ids, getattr(engine, "name", engine.export.name))
        rest_body, header_length = _v2_rest_body(ids)

        name = getattr(engine, "name", engine.export.name)
        if hasattr(kserve_v2, "grpc_answer"):
            grpc_answer = kserve_v2.grpc_answer
            rest_answer = kserve_rest.infer_response
        else:  # before the core spoke batches (to measure the change against): through protobuf bytes
            def grpc_answer(engine, result, outputs, padded, request_id):
                return kserve_v2.response_to_v2(result, outputs, padded, name, request_id).SerializeToString()

            def rest_answer(engine, result, outputs, padded, request_id, binary):
                payload = grpc_answer(engine, result, outputs, padded, request_id)
                return kserve_rest.infer_response(kserve_v2.M["ModelInferResponse"].FromString(payload), binary)

        if hasattr(engine, "wait"):  # before the task verbs (to measure the change against)
            def run(ours):
                return engine.wait(engine.submit(ours))
        else:  # the encode verb (serve/core/tasks/encode.py), as ModelInfer runs it
            from serve.core.tasks import encode

            def run(ours):
                return encode.submit(engine, ours).wait()

        def grpc_call() -> None:
            msg = kserve_v2.M["ModelInferRequest"].FromString(grpc_bytes)
            ours, outputs, padded = kserve_v2.request_from_v2(msg, engine)
            grpc_answer(engine, run(ours), outputs, padded, msg.id)

        def rest_call() -> None:
            msg, binary = kserve_rest.infer_request(rest_body, header_length, name, "")
            ours, outputs, padded = kserve_v2.request_from_v2(msg, engine)
            rest_answer(engine, run(ours), outputs, padded, msg.id, binary)

        backend = engine.backend
        feeds = {"input_ids": np.zeros((rows, length), np.int64)}

        def backend_call() -> None:
            backend.encode(feeds)

        def per_request(call) -> float:
            best = float("inf")
            for _ in range(rounds):
                for _ in range(10):
                    call()
                started = time.process_time()
                for _ in range(requests):
                    call()
                best = min(best, (time.process_time() - started) / requests)
            return best

        backend_s = per_request(backend_call)
        out = {"rows": rows, "length": length, "requests": requests, "rounds": rounds,
               "backend_us": backend_s * 1e6}
        for name, call in (("v2_grpc", grpc_call), ("v2_rest", rest_call)):
            out[f"{name}_us"] = (per_request(call) - backend_s) * 1e6
        return out
    finally:
        engine.batcher.stop(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", default="exports/default")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-results/core_cost.json")
    args = parser.parse_args(argv)
    result = measure(args.export_dir, args.rows, args.length, args.requests, args.rounds)
    print(f"{args.rows} x {args.length}: v2 gRPC {result['v2_grpc_us']:.0f} us/request, v2 REST "
          f"{result['v2_rest_us']:.0f} us/request of front-end and core CPU (backend's zeros "
          f"{result['backend_us']:.0f} us, subtracted)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
