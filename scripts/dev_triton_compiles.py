"""Run a script and print, for every Triton kernel compiled while it runs, the kvrelay call
sites that asked for it (the innermost kvrelay frames of the stack at the compile) and the
kernel's name: which launch meets a new specialisation at run time.

    python scripts/dev_triton_compiles.py scripts/dev_graph_miss.py MODEL_DIR --concurrency 1
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
import traceback

_run = subprocess.run


def run(cmd, *args, **kwargs):
    if any("ptxas" in str(c) for c in (cmd if isinstance(cmd, list) else [cmd])):
        frames = [f for f in traceback.extract_stack() if "/kvrelay/" in f.filename]
        sites = " <- ".join(f"{f.filename.split('/kvrelay/')[-1]}:{f.lineno}" for f in frames[::-1][:4])
        name, f = "?", sys._getframe()
        while f is not None:  # the JITFunction whose run() is compiling
            fn = getattr(f.f_locals.get("self"), "fn", None)
            if f.f_code.co_filename.endswith("jit.py") and fn is not None:
                name = getattr(fn, "__name__", "?")
                break
            f = f.f_back
        key, f = "", sys._getframe()
        while f is not None:  # the compile call's source: its signature and specialisation
            src = f.f_locals.get("src")
            if f.f_code.co_name == "compile" and src is not None:
                key = f" attrs={getattr(src, 'attrs', '')}"
                break
            f = f.f_back
        print(f"  [{time.strftime('%H:%M:%S')}] ptxas {name} for: {sites}{key}", flush=True)
    return _run(cmd, *args, **kwargs)


subprocess.run = run
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
