"""A real PD deployment for tests: a decode server, a prefill server and a router, as processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import ServerProcess, free_port


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


class PDStack:
    def __init__(
        self,
        prefill_args: tuple[str, ...] = (),
        decode_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
    ) -> None:
        common = ("--model", "smollm2", "--max-total-tokens", "16384")
        self.decode = self.prefill = self.router = None
        # One torch thread per engine: prefill and decode share the test machine's cores with the
        # single server, and oversubscribed intra-op threads slow everyone down many times over.
        threads = os.environ.get("KVRELAY_PD_TEST_CPU_THREADS", "1")
        saved = os.environ.get("KVRELAY_CPU_THREADS")
        os.environ["KVRELAY_CPU_THREADS"] = threads
        try:
            with ThreadPoolExecutor(2) as ex:  # the two servers load their models in parallel
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
        finally:
            if saved is None:
                os.environ.pop("KVRELAY_CPU_THREADS", None)
            else:
                os.environ["KVRELAY_CPU_THREADS"] = saved
        try:
            self.decode, self.prefill = fd.result(), fp.result()
            self.router = RouterProcess([self.prefill.url], [self.decode.url], *router_args)
        except BaseException:
            for f in (fd, fp):
                if f.exception() is None:
                    f.result().close()
            if self.router is not None:
                self.router.close()
            raise

    def wait_idle(self, timeout: float = 20.0) -> None:
        """KV pages and running requests back to 0 on both sides."""
        deadline = time.time() + timeout
        while True:
            vals = {
                (s, m): srv.metric(m)
                for s, srv in (("prefill", self.prefill), ("decode", self.decode))
                for m in (
                    "kvrelay_kv_pages_used",
                    "kvrelay_num_requests_running",
                    "kvrelay_num_requests_waiting",
                )
            }
            if not any(vals.values()):
                return
            if time.time() > deadline:
                raise AssertionError(f"not idle after {timeout}s: {vals}")
            time.sleep(0.2)

    def close(self) -> None:
        for p in (self.router, self.prefill, self.decode):
            if p is not None:
                p.close()
