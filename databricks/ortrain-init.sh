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
set -Eeuo pipefail

fail() { echo "ortrain init script: ERROR: $*" >&2; exit 1; }
trap 'fail "command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

PY="${ORTRAIN_PYTHON:-/databricks/python3/bin/python}"
[ -x "$PY" ] || fail "the cluster Python '$PY' does not exist or is not executable (set ORTRAIN_PYTHON)"
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

if [ "${ORTRAIN_AUTOLOAD:-1}" = "1" ]; then
    ipdir="${ORTRAIN_IPYTHON_DIR:-${IPYTHONDIR:-$HOME/.ipython}}"
    startup="$ipdir/profile_default/startup"
    mkdir -p "$startup" || fail "cannot create $startup"
    cat > "$startup/50-ortrain.py" <<'PYEOF'
# Written by the ortrain init script: load the %ort / %%ort magics in every IPython kernel.
try:
    get_ipython().extension_manager.load_extension("ortrain")  # noqa: F821
except Exception as e:  # never break a kernel's start
    print(f"ortrain: could not load the extension: {e}")
PYEOF
    echo "ortrain init script: the extension loads in every kernel ($startup/50-ortrain.py)"
fi
echo "ortrain init script: ortrain $version ready; in a notebook: %load_ext ortrain"
