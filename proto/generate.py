"""Regenerate proto/pdserve_pb2*.py from proto/pdserve.proto (run from the repo root).

    python -m proto.generate            # rewrite the generated files
    python -m proto.generate --check    # exit 1 if they are out of date (CI)
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc  # grpcio-tools: a dev/test dependency only

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(ROOT / "proto" / "pdserve.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    check = ap.parse_args().check
    if not check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        stale = [n for n in GENERATED
                 if not filecmp.cmp(pathlib.Path(tmp) / "proto" / n, ROOT / "proto" / n, shallow=False)]
    if stale:
        print(f"out of date: {stale}; run `python -m proto.generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
