"""ServerConfig: every server setting, from defaults < environment (ENCODER_*) < command-line flags.

This is the one place that reads the environment. Each field `foo_bar` is the flag `--foo-bar`
and the variable `ENCODER_FOO_BAR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

DEVICES = ("cpu", "cuda", "auto")
TRANSPORTS = ("auto", "native", "grpcio")
ROLES = ("", "front-end")  # "": the server itself (with or without front ends); "front-end": started by it
SPIN_POLICIES = ("run", "always", "never")  # ServerConfig.intra_op_spin
ENV_PREFIX = "ENCODER_"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # containers set 0.0.0.0
    port: int = 50051  # 0: let the OS choose (see port_file)
    # What carries the gRPC bytes (serve/transport/): "native" (gRPC C++, built by `python -m
    # tools.native_build`), "grpcio" (Python's gRPC server), "auto": native where it is built.
    # Every method, check and message is the same on both.
    transport: str = "auto"
    # HTTP (serve/transport/http.py): OpenAI's /v1/embeddings and /v1/models, /v2/health/*, on `host`.
    # 0: the OS chooses (see port_file); -1: off
    http_port: int = 8000
    # HTTP connections (serve/transport/http_connections.py, docs/serving.md "HTTP connections"):
    # idle keep-alive, longer than the balancers in front keep theirs (nginx 75 s; ALB, HAProxy setups 60 s)
    http_keep_alive_s: float = 75.0
    # a request's headers must be whole this long after its connection opened or its first byte came
    # (nginx's client_header_timeout); its body may pause at most this long between two reads
    http_header_timeout_s: float = 60.0
    http_body_timeout_s: float = 60.0
    # open HTTP connections; past it a connection is answered 503 (Retry-After) and closed
    http_max_connections: int = 1024
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464  # Prometheus /metrics on its own port; 0: OS chooses; -1: off
    port_file: str = ""  # when set, the bound ports are written here as JSON once listening
    export_dir: str = "exports/default"
    # Many models (serve/assembly/repository.py, docs/serving.md "Many models"): every subfolder of this
    # folder with a metadata.json is served under the subfolder's name; set, it replaces export_dir
    model_repository: str = ""
    # Models by id (serve/assembly/model_ids.py, docs/serving.md "Models by id"): [NAME=]ORG/NAME[@REVISION] or a
    # checkpoint / export directory; repeatable (comma-joined here and in ENCODER_MODEL). Resolved by
    # huggingface_hub, exported on first use into export_cache, served as a repository: set, they replace
    # export_dir, and model_repository's folders are served beside them
    model: str = ""
    models_file: str = ""  # the same, one per line (# comments): for compose and k8s
    export_cache: str = ""  # "": $XDG_CACHE_HOME/onnx-encoder/exports, else ~/.cache/onnx-encoder/exports
    prepare_only: bool = False  # resolve and export the models into export_cache, then exit 0 (the warm-up job)
    # the graphs exported for them (python -m export --graphs; part of the cache key); "": the exporter's
    # default (add fp16 for CUDA where the model is not rotary: the exporter refuses fp16 for rotary positions)
    export_graphs: str = ""
    # the model a request that names none runs on when more than one is served ("": only one may be)
    default_model: str = ""
    # what loaded models may hold together (graphs, sessions, warm-up arenas), in MiB; a load past it is
    # refused RESOURCE_EXHAUSTED. 0: MEMORY_SHARE of the memory this process may use (cgroup, else host)
    memory_budget_mb: int = 0
    # which metadata.json "graphs" entry to serve; "auto": on CUDA fp16, on CPU optimized, if the export
    # has it, else fp32 (never int8: it is outside the 1e-4 parity bound, so it must be asked for)
    graph: str = "auto"
    device: str = "cpu"  # cpu | cuda | auto
    cuda_device_id: int = 0
    # TF32 tensor-core matmuls for fp32 graphs on CUDA (Ampere and newer). onnxruntime turns them on
    # by default; they round inputs to 10 mantissa bits: measured 7e-4 max abs off PyTorch fp32 on an
    # H100 against 1e-6 without (docs/serving.md). Off: fp32 means fp32. On: faster, less exact.
    cuda_tf32: bool = False
    # Front-end processes (serve/assembly/front_ends.py, docs/serving.md "Front ends"): 0: one process does
    # everything; N >= 1: N processes run the request path (transports, protocols, tokenization, checks,
    # answers) on the server's ports, beside one engine process that holds the models and runs them;
    # -1 (the default): by device, `front_end_count`
    front_ends: int = -1
    # a front end's own settings, set by the engine that starts it (not for users): its role, index and the
    # folder of the wire's sockets
    role: str = ""
    front_end_index: int = 0
    ipc_dir: str = ""
    intra_op_threads: int = 0  # 0: the CPUs this process may run on (sched_getaffinity) / instances
    # How ONNX Runtime's intra-op threads wait for their next piece of work (SPIN_POLICIES): "never" always
    # sleep (each operator wakes them); "run" spin within a run and sleep once it returns; "always" (ONNX
    # Runtime's own default) spin between runs too, taking CPU from the request path and other runs.
    # "never" measured best or equal on every load here (docs/performance.md "Pooled clients and the spin
    # policy"): idle-then-call p50 0.65x run's, 8 pooled HTTP clients 1.22x, the default model 1.17x.
    intra_op_spin: str = "never"
    # Batches run at once, each by its own batcher thread on the one shared session (ONNX Runtime's
    # Run is thread-safe). 2 x 1 thread on a busy 2-core host wastes less CPU in intra-op hand-offs
    # than 1 x 2 (docs/performance.md, against Triton); a lone request then runs on fewer threads.
    # These are the server's run slots, shared by every model (serve/core/scheduler.py). 0: one for
    # --export-dir; for a repository, one per model found at start (at most one per CPU), so models
    # flooded together each run with their share of the CPUs instead of fighting over all of them;
    # with --device cuda at least two (least_run_slots).
    instances: int = 0
    max_batch_size: int = 32  # rows per session.run
    max_batch_tokens: int = 16384  # rows x padded length per session.run
    # How long the first queued request waits for company. 0: no added wait; requests that arrive
    # while a batch runs form the next batch anyway (measured faster here: docs/performance.md).
    max_queue_delay_ms: float = 0.0
    max_queue_size: int = 256  # queued requests before RESOURCE_EXHAUSTED
    # The express run: a request a transport reads while no other call is in flight on it (the native gRPC pump,
    # HTTP's event loop), for an idle model (nothing queued or running, a run slot free, max_queue_delay_ms 0),
    # runs on the transport's own thread when its run is predicted to take at most this long (the model's recent
    # seconds per padded token): no hand-off to the batcher's thread (serve/core/express.py). 0: off.
    express_run_ms: float = 2.0
    # Run a batch of mixed lengths as length-sorted session.runs, each padded to its own longest row,
    # when the padding saved pays for the extra runs; the per-run cost is measured on the backend at
    # start (serve/core/batch_plan.py). Batches still form in arrival order. Off: one run per batch.
    length_split: bool = True
    # the fixed cost of one session.run in token-equivalents for length_split, pinned (-1: measured at start)
    split_overhead_tokens: float = -1.0
    max_sequences_per_request: int = 32
    # Long inputs (serve/core/attention_budget.py). Each row runs on the cheapest attention path the export
    # has for its mask kind (sparse/linear graphs beside the dense one; false: dense only).
    long_paths: bool = True
    # Estimated attention memory a request (and a formed batch) may take; over it: RESOURCE_EXHAUSTED
    # naming the limit and the mask kinds that would fit. 0: half the memory this process may use.
    max_attention_bytes: int = 0
    # Longest sequence admitted; 0: the longest that fits max_attention_bytes on the cheapest path (a
    # learned position table caps it at its own size in any case).
    max_sequence_length: int = 0
    # Hidden states returned in one response at most (a 32k-token row of d_model 256 is 32 MiB); over
    # it the error suggests hidden_states=false or EncodeStream.
    max_response_bytes: int = 256 * 1024 * 1024
    max_request_bytes: int = 16 * 1024 * 1024
    workers: int = 32  # gRPC handler threads
    grace_s: float = 30.0  # drain budget on SIGTERM
    # On SIGTERM, first report not ready (gRPC health NOT_SERVING, HTTP /v2/health/ready 503) while
    # still admitting for this long, so the balancers in front take the replica out before it refuses
    # anything; then drain (grace_s). Compose sets 3 s (HAProxy ejects after 2 failed 1 s checks).
    drain_delay_s: float = 0.0
    # draining ends (gRPC stops) only after this long without a new call: late callers get UNAVAILABLE
    # from our handlers meanwhile, not CANCELLED from a stopping gRPC (serve/assembly/app.py shutdown)
    drain_quiet_ms: float = 500.0
    warmup: bool = True
    log_level: str = "info"
    # --- security (serve/transport/security.py, docs/reliability.md) ---
    tls_cert: str = ""  # PEM server certificate chain; with tls_key: serve TLS instead of plaintext
    tls_key: str = ""  # PEM private key for tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mTLS)
    # when set, every RPC but grpc.health.v1 needs `authorization: Bearer <token>`; kept out of repr
    auth_token: str = dataclasses.field(default="", repr=False)
    max_request_tokens: int = 0  # sequences x longest length per request; 0: max_batch_tokens
    # --- operations (EncoderServer.reload in serve/assembly/app.py, serve/protocols/admin.py, serve/backend/faults.py) ---
    admin: bool = False  # serve encoder.v1.AdminService (ReloadModel); SIGHUP reloads regardless
    fault_inject: str = ""  # TESTS ONLY, e.g. "poison_token=99" (serve/backend/faults.py); empty: off

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not one of {', '.join(DEVICES)}")
        if self.front_ends < -1:
            raise ValueError(f"front_ends must be >= 0 (0: one process), or -1 (by device), got {self.front_ends}")
        if self.intra_op_spin not in SPIN_POLICIES:
            raise ValueError(f"intra_op_spin={self.intra_op_spin!r} is not one of {', '.join(SPIN_POLICIES)}")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is not one of {', '.join(map(repr, ROLES))}")
        for name in ("max_batch_size", "max_batch_tokens", "max_queue_size", "max_sequences_per_request",
                     "max_request_bytes", "max_response_bytes", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_sequences_per_request > self.max_batch_size:
            raise ValueError(
                f"max_sequences_per_request={self.max_sequences_per_request} exceeds "
                f"max_batch_size={self.max_batch_size}: a request must fit in one batch"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be -1 (off) or in 0..65535, got {self.http_port}")
        for name in ("http_keep_alive_s", "http_header_timeout_s", "http_body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.http_max_connections < 1:
            raise ValueError(f"http_max_connections must be >= 1, got {self.http_max_connections}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.express_run_ms < 0:
            raise ValueError(f"express_run_ms must be >= 0 (0: off), got {self.express_run_ms}")
        if self.max_queue_delay_ms < 0 or self.grace_s < 0 or self.drain_quiet_ms < 0 or self.drain_delay_s < 0:
            raise ValueError("max_queue_delay_ms, grace_s, drain_quiet_ms and drain_delay_s must be >= 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both to serve TLS, or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key: client certificates need TLS")
        if self.split_overhead_tokens < 0 and self.split_overhead_tokens != -1:
            raise ValueError(f"split_overhead_tokens must be >= 0, or -1 to measure it, got {self.split_overhead_tokens}")
        if self.max_attention_bytes < 0 or self.max_sequence_length < 0:
            raise ValueError("max_attention_bytes and max_sequence_length must be >= 0 (0: derived)")
        if self.instances < 0:
            raise ValueError(f"instances must be >= 0 (0: one per model), got {self.instances}")
        if self.memory_budget_mb < 0:
            raise ValueError(f"memory_budget_mb must be >= 0 (0: a share of memory), got {self.memory_budget_mb}")
        if self.prepare_only and not (self.model or self.models_file):
            raise ValueError("prepare_only exports the models of model / models_file: name at least one")
        if self.max_request_tokens < 0:
            raise ValueError(f"max_request_tokens must be >= 0, got {self.max_request_tokens}")


def front_end_count(config: ServerConfig, cpus: int | None = None) -> int:
    """The front-end processes to run: ServerConfig.front_ends as set, or for -1 (the default) by device. With
    --device cpu or auto, none: a CPU host needs its cores for ONNX Runtime (one front end cost 19-26 % of the
    tiny model's throughput on 2 CPUs), and auto may fall back to the CPU. With --device cuda, min(8, CPUs // 2)
    and at least 1: there the model needs few cores and one interpreter is the limit (a 16-core H200 host:
    one process 57-80k tokens/s, 8 front ends 287-306k; docs/performance.md "The request path on a GPU host").
    `cpus`: the CPUs this process may run on (default: sched_getaffinity)."""
    if config.front_ends >= 0:
        return config.front_ends
    if config.device != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return max(1, min(8, cpus // 2))


# Run slots a server on CUDA takes at least (ServerConfig.instances = 0): two batches on the device at once, so
# one batch's Python (forming, padding, answering) overlaps the other's run. On a 16-core H200 host with the
# default 8 front ends and 256 clients, two slots against one: gRPC 281k -> 344k tokens/s, HTTP 405k -> 505k,
# the GPU busy 0.48-0.57 -> 0.72-0.75 (docs/performance.md "The request path on a GPU host, again").
CUDA_RUN_SLOTS = 2


def least_run_slots(config: ServerConfig) -> int:
    """The run slots a server takes by default (ServerConfig.instances = 0) before counting its models: two
    with --device cuda (CUDA_RUN_SLOTS); one elsewhere, where one slot keeps batches fuller (docs/serving.md
    "Instances") and auto may end on the CPU."""
    return CUDA_RUN_SLOTS if config.device == "cuda" else 1


def config_environment(config: ServerConfig, **changes) -> dict[str, str]:
    """`config` (with `changes`) as ENCODER_* variables: what another process of this server reads back
    (`load_config`) to run with the same settings."""
    values = dataclasses.asdict(dataclasses.replace(config, **changes))
    return {ENV_PREFIX + name.upper(): (str(value).lower() if isinstance(value, bool) else str(value))
            for name, value in values.items()}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(field: dataclasses.Field):
    return {"bool": _parse_bool, "int": int, "float": float}.get(str(field.type), str)


REPEATABLE = ("model",)  # flags given once per value; the field holds them comma-joined


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev off: a flag is taken only by its whole name (--model must never mean --model-repository)
    parser = argparse.ArgumentParser(prog="python -m serve", description="gRPC encoder service on ONNX Runtime",
                                     allow_abbrev=False)
    for field in dataclasses.fields(ServerConfig):
        flag = "--" + field.name.replace("_", "-")
        extra = {"choices": DEVICES} if field.name == "device" else {}
        if field.name in REPEATABLE:
            extra["action"] = "append"
        parser.add_argument(flag, dest=field.name, type=_converter(field), default=None,
                            help=f"default {field.default!r}; env {ENV_PREFIX}{field.name.upper()}"
                                 + (" (repeatable; comma-separated in the env)" if field.name in REPEATABLE else ""),
                            **extra)
    return parser


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """defaults < ENCODER_* environment < flags. Bad values raise ValueError naming the source."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for field in dataclasses.fields(ServerConfig):
        key = ENV_PREFIX + field.name.upper()
        if key in environ:
            try:
                values[field.name] = _converter(field)(environ[key])
            except ValueError as error:
                raise ValueError(f"{key}={environ[key]!r}: {error}") from None
    args = build_parser().parse_args(argv)
    values.update({k: ",".join(v) if k in REPEATABLE else v for k, v in vars(args).items() if v is not None})
    return ServerConfig(**values)
