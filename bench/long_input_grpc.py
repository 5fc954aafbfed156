"""`python -m bench.long_input_grpc EXPORT_DIR`: the long-input cost over the wire, as a client sees it.

Starts `python -m serve` on the export (127.0.0.1, port 0; extra server flags after `--`), sends one
sliding-window row per request (window 128 by default, embeddings only) at each length, after one
warm-up request per length, and prints the median of `--repeats` calls and time(longest)/time(shortest)
(the issue's target: time(32k)/time(4k) <= 9, linear work is 8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_input_grpc", description=__doc__.split("\n")[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("server_flags", nargs="*", help="after --: flags for python -m serve")
    args = parser.parse_args(argv)
    from client import EncoderClient, build_request

    work = Path(tempfile.mkdtemp(prefix="long-wire-"))
    port_file = work / "ports.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "serve", "--export-dir", str(args.export_dir), "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--port-file", str(port_file), *args.server_flags],
        stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "w"), env=os.environ.copy())
    medians = {}
    try:
        while not port_file.exists():
            if server.poll() is not None:
                raise SystemExit(f"server exited: {(work / 'server.log').read_text()[-500:]}")
            time.sleep(0.1)
        target = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
        with EncoderClient(target, timeout=900) as client:
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
    finally:
        server.terminate()
        server.wait(timeout=60)
    first, last = min(medians), max(medians)
    print(f"time({last})/time({first}) = {medians[last] / medians[first]:.2f} (linear: {last / first:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
