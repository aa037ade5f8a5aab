"""Build hook: generate the protobuf/gRPC Python code from protos/ into the `uibus_pb` package.

Generated code is never committed. protoc writes imports such as `from cline import common_pb2`,
which would claim the top-level names `cline` and `neuro_san` in site-packages (and clash with a
real neuro-san install), so every generated import of our own protos is rewritten to live under
`uibus_pb`. Re-run `pip install -e .` after editing a .proto file.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"
OUT = ROOT / "uibus_pb"
OWN_PACKAGES = ("cline", "neuro_san", "uibus")
_IMPORT = re.compile(rf"^(from|import) ((?:{'|'.join(OWN_PACKAGES)})(?:\.\w+)*)", re.MULTILINE)


def generate() -> None:
    from grpc_tools import protoc  # build requirement (pyproject [build-system])

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + " ".join(sources))
    for path in OUT.rglob("*.py*"):
        text = path.read_text()
        path.write_text(_IMPORT.sub(lambda m: f"{m.group(1)} uibus_pb.{m.group(2)}", text))
    for folder in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    (OUT / "py.typed").touch()


generate()
setup(
    packages=find_packages(include=["server*", "clients*", "uibus_pb*"]),
    package_data={"server": ["static/*", "static/**/*"], "uibus_pb": ["py.typed", "**/*.pyi"]},
)
