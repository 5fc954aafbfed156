# The one-shot export job: `python -m export` (torch CPU build) writing into the /exports volume.
#   docker build -f docker/export.Dockerfile -t onnx-encoder-export .
#   docker run --rm -v exports:/exports onnx-encoder-export          # both models (docker/export_repository.sh)
#   docker run --rm -v exports:/exports onnx-encoder-export --out-dir /exports --variant pre-norm   # one export
#   docker run --rm -v cache:/cache -e ENCODER_MODEL=BAAI/bge-base-en-v1.5 onnx-encoder-export  # an id into the cache
# torch==2.13.0+cpu comes from the PyTorch CPU index (build arg TORCH_INDEX), or from wheels dropped
# into docker/wheels/ for hosts that cannot reach it (pip --find-links; hashes still checked).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS deps
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/requirements-export.txt /tmp/requirements.txt
COPY docker/wheels/ /wheels/
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-deps --require-hashes --find-links /wheels \
      ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /tmp/requirements.txt

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface ENCODER_EXPORT_CACHE=/cache/exports
RUN groupadd --system --gid 10001 encoder \
 && useradd --system --uid 10001 --gid encoder --home-dir /app --no-create-home --shell /usr/sbin/nologin encoder \
 && mkdir -p /app /exports /cache && chown encoder:encoder /exports /cache
WORKDIR /app
COPY --from=deps /opt/venv /opt/venv
COPY model/ /app/model/
COPY export/ /app/export/
# `python -m serve --prepare-only true` (models by id into the export cache) runs before the server's own imports:
# the sources alone, no gRPC and no generated code (serve/__main__.py)
COPY serve/ /app/serve/
COPY docker/export_repository.sh /app/docker/export_repository.sh
USER 10001:10001
ENTRYPOINT ["sh", "/app/docker/export_repository.sh"]
