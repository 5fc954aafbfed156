"""A small client for the encoder service, and a CLI.

    client = EncoderClient("127.0.0.1:50051")
    out = client.encode([[1, 2, 3], [4, 5]], mask="sliding_window", window=2, hidden_states=True)
    out.embeddings  # float32 [2, d_model]
    out = client.embed(["some text", "more"], truncate=True)  # models with a tokenizer
    out.embeddings, out.token_counts  # float32 [2, d_model] (the export's pooling), (4, 3)

    python -m client encode --ids 1,2,3 --ids 4,5 --mask causal
    python -m client embed "some text" "more" [--out vectors.npy | --out vectors.jsonl]
    cat lines.txt | python -m client embed -        (client/embed.py)
    python -m client info
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model.mask_kinds import MaskKind
from serve.protocols.pb import admin_pb, admin_pb_grpc, pb, pb_grpc
from serve.protocols.tensors import from_numpy, to_numpy

_POOLING = {None: pb.POOLING_DEFAULT, "default": pb.POOLING_DEFAULT, "none": pb.POOLING_NONE,
            "mean": pb.POOLING_MEAN, "first": pb.POOLING_FIRST, "last": pb.POOLING_LAST}
SERVICE = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name  # "encoder.v1.EncoderService"
RETRYABLE = ("UNAVAILABLE",)  # not RESOURCE_EXHAUSTED: it also means "too large", which a retry cannot fix
MAX_ATTEMPTS = 5  # gRPC clamps retryPolicy.maxAttempts to 5


def service_config(retries: int, backoff_s: float, max_backoff_s: float) -> str | None:
    """The channel's gRPC service config (JSON) for `retries` > 0, else None (one attempt, fail fast).

    - Client-side health checking (round_robin + healthCheckConfig): an address counts as ready only
      while its health for encoder.v1.EncoderService is SERVING, so calls skip a replica that is
      loading or draining, and (waitForReady) wait for one that serves instead of failing on a server
      that is starting, restarting or unreachable.
    - retryPolicy: an UNAVAILABLE answer (the race between a drain or restart and the health update)
      is retried with jittered exponential backoff, at most min(retries + 1, 5) attempts, with retry
      throttling; the call's one deadline covers the waiting, every attempt and every backoff."""
    if retries <= 0:
        return None
    initial = max(backoff_s, 0.001)  # gRPC refuses a zero backoff
    method = {"name": [{"service": SERVICE}], "waitForReady": True,
              "retryPolicy": {"maxAttempts": min(retries + 1, MAX_ATTEMPTS), "initialBackoff": f"{initial:.3f}s",
                              "maxBackoff": f"{max(max_backoff_s, initial):.3f}s", "backoffMultiplier": 2,
                              "retryableStatusCodes": list(RETRYABLE)}}
    return json.dumps({"methodConfig": [method], "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
                       "loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SERVICE}})


@dataclass(frozen=True)
class EncodeOutput:
    request_id: str
    embeddings: np.ndarray | None  # float32 [B, D] (None when pooling="none")
    hidden_states: list[np.ndarray] | None  # one float32 [T_i, D] per sequence, when asked for
    metadata: "pb.ResponseMetadata"
    token_counts: tuple[int, ...] = ()  # tokens per sequence / text (after truncation, special tokens included)
    truncated: tuple[bool, ...] = ()  # texts only: which were cut to the model's max_text_tokens (truncate=True)
    chunks: tuple[int, ...] = ()  # texts only, chunk=True: windows each text was encoded in
    attention_paths: tuple[str, ...] = ()  # the attention path each sequence ran on (dense | sparse | linear)


def build_request(
    sequences: Sequence, *, mask: str | MaskKind | None = None, causal: bool = False, window: int = 0,
    step: int = 0, custom: np.ndarray | None = None, hidden_states: bool = False, pooling: str | None = None,
    normalize: bool | None = None, request_id: str = "", texts: Sequence[str] = (), truncate: bool = False,
    chunk: bool = False, prompt_name: str | None = None, dimensions: int | None = None,
) -> "pb.EncodeRequest":
    """An EncodeRequest of token-id / feature `sequences`, or of `texts` (send one of the two). `mask` None
    (and no causal / window / step / custom): no mask is sent, so the model's natural mask applies."""
    kind = mask if isinstance(mask, MaskKind) or mask is None else MaskKind.parse(mask)
    if kind is None and (causal or window or step or custom is not None):
        kind = MaskKind.BIDIRECTIONAL
    tensors = []
    for seq in sequences:
        array = np.asarray(seq)
        if array.dtype.kind in "iu":
            array = array.astype(np.int64, copy=False)
        elif array.dtype.kind == "f":
            array = array.astype(np.float32, copy=False)
        tensors.append(from_numpy(array))
    msg = pb.EncodeRequest(
        request_id=request_id, sequences=tensors, texts=list(texts), truncate=truncate, chunk=chunk,
        mask=pb.Mask(kind=int(kind), causal=causal, window=window, step=step) if kind is not None else None,
        output=pb.OutputOptions(hidden_states=hidden_states, pooling=_POOLING[pooling]),
    )
    if custom is not None:
        msg.mask.custom.CopyFrom(from_numpy(np.asarray(custom, bool)))
    if normalize is not None:
        msg.output.normalize = normalize
    if dimensions is not None:  # Matryoshka: the first N values of each embedding
        msg.output.dimensions = dimensions
    if prompt_name is not None:  # one of the model's prompts (GetModelInfo prompts), put before each text
        msg.prompt_name = prompt_name
    return msg


def parse_response(response: "pb.EncodeResponse") -> EncodeOutput:
    embeddings = [to_numpy(r.embedding, "embedding", answer=True) for r in response.results
                  if r.HasField("embedding")]
    hidden = [to_numpy(r.hidden_states, "hidden_states") for r in response.results if r.HasField("hidden_states")]
    return EncodeOutput(
        request_id=response.request_id,
        embeddings=np.stack(embeddings) if embeddings else None,
        hidden_states=hidden or None,
        metadata=response.metadata,
        token_counts=tuple(response.metadata.token_counts),
        truncated=tuple(response.metadata.truncated),
        chunks=tuple(response.metadata.chunks),
        attention_paths=tuple(response.metadata.attention_paths),
    )


def _pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes, or a path to a PEM file."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as handle:
        return handle.read()


class EncoderClient:
    """`timeout` is each call's one overall deadline (None: none). With `retries` > 0 the channel uses
    gRPC's own retry machinery (`service_config`): calls wait, within that deadline, for a replica
    whose health is SERVING (one that is starting, restarting, loading, draining or unreachable is
    skipped), and an UNAVAILABLE answer is retried with jittered, capped exponential backoff
    (`backoff_s` doubling up to `max_backoff_s`; gRPC allows at most 4 retries). `retries=0`: one
    attempt, failing fast. Encode is idempotent; ReloadModel and health are never retried.

    TLS: `tls=True` (system roots) or `tls_ca` (PEM bytes or path); mTLS adds `tls_cert` + `tls_key`.
    `token` is sent as `authorization: Bearer <token>` on every call (health included, harmlessly).
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = 30.0, retries: int = 3,
                 backoff_s: float = 0.1, max_backoff_s: float = 2.0, max_message_bytes: int = 256 * 1024 * 1024,
                 tls: bool = False, tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None, token: str | None = None) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # reconnect soon after a restart rather than after gRPC's default backoff (up to 120 s)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(max(max_backoff_s, 0.1) * 1000)),
        ]
        if tls or tls_ca or tls_cert:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_ca), private_key=_pem(tls_key), certificate_chain=_pem(tls_cert))
            self._open = lambda extra: grpc.secure_channel(target, credentials, options=options + extra)
        else:
            self._open = lambda extra: grpc.insecure_channel(target, options=options + extra)
        config = service_config(retries, backoff_s, max_backoff_s)
        retrying = [] if config is None else [
            ("grpc.service_config", config), ("grpc.enable_retries", 1),
            ("grpc.per_rpc_retry_buffer_size", max_message_bytes)]  # a request is retried whole, never cut
        self.channel = self._open(retrying)
        self._health_channel = self.channel if config is None else None  # opened when first asked
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = pb_grpc.EncoderServiceStub(self.channel)
        self.timeout, self.retries, self.backoff_s, self.max_backoff_s = timeout, retries, backoff_s, max_backoff_s

    def close(self) -> None:
        if self._health_channel not in (None, self.channel):
            self._health_channel.close()
        self.channel.close()

    def __enter__(self) -> "EncoderClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request):
        return method(request, timeout=self.timeout, metadata=self.metadata)

    def encode(self, sequences: Sequence, **options) -> EncodeOutput:
        return parse_response(self._call(self.stub.Encode, build_request(sequences, **options)))

    def embed(self, texts: Sequence[str], *, truncate: bool = False, chunk: bool = False,
              **options) -> EncodeOutput:
        """Embeds `texts` in one request (the server tokenizes); `truncate` cuts over-long texts,
        `chunk` encodes them as overlapping windows pooled into one embedding per text."""
        request = build_request((), texts=[texts] if isinstance(texts, str) else list(texts), truncate=truncate,
                                chunk=chunk, **options)
        return parse_response(self._call(self.stub.Encode, request))

    def model_info(self) -> "pb.ModelInfo":
        return self._call(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    def reload_model(self, export_dir: str = "", graph: str = ""):
        """encoder.v1.AdminService/ReloadModel (server started with --admin); not retried."""
        stub = admin_pb_grpc.AdminServiceStub(self.channel)
        return stub.ReloadModel(admin_pb.ReloadModelRequest(export_dir=export_dir, graph=graph),
                                timeout=self.timeout, metadata=self.metadata)

    def health(self, service: str = "") -> str:
        """The server's health status, NOT_SERVING included (on a channel without health checking,
        which would refuse to call a server that is not SERVING)."""
        if self._health_channel is None:
            self._health_channel = self._open([])
        stub = health_pb2_grpc.HealthStub(self._health_channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout,
                              metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", allow_abbrev=False)
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call, retries and waiting included")
    parser.add_argument("--retries", type=int, default=3,
                        help="retries on UNAVAILABLE, with backoff (at most 4); 0: one attempt, fail fast")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    parser.add_argument("--tls-ca", help="PEM CA bundle to verify the server (implies TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate (mTLS); with --tls-key")
    parser.add_argument("--tls-key", help="PEM client private key (mTLS)")
    parser.add_argument("--token", help='bearer token; prefer --token "$ENCODER_AUTH_TOKEN" from a secret')
    sub = parser.add_subparsers(dest="command", required=True)
    enc = sub.add_parser("encode", help="encode token ids and print a summary")
    enc.add_argument("--ids", action="append", required=True, help="comma-separated token ids; repeat per sequence")
    enc.add_argument("--mask", default=None, help=", ".join(k.label for k in MaskKind) + " (default: the model's own)")
    enc.add_argument("--causal", action="store_true")
    enc.add_argument("--window", type=int, default=0)
    enc.add_argument("--step", type=int, default=0)
    enc.add_argument("--pooling", choices=["default", "none", "mean", "first", "last"], default="default")
    enc.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None)
    enc.add_argument("--hidden", action="store_true", help="also return per-token hidden states")
    sub.add_parser("info", help="print the served model")
    sub.add_parser("health", help="print the health status")
    from client import embed  # the `embed` command (texts -> sentence embeddings)

    embed.add_parser(sub)
    reload = sub.add_parser("reload", help="swap in a new export directory without downtime (server --admin)")
    reload.add_argument("--export-dir", default="", help="default: re-read the one being served")
    reload.add_argument("--graph", default="")
    args = parser.parse_args(argv)
    with EncoderClient(args.target, timeout=args.timeout, retries=args.retries, tls=args.tls, tls_ca=args.tls_ca,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, token=args.token) as client:
        try:
            if args.command == "info":
                print(client.model_info())
            elif args.command == "health":
                print(client.health())
            elif args.command == "embed":
                return embed.run(client, args)
            elif args.command == "reload":
                print(client.reload_model(args.export_dir, args.graph))
            else:
                sequences = [[int(x) for x in ids.split(",") if x.strip()] for ids in args.ids]
                out = client.encode(sequences, mask=args.mask, causal=args.causal, window=args.window,
                                    step=args.step, pooling=args.pooling, normalize=args.normalize,
                                    hidden_states=args.hidden)
                m = out.metadata
                print(f"model={m.model_name} sha256={m.model_sha256[:12]} provider={m.execution_provider} "
                      f"batch_size={m.batch_size} queue_ms={m.timings.queue_ms:.2f} "
                      f"inference_ms={m.timings.inference_ms:.2f} total_ms={m.timings.total_ms:.2f}")
                for i, seq in enumerate(sequences):
                    parts = [f"sequence[{i}] length={len(seq)}"]
                    if out.embeddings is not None:
                        e = out.embeddings[i]
                        parts.append(f"embedding[{e.shape[0]}] norm={np.linalg.norm(e):.4f} head={[round(float(x), 4) for x in e[:4]]}")
                    if out.hidden_states is not None:
                        parts.append(f"hidden_states{list(out.hidden_states[i].shape)}")
                    print(" ".join(parts))
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
