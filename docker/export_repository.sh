#!/bin/sh
# The export image's entrypoint (docker/export.Dockerfile).
#   with arguments:    python -m export ARGUMENTS (one export, as asked)
#   without, with ENCODER_MODEL or ENCODER_MODELS_FILE set (models by id: compose's MODEL_IDS):
#                      python -m serve --prepare-only true: resolves each id (huggingface_hub: HF_HOME,
#                      HF_TOKEN, HF_HUB_OFFLINE) and exports it into the export cache ENCODER_EXPORT_CACHE,
#                      where a serving image (no torch) finds it (docs/serving.md "Models by id")
#   without:           the model repository the servers serve (ENCODER_MODEL_REPOSITORY=/exports), one
#                      folder per model: /exports/default (the default encoder) and
#                      /exports/all-minilm-l6-v2 (the packaged all-MiniLM-L6-v2)
# docker-compose's `export` job and deploy/k8s/export-job.yaml run it without arguments. The exporter
# renames each finished export into place, replacing an older one, so a server never sees half of one.
set -eu
if [ "$#" -gt 0 ]; then
    exec python -m export "$@"
fi
if [ -n "${ENCODER_MODEL:-}${ENCODER_MODELS_FILE:-}" ]; then
    exec python -m serve --prepare-only true
fi
python -m export --out-dir /exports --name default
exec python -m export --minilm --out-dir /exports --name all-minilm-l6-v2
