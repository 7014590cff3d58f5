#!/usr/bin/env bash
# ortrain cluster init script for Databricks.
#
# Installs the ortrain wheel with the cluster's own pip and makes `%load_ext ortrain` work in
# every notebook on the node. Idempotent (safe to run again); exits non-zero with a clear
# message on any failure (Databricks then reports the init script as failed).
#
# Environment (set in the cluster's "Environment variables"):
#   ORTRAIN_WHEEL     required: the wheel file, or a directory holding ortrain-*.whl, e.g.
#                     /Volumes/main/default/libs/ortrain-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl
#                     or /Workspace/Shared/ortrain/ (the newest wheel in it is used)
#   ORTRAIN_PYTHON    the cluster's Python (default /databricks/python3/bin/python)
#   ORTRAIN_AUTOLOAD  1 (default) also loads the extension in every IPython kernel via a startup
#                     file in the Python environment's IPython profile; 0 leaves it to `%load_ext`
#   ORTRAIN_IPYTHON_DIR  where IPython profiles live (default: $IPYTHONDIR or ~/.ipython)
#   ORTRAIN_WARM_KERNELS background (default) compiles ortrain's CUDA kernels for the node's GPUs
#                     into the kernel cache after the script ends (`python -m ortrain.cuda warm`,
#                     log in $ORTRAIN_WARM_LOG, default /tmp/ortrain-warm-kernels.log), so that the
#                     first accelerated step reads them from disk instead of waiting for NVRTC;
#                     wait does it before the script ends; 0 leaves it to the first step. A node
#                     without an NVIDIA GPU warms nothing.
#   ORTRAIN_CACHE_DIR the kernel cache (default /local_disk0/ortrain-cache where /local_disk0 is
#                     writable, else ~/.cache/ortrain); with ORTRAIN_AUTOLOAD=1 every kernel uses
#                     it too
set -Eeuo pipefail

fail() { echo "ortrain init script: ERROR: $*" >&2; exit 1; }
trap 'fail "command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

PY="${ORTRAIN_PYTHON:-/databricks/python3/bin/python}"
[ -x "$PY" ] || fail "the cluster Python '$PY' does not exist or is not executable (set ORTRAIN_PYTHON)"
case "${ORTRAIN_WARM_KERNELS:-background}" in
    background | wait | 0) ;;
    *) fail "ORTRAIN_WARM_KERNELS='${ORTRAIN_WARM_KERNELS}': allowed values are background (default), wait, 0" ;;
esac
[ -n "${ORTRAIN_WHEEL:-}" ] || fail "ORTRAIN_WHEEL is not set: set it to the ortrain wheel (or its directory) on a volume or in the workspace"

wheel="$ORTRAIN_WHEEL"
if [ -d "$wheel" ]; then
    wheel="$(ls -1t "$wheel"/ortrain-*.whl 2>/dev/null | head -n 1 || true)"
    [ -n "$wheel" ] || fail "no ortrain-*.whl in directory '$ORTRAIN_WHEEL'"
fi
[ -f "$wheel" ] || fail "the wheel '$wheel' does not exist (ORTRAIN_WHEEL=$ORTRAIN_WHEEL)"
case "$wheel" in *.whl) ;; *) fail "'$wheel' is not a wheel (*.whl)";; esac

echo "ortrain init script: installing $wheel with $PY -m pip"
"$PY" -m pip install --quiet --no-deps --force-reinstall --disable-pip-version-check "$wheel" \
    || fail "pip could not install '$wheel' into $PY"
version="$("$PY" -c 'import ortrain, ortrain._ortrain; print(ortrain.__version__)')" \
    || fail "ortrain was installed but does not import with $PY"

# the kernel cache the warm-up fills and the notebooks read
if [ -n "${ORTRAIN_CACHE_DIR:-}" ]; then
    cache="$ORTRAIN_CACHE_DIR"
elif [ -d /local_disk0 ] && [ -w /local_disk0 ]; then
    cache=/local_disk0/ortrain-cache
else
    cache="${HOME:-/root}/.cache/ortrain"
fi
mkdir -p "$cache" || fail "cannot create the kernel cache folder $cache (set ORTRAIN_CACHE_DIR)"

if [ "${ORTRAIN_AUTOLOAD:-1}" = "1" ]; then
    ipdir="${ORTRAIN_IPYTHON_DIR:-${IPYTHONDIR:-$HOME/.ipython}}"
    startup="$ipdir/profile_default/startup"
    mkdir -p "$startup" || fail "cannot create $startup"
    cache_literal="$("$PY" -c 'import sys; print(repr(sys.argv[1]))' "$cache")"
    cat > "$startup/50-ortrain.py" <<PYEOF
# Written by the ortrain init script: load the %ort / %%ort magics in every IPython kernel, and
# read CUDA kernels from the cache the init script warmed (unless ORTRAIN_CACHE_DIR says otherwise).
import os
os.environ.setdefault("ORTRAIN_CACHE_DIR", $cache_literal)
try:
    get_ipython().extension_manager.load_extension("ortrain")  # noqa: F821
except Exception as e:  # never break a kernel's start
    print(f"ortrain: could not load the extension: {e}")
PYEOF
    echo "ortrain init script: the extension loads in every kernel ($startup/50-ortrain.py)"
fi

warm=("$PY" -m ortrain.cuda warm --arch auto)
case "${ORTRAIN_WARM_KERNELS:-background}" in
    0) echo "ortrain init script: CUDA kernels not warmed (ORTRAIN_WARM_KERNELS=0): the first GPU step compiles them" ;;
    wait)
        ORTRAIN_CACHE_DIR="$cache" "${warm[@]}" || fail "warming the CUDA kernel cache in $cache failed (ORTRAIN_WARM_KERNELS=0 skips it)" ;;
    background)
        log="${ORTRAIN_WARM_LOG:-/tmp/ortrain-warm-kernels.log}"
        ORTRAIN_CACHE_DIR="$cache" nohup setsid "${warm[@]}" > "$log" 2>&1 < /dev/null &
        echo "ortrain init script: warming the CUDA kernel cache in $cache in the background (log: $log)" ;;
esac
echo "ortrain init script: ortrain $version ready; in a notebook: %load_ext ortrain"
