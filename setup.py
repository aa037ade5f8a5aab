"""Build hook: generate the protobuf/gRPC Python code from protos/ into `uibus.pb`, and map the
source folders onto the one installed package.

The tree keeps the design's layout (`server/`, `clients/`, `protos/` at the top) while exactly one
import name, `uibus`, is installed: `server/` is the package `uibus`, `clients/` is `uibus.clients`
and the generated code is `uibus.pb` (written to `server/pb/`, never committed). protoc writes
imports such as `from cline import common_pb2`, which would claim the top-level names `cline` and
`neuro_san` (and clash with a real neuro-san install), so every generated import of our own protos
is rewritten to live under `uibus.pb`. Re-run `pip install -e .` after editing a .proto file.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"
OUT = ROOT / "server" / "pb"
OWN_PACKAGES = ("cline", "neuro_san", "uibus")
_IMPORT = re.compile(rf"^(from|import) ((?:{'|'.join(OWN_PACKAGES)})(?:\.\w+)*)", re.MULTILINE)


def generate() -> None:
    from grpc_tools import protoc  # build requirement (pyproject [build-system])

    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {PROTOS}: the source tree is incomplete")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + " ".join(sources))
    for path in OUT.rglob("*.py*"):
        text = path.read_text()
        path.write_text(_IMPORT.sub(lambda m: f"{m.group(1)} uibus.pb.{m.group(2)}", text))
    for folder in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    (OUT / "py.typed").touch()


def packages(folder: str, name: str) -> list[str]:
    """`name` and its subpackages, for the source folder `folder`."""
    return [name, *(f"{name}.{sub}" for sub in find_packages(folder))]


generate()
setup(
    package_dir={"uibus": "server", "uibus.clients": "clients"},
    packages=[*(p for p in packages("server", "uibus")), *packages("clients", "uibus.clients")],
    # Data files are named here, not taken from MANIFEST.in (which is for the sdist), so the page
    # in server/static/ ships as data of `uibus` rather than as a would-be package `uibus.static`.
    include_package_data=False,
    package_data={"uibus": ["py.typed", "static/*"], "uibus.pb": ["py.typed", "**/*.pyi"]},
)
