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
# The other runtime dependencies as pinned in pyproject.toml (grpcio*/protobuf stay as installed above).
listed=$("$dir/.venv/bin/python" - "$dir/pyproject.toml" <<'EOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith(("grpcio", "protobuf"))))
EOF
)
mapfile -t deps <<< "$listed"
if [ -n "$listed" ]; then
  "$dir/.venv/bin/pip" install -q "${deps[@]}"
fi
"$dir/.venv/bin/pip" install -q --no-build-isolation --no-deps -e "$dir"
# The server and its generated stubs import: server/ installs as the package uibus with the stubs in
# uibus.pb (its __main__ runs uibus.clients.cli); an older tree has the top-level server and uibus_pb
# (the same rule bench/run.py uses to pick `python -m uibus serve` or `python -m server`).
if grep -qs 'uibus\.clients\.cli' "$dir/server/__main__.py"; then
  modules=uibus.app,uibus.pb.cline.ui_pb2_grpc
else
  modules=server.app,uibus_pb.cline.ui_pb2_grpc
fi
cd "$dir" && .venv/bin/python -c "import grpc, $modules; print('grpcio', grpc.__version__, 'ready in $dir')"
