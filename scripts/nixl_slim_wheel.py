"""A slim nixl-cu13 wheel for the GPU machine: the ~56 MB wheel with the code and the other wheels
is over the 64 MiB one device call carries (shared/reference/gpu-machine.md). kvrelay's nixl
backend uses the Python API and the UCX plugin only, so this keeps `nixl_cu13/`, the shared
libraries those need (the closure of their ELF DT_NEEDED entries through the wheel's RPATH dirs),
the UCX plugin and UCX's CUDA, CMA and TCP/shared-memory modules (UCX loads them by name at run
time), and drops the rest: `nixl_ep_cu13/`, the other plugins (object stores, GDS, libfabric)
and UCX's InfiniBand modules. RECORD is written anew for what is kept.

    python scripts/nixl_slim_wheel.py                      # .whl/nixl/, for the GPU machine (3.12)
    python scripts/nixl_slim_wheel.py --python-version 3.11 --dest /tmp/nixl-slim   # this machine
Then on the device: pip install --no-deps --target /tmp/site .whl/nixl/*.whl (PART=nixl).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.5.1"
SYSTEM = ("libc.", "libm.", "libstdc++", "libgcc_s", "ld-linux", "libdl.", "libpthread", "librt.",
          "libcuda", "libnvidia", "libssl", "libcrypto", "libz.")  # fmt: skip
# UCX modules it loads by name: CUDA copies and IPC, cross-memory attach; not InfiniBand/EFA/tests
UCX_SKIP = re.compile(r"uct_ib|efa|mlx5|perftest|_mad|gdr|rdmacm")


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def kept_files(root: Path) -> set[Path]:
    """Files of the unpacked wheel at `root` that the Python API and the UCX plugin need."""
    libs = [p for d in ("nixl_cu13.libs", ".nixl_cu13.mesonpy.libs") for p in (root / d).rglob("*")]
    by_name = {p.name: p for p in libs if p.is_file() and ".so" in p.name}
    ucx = [
        p for p in (root / "nixl_cu13.libs" / "ucx").glob("*.so*") if not UCX_SKIP.search(p.name)
    ]
    # the UCX plugin where nixl looks for plugins (meson's libs dir), and auditwheel's copy
    plugins = [root / ".nixl_cu13.mesonpy.libs/plugins", root / "nixl_cu13.libs/nixl"]
    ucx_plugin = [d / "libplugin_UCX.so" for d in plugins if (d / "libplugin_UCX.so").is_file()]
    roots = [*(root / "nixl_cu13").glob("*.so"), *ucx_plugin, *ucx]
    keep, todo, missing = set(), list(roots), set()
    while todo:
        p = todo.pop()
        if p in keep:
            continue
        keep.add(p)
        for name in needed(p):
            if name in by_name:
                todo.append(by_name[name])
            elif not name.startswith(SYSTEM):
                missing.add(name)
    if missing:
        raise SystemExit(f"libraries needed but not in the wheel nor the system's: {missing}")
    keep |= {
        p for p in (root / "nixl_cu13").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    keep |= {
        p for p in root.glob("nixl_cu13-*.dist-info/**/*") if p.is_file() and p.name != "RECORD"
    }
    return keep


def record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--dest", default=".whl/nixl")
    a = p.parse_args()
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tag = a.python_version.replace(".", "")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", a.python_version, "--implementation", "cp", "--abi", f"cp{tag}",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
             "-d", tmp, f"nixl-cu13=={VERSION}"],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("nixl_cu13-*.whl")
        full_mb = wheel.stat().st_size / 2**20
        root = Path(tmp) / "x"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        for f in root.rglob("*.so*"):  # zip drops the mode bits: readelf reads them anyway
            os.chmod(f, 0o755)
        keep = sorted(kept_files(root))
        (dist,) = root.glob("nixl_cu13-*.dist-info")
        out = dest / wheel.name
        lines = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for f in keep:
                rel = f.relative_to(root).as_posix()
                data = f.read_bytes()
                z.writestr(rel, data)
                lines.append(record_line(rel, data))
            lines.append(f"{dist.name}/RECORD,,")
            z.writestr(f"{dist.name}/RECORD", "\n".join(lines) + "\n")
    mb = out.stat().st_size / 2**20
    print(f"{out}: {len(keep)} files, {mb:.1f} MiB (the full wheel: {full_mb:.1f} MiB)")


if __name__ == "__main__":
    main()
