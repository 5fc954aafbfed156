"""Benchmarks: the index. Each script on one line: what it measures | against what | how to run it.

`python -m bench` runs the main one (the model and the server in one process, one machine, one thread count),
prints a table and writes JSON; docs/performance.md shows every run and how to read it, and records each verdict.
`python -m bench --help` prints this index too. What several scripts share (free ports, starting and stopping
`python -m serve`, RSS, CPU, percentiles, /metrics, closed load loops, verdicts) is bench/harness.py's. Every load
goes to 127.0.0.1 and is bounded in time; nothing here asserts a timing, it reports.

model_and_server.py  model + server, JSON + table | model_and_server_report.TARGETS | python -m bench [--quick]
model_and_server_report.py  those targets judged, and the table | a saved bench.json | used by model_and_server.py
model_bench.py       ms and GFLOP/s per (B, T), engines interleaved | PyTorch eager, matmul rate | in python -m bench
encoder_flops.py     analytic FLOPs of one encoder forward (for GFLOP/s) | - | imported by model_bench.py
server_bench.py      served p50, req/s batching on/off, RSS 1k->20k | in-process session.run | in python -m bench
bare_server.py       no benchmark: gRPC + session.run only, a floor | (the peer itself) | started by server_bench.py
long_input_attention.py  ms, peak RSS per mask kind, T 1k-32k | dense graph, PyTorch SDPA | python -m bench --long
long_input_grpc.py   time(32k)/time(4k), a window row over gRPC | linear work (8x) | python -m bench.long_input_grpc DIR
modernbert_bench.py  ModernBERT-base shape, 8k+: ms, RSS | dense graph, HF sdpa/eager | python -m bench.modernbert_bench
front_end.py         server CPU per request: front end vs model | KServe v2 on one server | python -m bench --front-end
core_cost.py         serving code's own CPU per request, backend nulled | v2 gRPC vs v2 REST | python -m bench.core_cost
gpu_request_path.py  server tokens/s vs in process, GPU busy, 1 and N front ends | the same graph in process |
                     python -m bench.gpu_request_path (a GPU host; --device cpu --quick checks the script)
engine_cost.py       the engine process alone: req/s, CPU per request, device busy | before/after trees
                     (PYTHONPATH) | python -m bench.engine_cost --export-dir E [--run-ms 0.5 --row-ms 0.09]
many_models.py       two models, one host: share, quiet p50 | two processes vs one server | python -m bench --models
infinity_http.py     sentences/s, p50 over /v1/embeddings (+ gRPC) | infinity-emb (peer) | python -m bench.infinity_http
rerank_bench.py      rerank pairs/s, p50 | infinity-emb /rerank, CrossEncoder in process | python -m bench.rerank_bench
big_model.py         a big checkpoint: RSS/weights, tokens/s, cosine | sentence-transformers | python -m bench.big_model
pooled_clients.py    p50/p99 after idle gaps, req/s of 8 | openai, requests, httpx clients; checkouts A/B |
                     python -m bench.pooled_clients EXPORT [--serve-from CHECKOUT ...]
lone_call.py         one client back to back: p50, server CPU per call by thread | checkouts or flags A/B, in turns |
                     python -m bench.lone_call EXPORT [--serve-from CHECKOUT ...] [--with-flags FLAGS ...]
bare_native.py       no benchmark: our native transport + parse + run, the lone call's floor | (the floor itself) |
                     compare.sh with PROJECT_PYTHON=bench/bare_native_python.sh --config 'floor=--bare-floor'
padding_graph.py     session.run, nodes: a graph for the padding mask alone | the export's dense graph (all kinds) |
                     python -m bench.padding_graph EXPORT_DIR (an experiment: the server does not serve it)
soak.py              failures, RSS growth, p99 drift, 70 % load, gRPC + HTTP | its minutes 1, 2 | python -m bench.soak
harness.py           no benchmark: the shared pieces above | - | imported

Targets and peers, by issue (the figures and verdicts: docs/performance.md):
  -       model_and_server_report.TARGETS: ORT fp32 >= 1.5x PyTorch eager, best fp32 graph >= 75 % of matmul, int8 >=
          1.8x ORT fp32, server p50 <= 1.15x in process, batching >= 3x, RSS growth 1k->20k <= 5 %
  12      long_input_attention.TARGETS: time(32k)/time(4k) <= 9, peak RSS at 32k <= 2 GiB, window 128 at 8k >= 4x the
          dense graph and >= 3x PyTorch's masked SDPA, dilated 8 at 8k >= 3x the dense graph
  13, 21  Triton 2.51, same graph, same client: kits outside bench/. Its native ONNX Runtime backend
          (../shared/peers/triton-ort/compare.sh): req/s >= 1.05x, lone p50 <= 1.0x; its python backend with mixed
          lengths (../shared/peers/triton/side_by_side.py): >= 1.6x. front_end.py: Encode's front-end CPU <= 0.2 ms
          per request, Encode within 10 % of KServe v2's throughput
  22, 31  infinity_http.py against infinity-emb (31's goals): short >= 1.6x and >= 0.9x our gRPC, bulk >= 3x, one
          client's p50 <= 0.5x; soak.py: zero failures, RSS growth <= 3 %, p99 of the last minute <= 2x minute 2's
  27      many_models.py: one server's share >= 0.9 and >= 1.4x two processes', a quiet model's p50 <= 2x its idle
          p50; core_cost.py: the serving code's CPU per request before and after a change
  28      modernbert_bench.py: the long-input graph <= 0.45x transformers' sdpa time at 8k
  29      rerank_bench.py: >= 1.5x infinity-emb's fastest engine, >= 2x CrossEncoder in process
  32      big_model.py: server RSS <= 1.3x the weights, tokens/s >= 1.5x sentence-transformers at 8 x 256
  40      Triton's native backend on a 1-layer 32-wide export (compare.sh --export-dir): req/s >= 1.0x, lone p50
          <= 1.2x; the default model no worse than before; gpu_request_path.py: the server >= 0.7x in process;
          engine_cost.py: what bounds that on a GPU host, without one
"""
