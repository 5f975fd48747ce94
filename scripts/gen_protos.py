"""Generate the gRPC stubs in protos/ from protos/*.proto, reproducibly.

    python scripts/gen_protos.py           # write protos/*_pb2*.py
    python scripts/gen_protos.py --check   # exit 1 if the checked-in stubs differ (CI)

The .proto files are compiled from a temporary tree ``baton/protos/`` so that the generated code
imports its siblings as ``baton.protos.X_pb2`` (protoc derives imports from the include path).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        pkg = pathlib.Path(tmp) / "baton" / "protos"
        pkg.mkdir(parents=True)
        sources = sorted(PROTOS.glob("*.proto"))
        for src in sources:
            shutil.copy(src, pkg / src.name)
        args = ["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}"]
        args += [f"baton/protos/{s.name}" for s in sources]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for gen in sorted(pkg.glob("*_pb2*.py*")):
            dest = out_dir / gen.name
            shutil.copy(gen, dest)
            written.append(dest)
        return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with the checked-in stubs")
    a = ap.parse_args()
    if not a.check:
        for path in generate(PROTOS):
            print("wrote", path.relative_to(ROOT))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (PROTOS / p.name).exists() or (PROTOS / p.name).read_bytes() != p.read_bytes()
        ]
    if stale:
        print(
            "stale generated stubs:", ", ".join(stale), "- run: python scripts/gen_protos.py", file=sys.stderr
        )
        return 1
    print("stubs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
