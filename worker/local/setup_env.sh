#!/usr/bin/env bash
# Prepares everything the tests and the demo need on a fresh machine, idempotently:
#   - a Python virtual environment with the project's dependencies, kept OUTSIDE the clone and keyed by the
#     dependency list, so the multi-GB PyTorch install happens once per machine, not once per clone/run;
#   - the Apache Kafka broker jars, fetched by Maven from Maven Central into the same cache;
#   - Debian's redis-server, installed with apt-get when missing.
# Prints the venv's python path as its last line so callers can `PY=$(... | tail -n1)`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache="${KIW_CACHE:-$HOME/.cache/kafka-inference-worker}"
extras="${KIW_EXTRAS:-test,models,dev,onnx,bench,reference}"
mkdir -p "$cache"
log() { echo "[setup] $*" >&2; }

# --- Python environment -------------------------------------------------------------------------
python_bin="${PYTHON:-python3}"
pyver="$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# Key = python version + the dependency sections of pyproject + the extras chosen.
key="$( { echo "$pyver $extras"; awk '/^dependencies = \[/{on=1} /^\[project.scripts\]/{on=0} on' "$root/pyproject.toml"; } \
        | sha256sum | cut -c1-12)"
venv="$cache/venv-py$pyver-$key"
if [ ! -f "$venv/.complete" ]; then
  log "creating $venv (PyTorch is several GB: first run only)"
  rm -rf "$venv"
  "$python_bin" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # Install the dependencies only; the project itself runs from the clone (PYTHONPATH), so many clones
  # can share one environment.
  "$venv/bin/pip" install -q "$root[$extras]" >&2
  "$venv/bin/pip" uninstall -q -y kafka-inference-worker >&2
  touch "$venv/.complete"
else
  log "reusing $venv"
fi

# --- Apache Kafka jars --------------------------------------------------------------------------
"$venv/bin/python" -c "import sys; sys.path.insert(0, '$root'); from worker.local.kafka_broker import ensure_jars; ensure_jars()" >&2

# --- openssl (the Redis TLS test makes its certificate with it) --------------------------------
if ! command -v openssl >/dev/null 2>&1; then
  log "installing openssl with apt-get"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssl >&2 \
    || { $SUDO apt-get update -qq >&2 || true; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssl >&2; }
fi

# --- Redis -------------------------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server with apt-get"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >&2 || true
  $SUDO apt-get install -y -qq redis-server >&2
  # Debian starts a system instance on 6379; the tests start their own on a free port.
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

echo "$venv/bin/python"
