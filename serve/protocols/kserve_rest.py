"""KServe v2 REST (Open Inference Protocol over HTTP, as tritonclient.http speaks it) <-> the v2
protobuf messages of serve/protocols/kserve_v2.py, whose conversion (`request_from_v2`, `response_to_v2`,
`model_metadata`) then runs unchanged: the same checks and the same messages as gRPC ModelInfer.

  GET  /v2                                        server metadata
  GET  /v2/models/{model}[/versions/{version}]    model metadata
  GET  .../ready                                  model readiness (200, else 503)
  POST .../infer                                  inference
  POST /v2/repository/...                         Triton's repository extension (serve/protocols/repository_api.py)
  (GET /v2/health/live and /ready: serve/protocols/health.py)

JSON tensors go into the typed `contents`; tensors in the binary tensor extension (the body is
`Inference-Header-Content-Length` bytes of JSON, then each input's `binary_data_size` bytes in input
order) go into `raw_input_contents` when every input is binary (the common tritonclient case), else into
the typed contents too. Outputs come back as JSON lists, or binary when asked
(`parameters.binary_data` per output, or `binary_data_output` for all).
"""

from __future__ import annotations

import numpy as np
import orjson

from serve.errors import NotFound, ValidationError, clip, quote
from serve.protocols import kserve_v2 as kserve
from serve.protocols import repository_api
from serve.protocols.edge import Api, answer_now, json_object
from serve.protocols.routing import Family, HttpCall, Route

M = kserve.M
HEADER = b"inference-header-content-length"


def error_body(status: int, message: str) -> bytes:
    """KServe v2 REST's error shape, {"error": message}."""
    return orjson.dumps({"error": message})


def metadata_json(engine) -> dict:
    meta = kserve.model_metadata(engine)
    tensor = lambda t: {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}  # noqa: E731
    # "validation" is ours (the export's parity proof per graph): v2 clients ignore a field they do not know;
    # v2 gRPC's ModelMetadataResponse has no room for it (GetModelInfo has it)
    return {"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
            "inputs": [tensor(t) for t in meta.inputs], "outputs": [tensor(t) for t in meta.outputs],
            "validation": engine.describe().validation}


def _set_param(target, key: str, value, where: str) -> None:
    if isinstance(value, bool):
        target[key].bool_param = value
    elif isinstance(value, int):
        target[key].int64_param = value
    elif isinstance(value, float):
        target[key].double_param = value
    elif isinstance(value, str):
        target[key].string_param = value
    else:
        raise ValidationError(f"{where}[{clip(key)}]: {quote(value)} must be a boolean, number or string")


def _flat(data, name: str) -> list:
    """A JSON tensor's data (flat or nested lists) as one flat list."""
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [data]
    while stack:  # iterative: a deeply nested body cannot exhaust the stack
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def _typed(tensor, values: list, name: str) -> None:
    """JSON values into the typed contents field of the tensor's datatype (type errors name the input)."""
    datatype = tensor.datatype
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise ValidationError(f"{name}.data: BYTES values must be strings")
        tensor.contents.bytes_contents.extend(v.encode("utf-8") for v in values)
        return
    field = kserve.CONTENTS_FIELD.get(datatype)
    if field is None:  # kserve.tensor_to_numpy names the datatypes it supports
        return
    ok = {"BOOL": lambda v: isinstance(v, bool), "FP32": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    check = ok.get(datatype, lambda v: isinstance(v, int) and not isinstance(v, bool))
    if not all(check(v) for v in values):
        raise ValidationError(f"{name}.data: values must be {datatype} ({'true/false' if datatype == 'BOOL' else 'numbers'})")
    try:
        getattr(tensor.contents, field).extend(values)
    except (ValueError, TypeError, OverflowError) as error:
        raise ValidationError(f"{name}.data: {error}") from None


def _from_raw(tensor, raw: bytes, name: str) -> list:
    if tensor.datatype == "BYTES":
        return [t for t in kserve.texts_from_v2(tensor, raw)]
    dtype = kserve.DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise ValidationError(f"{name}.datatype: {quote(tensor.datatype)} is not supported; use "
                              f"{', '.join(kserve.DATATYPES)}")
    if len(raw) % dtype.itemsize:
        raise ValidationError(f"{name} binary data: {len(raw)} bytes is not a whole number of {tensor.datatype}")
    return np.frombuffer(raw, dtype).tolist()


def infer_request(body: bytes, header_length: int | None, name: str, version: str):
    """(ModelInferRequest, binary outputs wanted: set of names or True for all) from a REST body."""
    if header_length is not None:
        if not 0 <= header_length <= len(body):
            raise ValidationError(f"Inference-Header-Content-Length: {header_length} is outside the body "
                                  f"({len(body)} bytes)")
        text, binary = body[:header_length], body[header_length:]
    else:
        text, binary = body, b""
    doc = json_object(text)
    msg = M["ModelInferRequest"](model_name=name, model_version=version)
    if not isinstance(doc.get("id", ""), str):
        raise ValidationError("id: must be a string")
    msg.id = doc.get("id", "")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValidationError("parameters: must be an object")
    binary_all = bool(params.get("binary_data_output", False))
    for key, value in params.items():
        if key != "binary_data_output":
            _set_param(msg.parameters, key, value, "parameters")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValidationError("inputs: required, a non-empty list of tensors")
    parsed, offset = [], 0
    for i, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise ValidationError(f"inputs[{i}]: must be an object with name, shape, datatype, data")
        tname = item.get("name")
        if not isinstance(tname, str):
            raise ValidationError(f"inputs[{i}].name: required, a string")
        shape, datatype = item.get("shape"), item.get("datatype")
        label = f"inputs[{clip(tname)}]"
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise ValidationError(f"{label}.shape: required, a list of integers")
        if not isinstance(datatype, str):
            raise ValidationError(f"{label}.datatype: required, a string")
        tensor = msg.inputs.add(name=tname, datatype=datatype)
        try:
            tensor.shape.extend(shape)
        except ValueError as error:
            raise ValidationError(f"{label}.shape: {error}") from None
        tparams = item.get("parameters") or {}
        size = tparams.get("binary_data_size") if isinstance(tparams, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ValidationError(f"{label}.parameters.binary_data_size: {quote(size)} bytes, but "
                                      f"{len(binary) - offset} binary bytes remain")
            parsed.append((tensor, binary[offset:offset + size], label))
            offset += size
        elif "data" in item:
            parsed.append((tensor, item["data"], label))
        else:
            raise ValidationError(f"{label}: no data (send `data`, or binary data with binary_data_size)")
    if offset != len(binary):
        raise ValidationError(f"binary data: {len(binary) - offset} bytes past the inputs' binary_data_size")
    if all(isinstance(data, bytes) for _, data, _ in parsed):
        msg.raw_input_contents.extend(data for _, data, _ in parsed)
    else:
        for tensor, data, label in parsed:
            _typed(tensor, _from_raw(tensor, data, label) if isinstance(data, bytes) else _flat(data, label), label)
    binary_outputs: set[str] | bool = True if binary_all else set()
    outputs = doc.get("outputs") or []
    if not isinstance(outputs, list):
        raise ValidationError("outputs: must be a list")
    for j, out in enumerate(outputs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise ValidationError(f"outputs[{j}]: must be an object with a name")
        msg.outputs.add(name=out["name"])
        oparams = out.get("parameters") or {}
        if isinstance(oparams, dict) and oparams.get("binary_data") and binary_outputs is not True:
            binary_outputs.add(out["name"])
    return msg, binary_outputs


def infer_response(engine, result, requested: list[str], length: int, request_id: str,
                   binary_outputs) -> tuple[bytes, list, bytes]:
    """The REST answer (body, extra headers, content type), rendered from the core's result through
    the same output arrays as gRPC's (kserve.output_arrays), never through protobuf bytes."""
    outputs, tail = [], []
    for name, array in kserve.output_arrays(result, requested, length):
        entry = {"name": name, "datatype": kserve.OUTPUT_DATATYPES[array.dtype.str], "shape": list(array.shape)}
        if binary_outputs is True or name in binary_outputs:
            raw = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            entry["data"] = array.reshape(-1)
        outputs.append(entry)
    doc = {"model_name": engine.name, "model_version": kserve.MODEL_VERSION, "id": request_id,
           "parameters": kserve.response_parameters(result), "outputs": outputs}
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)  # float32 data natively (openai.py)
    if not tail:
        return header, [], b"application/json"
    return header + b"".join(tail), [(HEADER, str(len(header)).encode())], b"application/octet-stream"


def server_metadata(api: Api, rpc, call: HttpCall) -> None:
    """The server's name, version and protocol extensions."""
    answer_now(api, "v2.ServerMetadata", rpc, lambda: orjson.dumps(
        {"name": kserve.SERVER_NAME, "version": kserve.server_version(), "extensions": kserve.EXTENSIONS}))


def model_metadata(api: Api, rpc, call: HttpCall) -> None:
    """A model's name, versions, platform, inputs and outputs."""
    def work() -> bytes:
        kserve.check_version(call.params["model"], call.params.get("version", ""), NotFound)
        return orjson.dumps(metadata_json(api.engine(call.params["model"])))

    answer_now(api, "v2.ModelMetadata", rpc, work)


def model_ready(api: Api, rpc, call: HttpCall) -> None:
    """Whether the model is served and the server ready (200), else 503."""
    def work() -> bytes:
        name = call.params["model"]
        kserve.check_version(name, call.params.get("version", ""), NotFound)
        api.engine(name)  # NotFound naming the served models; Unavailable unless serving
        ready = api.ready()
        rpc.status = 200 if ready else 503
        return orjson.dumps({"name": name, "ready": ready})

    answer_now(api, "v2.ModelReady", rpc, work)


def infer(api: Api, rpc, call: HttpCall) -> None:
    """Inference: the v2 request in JSON (or the binary tensor extension), as gRPC ModelInfer runs it."""
    length = call.header(HEADER.decode())
    if length is not None and not length.isdigit():
        raise ValidationError(f"Inference-Header-Content-Length: {quote(length)} is not a byte count")
    request, binary = infer_request(call.body, int(length) if length is not None else None,
                                    call.params["model"], call.params.get("version", ""))
    rpc.render = lambda answer: answer  # infer_response made the (body, headers, content type)
    kserve.start_infer(api, rpc, request,
                       lambda engine, result, outputs, length, id: infer_response(engine, result, outputs, length,
                                                                                   id, binary),
                       route=rpc.method, routes=call.verbs)


MODEL = "/v2/models/{model}"
VERSION = "/v2/models/{model}/versions/{version}"
FAMILY = Family("kserve", error_body, (
    Route("GET", "/v2", server_metadata, body="none"),
    Route("GET", MODEL, model_metadata, body="none"),
    Route("GET", VERSION, model_metadata, body="none"),
    Route("GET", f"{MODEL}/ready", model_ready, body="none"),
    Route("GET", f"{VERSION}/ready", model_ready, body="none"),
    Route("POST", f"{MODEL}/infer", infer, "encode", body="raw"),
    Route("POST", f"{VERSION}/infer", infer, "encode", body="raw"),
    *repository_api.ROUTES,
))
