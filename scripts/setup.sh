#!/usr/bin/env bash
# Idempotent set-up: Debian's fuse3 (libfuse 3 + fusermount3), then a virtual environment .venv with
# ckptfs (editable), torch==2.13.0 pinned exactly, and the test dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CKPTFS_VENV:-.venv}"
PY="${PYTHON:-python3}"
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"  # the source package whose llama.cpp converter the tests run

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
    # real TensorFlow for the tests of the tf/ view and of TF sources (it reads and writes saver checkpoints); it pins
    # h5py<3.15, with which the suite's threaded chunk reads crashed: the newest h5py goes back after it (TensorFlow's
    # saver does not use h5py)
    "$VENV/bin/python" -m pip install -q "tensorflow-cpu==2.21.0"
    "$VENV/bin/python" -m pip install -q --upgrade "h5py>=3.15"
    # llama.cpp's HF -> GGUF converter for the tests (tests/test_llama_cpp.py): convert_hf_to_gguf.py, its
    # conversion/ package and gguf-py, taken from the llama-cpp-python source package (CPU only, nothing built)
    # into $VENV/share/llama.cpp; gguf-py is installed from there, so that converter and library match
    echo "setup: fetching llama.cpp's converter from $LLAMA_CPP_PYTHON (source package)" >&2
    tmp="$(mktemp -d)"
    "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "$LLAMA_CPP_PYTHON" -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
        '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
    rm -rf "$VENV/share/llama.cpp" && mkdir -p "$VENV/share/llama.cpp"
    cp -r "$tmp"/llama_cpp_python-*/vendor/llama.cpp/{convert_hf_to_gguf.py,conversion,gguf-py} "$VENV/share/llama.cpp/"
    rm -rf "$tmp"
    "$VENV/bin/python" -m pip install -q "$VENV/share/llama.cpp/gguf-py"
    echo "$want" > "$stamp"
fi
