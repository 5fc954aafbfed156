"""Builds the native gRPC transport (native/transport.cc) into serve/_native/: `python -m tools.native_build`
(`make native`; `make test` and `make run` run it).

It needs g++, pkg-config, gRPC C++ (Debian: libgrpc++-dev) and pybind11 (the `dev` extra); the
transport knows no message type, so neither protoc nor protobuf's C++ library is needed. Without the
toolchain it says what is missing and exits 0 (`--require`: 1); the server then runs on the grpcio
transport (serve/transport/grpcio.py) and says why in its log. A STAMP of the inputs' hashes skips a
rebuild when nothing changed; the module is written beside and renamed into place, never half-written.
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
SOURCE = ROOT / "native" / "transport.cc"
OUT_DIR = ROOT / "serve" / "_native"
MODULE = "_transport"
# The one list of the Debian packages the transport needs: to build it, and to run it (an image that
# serves holds only the runtime one). The Makefile (`--install-deps`) and docker/Dockerfile
# (`--debian-packages build|runtime`) read them from here.
DEBIAN_PACKAGES = {"build": "g++ libgrpc++-dev pkg-config libpython3-dev", "runtime": "libgrpc++1.51"}


def module_path() -> Path:
    return OUT_DIR / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def missing() -> list[str]:
    """What the build lacks (empty: it can build)."""
    lacks = [tool for tool in ("g++", "pkg-config") if shutil.which(tool) is None]
    if not lacks and subprocess.run(["pkg-config", "--exists", "grpc++"]).returncode != 0:
        lacks.append("pkg-config package grpc++")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        lacks.append(f"the Python headers (Python.h in {sysconfig.get_paths()['include']}; Debian: libpython3-dev)")
    try:
        import pybind11  # noqa: F401
    except ImportError:
        lacks.append("pybind11 (pip install -e '.[dev]')")
    return lacks


def install_deps() -> None:
    """apt-get installs the build's packages, where this runs as root on a Debian-like system; else
    it says nothing and the build reports what is missing."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    packages = DEBIAN_PACKAGES["build"].split()
    print(f"installing {' '.join(packages)} (Debian) for the native transport", file=sys.stderr)
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    quiet = {"stdout": subprocess.DEVNULL, "env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}}
    if subprocess.run(install, **quiet).returncode != 0:  # a stale package list: update once, then retry
        subprocess.run(["apt-get", "update", "-q"], **quiet)
        subprocess.run(install, **quiet)


def _stamp() -> str:
    digest = hashlib.sha256()
    for path in (SOURCE, Path(__file__)):
        digest.update(path.read_bytes())
    digest.update(sys.version.encode())
    digest.update(subprocess.run(["pkg-config", "--modversion", "grpc++"], capture_output=True,
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
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], capture_output=True,
                               text=True, check=True).stdout.split()
        built = work / target.name
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
                        f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}",
                        str(SOURCE), "-o", str(built), *flags], check=True)
        os.replace(built, target)
    tmp_stamp = stamp_file.with_name("STAMP.tmp")
    tmp_stamp.write_text(stamp)
    os.replace(tmp_stamp, stamp_file)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.native_build", description=__doc__.split("\n")[0])
    parser.add_argument("--debian-packages", choices=sorted(DEBIAN_PACKAGES),
                        help="print the Debian packages the build (or a server) needs, and exit")
    parser.add_argument("--install-deps", action="store_true",
                        help="install the build's Debian packages with apt-get first, when missing and run as root")
    parser.add_argument("--require", action="store_true", help="exit 1 when the toolchain is missing")
    parser.add_argument("--force", action="store_true", help="rebuild even when the STAMP is current")
    args = parser.parse_args(argv)
    if args.debian_packages:
        print(DEBIAN_PACKAGES[args.debian_packages])
        return 0
    if args.install_deps and missing():
        install_deps()
    lacks = missing()
    if lacks:
        print(f"native transport not built: missing {', '.join(lacks)} "
              f"(Debian: apt-get install {DEBIAN_PACKAGES['build']})",
              file=sys.stderr)
        return 1 if args.require else 0
    print(f"native transport: {build(args.force)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
