"""The gRPC servicer: protobuf <-> our request types, errors -> status. Nothing more.

Deadlines, metrics and status codes are the shared edge's (serve/protocols/edge.py): every ServeError is mapped
to its status by serve.protocols.status.to_status (the one place); anything else becomes INTERNAL with its type,
never UNKNOWN.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator

from model.mask_kinds import MaskKind
from serve.core.requests import EncodeRequest, EncodeResult, MaskChoice
from serve.protocols.edge import Call, deadline_of, start_call
from serve.core import tasks
from serve.core.engine import Engine
from serve.errors import Unavailable, ValidationError
from serve.protocols.status import to_status
from serve.core.metrics import Metrics
from serve.protocols.pb import pb, pb_grpc
from serve.protocols.tensors import from_numpy, to_numpy

_POOLING = {pb.POOLING_NONE: "none", pb.POOLING_MEAN: "mean", pb.POOLING_FIRST: "first", pb.POOLING_LAST: "last"}


def request_from_proto(msg: "pb.EncodeRequest", engine: Engine, max_bytes: int) -> EncodeRequest:
    size = msg.ByteSize()
    if size > max_bytes:
        raise ValidationError(f"request: {size} bytes exceed max_request_bytes={max_bytes}")
    config = engine.export.config
    layout = "[T]" if config.input_kind == "tokens" else f"[T, {config.d_model}]"
    # at most 2-d here, whatever the model: which dtype and shape it takes is the core's rule
    # (serve/core/requests.py), so features sent to a token model are told it takes INT64/INT32 ids
    sequences = tuple(to_numpy(t, f"sequences[{i}]", layout, 2) for i, t in enumerate(msg.sequences))
    try:  # no mask set: the model's natural mask (resolved by core/requests.py to_rows)
        kind = MaskKind(msg.mask.kind) if msg.HasField("mask") else None
    except ValueError:
        raise ValidationError(f"mask.kind: unknown value {msg.mask.kind}") from None
    custom = (to_numpy(msg.mask.custom, "mask.custom", "[T, T] or [B, T, T]", 3)
              if msg.mask.HasField("custom") else None)
    pooling = _POOLING.get(msg.output.pooling)
    if pooling is None and msg.output.pooling != pb.POOLING_DEFAULT:
        raise ValidationError(f"output.pooling: unknown value {msg.output.pooling}")
    return EncodeRequest(
        sequences=sequences,
        mask=MaskChoice(kind, bool(msg.mask.causal), int(msg.mask.window), int(msg.mask.step), custom),
        hidden_states=bool(msg.output.hidden_states),
        pooling=pooling or "",  # "": the model's default, and normalize None too (the Engine resolves them)
        normalize=msg.output.normalize if msg.output.HasField("normalize") else None,
        request_id=msg.request_id,
        texts=tuple(msg.texts),
        truncate=bool(msg.truncate),
        chunk=bool(msg.chunk),
        prompt_name=msg.prompt_name if msg.HasField("prompt_name") else None,
        truncation_direction=tasks.truncation_direction(msg.truncation_direction or None),
    )


def response_to_proto(result: EncodeResult, engine: Engine, received: float) -> "pb.EncodeResponse":
    results = []
    for out in result.outputs:
        item = pb.SequenceResult()
        if out.hidden_states is not None:
            item.hidden_states.CopyFrom(from_numpy(out.hidden_states))
        if out.embedding is not None:
            item.embedding.CopyFrom(from_numpy(out.embedding))
        if out.scores is not None:
            item.scores.CopyFrom(from_numpy(out.scores))
        results.append(item)
    return pb.EncodeResponse(request_id=result.request_id, results=results,
                             metadata=response_metadata(result, engine, received))


def response_metadata(result: EncodeResult, engine: Engine, received: float) -> "pb.ResponseMetadata":
    """Every method's answer metadata: the model, the timings, the batch, the tokens."""
    return pb.ResponseMetadata(
        model_name=engine.name,
        model_version=engine.export.version,
        model_sha256=engine.export.sha256,
        execution_provider=result.execution_provider,
        timings=pb.Timings(
            queue_ms=result.queue_s * 1e3,
            inference_ms=result.inference_s * 1e3,
            total_ms=(time.monotonic() - received) * 1e3,
        ),
        batch_size=result.batch_size,
        batch_sequence_length=result.batch_length,
        token_counts=list(result.token_counts),
        total_tokens=sum(result.token_counts),
        truncated=list(result.truncated),
        attention_paths=list(result.attention_paths),
        chunks=list(result.chunks),
    )


# encoder.v1's methods -> what they do (serve/core/tasks.py OPERATIONS): a method that does not fit a
# model's task is refused naming the task and the methods that fit it
METHODS = {"Encode": "hidden_states", "Rerank": "rerank", "Classify": "predict", "EmbedSparse": "embed_sparse",
           "Tokenize": "tokenize"}


def rerank_request(msg: "pb.RerankRequest", engine: Engine) -> EncodeRequest:
    engine.check("rerank", "Rerank", METHODS)
    query = tasks.query(msg.query)
    documents = tasks.documents(list(msg.documents))
    return EncodeRequest(sequences=(), pairs=tuple((query, d) for d in documents), request_id=msg.request_id,
                         truncate=bool(msg.truncate), pair_fields=("query", "documents[{i}]"),
                         truncation_direction=tasks.truncation_direction(msg.truncation_direction or None))


def rerank_response(msg: "pb.RerankRequest", result: EncodeResult, engine: Engine, received: float) -> bytes:
    scores = engine.scores(result, msg.raw_scores)[:, 0]
    order = tasks.ranking(scores, msg.top_n or None)
    return pb.RerankResponse(
        request_id=msg.request_id,
        results=[pb.RankedDocument(index=i, score=float(scores[i]),
                                   document=msg.documents[i] if msg.return_documents else "")
                 for i in order.tolist()],
        metadata=response_metadata(result, engine, received)).SerializeToString()


def classify_request(msg: "pb.ClassifyRequest", engine: Engine) -> EncodeRequest:
    engine.check("predict", "Classify", METHODS)
    if msg.texts and msg.pairs:
        raise ValidationError("texts: send either texts or pairs, not both")
    common = dict(sequences=(), request_id=msg.request_id, truncate=bool(msg.truncate),
                  truncation_direction=tasks.truncation_direction(msg.truncation_direction or None))
    if msg.pairs:
        return EncodeRequest(pairs=tuple((p.first, p.second) for p in msg.pairs),
                             pair_fields=("pairs[{i}].first", "pairs[{i}].second"), **common)
    return EncodeRequest(texts=tuple(msg.texts), prompt_name=msg.prompt_name if msg.HasField("prompt_name") else None,
                         **common)


def classify_response(msg: "pb.ClassifyRequest", result: EncodeResult, engine: Engine, received: float) -> bytes:
    ranked = tasks.predictions(engine.scores(result, msg.raw_scores), engine.labels)
    return pb.ClassifyResponse(
        request_id=msg.request_id,
        results=[pb.Classification(labels=[pb.LabelScore(label=label, score=score) for label, score in row])
                 for row in ranked],
        metadata=response_metadata(result, engine, received)).SerializeToString()


def sparse_request(msg: "pb.EmbedSparseRequest", engine: Engine) -> EncodeRequest:
    engine.check("embed_sparse", "EmbedSparse", METHODS)
    return EncodeRequest(sequences=(), texts=tuple(msg.texts), request_id=msg.request_id, truncate=bool(msg.truncate),
                         truncation_direction=tasks.truncation_direction(msg.truncation_direction or None),
                         prompt_name=msg.prompt_name if msg.HasField("prompt_name") else None)


def sparse_response(msg: "pb.EmbedSparseRequest", result: EncodeResult, engine: Engine, received: float) -> bytes:
    return pb.EmbedSparseResponse(
        request_id=msg.request_id,
        results=[pb.SparseEmbedding(indices=index.tolist(), values=values.tolist())
                 for index, values in tasks.sparse_rows(result.scores)],
        metadata=response_metadata(result, engine, received)).SerializeToString()


_DRAINING = object()  # EncodeStream: the server began to drain


class _Message:
    """One EncodeStream message as admission counts a call (`add_callback`): in flight until `end()`."""

    __slots__ = ("_callbacks",)

    def __init__(self) -> None:
        self._callbacks: list = []

    def add_callback(self, callback) -> bool:
        self._callbacks.append(callback)
        return True

    def end(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
SERVICE = pb.DESCRIPTOR.services_by_name['EncoderService'].full_name
ENCODE = f"/{SERVICE}/Encode"
RERANK, CLASSIFY, EMBED_SPARSE = (f"/{SERVICE}/{m}" for m in ("Rerank", "Classify", "EmbedSparse"))


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    def __init__(self, engine: Callable[..., Engine], metrics: Metrics, max_request_bytes: int) -> None:
        # engine(context, on_drain=None): admits the call (counted in flight until it ends, so a drain
        # waits for it); raises Unavailable until loaded, and while shutting down (EncoderServer.admit)
        self._engine = engine
        self._metrics = metrics
        self._max_bytes = max_request_bytes

    def start_encode(self, rpc, request) -> None:
        """Encode, started (serve/transport/rpc.py): admitted, checked and queued here; answered from
        the batcher's thread once its batch has run. No thread waits for it."""
        def submit():
            engine = self._engine(rpc, model=request.model)
            return engine, engine.submit(request_from_proto(request, engine, self._max_bytes), rpc.deadline)

        start_call(self._metrics, "Encode", rpc, submit,
                   lambda engine, result, call: response_to_proto(result, engine, call.received).SerializeToString())

    def _start(self, method: str, rpc, msg, build, render) -> None:
        """A task method, started as Encode is: `build(msg, engine)` makes the core's request (its
        checks), `render(msg, result, engine, received)` the answer's bytes once its batch has run."""
        def submit():
            engine = self._engine(rpc, model=msg.model)
            size = msg.ByteSize()
            if size > self._max_bytes:
                raise ValidationError(f"request: {size} bytes exceed max_request_bytes={self._max_bytes}")
            return engine, engine.submit(build(msg, engine), rpc.deadline)

        start_call(self._metrics, method, rpc, submit,
                   lambda engine, result, call: render(msg, result, engine, call.received))

    def start_rerank(self, rpc, msg) -> None:
        self._start("Rerank", rpc, msg, rerank_request, rerank_response)

    def start_classify(self, rpc, msg) -> None:
        self._start("Classify", rpc, msg, classify_request, classify_response)

    def start_embed_sparse(self, rpc, msg) -> None:
        self._start("EmbedSparse", rpc, msg, sparse_request, sparse_response)

    def Tokenize(self, request, context):
        with Call(self._metrics, "Tokenize", context):
            engine = self._engine(context, model=request.model)
            texts = tasks.texts_of(list(request.texts), "texts")
            engine.limits.check_count(len(texts), "texts")
            tokens = engine.tokenize(texts, request.add_special_tokens if request.HasField("add_special_tokens")
                                     else True, request.prompt_name if request.HasField("prompt_name") else None)
            return pb.TokenizeResponse(results=[pb.TokenizedText(tokens=[pb.Token(**t) for t in row])
                                                for row in tokens])

    def EncodeStream(self, request_iterator, context) -> Iterator["pb.EncodeStreamResponse"]:
        with Call(self._metrics, "EncodeStream", context):
            yield from self._stream(request_iterator, context)

    def _stream(self, request_iterator, context) -> Iterator["pb.EncodeStreamResponse"]:
        pending: queue.Queue = queue.Queue()
        admitting = threading.Lock()  # a request admitted before a drain is queued before its marker

        def on_drain() -> None:  # the server stopped admitting: end after answering what was admitted
            with admitting:
                pending.put(_DRAINING)

        self._engine(context, on_drain=on_drain, model=None)  # counted in flight; each message names its model
        deadline = deadline_of(context)
        tickets = []
        context.add_callback(lambda: [t.cancel() for t in list(tickets)])

        def read() -> None:  # admits each request as it arrives, so a stream's requests batch together
            try:
                for msg in request_iterator:
                    started = time.monotonic()
                    with admitting:
                        try:
                            # each message counts against its model until answered, so an unload or a
                            # reload of that model waits for it (serve/core/admission.py wait_engine)
                            message = _Message()
                            engine = self._engine(message, model=msg.model)
                            try:
                                ticket = engine.submit(request_from_proto(msg, engine, self._max_bytes), deadline)
                            except Exception:
                                message.end()
                                raise
                            ticket.add_done_callback(lambda _, message=message: message.end())
                            tickets.append(ticket)
                            pending.put((started, (engine, ticket), None, msg.request_id))
                        except Exception as error:
                            pending.put((started, None, error, msg.request_id))
            except Exception:  # the client went away or cancelled; nothing left to answer
                pass
            finally:
                pending.put(None)

        threading.Thread(target=read, name="stream-reader", daemon=True).start()
        answered = 0
        while True:
            item = pending.get()
            if item is None:
                return
            if item is _DRAINING:  # retry-safe: every request sent before was answered above
                raise Unavailable(
                    f"server is shutting down; this stream ended after answering its {answered} requests "
                    f"sent before; send the rest to another replica")
            answered += 1
            started, admitted, error, request_id = item
            if admitted is not None:
                engine, ticket = admitted
                try:
                    result = engine.wait(ticket, deadline)
                    self._metrics.sequences.inc(len(result))
                    self._metrics.requests.labels("EncodeStream.item", "OK").inc()
                    yield pb.EncodeStreamResponse(response=response_to_proto(result, engine, started))
                    continue
                except Exception as wait_error:
                    error = wait_error
            code, message = to_status(error)
            self._metrics.requests.labels("EncodeStream.item", code.name).inc()
            yield pb.EncodeStreamResponse(
                response=pb.EncodeResponse(request_id=request_id),
                error=pb.Status(code=code.value[0], message=message),
            )

    def GetModelInfo(self, request, context):
        with Call(self._metrics, "GetModelInfo", context):
            d = self._engine(context, model=request.model).describe()
            return pb.ModelInfo(
                name=d.name, version=d.version, sha256=d.sha256, config_json=d.config_json, opset=d.opset,
                inputs=[pb.TensorInfo(name=i["name"], dtype=i["dtype"], dims=[str(x) for x in i["dims"]])
                        for i in d.inputs],
                outputs=[pb.TensorInfo(name=o["name"], dtype=o["dtype"], dims=[str(x) for x in o["dims"]])
                         for o in d.outputs],
                mask_kinds=list(d.mask_kinds),
                limits=pb.Limits(**d.limits),
                providers=list(d.providers),
                available_providers=list(d.available_providers),
                input_kind=d.input_kind, d_model=d.d_model, vocab_size=d.vocab_size,
                has_tokenizer=d.has_tokenizer, default_pooling=d.default_pooling,
                default_normalize=d.default_normalize, memory_bytes=d.memory_bytes,
                task=d.task, labels=list(d.labels), prompts=dict(d.prompts),
                default_prompt_name=d.default_prompt_name, natural_mask=d.natural_mask,
                embedding_width=d.embedding_width,
            )
