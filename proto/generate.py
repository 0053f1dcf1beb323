"""Regenerate proto/pdserve_pb2*.py from proto/pdserve.proto.

    python -m pdserve.proto.generate            # rewrite the generated files
    python -m pdserve.proto.generate --check    # exit 1 if they are out of date (CI)

protoc names the generated module after the .proto's path under its include root, so the
file is compiled as pdserve/proto/pdserve.proto from a scratch tree: the generated gRPC code
then imports `pdserve.proto.pdserve_pb2`, the installed name.
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    """Write pdserve_pb2.py, .pyi and _grpc.py into out_dir."""
    from grpc_tools import protoc  # grpcio-tools: a dev/test dependency only

    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "src" / "pdserve" / "proto"
        src.mkdir(parents=True)
        shutil.copy(ROOT / "proto" / "pdserve.proto", src / "pdserve.proto")
        gen = pathlib.Path(tmp) / "out"
        gen.mkdir()
        args = ["protoc", f"-I{pathlib.Path(tmp) / 'src'}", f"--python_out={gen}",
                f"--pyi_out={gen}", f"--grpc_python_out={gen}", str(src / "pdserve.proto")]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for name in GENERATED:
            shutil.copy(gen / "pdserve" / "proto" / name, out_dir / name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    check = ap.parse_args().check
    if not check:
        generate(ROOT / "proto")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        stale = [n for n in GENERATED
                 if not filecmp.cmp(pathlib.Path(tmp) / n, ROOT / "proto" / n, shallow=False)]
    if stale:
        print(f"out of date: {stale}; run `python -m pdserve.proto.generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
