"""`python -m bench.long_input_grpc EXPORT_DIR`: the long-input cost over the wire, as a client sees it.

Starts `python -m serve` on the export (bench.harness.running_server; extra server flags after `--`), sends one
sliding-window row per request (window 128 by default, embeddings only) at each length, after one
warm-up request per length, and prints the median of `--repeats` calls and time(longest)/time(shortest)
(the issue's target: time(32k)/time(4k) <= 9, linear work is 8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness import running_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_input_grpc", description=__doc__.split("\n")[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("server_flags", nargs="*", help="after --: flags for python -m serve")
    args = parser.parse_args(argv)
    from client import EncoderClient, build_request

    medians = {}
    # long graphs load slowly; every call below has its own timeout
    with running_server(args.export_dir, args.server_flags, start_timeout_s=900.0) as server:
        with EncoderClient(server.target, timeout=900) as client:
            for length in (int(n) for n in args.lengths.split(",")):
                ids = np.random.default_rng(0).integers(1, 100, length)
                request = build_request([ids], mask="sliding_window", window=args.window)
                client.stub.Encode(request, timeout=900)  # warm-up
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    response = client.stub.Encode(request, timeout=900)
                    times.append(time.perf_counter() - started)
                medians[length] = statistics.median(times) * 1e3
                print(f"T={length:6d}  median {medians[length]:8.0f} ms  runs {[round(t * 1e3) for t in times]}  "
                      f"path {list(response.metadata.attention_paths)}", flush=True)
    first, last = min(medians), max(medians)
    print(f"time({last})/time({first}) = {medians[last] / medians[first]:.2f} (linear: {last / first:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
