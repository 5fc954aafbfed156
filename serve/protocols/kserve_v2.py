"""KServe v2 / Open Inference Protocol gRPC service (`inference.GRPCInferenceService`) on the same core.

tritonclient.grpc and KServe clients work unchanged. The servicer converts v2 messages to the encode verb's
request (serve/core/tasks/encode.py) and its result back, nothing more: validation, admission and batching
are the core's, and deadline, metrics and status codes are the shared edge's (serve/protocols/edge.py), as
for the Encode service.

The v2 view of the served export (ModelMetadata says the same):
  inputs   input_ids       INT64|INT32 [B, T]     (inputs_embeds FP32 [B, T, D] for feature models)
           attention_mask  INT64|INT32 [B, T]     optional; 1s then 0s per row (right padding),
                                                  default all ones
           custom_mask     BOOL [T, T] or [B, T, T]  only with mask_kind=custom; rows of unequal length
                                                  (attention_mask): row i uses its top-left [T_i, T_i]
           texts           BYTES [B]              UTF-8 texts instead of input_ids, for exports with a
                                                  tokenizer (serve/core/text.py, as Encode's `texts`)
  outputs  last_hidden_state  FP32 [B, T, D]      zeros at padded positions
           embeddings         FP32 [B, D]         pooled per `pooling` (model default: mean); with parameter
                                                  encoding: INT8 / UINT8 [B, D] (int8, uint8) or
                                                  INT8 / UINT8 [B, ceil(D / 8)] (binary, ubinary)
  request parameters (all optional): mask_kind (label or int), window, step, causal,
           pooling ("mean" | "first" | "last" | "none"), normalize, dimensions (Matryoshka: the first N
           values of each embedding), truncate (texts over the tokenizer's max_length are cut instead of
           refused), encoding ("float" | "int8" | "uint8" | "binary" | "ubinary": the embeddings' output
           encoding, serve/core/encodings.py)
  With texts, T of last_hidden_state is the longest text's token count.
  response parameters: batch_size (rows in the session.run that computed the request's longest row),
           batch_sequence_length (that run's padded length), execution_provider (as Encode's metadata)
Only the requested outputs are computed (none requested: all of them, as the protocol says).

Message classes live in a PRIVATE descriptor pool built from protos/kserve/v2/grpc_predict_v2.proto
(compiled to a FileDescriptorSet by the build step, `python -m tools.protogen`, and loaded through
serve/protocols/pb.py, which refuses a missing or stale one), not in protobuf's default pool: tritonclient
registers the same `inference.*` names from Triton's grpc_service.proto there, and two files
defining one symbol in one pool is a hard import error. The wire format, and so the service's
method paths, are the same either way.
"""

from __future__ import annotations

import math
from typing import Callable

import grpc
import numpy as np
from google.protobuf import descriptor_pool, message_factory

from serve.core import encodings
from serve.core.engine import Engine
from serve.core.pooling import pooling_name, resolve_pooling
from serve.core.requests import EncodeResult, MaskChoice, mask_choice
from serve.core.tasks import SERVES, encode
from serve.core.tasks.encode import EncodeTask
from serve.core.tasks.inputs import Inputs, TextOptions
from serve.errors import ServeError, ValidationError, clip, listing, quote
from serve.protocols import fields
from serve.protocols.edge import Api, Call, start_task
from serve.protocols.pb import kserve_descriptors
from serve.protocols.tensors import array_from_bytes, check_shape

SERVICE = "inference.GRPCInferenceService"
SERVER_NAME = "onnx-encoder-service"
MODEL_VERSION = "1"  # the one version served; "" (server's choice) also selects it
PLATFORM = "onnxruntime_onnx"
OUTPUTS = ("last_hidden_state", "embeddings")
# the tasks whose v2 outputs are OUTPUTS (pooling picks which are answered): those the embed verb serves
EMBEDDING_TASKS = SERVES["embed"]
# v2 datatype <-> little-endian numpy dtype, and the InferTensorContents field for each.
DATATYPES = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"), "FP32": np.dtype("<f4"), "BOOL": np.dtype("bool")}
OUTPUT_DATATYPES = {"<f4": "FP32", "|i1": "INT8", "|u1": "UINT8"}  # an answer's numpy dtype -> its v2 datatype
CONTENTS_FIELD = {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents",
                  "BOOL": "bool_contents"}
LIST_NAMES = 5  # names listed in a message before "and N more"
EXTENSIONS = ["parameters", "model_repository"]  # model_repository: serve/protocols/repository_api.py


def _load_messages() -> tuple[descriptor_pool.DescriptorPool, dict[str, type]]:
    """The generated v2 descriptors in a private pool: (pool, message classes by name)."""
    pool = descriptor_pool.DescriptorPool()
    for file in kserve_descriptors().file:
        pool.Add(file)
    service = pool.FindServiceByName(SERVICE)
    messages = {}
    for method in service.methods:
        for descriptor in (method.input_type, method.output_type):
            messages[descriptor.name] = message_factory.GetMessageClass(descriptor)
    messages["InferParameter"] = message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.InferParameter"))
    return pool, messages


POOL, M = _load_messages()


class ReflectionPool:
    """What server reflection looks descriptors up in: protobuf's default pool (encoder.v1, health,
    reflection), then the private v2 pool, so grpcurl can list, describe and call
    inference.GRPCInferenceService like the services in the default pool."""

    def __getattr__(self, name: str):  # the Find* lookups grpc_reflection makes; KeyError when neither has it
        def find(*args):
            try:
                return getattr(descriptor_pool.Default(), name)(*args)
            except KeyError:
                return getattr(POOL, name)(*args)
        return find


# -- protobuf -> numpy / our request ----------------------------------------------------------

def _params(msg) -> dict:
    """The request's parameters as {name: value} (serve/protocols/fields.py reads them, leniently: v2 clients
    send booleans and integers as strings too)."""
    return fields.parameter_values(msg.parameters) if msg.parameters else {}


def texts_from_v2(tensor, raw: bytes | None) -> tuple[str, ...]:
    """A BYTES input as UTF-8 strings: typed `bytes_contents`, or raw contents in the v2 / Triton
    serialisation (per element a 4-byte little-endian length, then that many bytes)."""
    name = f"inputs[{clip(tensor.name)}]"
    if tensor.datatype != "BYTES":
        raise ValidationError(f"{name}.datatype: {quote(tensor.datatype)}; texts are BYTES (UTF-8 strings)")
    shape = list(check_shape(tensor.shape, name, "[B]", 1))
    if len(shape) != 1 or shape[0] < 1:
        raise ValidationError(f"{name}.shape: {shape} must be [B] with B >= 1")
    if raw is None:
        items = list(tensor.contents.bytes_contents)
    else:
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise ValidationError(f"{name} raw contents: truncated length prefix at byte {offset}")
            size = int.from_bytes(raw[offset:offset + 4], "little")
            if offset + 4 + size > len(raw):
                raise ValidationError(f"{name} raw contents: element {len(items)} declares {size} bytes, "
                                      f"{len(raw) - offset - 4} remain")
            items.append(raw[offset + 4:offset + 4 + size])
            offset += 4 + size
    if len(items) != shape[0]:
        raise ValidationError(f"{name}: {len(items)} elements for shape {shape}")
    texts = []
    for i, item in enumerate(items):
        try:
            texts.append(bytes(item).decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValidationError(f"{name}[{i}]: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    return tuple(texts)


# the shape each tensor input takes, and the most dimensions it may have (the one rank rule, as Encode's)
LAYOUTS = {"input_ids": "[B, T]", "inputs_embeds": "[B, T, D]", "attention_mask": "[B, T]",
           "custom_mask": "[T, T] or [B, T, T]"}
OTHER_LAYOUT = "[B, T, D]"
MAX_RANK = {name: layout.split(" or ")[-1].count(",") + 1 for name, layout in {**LAYOUTS, "": OTHER_LAYOUT}.items()}


def tensor_to_numpy(tensor, raw: bytes | None) -> np.ndarray:
    """One v2 input (raw bytes or typed contents) as numpy; ValidationError naming the input."""
    dtype = DATATYPES.get(tensor.datatype)
    layout = LAYOUTS.get(tensor.name, OTHER_LAYOUT)
    max_rank = MAX_RANK.get(tensor.name, MAX_RANK[""])
    name = None if dtype is not None and raw is not None and len(tensor.shape) <= max_rank else \
        f"inputs[{clip(tensor.name)}]"
    if dtype is None:
        raise ValidationError(f"{name}.datatype: {quote(tensor.datatype)} is not supported; use "
                              f"{', '.join(DATATYPES)}")
    if raw is not None:
        return array_from_bytes(raw, dtype, tensor.shape, field=name or f"inputs[{clip(tensor.name)}]",
                                data_field=None, type_name=tensor.datatype, layout=layout, max_rank=max_rank)
    shape = check_shape(tensor.shape, name, layout, max_rank)
    count = math.prod(shape)
    field = CONTENTS_FIELD[tensor.datatype]
    others = [f for f in CONTENTS_FIELD.values() if f != field and len(getattr(tensor.contents, f))]
    if others:
        raise ValidationError(f"{name}.contents: values in {', '.join(others)}, but datatype "
                              f"{tensor.datatype} is read from {field}")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise ValidationError(f"{name}.contents: {len(values)} values for shape {list(shape)}")
    return np.asarray(values, dtype=dtype).reshape(shape)


def _row_lengths(attention: np.ndarray | None, batch: int, length: int) -> np.ndarray | None:
    """Each row's length from an attention mask of 1s then 0s (right padding); None when every row is
    `length` long (no mask, or all ones: the common case, found by comparing bytes, `_all_ones`)."""
    if attention is None:
        return None
    if attention.shape != (batch, length):
        raise ValidationError(f"inputs[attention_mask].shape: {list(attention.shape)} must equal the "
                              f"ids' [{batch}, {length}]")
    if _all_ones(attention):
        return None
    lengths = np.count_nonzero(attention, axis=1)
    right_padded = attention == (np.arange(length) < lengths[:, None])  # 1s then 0s, nothing else
    if not right_padded.all():
        row = int(np.flatnonzero(~right_padded.all(axis=1))[0])
        raise ValidationError(f"inputs[attention_mask][{row}]: must be 1s then 0s (right padding)")
    return lengths


_ONES: dict[tuple[str, int], bytes] = {}


def _all_ones(array: np.ndarray) -> bool:
    """Whether every element is 1, as a comparison of bytes (no numpy reduction: most masks are all ones)."""
    key = (array.dtype.str, array.size)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) >= 256:
            _ONES.clear()
        ones = _ONES[key] = np.ones(array.size, array.dtype).tobytes()
    return array.tobytes() == ones


def _names(names) -> str:
    """Client-supplied names for a message: each clipped, at most LIST_NAMES of them."""
    return listing(names, LIST_NAMES)


def _check_inputs(msg, known: set[str]) -> list[str]:
    """Refuses what the v2 protocol leaves ambiguous, naming the input: raw_input_contents that do not
    pair one to one with the inputs, typed contents beside raw ones, an input given twice, an
    unknown input, an output asked for twice. Returns the inputs' names."""
    inputs = msg.inputs
    names = [t.name for t in inputs]
    raw_count = len(msg.raw_input_contents)
    if raw_count not in (0, len(names)):
        raise ValidationError(f"raw_input_contents: {raw_count} entries for {len(names)} inputs; "
                              f"send one per input, in the order of inputs, or none")
    if raw_count:
        typed = [t.name for t in inputs if t.HasField("contents")]
        if typed:
            raise ValidationError(f"inputs[{clip(typed[0])}]: typed contents and raw_input_contents in one "
                                  f"request; the v2 protocol allows one or the other, not both")
    distinct = set(names)
    if len(distinct) != len(names):
        repeated = next(name for name in names if names.count(name) > 1)
        raise ValidationError(f"inputs[{clip(repeated)}]: given {names.count(repeated)} times; send each "
                              f"input once")
    if not distinct <= known:
        raise ValidationError(f"inputs: unknown input(s) {_names(sorted(distinct - known))}; this model takes "
                              f"{', '.join(sorted(known))}")
    outputs = [o.name for o in msg.outputs]
    if len(set(outputs)) != len(outputs):
        twice = next(name for name in outputs if outputs.count(name) > 1)
        raise ValidationError(f"outputs[{clip(twice)}]: requested {outputs.count(twice)} times; ask for "
                              f"each output once")
    return names


def request_from_v2(msg, engine: Engine) -> tuple[EncodeTask, list[str], int]:
    """(the encode task, the outputs to return, the padded length T of the batch: 0 for texts, known only once
    they are tokenized)."""
    tokens = engine.export.config.input_kind == "tokens"
    first = "input_ids" if tokens else "inputs_embeds"
    names = _check_inputs(msg, KNOWN[tokens, engine.export.has_tokenizer])
    raws = msg.raw_input_contents or [None] * len(names)
    params = _params(msg)
    if "texts" in names:
        if len(names) > 1:
            raise ValidationError(f"inputs: send either texts or {first} (with its masks), not both")
        inputs = Inputs(texts_from_v2(msg.inputs[0], raws[0]),
                        text=TextOptions(truncate=_flag(params, "truncate")))
        return _task(msg, params, engine, inputs, _mask(params, None)) + (0,)
    tensors = {name: tensor_to_numpy(t, raw) for name, t, raw in zip(names, msg.inputs, raws)}
    ids = tensors.get(first)
    if ids is None:
        raise ValidationError(f"inputs: missing {first}")
    if ids.ndim < 2 or ids.shape[0] == 0:
        raise ValidationError(f"inputs[{first}].shape: {list(ids.shape)} must be {LAYOUTS[first]} with B >= 1")
    batch, length = ids.shape[0], ids.shape[1]
    lengths = _row_lengths(tensors.get("attention_mask"), batch, length)
    custom = tensors.get("custom_mask")
    if custom is not None:
        custom = _cut_custom(custom, np.full(batch, length, np.int64) if lengths is None else lengths)
    # the tensor itself, with each row's length: the core checks it at once and never cuts it up
    inputs = Inputs(sequences=ids, lengths=lengths)
    return _task(msg, params, engine, inputs, _mask(params, custom)) + (length,)


# the inputs a model takes, by (token ids?, a tokenizer?)
KNOWN = {(tokens, texts): {"input_ids" if tokens else "inputs_embeds", "attention_mask", "custom_mask"}
         | ({"texts"} if texts else set()) for tokens in (True, False) for texts in (True, False)}


def outputs_of(engine: Engine) -> tuple[str, ...]:
    """The v2 outputs of a model: the hidden states, and its embeddings (an embedder; bge-m3: its dense embedding
    beside its ColBERT vectors) or, for a model with a head (serve/core/tasks/), the head's output ("logits"
    [B, labels], "sparse_embedding" [B, vocab]); a late-interaction model's token vectors alone, as its hidden
    states (a document's: v2 has no query)."""
    if engine.task in EMBEDDING_TASKS:
        return OUTPUTS
    if engine.task == "multivector":
        return OUTPUTS[:1]
    return ("last_hidden_state", engine.export.row_output)


def _flag(params: dict, name: str) -> bool:
    return fields.flag(params, name, field=f"parameters.{name}", lenient=True)


def _integer(params: dict, name: str, default: int) -> int:
    return fields.integer(params, name, default, field=f"parameters.{name}", lenient=True)


def _task(msg, params: dict, engine: Engine, inputs: Inputs, mask: MaskChoice) -> tuple[EncodeTask, list[str]]:
    """The encode task for `inputs` with the outputs `msg` asks for (a model with a head answers its head's
    output, raw: the activation and labels are the task APIs')."""
    outputs = outputs_of(engine)
    pooling = pooling_name(str(params.get("pooling") or ""), field="parameters.pooling")
    if engine.task in EMBEDDING_TASKS:  # which outputs a model has depends on its default pooling (ModelMetadata)
        pooling = resolve_pooling(pooling, engine.export.default_pooling)
        requested = [o.name for o in msg.outputs] or [o for o in outputs if o != "embeddings" or pooling != "none"]
    else:
        requested = [o.name for o in msg.outputs] or [outputs[-1]]
    for name in requested:
        if name not in outputs:
            raise ValidationError(f"outputs: unknown output {quote(name)}; this model has {', '.join(outputs)}")
    if engine.task in EMBEDDING_TASKS:
        if "embeddings" in requested and pooling == "none":
            raise ValidationError("outputs: embeddings requested with parameters.pooling='none'")
        if "embeddings" not in requested:
            pooling = "none"
    dimensions = params.get("dimensions")
    encoding, = encodings.names(params.get("encoding") or "float", "parameters.encoding", encodings.TENSOR_ENCODINGS)
    task = EncodeTask(inputs, mask, hidden_states="last_hidden_state" in requested, pooling=pooling,
                      normalize=_flag(params, "normalize") if params.get("normalize") is not None else None,
                      dimensions=None if dimensions is None else _integer(params, "dimensions", 0),
                      request_id=msg.id, encodings=() if encoding == "float" else (encoding,),
                      encoding_field="parameters.encoding")
    return task, requested


def _mask(params: dict, custom: np.ndarray | None) -> MaskChoice:
    if not params and custom is None:
        return NATURAL  # the model's natural mask (resolved by core/requests.py to_rows)
    return mask_choice(params.get("mask_kind"), _flag(params, "causal"), _integer(params, "window", 0),
                       _integer(params, "step", 1), custom, field="parameters.mask_kind")


NATURAL = MaskChoice()


def _cut_custom(custom: np.ndarray | None, lengths: np.ndarray) -> np.ndarray | None:
    """custom_mask [T, T] (every row) or [B, T, T] (one per row), in the ids' padded coordinates, as
    [B, Tmax, Tmax] cut to the longest row; entries past a row's own length are ignored."""
    if custom is None:
        return None
    longest, batch = int(lengths.max()), len(lengths)
    square = custom.ndim in (2, 3) and custom.shape[-1] == custom.shape[-2] >= longest
    if not square or (custom.ndim == 3 and custom.shape[0] != batch):
        raise ValidationError(f"inputs[custom_mask].shape: {list(custom.shape)} must be [T, T] or [{batch}, T, T] "
                              f"with T at least the longest row ({longest})")
    if custom.ndim == 2:
        custom = np.broadcast_to(custom, (batch, *custom.shape))
    return custom[:, :longest, :longest]


def output_arrays(result: EncodeResult, requested: list[str], length: int) -> list[tuple[str, np.ndarray]]:
    """The requested v2 outputs as little-endian arrays (gRPC and REST answer from these, typed by
    OUTPUT_DATATYPES): last_hidden_state float32 [B, T, D] with zeros at padded positions, embeddings float32
    [B, D] or in the encoding asked (int8 / uint8). The core's arrays as they are (views of the run's output),
    padded only when the request's T is wider than its longest row."""
    arrays = []
    for name in requested:
        if name == "last_hidden_state":
            array = result.hidden_states
            if length and array.shape[1] < length:  # every row was padded: the answer keeps the request's T
                array = np.pad(array, ((0, 0), (0, length - array.shape[1]), (0, 0)))
        elif name == "embeddings" and result.encoded:  # the one encoding asked (serve/core/tasks/encode.py)
            array = next(iter(result.encoded.values()))
        else:
            array = result.embeddings if name == "embeddings" else result.scores  # a head's output
        arrays.append((name, array if array.dtype.itemsize == 1 else array.astype("<f4", copy=False)))
    return arrays


def response_parameters(result: EncodeResult) -> dict:
    """What Encode's ResponseMetadata says of the run, as v2 response parameters (module docstring)."""
    return {"batch_size": result.batch_size, "batch_sequence_length": result.batch_length,
            "execution_provider": result.execution_provider}


def response_to_v2(result: EncodeResult, requested: list[str], length: int, model_name: str, request_id: str):
    response = M["ModelInferResponse"](model_name=model_name, model_version=MODEL_VERSION, id=request_id)
    for name, array in output_arrays(result, requested, length):
        response.outputs.add(name=name, datatype=OUTPUT_DATATYPES[array.dtype.str], shape=list(array.shape))
        response.raw_output_contents.append(array.tobytes())
    for key, value in response_parameters(result).items():
        if isinstance(value, str):
            response.parameters[key].string_param = value
        else:
            response.parameters[key].int64_param = value
    return response


def grpc_answer(engine: Engine, result: EncodeResult, requested: list[str], length: int, request_id: str) -> bytes:
    """ModelInfer's answer over gRPC: the serialised ModelInferResponse."""
    return response_to_v2(result, requested, length, engine.name, request_id).SerializeToString()


def serves_version(version: str) -> bool:
    """Whether `version` is the one this server serves ("": the server's choice, that one)."""
    return version in ("", MODEL_VERSION)


def check_version(name: str, version: str, error: type = ValidationError) -> None:
    """Refuses a version this server does not serve (`error`: INVALID_ARGUMENT on gRPC, as Triton
    answers; REST passes NotFound: 404). Which models are served is admission's rule
    (serve/core/admission.py: NOT_FOUND naming them)."""
    if not serves_version(version):
        raise error(f"model {quote(name)} has version {MODEL_VERSION!r} only, not {quote(version)}")


def model_metadata(engine: Engine):
    """The ModelMetadataResponse for the served export (gRPC ModelMetadata; REST GET /v2/models/{name})."""
    config = engine.export.config
    T = M["ModelMetadataResponse"].TensorMetadata
    if config.input_kind == "tokens":
        first = T(name="input_ids", datatype="INT64", shape=[-1, -1])
    else:
        first = T(name="inputs_embeds", datatype="FP32", shape=[-1, -1, config.d_model])
    texts = [T(name="texts", datatype="BYTES", shape=[-1])] if engine.export.has_tokenizer else []
    return M["ModelMetadataResponse"](
        name=engine.name, versions=[MODEL_VERSION], platform=PLATFORM,
        inputs=[first, T(name="attention_mask", datatype="INT64", shape=[-1, -1]),
                T(name="custom_mask", datatype="BOOL", shape=[-1, -1, -1]), *texts],
        outputs=[T(name="last_hidden_state", datatype="FP32", shape=[-1, -1, config.vector_dim or config.d_model]),
                 *[T(name=name, datatype="FP32", shape=[-1, _row_width(engine)]) for name in outputs_of(engine)[1:]]],
    )


def _row_width(engine: Engine) -> int:
    """The width of the per-row output: the embeddings' (d_model, or the projection's output), a head's labels,
    or the vocabulary."""
    config = engine.export.config
    if engine.task in EMBEDDING_TASKS:
        return engine.embedding_width
    return config.vocab_size if engine.task == "sparse" else config.num_labels


# -- the servicer -------------------------------------------------------------------------------

METHODS = {"ModelInfer": "encode"}  # the v2 methods that run a task verb (serve/core/tasks/): every model's


class KServeServicer:
    def __init__(self, api: Api) -> None:
        self._api = api

    def _model(self, name: str, version: str, context: grpc.ServicerContext) -> Engine:
        check_version(name, version)
        return self._api.admit(context, model=name)

    def ServerLive(self, request, context):
        return M["ServerLiveResponse"](live=True)

    def ServerReady(self, request, context):
        return M["ServerReadyResponse"](ready=self._api.ready())

    def ModelReady(self, request, context):
        return M["ModelReadyResponse"](ready=model_ready(self._api, request.name, request.version))

    def ServerMetadata(self, request, context):
        return M["ServerMetadataResponse"](name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS)

    def ModelMetadata(self, request, context):
        with Call(self._api.metrics, "v2.ModelMetadata", context):
            return model_metadata(self._model(request.name, request.version, context))

    def start_infer(self, rpc, request) -> None:
        start_infer(self._api, rpc, request)


def start_infer(api: Api, rpc, request, answer: Callable[..., object] | None = None, route: str = "ModelInfer",
                routes=METHODS) -> None:
    """ModelInfer, started (serve/transport/rpc.py): admitted, checked and queued here; answered from the
    batcher's thread once its batch has run, by `answer(engine, result, outputs, length, id)` (gRPC: protobuf
    bytes; REST, serve/protocols/kserve_rest.py: its JSON or binary body)."""
    answer = answer or grpc_answer
    asked = {}  # the outputs and padded length the answer takes (request_from_v2)

    def submit(engine):
        check_version(request.model_name, request.model_version)
        task, asked["outputs"], asked["length"] = request_from_v2(request, engine)
        return encode.submit(engine, task, rpc.deadline)

    start_task(api, "v2.ModelInfer", rpc, request.model_name, "encode", routes, submit,
               lambda engine, result, call: answer(engine, result, asked["outputs"], asked["length"], request.id),
               route)


def model_ready(api: Api, name: str, version: str) -> bool:
    """ModelReady: the server is ready (admission's one readiness) and serves `name` at `version`."""
    if not serves_version(version) or not name or not api.ready():
        return False
    try:
        api.engine(name)
    except ServeError:
        return False
    return True


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onnx-encoder-service")
    except PackageNotFoundError:
        return "0.1.0"


def add_kserve_to_server(api: Api, server) -> None:
    """Registers `inference.GRPCInferenceService` (serve/transport/rpc.py Registry): ModelInfer started (answered
    from its batch), the others as servicer methods. KServe v2 REST (serve/protocols/kserve_rest.py) calls this
    module's functions, not the servicer."""
    servicer = KServeServicer(api)
    handlers = {}
    for method in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"):
        handlers[method] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method, None),
            request_deserializer=M[f"{method}Request"].FromString,
            response_serializer=M[f"{method}Response"].SerializeToString,
        )
    server.add_registered_method_handlers(SERVICE, handlers)
    server.add_started(f"/{SERVICE}/ModelInfer", servicer.start_infer, M["ModelInferRequest"].FromString)
