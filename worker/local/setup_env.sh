#!/usr/bin/env bash
# Prepares everything the tests and the demo need on a fresh machine, idempotently:
#   - a Python virtual environment with the project's dependencies, kept OUTSIDE the clone and keyed by the
#     dependency list, so the multi-GB PyTorch install happens once per machine, not once per clone/run;
#   - the Apache Kafka broker jars, fetched by Maven from Maven Central into the same cache;
#   - Debian's redis-server (and openssl), installed with apt-get when missing; KIW_SETUP_REDIS=0 skips them
#     (the demo uses no Redis, and needs no root or sudo then).
# Prints the venv's python path as its last line so callers can `PY=$(... | tail -n1)`.
# Safe to run concurrently: the venv build and the jar fetch each hold a lock in the cache folder.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache="${KIW_CACHE:-$HOME/.cache/kafka-inference-worker}"
extras="${KIW_EXTRAS:-test,models,dev,onnx,bench,reference}"
mkdir -p "$cache"
log() { echo "[setup] $*" >&2; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# apt_install PKG...: installs Debian packages as root, or with `sudo -n` (never prompts for a password).
# Tries the install first and runs `apt-get update` only when that fails (e.g. no package lists yet); any
# failure after that stops the setup with the command to run by hand. Waits for a concurrent apt/dpkg.
apt_install() {
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "$* missing and not root (no sudo): run as root: apt-get install $*"
    sudo -n true 2>/dev/null || die "$* missing and sudo needs a password: run: sudo apt-get install $*"
    sudo=(sudo -n)
  fi
  command -v apt-get >/dev/null 2>&1 || die "$* missing and this is no Debian/Ubuntu machine (no apt-get): install $* yourself"
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -qq -o DPkg::Lock::Timeout=300)
  # 9>&-: a service that a package starts must not inherit the venv lock's descriptor (and hold the lock).
  if ! "${apt[@]}" install "$@" >&2 9>&-; then
    log "apt-get install $* failed; running apt-get update and trying once more"
    "${apt[@]}" update >&2 9>&- || die "apt-get update failed (see above); fix apt, then: apt-get install $*"
    "${apt[@]}" install "$@" >&2 9>&- || die "apt-get install $* failed (see above)"
  fi
}

# --- Python environment -------------------------------------------------------------------------
python_bin="${PYTHON:-python3}"
command -v "$python_bin" >/dev/null 2>&1 || die "$python_bin not found: install Python >= 3.10 (apt-get install python3)"
pyver="$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# Key = python version + the dependency sections of pyproject + the extras chosen.
key="$( { echo "$pyver $extras"; awk '/^dependencies = \[/{on=1} /^\[project.scripts\]/{on=0} on' "$root/pyproject.toml"; } \
        | sha256sum | cut -c1-12)"
venv="$cache/venv-py$pyver-$key"

make_venv() {
  if "$python_bin" -m venv "$venv" >&2; then return 0; fi
  rm -rf "$venv"
  # Debian/Ubuntu split venv's ensurepip into a package of its own.
  if "$python_bin" -c 'import ensurepip' >/dev/null 2>&1; then die "$python_bin -m venv $venv failed (see above)"; fi
  case "$(readlink -f "$(command -v "$python_bin")")" in
    /usr/bin/*)
      log "$python_bin has no ensurepip: installing python$pyver-venv with apt-get"
      apt_install "python$pyver-venv"
      "$python_bin" -m venv "$venv" >&2 || die "$python_bin -m venv $venv failed even with python$pyver-venv (see above)" ;;
    *) die "$python_bin cannot make a virtual environment (no ensurepip): install its venv support (Debian/Ubuntu: apt-get install python3-venv)" ;;
  esac
}

# The lock: two runs at once (two clones, make test beside make demo) would both build the same venv.
# flock is util-linux; without it (not Linux) the build runs unlocked. Only this block holds the lock, so
# nothing started later (apt's services) can keep it.
(
  if command -v flock >/dev/null 2>&1; then
    flock 9 || die "cannot lock $cache/.venv.lock"
  fi
  if [ ! -f "$venv/.complete" ]; then
    log "creating $venv (PyTorch is several GB: first run only)"
    rm -rf "$venv"
    make_venv
    "$venv/bin/pip" install -q --upgrade pip >&2
    # Install the dependencies only; the project itself runs from the clone (PYTHONPATH), so many clones
    # can share one environment.
    "$venv/bin/pip" install -q "$root[$extras]" >&2
    "$venv/bin/pip" uninstall -q -y kafka-inference-worker >&2
    touch "$venv/.complete"
  else
    log "reusing $venv"
  fi
) 9>"$cache/.venv.lock"

# --- Apache Kafka jars (ensure_jars locks the jar folder itself) --------------------------------
"$venv/bin/python" -c "import sys; sys.path.insert(0, sys.argv[1]); from worker.local.kafka_broker import ensure_jars; ensure_jars()" "$root" >&2

# --- openssl (the Redis TLS test makes its certificate with it) --------------------------------
setup_redis="${KIW_SETUP_REDIS:-1}"
if [ "$setup_redis" != 0 ] && ! command -v openssl >/dev/null 2>&1; then
  log "installing openssl with apt-get"
  apt_install openssl
fi

# --- Redis -------------------------------------------------------------------------------------
if [ "$setup_redis" != 0 ] && ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server with apt-get"
  apt_install redis-server
  # Debian starts a system instance on 6379; the tests start their own on a free port.
  if [ "$(id -u)" = 0 ]; then systemctl disable --now redis-server >/dev/null 2>&1 || true
  else sudo -n systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
fi

echo "$venv/bin/python"
