#!/usr/bin/env bash
# Makes DIR a copy of this work tree (tracked and new files, uncommitted edits included) with its
# own .venv on another grpcio release, for `python -m bench --with LABEL=DIR`. The protos are
# regenerated with the matching grpcio-tools, because generated stubs refuse an older runtime.
# Usage: bench/alt_checkout.sh 1.82.3 /tmp/uibus-grpc1.82   (re-run after editing server code)
#        bench/alt_checkout.sh 1.85.3 /tmp/uibus-grpc1.85.3 1.85.1   (grpcio-tools/-reflection/-health
#        version when it differs: a runtime may be newer than the codegen, never older)
set -euo pipefail
version=${1:?grpcio version, e.g. 1.82.3}
dir=${2:?target directory}
tools=${3:-$version}
src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dir"
(cd "$src" && git ls-files -co --exclude-standard -z | grep -zv '^bench/results/' | tar --null -cf - -T -) | tar -xf - -C "$dir"
if [ ! -x "$dir/.venv/bin/python" ]; then
  python3 -m venv "$dir/.venv"
fi
if ! "$dir/.venv/bin/python" -c "import grpc, sys; sys.exit(grpc.__version__ != '$version')" 2>/dev/null; then
  "$dir/.venv/bin/pip" install -q "grpcio==$version" "grpcio-tools==$tools" "grpcio-reflection==$tools" \
    "grpcio-health-checking==$tools" "setuptools==80.9.0"
fi
"$dir/.venv/bin/pip" install -q --no-build-isolation --no-deps -e "$dir"
cd "$dir" && .venv/bin/python -c "import grpc, uibus.pb.cline.ui_pb2_grpc; print('grpcio', grpc.__version__, 'ready in $dir')"
