"""What the generated protobuf code in serve/_proto/ is, and whether it is current (no grpcio-tools here).

`python -m tools.protogen` (a build step: `make proto`, the image's build stage) writes serve/_proto/:
  encoder/v1/*_pb2*.py          Python modules for protos/encoder (protobuf's default pool)
  kserve/v2/grpc_predict_v2.binpb  a serialized FileDescriptorSet for protos/kserve, which serve/protocols/kserve_v2.py
                                loads into its PRIVATE descriptor pool (why: that module's docstring)
  STAMP                         first line: the hash of protos/ and the generator version; then the
                                sha256 of every file written
At import (serve/protocols/pb.py) `check()` refuses a missing, incomplete, hand-edited or stale serve/_proto with
one message saying to run the build step; nothing is generated at import, so the server runs without
grpcio-tools.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "serve" / "_proto"
STAMP = "STAMP"
DESCRIPTOR_SET_PROTOS = ("kserve",)  # top-level directories of protos/ compiled to a descriptor set, not Python
KSERVE_PROTO = "kserve/v2/grpc_predict_v2.proto"
KSERVE_DESCRIPTORS = "kserve/v2/grpc_predict_v2.binpb"
REQUIRED = ("encoder/v1/encoder_pb2.py", "encoder/v1/encoder_pb2_grpc.py", "encoder/v1/admin_pb2.py",
            "encoder/v1/admin_pb2_grpc.py", KSERVE_DESCRIPTORS)
FIX = "run `python -m tools.protogen` (or `make proto`)"


class GeneratedCodeError(ImportError):
    """serve/_proto is missing, incomplete, edited, or older than protos/."""


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.rglob("*.proto"))


def sources_digest(proto_dir: Path = PROTO_DIR) -> str:
    """sha256 over every .proto under `proto_dir` (relative path and contents)."""
    digest = hashlib.sha256()
    for path in proto_files(proto_dir):
        digest.update(path.relative_to(proto_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def stamp_text(sources_line: str, out_dir: Path) -> str:
    """The STAMP for the files now in `out_dir`: `sources_line`, then `<sha256>  <path>` per file."""
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != STAMP and "__pycache__" not in p.parts)
    return sources_line + "".join(f"{file_digest(p)}  {p.relative_to(out_dir).as_posix()}\n" for p in files)


def check(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> None:
    """Raises GeneratedCodeError unless `out_dir` holds every required file, unchanged since it was
    generated, from the .proto files now in `proto_dir` (not compared when protos/ is absent)."""
    stamp = out_dir / STAMP
    if not stamp.is_file():
        raise GeneratedCodeError(f"{out_dir}: no generated protobuf code; {FIX}")
    first, *rows = stamp.read_text().splitlines() or [""]
    if proto_dir.is_dir() and f"sources={sources_digest(proto_dir)}" not in first.split():
        raise GeneratedCodeError(f"{out_dir} is stale: {proto_dir} changed since it was generated; {FIX}")
    pairs = [row.split("  ", 1) for row in rows]
    if any(len(pair) != 2 for pair in pairs):
        raise GeneratedCodeError(f"{stamp} is not the one the generator wrote; {FIX}")
    recorded = {name: digest for digest, name in pairs}
    missing = [name for name in REQUIRED if name not in recorded]
    if missing:
        raise GeneratedCodeError(f"{out_dir}: {', '.join(missing)} not generated; {FIX}")
    for name, digest in recorded.items():
        path = out_dir / name
        if not path.is_file() or file_digest(path) != digest:
            raise GeneratedCodeError(f"{out_dir}/{name} is missing or differs from what was generated; {FIX}")
