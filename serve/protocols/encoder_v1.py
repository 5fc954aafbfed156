"""The gRPC servicer: protobuf <-> our request types, errors -> status. Nothing more.

Deadlines, metrics and status codes are the shared edge's (serve/protocols/edge.py): every ServeError is mapped
to its status by serve.protocols.status.to_status (the one place); anything else becomes INTERNAL with its type,
never UNKNOWN.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

from serve.core.admission import Held
from serve.core.encodings import TENSOR_ENCODINGS
from serve.core.pooling import POOLINGS
from serve.core.requests import EncodeResult, mask_choice
from serve.core.tasks import classify, encode, rerank, sparse, tokens
from serve.core.tasks.encode import EncodeTask
from serve.core.tasks.inputs import Inputs, TextOptions, direction
from serve.errors import Unavailable, ValidationError
from serve.protocols.edge import Api, Call, deadline_of, start_task
from serve.protocols.pb import pb, pb_grpc
from serve.protocols.status import to_status
from serve.protocols.tensors import from_numpy, to_numpy

# the Pooling enum's values by name (serve/core/pooling.py POOLINGS: the one list of poolings)
_POOLING = {getattr(pb, f"POOLING_{name.upper()}"): name for name in POOLINGS}
# the EmbeddingEncoding enum's values by name (serve/core/encodings.py TENSOR_ENCODINGS: the encodings a tensor
# carries)
_ENCODING = {getattr(pb, f"EMBEDDING_ENCODING_{name.upper()}"): name for name in TENSOR_ENCODINGS}
# encoder.v1's methods that run a task verb (serve/core/tasks/): a method that does not fit a model's task
# is refused naming the task and the methods that fit it
METHODS = {"Encode": "encode", "Rerank": "rerank", "Classify": "classify", "EmbedSparse": "sparse",
           "Tokenize": "tokenize"}


def _prompt(msg) -> str | None:
    return msg.prompt_name if msg.HasField("prompt_name") else None


def _text(msg, prompts: bool = True) -> TextOptions:
    return TextOptions(truncate=bool(msg.truncate), direction=direction(msg.truncation_direction),
                       prompt_name=_prompt(msg) if prompts else None)


def _size(msg, max_bytes: int) -> None:
    size = msg.ByteSize()
    if size > max_bytes:
        raise ValidationError(f"request: {size} bytes exceed max_request_bytes={max_bytes}")


def encode_task(msg: "pb.EncodeRequest", engine) -> EncodeTask:
    config = engine.export.config
    layout = "[T]" if config.input_kind == "tokens" else f"[T, {config.d_model}]"
    # at most 2-d here, whatever the model: which dtype and shape it takes is the core's rule
    # (serve/core/requests.py), so features sent to a token model are told it takes INT64/INT32 ids
    sequences = tuple(to_numpy(t, f"sequences[{i}]", layout, 2) for i, t in enumerate(msg.sequences))
    custom = (to_numpy(msg.mask.custom, "mask.custom", "[T, T] or [B, T, T]", 3)
              if msg.mask.HasField("custom") else None)
    output = msg.output
    pooling = _POOLING.get(output.pooling)
    if pooling is None and output.pooling != pb.POOLING_DEFAULT:
        raise ValidationError(f"output.pooling: unknown value {output.pooling}")
    encoding = _ENCODING.get(output.encoding)
    if encoding is None:
        raise ValidationError(f"output.encoding: unknown value {output.encoding}; one of "
                              + ", ".join(f"{pb.EmbeddingEncoding.Name(code)} ({code})" for code in _ENCODING))
    return EncodeTask(
        Inputs(tuple(msg.texts), sequences, text=_text(msg)),
        # no mask set: the model's natural mask (resolved by core/requests.py to_rows)
        mask_choice(msg.mask.kind if msg.HasField("mask") else None, bool(msg.mask.causal), int(msg.mask.window),
                    int(msg.mask.step), custom, field="mask.kind"),
        hidden_states=bool(output.hidden_states),
        pooling=pooling or "",  # "": the model's default, and normalize None too (the verb resolves them)
        normalize=output.normalize if output.HasField("normalize") else None,
        dimensions=output.dimensions if output.HasField("dimensions") else None,
        chunk=bool(msg.chunk),
        request_id=msg.request_id,
        encodings=() if encoding == "float" else (encoding,),
        encoding_field="output.encoding",
        is_query=bool(msg.is_query),
        maxsim_query=msg.maxsim_query if msg.HasField("maxsim_query") else None,
    )


def response_to_proto(result: EncodeResult, engine, received: float) -> "pb.EncodeResponse":
    results = []
    # the embeddings in the one encoding asked (serve/core/tasks/encode.py made it), else as they are
    embeddings = next(iter(result.encoded.values())) if result.encoded else result.embeddings
    for i, out in enumerate(result.outputs):
        item = pb.SequenceResult()
        if out.hidden_states is not None:
            item.hidden_states.CopyFrom(from_numpy(out.hidden_states))
        if out.embedding is not None:
            item.embedding.CopyFrom(from_numpy(embeddings[i]))
        if out.scores is not None and engine.task == "multivector":  # MaxSim against EncodeRequest.maxsim_query
            item.maxsim_score = float(out.scores[0])
        elif out.scores is not None:
            item.scores.CopyFrom(from_numpy(out.scores))
        results.append(item)
    return pb.EncodeResponse(request_id=result.request_id, results=results,
                             metadata=response_metadata(result, engine, received))


def response_metadata(result: EncodeResult, engine, received: float) -> "pb.ResponseMetadata":
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


def rerank_task(msg: "pb.RerankRequest") -> rerank.RerankTask:
    return rerank.RerankTask(msg.query, tuple(msg.documents), _text(msg, prompts=False), top_n=msg.top_n or None,
                             raw_scores=msg.raw_scores, request_id=msg.request_id,
                             instruction=msg.instruction if msg.HasField("instruction") else None)


def rerank_response(msg: "pb.RerankRequest", result: rerank.Ranking, engine, received: float) -> bytes:
    return pb.RerankResponse(
        request_id=msg.request_id,
        results=[pb.RankedDocument(index=i, score=float(result.scores[i]),
                                   document=msg.documents[i] if msg.return_documents else "")
                 for i in result.order.tolist()],
        metadata=response_metadata(result.run, engine, received)).SerializeToString()


def classify_task(msg: "pb.ClassifyRequest") -> classify.ClassifyTask:
    return classify.ClassifyTask(tuple(msg.texts), tuple((p.first, p.second) for p in msg.pairs),
                                 _text(msg, prompts=not msg.pairs), raw_scores=msg.raw_scores,
                                 request_id=msg.request_id, pair_fields=("pairs[{i}].first", "pairs[{i}].second"))


def classify_response(msg: "pb.ClassifyRequest", result: classify.Predictions, engine, received: float) -> bytes:
    return pb.ClassifyResponse(
        request_id=msg.request_id,
        results=[pb.Classification(labels=[pb.LabelScore(label=label, score=score) for label, score in row])
                 for row in result.ranked],
        metadata=response_metadata(result.run, engine, received)).SerializeToString()


def sparse_task(msg: "pb.EmbedSparseRequest") -> sparse.SparseTask:
    return sparse.SparseTask(Inputs(tuple(msg.texts), text=_text(msg)), request_id=msg.request_id)


def sparse_response(msg: "pb.EmbedSparseRequest", result: sparse.SparseVectors, engine, received: float) -> bytes:
    return pb.EmbedSparseResponse(
        request_id=msg.request_id,
        results=[pb.SparseEmbedding(indices=index.tolist(), values=values.tolist()) for index, values in result.rows],
        metadata=response_metadata(result.run, engine, received)).SerializeToString()


_DRAINING = object()  # EncodeStream: the server began to drain


SERVICE = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name  # "encoder.v1.EncoderService"


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    def __init__(self, api: Api, max_request_bytes: int) -> None:
        self._api = api
        self._metrics = api.metrics
        self._max_bytes = max_request_bytes

    def _start(self, method: str, rpc, msg, submit, render) -> None:
        """A task method, started (serve/transport/rpc.py): admitted, checked and queued here by `submit(engine)`
        (a task verb); answered from the batcher's thread by `render(result, engine, received)`."""
        def checked(engine):
            _size(msg, self._max_bytes)
            return submit(engine)

        start_task(self._api, method, rpc, msg.model, METHODS[method], METHODS, checked,
                   lambda engine, result, call: render(result, engine, call.received), method)

    def start_encode(self, rpc, msg) -> None:
        self._start("Encode", rpc, msg,
                    lambda engine: encode.submit(engine, encode_task(msg, engine), rpc.deadline),
                    lambda result, engine, received: response_to_proto(result, engine, received).SerializeToString())

    def start_rerank(self, rpc, msg) -> None:
        self._start("Rerank", rpc, msg, lambda engine: rerank.submit(engine, rerank_task(msg), rpc.deadline),
                    lambda result, engine, received: rerank_response(msg, result, engine, received))

    def start_classify(self, rpc, msg) -> None:
        self._start("Classify", rpc, msg, lambda engine: classify.submit(engine, classify_task(msg), rpc.deadline),
                    lambda result, engine, received: classify_response(msg, result, engine, received))

    def start_embed_sparse(self, rpc, msg) -> None:
        self._start("EmbedSparse", rpc, msg, lambda engine: sparse.submit(engine, sparse_task(msg), rpc.deadline),
                    lambda result, engine, received: sparse_response(msg, result, engine, received))

    def Tokenize(self, request, context):
        with Call(self._metrics, "Tokenize", context):
            engine = self._api.admit(context, model=request.model)
            task = tokens.TokenizeTask(tuple(request.texts), request.add_special_tokens
                                       if request.HasField("add_special_tokens") else True, _prompt(request))
            return pb.TokenizeResponse(results=[pb.TokenizedText(tokens=[pb.Token(**t) for t in row])
                                                for row in tokens.tokenize(engine, task)])

    def EncodeStream(self, request_iterator, context) -> Iterator["pb.EncodeStreamResponse"]:
        with Call(self._metrics, "EncodeStream", context):
            yield from self._stream(request_iterator, context)

    def _stream(self, request_iterator, context) -> Iterator["pb.EncodeStreamResponse"]:
        pending: queue.Queue = queue.Queue()
        admitting = threading.Lock()  # a request admitted before a drain is queued before its marker

        def on_drain() -> None:  # the server stopped admitting: end after answering what was admitted
            with admitting:
                pending.put(_DRAINING)

        self._api.admit(context, on_drain=on_drain, model=None)  # counted in flight; each message names its model
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
                            message = Held()
                            engine = self._api.admit(message, model=msg.model)
                            try:
                                _size(msg, self._max_bytes)
                                ticket = encode.submit(engine, encode_task(msg, engine), deadline)
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
                    result = ticket.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
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
            d = self._api.admit(context, model=request.model).describe()
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
                validation=[pb.GraphValidation(graph=graph, **proof) for graph, proof in d.validation.items()],
            )


def add_encoder_to_server(api: Api, max_request_bytes: int, server) -> None:
    """Registers `encoder.v1.EncoderService` (serve/transport/rpc.py Registry): its task methods started (answered
    from their batch: no thread waits per call), the others as servicer methods."""
    servicer = EncoderServicer(api, max_request_bytes)
    pb_grpc.add_EncoderServiceServicer_to_server(servicer, server)
    for method, start in (("Encode", servicer.start_encode), ("Rerank", servicer.start_rerank),
                          ("Classify", servicer.start_classify), ("EmbedSparse", servicer.start_embed_sparse)):
        request = getattr(pb, pb.DESCRIPTOR.services_by_name["EncoderService"].methods_by_name[method].input_type.name)
        server.add_started(f"/{SERVICE}/{method}", start, request.FromString)
