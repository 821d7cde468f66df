#!/usr/bin/env bash
# Installs Triton's perf_analyzer into DEST (default .perf) without root and
# without touching the system: the binary from the tritonclient 2.50.0 wheel
# (newer wheels no longer carry it; PyPI's perf-analyzer is a placeholder),
# Debian's libb64 (unpacked, not installed) and the CUDA runtime library it
# links (used only for GPU shared memory, which we do not use). DEST/bin/
# perf_analyzer is a wrapper that sets LD_LIBRARY_PATH. In NGC, the
# tritonserver:<yy.mm>-py3-sdk container ships perf_analyzer and genai-perf.
# Usage: client/install_perf_analyzer.sh [DEST] [PYTHON]
set -euo pipefail
DEST=$(realpath -m "${1:-.perf}")
PYTHON=${2:-python3}
TRITONCLIENT=2.50.0
CUDA_RUNTIME=12.9.79

if [ "$(uname -m)" != x86_64 ]; then
    echo "install_perf_analyzer: the tritonclient wheel's binary is for x86_64 only;" \
         "on $(uname -m) use the NGC -py3-sdk container" >&2
    exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST/bin" "$DEST/lib" "$DEST/libexec"

"$PYTHON" -m pip download --quiet --no-deps --dest "$work" "tritonclient==$TRITONCLIENT"
"$PYTHON" -m zipfile -e "$work"/tritonclient-$TRITONCLIENT-*.whl "$work/wheel"
install -m 755 "$work/wheel/tritonclient-$TRITONCLIENT.data/data/bin/perf_analyzer" "$DEST/libexec/"

"$PYTHON" -m pip download --quiet --no-deps --dest "$work" "nvidia-cuda-runtime-cu12==$CUDA_RUNTIME"
"$PYTHON" -m zipfile -e "$work"/nvidia_cuda_runtime_cu12-*.whl "$work/cuda"
cp "$work/cuda/nvidia/cuda_runtime/lib/libcudart.so.12" "$DEST/lib/"

if ! ldconfig -p | grep -q 'libb64\.so\.0d'; then
    (cd "$work" && apt-get download libb64-0d 2>/dev/null)
    dpkg-deb -x "$work"/libb64-0d_*.deb "$work/deb"
    cp "$work"/deb/usr/lib/*/libb64.so.0d* "$DEST/lib/"
fi

cat > "$DEST/bin/perf_analyzer" <<WRAPPER
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$DEST/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$DEST/libexec/perf_analyzer" "\$@"
WRAPPER
chmod 755 "$DEST/bin/perf_analyzer"
if ! "$DEST/bin/perf_analyzer" --version >/dev/null 2>&1 && ! "$DEST/bin/perf_analyzer" --help >/dev/null 2>&1; then
    echo "install_perf_analyzer: $DEST/bin/perf_analyzer does not run:" >&2
    ldd "$DEST/libexec/perf_analyzer" | grep 'not found' >&2 || true
    exit 1
fi
echo "perf_analyzer installed: $DEST/bin/perf_analyzer"
