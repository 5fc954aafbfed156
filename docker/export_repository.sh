#!/bin/sh
# The export image's entrypoint (docker/export.Dockerfile).
#   with arguments:    python -m export ARGUMENTS (one export, as asked)
#   without:           the model repository the servers serve (ENCODER_MODEL_REPOSITORY=/exports), one
#                      folder per model: /exports/default (the default encoder) and
#                      /exports/all-minilm-l6-v2 (the packaged all-MiniLM-L6-v2)
# docker-compose's `export` job and deploy/k8s/export-job.yaml run it without arguments. The exporter
# renames each finished export into place, replacing an older one, so a server never sees half of one.
set -eu
if [ "$#" -gt 0 ]; then
    exec python -m export "$@"
fi
python -m export --out-dir /exports --name default
exec python -m export --minilm --out-dir /exports --name all-minilm-l6-v2
