"""A real PD deployment for tests: a decode server, a prefill server and a router, as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
from conftest import ServerProcess, free_port

PD_SECRET = (
    "pd-stack-test-secret"  # the stack's shared secret (tests may pass it on the command line)
)


class RouterProcess:
    """`kvrelay router` as a real process."""

    def __init__(self, prefill: list[str], decode: list[str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/kvrelay-test-router-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvrelay.cli",
                "router",
                "--port",
                str(self.port),
                "--prefill",
                ",".join(prefill),
                "--decode",
                ",".join(decode),
                *args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited ({self.proc.returncode}); log:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"router not healthy; log:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + labels + " ") or (not labels and line.startswith(name + "{")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {"name{labels}": value}."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def pd_gauges(url: str) -> dict[str, float]:
    """The per-state transfer gauges of a prefill or decode server."""
    return {k: v for k, v in metrics(url).items() if k.startswith("kvrelay_pd_transfers{")}


def bootstrap_events(url: str) -> dict[str, float]:
    """A prefill or decode server's PD bootstrap events by name."""
    name = "kvrelay_pd_bootstrap_events_total{"
    return {k.split('"')[1]: v for k, v in metrics(url).items() if k.startswith(name)}


@contextmanager
def engine_threads():
    # One torch thread per engine: prefill and decode share the test machine's cores with the
    # single server, and oversubscribed intra-op threads slow everyone down many times over.
    saved = os.environ.get("KVRELAY_CPU_THREADS")
    os.environ["KVRELAY_CPU_THREADS"] = os.environ.get("KVRELAY_PD_TEST_CPU_THREADS", "1")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KVRELAY_CPU_THREADS", None)
        else:
            os.environ["KVRELAY_CPU_THREADS"] = saved


class PDStack:
    def __init__(
        self,
        prefill_args: tuple[str, ...] = (),
        decode_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
        max_total_tokens: int = 16384,
        model: tuple[str, ...] = ("--model", "smollm2"),
    ) -> None:
        common = (*model, "--max-total-tokens", str(max_total_tokens), "--pd-secret", PD_SECRET)
        self.decode = self.prefill = self.router = None
        with engine_threads(), ThreadPoolExecutor(2) as ex:  # the two load in parallel
            fd = ex.submit(
                ServerProcess,
                *common,
                "--role",
                "decode",
                "--max-num-batched-tokens",
                "512",
                *decode_args,
            )
            fp = ex.submit(
                ServerProcess,
                *common,
                "--role",
                "prefill",
                "--max-num-batched-tokens",
                "64",
                *prefill_args,
            )
        try:
            self.decode, self.prefill = fd.result(), fp.result()
            self.router = RouterProcess(
                [self.prefill.url], [self.decode.url], "--pd-secret", PD_SECRET, *router_args
            )
        except BaseException:
            for f in (fd, fp):
                if f.exception() is None:
                    f.result().close()
            if self.router is not None:
                self.router.close()
            raise

    def idle_values(self) -> dict[tuple[str, str], float]:
        """What must be 0 on both sides when nothing is in flight: KV pages, requests and the
        per-state transfer gauges (each side reports every state it has, so none can hide)."""
        vals = {}
        for side, srv in (("prefill", self.prefill), ("decode", self.decode)):
            m = metrics(srv.url)
            gauges = [k for k in m if k.startswith("kvrelay_pd_transfers{")]
            assert gauges, f"{side} reports no per-state transfer gauges"
            for k in (
                "kvrelay_kv_pages_used",
                "kvrelay_num_requests_running",
                "kvrelay_num_requests_waiting",
                *gauges,
            ):
                vals[(side, k)] = m[k]
        if self.router is not None:  # a stream's outcome is counted when its relay settles
            k = "kvrelay_router_inflight_requests"
            vals[("router", k)] = self.router.metric(k)
        return vals

    def wait_idle(self, timeout: float = 20.0) -> float:
        """Wait until `idle_values` are all 0; returns the seconds it took."""
        start = time.time()
        while True:
            vals = self.idle_values()
            if not any(vals.values()):
                return time.time() - start
            if time.time() - start > timeout:
                busy = {k: v for k, v in vals.items() if v}
                raise AssertionError(f"not idle after {timeout}s: {busy}")
            time.sleep(0.2)

    def kill(self, side: str) -> float:
        """SIGKILL one server's API process, as an operator or the OOM killer would; its engine
        must follow on its own. Returns when both are gone: the time of the kill."""
        srv = getattr(self, side)
        engine = srv.engine_pid()
        t = time.time()
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        deadline = time.time() + 10
        while _alive(engine):
            assert time.time() < deadline, f"{side} engine {engine} outlived its API process"
            time.sleep(0.05)
        return t

    def restart(self, side: str, *args: str) -> None:
        """Start a server again on the same port (stopping it first if it runs), with the same
        arguments plus `args` (argparse: a later flag wins)."""
        old = getattr(self, side)
        old.close()
        with engine_threads():
            setattr(self, side, ServerProcess(*old.args, *args, port=old.port))

    def close(self) -> None:
        for p in (self.router, self.prefill, self.decode):
            if p is not None:
                p.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie is dead, just not reaped
    except FileNotFoundError:
        return False


def single_beside_pd(
    model: tuple[str, ...], single_args: tuple[str, ...], side_args: tuple[str, ...]
) -> tuple[ServerProcess, PDStack]:
    """A single server and a PD stack (both sides with `side_args`) of one model, loading side by
    side (three starts at once, one torch thread each); if either fails, neither is left."""
    with engine_threads(), ThreadPoolExecutor(1) as ex:
        started = ex.submit(ServerProcess, *model, *single_args)
        try:
            pd = PDStack(prefill_args=side_args, decode_args=side_args, model=model)
        except BaseException:
            if started.exception() is None:  # waits for its start to end either way
                started.result().close()
            raise
    try:
        return started.result(), pd
    except BaseException:
        pd.close()
        raise
