"""The grpcio transport: the fallback where the native one (serve/transport/native.py) is not built.

grpcio's server carries the bytes (one generic handler, no (de)serialisers: every method is raw) and
each call goes through the same Router as on the native transport (serve/transport/rpc.py), so both
answer alike, error texts included. A grpcio handler thread waits for its call's answer.
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures

import grpc

from serve import logs
from serve.transport.rpc import Registry, Router, Rpc

_DONE = object()


class GrpcioRpc(Rpc):
    def __init__(self, context: grpc.ServicerContext, method: str) -> None:
        remaining = context.time_remaining()
        super().__init__(method, context.invocation_metadata(), remaining)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages, then (_DONE, code, message, payload)

    def _send(self, payload: bytes) -> None:
        self.outbox.put(payload)

    def _close(self, code, message, payload) -> None:
        self.outbox.put((_DONE, code, message, payload))

    def _gone(self) -> None:  # the handler thread stops waiting; grpcio has ended the call already
        self.outbox.put((_DONE, grpc.StatusCode.CANCELLED, "cancelled", None))


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, router: Router, registry: Registry) -> None:
        self._router, self._registry = router, registry
        self._handlers = {}

    def service(self, details):
        method = details.method
        if not self._router.known(method):
            return None  # grpcio's own UNIMPLEMENTED
        handler = self._handlers.get(method)
        if handler is None:
            if self._registry.unary(method) and self._registry.answers_once(method):
                handler = grpc.unary_unary_rpc_method_handler(
                    lambda request, context: self._unary(method, request, context))
            elif self._registry.unary(method):
                handler = grpc.unary_stream_rpc_method_handler(
                    lambda request, context: self._unary_stream(method, request, context))
            else:
                handler = grpc.stream_stream_rpc_method_handler(
                    lambda requests, context: self._stream(method, requests, context))
            self._handlers[method] = handler
        return handler

    def _answer(self, rpc: GrpcioRpc, context):
        context.add_callback(lambda: self._router.cancel(rpc))
        while True:
            item = rpc.outbox.get()
            if isinstance(item, tuple) and item and item[0] is _DONE:
                _, code, message, payload = item
                if payload is not None:
                    yield payload
                if code != grpc.StatusCode.OK:
                    context.abort(code, message)
                return
            yield item

    # a unary call's answer and its status leave in one grpcio batch (served as unary-stream, the message
    # and the status were two sends, the handler thread waiting for the first to complete)
    def _unary(self, method: str, request: bytes, context) -> bytes | None:
        answer = None
        for answer in self._unary_stream(method, request, context):  # one message at most (Registry.answers_once)
            pass
        return answer

    def _unary_stream(self, method: str, request: bytes, context):
        rpc = GrpcioRpc(context, method)
        self._router.start(rpc, request)
        yield from self._answer(rpc, context)

    def _stream(self, method: str, request_iterator, context):
        rpc = GrpcioRpc(context, method)
        self._router.start(rpc, None)

        def read() -> None:
            try:
                for message in request_iterator:
                    self._router.message(rpc, message)
            except Exception:  # the client went away
                pass
            self._router.half_close(rpc)

        threading.Thread(target=read, name="grpcio-reader", daemon=True).start()
        yield from self._answer(rpc, context)


class GrpcioTransport:
    name = "grpcio"

    def __init__(self, address: str, router: Router, registry: Registry, max_receive_bytes: int,
                 credentials: grpc.ServerCredentials | None, workers: int) -> None:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc",
                                       initializer=logs.name_thread, initargs=("grpcio-handler",)),
            options=[("grpc.max_receive_message_length", max_receive_bytes),
                     ("grpc.max_send_message_length", -1)],
        )
        self._server.add_generic_rpc_handlers((_Handler(router, registry),))
        self.port = (self._server.add_insecure_port(address) if credentials is None
                     else self._server.add_secure_port(address, credentials))
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {address}")

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float) -> None:
        self._server.stop(grace).wait()
