"""`python -m bench [--quick] [--out FILE] ...`: parse arguments, call bench.model_and_server.run_bench."""

from __future__ import annotations

import argparse
import sys

from pathlib import Path

import bench
from bench.long_input_attention import run_long
from bench.model_and_server import BenchOptions, run_bench


def parse_points(text: str) -> tuple:
    """"1x128,8x256" -> ((1, 128), (8, 256))."""
    points = []
    for item in text.split(","):
        batch, length = item.lower().split("x")
        points.append((int(batch), int(length)))
    return tuple(points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, epilog=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # the index, as written
    parser.add_argument("--quick", action="store_true", help="a tiny model and few requests (the test suite)")
    parser.add_argument("--out", default="bench-results/bench.json")
    parser.add_argument("--export-dir", default="", help="benchmark this export instead of exporting one")
    parser.add_argument("--threads", type=int, default=0, help="0: physical cores")
    parser.add_argument("--points", type=parse_points, default=None, help="BxT,... e.g. 1x128,8x256,1x1024")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-model", action="store_true", help="skip the model benchmark")
    parser.add_argument("--no-server", action="store_true", help="skip the server benchmark")
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--serve-graph", default="optimized", help="graph variant the server benchmark serves")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: PyTorch, every session and the server on the GPU (needs onnxruntime-gpu)")
    parser.add_argument("--rss-requests", default=None, help="two request counts, e.g. 1000,20000")
    parser.add_argument("--long", action="store_true",
                        help="only the long-input benchmark (bench/long_input_attention.py), into "
                             "bench-results/long.json")
    parser.add_argument("--lengths", default="", help="with --long: only these T, e.g. 4096,32768 (default: all)")
    parser.add_argument("--engines", default="",
                        help="with --long: only these engines, of served,dense,torch,torch-sdpa (default: all)")
    parser.add_argument("--no-long", action="store_true", help="skip the long-input part of a full run")
    parser.add_argument("--front-end", action="store_true",
                        help="only the front end's cost per protocol (bench/front_end.py: Encode vs KServe v2, "
                             "32 clients, default flags), into bench-results/front_end.json")
    parser.add_argument("--models", action="store_true",
                        help="only many models on one host (bench/many_models.py: the default encoder and MiniLM, "
                             "two processes vs one server, share and quiet-model p50), into bench-results/models.json")
    args = parser.parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    long_out = str(Path(args.out).with_name("long.json"))
    if args.front_end:
        from bench import front_end

        return front_end.main(["--export-dir", args.export_dir or "exports/default",
                               "--out", str(Path(args.out).with_name("front_end.json")),
                               *(["--rounds", "1", "--seconds", "3"] if args.quick else [])])
    if args.models:
        from bench import many_models

        return many_models.main(["--out", str(Path(args.out).with_name("models.json")),
                                 *(["--quick"] if args.quick else [])])
    if args.long:
        report = run_long(long_out, quick=args.quick, threads=args.threads, device=args.device, say=say,
                          lengths=tuple(int(t) for t in args.lengths.split(",") if t),
                          engines=tuple(e for e in args.engines.split(",") if e))
        print(report["table"])
        print(f"\nwrote {long_out}")
        return 0
    overrides = {"out": args.out, "export_dir": args.export_dir, "threads": args.threads,
                 "server": not args.no_server, "model": not args.no_model, "serve_graph": args.serve_graph,
                 "device": args.device}
    if args.points:
        overrides["points"] = args.points
    if args.repeats:
        overrides["repeats"] = args.repeats
    if args.no_tune:
        overrides["tune"] = False
    if args.rss_requests:
        overrides["rss_checkpoints"] = tuple(int(x) for x in args.rss_requests.split(","))
    options = BenchOptions.quick_defaults(**overrides) if args.quick else BenchOptions(**overrides)
    report = run_bench(options, progress=say)
    print(report["table"])
    print(f"\nwrote {options.out}")
    if not args.quick and not args.no_long and not args.export_dir and args.device == "cpu":
        long_report = run_long(long_out, threads=args.threads, say=say)
        print(long_report["table"])
        print(f"\nwrote {long_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
