#!/usr/bin/env bash
# Idempotent set-up: Debian's fuse3 (libfuse 3 + fusermount3), then a virtual environment .venv with
# ckptfs (editable), torch==2.13.0 pinned exactly, and the test dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CKPTFS_VENV:-.venv}"
PY="${PYTHON:-python3}"

if ! command -v fusermount3 >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Debian fuse3" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null
    else
        echo "setup: warning: fuse3 is missing; run 'sudo apt-get install -y fuse3' to use 'ckptfs mount'" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.ckptfs-setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing Python dependencies into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    # torch first and pinned exactly, so nothing else can pull a CUDA build
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    echo "$want" > "$stamp"
fi
