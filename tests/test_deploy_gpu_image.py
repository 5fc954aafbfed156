"""The GPU serving image, built and checked on a machine without a GPU (opt-in: SMOKE_GPU_IMAGE=1).

`docker build -f docker/Dockerfile --target gpu` exactly as docs/deployment.md writes it (it downloads
~3 GB of CUDA/cuDNN wheels the first time), then, inside the image:

* onnxruntime-gpu lists CUDAExecutionProvider;
* `ldd` on ONNX Runtime's CUDA provider library and on every library of the nvidia-* wheels (CUDA
  runtime, cuBLAS/cuBLASLt, cuDNN and the engine libraries cuDNN loads, cuFFT, cuRAND, NVRTC,
  nvJitLink) resolves every dependency but the driver's libcuda.so.1, which the NVIDIA Container
  Toolkit mounts from the host at run time; the provider's CUDA libraries resolve to the wheels;
* the server's entry point, asked for `--device cuda` where there is no driver, fails at start
  (exit 1, `startup_failed`) instead of falling back to CPU silently.

What needs a GPU (CUDA kernels, the parity of CUDA outputs) is tests/test_cuda.py's, on a GPU host.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.docker_env import DOCKER, ensure_engine, image_size, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.environ.get("SMOKE_GPU_IMAGE") != "1",
                       reason="set SMOKE_GPU_IMAGE=1 to build the GPU image (~3 GB of CUDA wheels, several minutes)"),
]

TAG = "onnx-encoder-serve:gpu"
DRIVER_LIBRARIES = {"libcuda.so.1"}  # from the host's driver, through the NVIDIA Container Toolkit

# Inside the image: the provider library and every .so of the nvidia-* wheels, each followed by its ldd.
LDD_SCRIPT = r"""
set -e
site=$(python -c 'import onnxruntime, os; print(os.path.dirname(os.path.dirname(onnxruntime.__file__)))')
provider=$site/onnxruntime/capi/libonnxruntime_providers_cuda.so
test -f "$provider"
for lib in "$provider" $(find "$site/nvidia" -name 'lib*.so*' -type f | sort); do
  echo "== $lib"
  ldd "$lib"
done
echo "== ldconfig"
ldconfig -p
"""


@pytest.fixture(scope="module")
def gpu_image():
    ensure_engine()
    started = time.monotonic()
    run([DOCKER, "build", "-f", "docker/Dockerfile", "--target", "gpu", "-t", TAG, "."], timeout=3000)
    print(f"{TAG} built in {time.monotonic() - started:.0f} s; size {image_size(TAG)}")
    return TAG


def _python_in_image(image: str, code: str) -> str:
    return run([DOCKER, "run", "--rm", "--entrypoint", "python", image, "-c", code], timeout=300).stdout


def test_onnxruntime_in_the_gpu_image_lists_the_cuda_provider(gpu_image):
    out = _python_in_image(gpu_image, "import onnxruntime as ort; print(ort.__version__, ort.get_available_providers())")
    assert "CUDAExecutionProvider" in out, out
    assert "'CPUExecutionProvider'" in out, out


def test_the_server_in_the_gpu_image_offers_no_tensorrt_without_its_library(gpu_image):
    """The image has no TensorRT (libnvinfer.so.10), so the server drops the provider onnxruntime lists."""
    out = _python_in_image(gpu_image, "import onnxruntime as ort; from serve.backend.session import offered_providers; "
                                      "print(offered_providers(ort.get_available_providers()))")
    assert "CUDAExecutionProvider" in out and "TensorrtExecutionProvider" not in out, out


def _ldd_report(image: str) -> dict[str, dict[str, str]]:
    """{library: {dependency: resolved path or 'not found'}} from ldd inside the image."""
    out = run([DOCKER, "run", "--rm", "--entrypoint", "bash", image, "-c", LDD_SCRIPT], timeout=300).stdout
    report: dict[str, dict[str, str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("== "):
            current = report.setdefault(line[3:], {})
            continue
        match = re.match(r"\s*(\S+)(?: \(.*\))? => (not found|\S+)", line)
        if match and current is not None:
            current[match.group(1)] = match.group(2)
    return report


def test_cuda_provider_and_cuda_libraries_resolve_everything_but_the_driver(gpu_image):
    report = _ldd_report(gpu_image)
    provider = next(lib for lib in report if lib.endswith("libonnxruntime_providers_cuda.so"))
    names = {lib.rsplit("/", 1)[-1] for lib in report}
    assert {"libcudnn.so.9", "libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"} <= names, sorted(names)
    assert any(name.startswith("libcudnn_engines") for name in names), sorted(names)  # what cuDNN loads
    missing = {(lib, dep) for lib, deps in report.items() for dep, path in deps.items() if path == "not found"}
    assert {dep for _, dep in missing} <= DRIVER_LIBRARIES, sorted(missing)
    # The provider links the CUDA runtime and cuBLAS by name; each resolves to the wheels.
    cuda_deps = {dep: path for dep, path in report[provider].items()
                 if dep.startswith(("libcudart", "libcublas", "libcudnn", "libcurand", "libcufft"))}
    assert {"libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"} <= cuda_deps.keys(), cuda_deps
    assert all("/site-packages/nvidia/" in path for path in cuda_deps.values()), cuda_deps
    # cuDNN and its engine libraries are dlopen()ed at run time: the loader's cache (ldconfig, set up by
    # the gpu stage) must know them, at the wheels' paths, since no LD_LIBRARY_PATH is set.
    cache = report["ldconfig"]
    for name in ("libcudnn.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_graph.so.9", "libcublasLt.so.13"):
        assert "/site-packages/nvidia/" in cache.get(name, ""), (name, cache.get(name))


def test_server_asked_for_cuda_without_a_driver_fails_at_start(gpu_image, serve_export_dir):
    # Root inside the container only to read the host's pytest temp folder (mode 0700).
    result = run([DOCKER, "run", "--rm", "--user", "0", "-v", f"{serve_export_dir}:/exports/default:ro",
                  gpu_image, "--device", "cuda", "--warmup", "false"], timeout=300, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "startup_failed" in result.stdout + result.stderr
