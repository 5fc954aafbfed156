#!/usr/bin/env bash
# The project's interpreter, but `-m serve` runs the bare floor (bench/bare_native.py) when the flags ask for it:
# `compare.sh --python bench/bare_native_python.sh --config 'floor=--bare-floor' --config 'hop=--bare-floor --hop'`
# measures Triton, the server and the floor in the same rounds. Without --bare-floor it is `python -m serve`.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${BARE_PYTHON:-$here/.venv/bin/python}"
args=("$@")
if [[ " ${args[*]} " == *" --bare-floor "* && "${args[0]}" == "-m" && "${args[1]}" == "serve" ]]; then
  rest=()
  for a in "${args[@]:2}"; do [[ "$a" == "--bare-floor" ]] || rest+=("$a"); done
  exec "$py" -m bench.bare_native "${rest[@]}"
fi
exec "$py" "$@"
