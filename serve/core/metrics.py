"""Prometheus metrics, on their own registry and their own HTTP port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


REQUESTS, ENGINE = "requests", "engine"  # the two parts (a front-end process counts requests, the engine the rest)


class _Off:
    """A metric of the part this process does not keep (a front end's `ready`: the engine reports it)."""

    def set(self, value: float) -> None:
        pass


class Metrics:
    """Every metric of the server, in two parts: the requests (counted where they arrive: per method and status,
    their seconds and sequences) and the engine (queues, batches, runs, models, readiness). One process keeps
    both; with --front-ends N each front end keeps the requests part (in prometheus_client's multiprocess files)
    and the engine the rest, serving both on its one port (`serve_http` with `front_ends_dir`)."""

    def __init__(self, parts: tuple[str, ...] = (REQUESTS, ENGINE)) -> None:
        self.registry = CollectorRegistry()
        self._http = None
        self._children: dict[tuple[str, str], tuple] = {}  # (method, code) -> its labelled children
        r = self.registry
        if REQUESTS in parts:
            self.requests = Counter("encoder_requests", "Requests by method and final gRPC status",
                                    ["method", "code"], registry=r)
            self.sequences = Counter("encoder_sequences", "Sequences encoded", registry=r)
            self.total_seconds = Histogram("encoder_request_seconds", "Request received -> response built",
                                           ["method"], buckets=_LATENCY, registry=r)
        self.ready = _Off()
        if ENGINE not in parts:
            return
        self.queue_seconds = Histogram("encoder_queue_seconds", "Admitted -> batch start", buckets=_LATENCY, registry=r)
        self.session_run_cpu = Counter("encoder_session_run_cpu_seconds", "CPU time of the calling (batcher) "
                                       "threads inside session.run; ONNX Runtime's pool threads not included",
                                       registry=r)
        self.inference_seconds = Histogram("encoder_inference_seconds", "session.run of one batch",
                                           buckets=_LATENCY, registry=r)
        self.batch_size = Histogram("encoder_batch_size", "Rows per session.run", buckets=_BATCH, registry=r)
        self.batch_tokens = Histogram("encoder_batch_tokens", "Rows x padded length per session.run",
                                      buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
        self.padding_tokens = Counter("encoder_padding_tokens", "Padding computed: rows x padded length minus "
                                      "the rows' own tokens, over all session.runs", registry=r)
        self.path_rows = Counter("encoder_attention_path_rows", "Rows run per attention path (dense | sparse | "
                                 "linear; model/attention_paths.py)", ["path"], registry=r)
        self.express_runs = Counter("encoder_express_runs", "Requests run on the transport's own thread: an idle "
                                    "model's lone request, no hand-off to its batcher (--express-run-ms)", registry=r)
        self.queue_depth = Gauge("encoder_queue_depth", "Requests waiting for a batch", registry=r)
        self.ready = Gauge("encoder_ready", "1 when loaded, warm and serving", registry=r)
        # per model (a repository serves several; serve/assembly/repository.py)
        self.model_queue_depth = Gauge("encoder_model_queue_depth", "Requests waiting for a batch, per model",
                                       ["model"], registry=r)
        self.model_rows = Counter("encoder_model_rows", "Rows run, per model", ["model"], registry=r)
        self.model_memory = Gauge("encoder_model_memory_bytes", "Each loaded model's share of the memory budget "
                                  "(--memory-budget-mb)", ["model"], registry=r)
        self.model_ready = Gauge("encoder_model_ready", "1 while the model serves", ["model"], registry=r)
        self._depths: dict[str, int] = {}  # queued requests per model (`observer`), read at scrape time
        self.queue_depth.set_function(lambda: sum(self._depths.values()))

    def finished(self, method: str, code: str, seconds: float) -> None:
        """One request of `method` ended with status `code` after `seconds` (the labelled children are
        looked up once: this runs for every request)."""
        children = self._children.get((method, code))
        if children is None:
            children = self._children[(method, code)] = (self.requests.labels(method, code),
                                                           self.total_seconds.labels(method))
        children[0].inc()
        children[1].observe(seconds)

    def observe_batcher(self, *, batch_size: int | None = None,
                        batch_tokens: int | None = None, inference_s: float | None = None,
                        padding_tokens: int | None = None, path: str | None = None,
                        queue_s: list[float] | None = None, run_cpu_s: float | None = None,
                        express: bool = False) -> None:
        if express:
            self.express_runs.inc()
        if batch_size is not None:
            self.batch_size.observe(batch_size)
        if batch_tokens is not None:
            self.batch_tokens.observe(batch_tokens)
        if inference_s is not None:
            self.inference_seconds.observe(inference_s)
        if padding_tokens is not None:
            self.padding_tokens.inc(padding_tokens)
        if path is not None and batch_size is not None:
            self.path_rows.labels(path=path).inc(batch_size)
        if queue_s is not None:  # one value per request the run answered
            for seconds in queue_s:
                self.queue_seconds.observe(seconds)
        if run_cpu_s is not None:
            self.session_run_cpu.inc(run_cpu_s)

    def observer(self, model: str):
        """The batcher's observe callback for `model`: the server totals and the model's own series. Queue
        depths are only noted here (every submit reports one) and read when /metrics is scraped."""
        depths, rows = self._depths, self.model_rows.labels(model)
        self.model_queue_depth.labels(model).set_function(lambda: depths.get(model, 0))

        def observe(queue_depth: int | None = None, **values) -> None:
            if queue_depth is not None:
                depths[model] = queue_depth
                if not values:
                    return
            self.observe_batcher(**values)
            if values.get("batch_size") is not None and values.get("inference_s") is not None:
                rows.inc(values["batch_size"])

        return observe

    def model_loaded(self, model: str, memory_bytes: int) -> None:
        self.model_memory.labels(model).set(memory_bytes)
        self.model_ready.labels(model).set(1)

    def model_unloaded(self, model: str) -> None:
        self._depths.pop(model, None)
        for gauge in (self.model_memory, self.model_ready, self.model_queue_depth):
            try:
                gauge.remove(model)
            except KeyError:
                pass

    def serve_http(self, host: str, port: int, front_ends_dir: str = "") -> int:
        """Starts /metrics; returns the bound port (port 0: the OS chooses). `front_ends_dir`: the front-end
        processes' multiprocess folder, whose request counts are added (summed over the processes)."""
        if front_ends_dir:
            from prometheus_client.multiprocess import MultiProcessCollector

            MultiProcessCollector(self.registry, path=front_ends_dir)
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
