"""Builds the native KServe v2 lane (native/kserve_lane.cc) into serve/_native/: `python -m serve.native_build`
(`make native`; `make test` and `make run` run it).

It needs g++, pkg-config, gRPC C++ and protobuf with their compilers (Debian: libgrpc++-dev,
protobuf-compiler-grpc) and pybind11 (the `dev` extra). The v2 messages are compiled from the same
protos/kserve/v2/grpc_predict_v2.proto that the Python side reads. Without the toolchain it says what is
missing and exits 0 (`--require`: 1); the server then refuses --kserve-native-port with that reason, and
the lane's tests skip with it. A STAMP of the inputs' hashes skips a rebuild when nothing changed;
the module is written beside and renamed into place, never half-written.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "native" / "kserve_lane.cc"
PROTO = ROOT / "protos" / "kserve" / "v2" / "grpc_predict_v2.proto"
OUT_DIR = Path(__file__).resolve().parent / "_native"
MODULE = "_kserve_lane"
DEBIAN_PACKAGES = "g++ libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc pkg-config"


def module_path() -> Path:
    return OUT_DIR / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def missing() -> list[str]:
    """What the build lacks (empty: it can build)."""
    lacks = [tool for tool in ("g++", "pkg-config", "protoc", "grpc_cpp_plugin") if shutil.which(tool) is None]
    if not lacks and subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"]).returncode != 0:
        lacks.append("pkg-config packages grpc++ and protobuf")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        lacks.append(f"the Python headers (Python.h in {sysconfig.get_paths()['include']}; Debian: libpython3-dev)")
    try:
        import pybind11  # noqa: F401
    except ImportError:
        lacks.append("pybind11 (pip install -e '.[dev]')")
    return lacks


def _stamp() -> str:
    digest = hashlib.sha256()
    for path in (SOURCE, PROTO, Path(__file__)):
        digest.update(path.read_bytes())
    digest.update(sys.version.encode())
    digest.update(subprocess.run(["pkg-config", "--modversion", "grpc++", "protobuf"], capture_output=True,
                                 text=True).stdout.encode())
    return digest.hexdigest()


def build(force: bool = False) -> Path:
    """Compiles the module (unless the STAMP says it is current); its path."""
    import pybind11

    target, stamp_file = module_path(), OUT_DIR / "STAMP"
    stamp = _stamp()
    if not force and target.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return target
    OUT_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        work = Path(tmp)
        subprocess.run(["protoc", f"-I{PROTO.parent}", f"--cpp_out={work}", f"--grpc_out={work}",
                        f"--plugin=protoc-gen-grpc={shutil.which('grpc_cpp_plugin')}", str(PROTO)], check=True)
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++", "protobuf"], capture_output=True,
                               text=True, check=True).stdout.split()
        built = work / target.name
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
                        f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}", f"-I{work}",
                        str(SOURCE), str(work / "grpc_predict_v2.pb.cc"), str(work / "grpc_predict_v2.grpc.pb.cc"),
                        "-o", str(built), *flags], check=True)
        os.replace(built, target)
    tmp_stamp = stamp_file.with_name("STAMP.tmp")
    tmp_stamp.write_text(stamp)
    os.replace(tmp_stamp, stamp_file)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.native_build", description=__doc__.split("\n")[0])
    parser.add_argument("--require", action="store_true", help="exit 1 when the toolchain is missing")
    parser.add_argument("--force", action="store_true", help="rebuild even when the STAMP is current")
    args = parser.parse_args(argv)
    lacks = missing()
    if lacks:
        print(f"native lane not built: missing {', '.join(lacks)} (Debian: apt-get install {DEBIAN_PACKAGES})",
              file=sys.stderr)
        return 1 if args.require else 0
    print(f"native lane: {build(args.force)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
