"""The router's /metrics carries its servers' metrics (issue 28 item 6), each sample relabelled
`server=<url>,role=<role>`, and a frozen server cannot stall it: behind the router here are a
server that answers /metrics (a real HTTP server with prometheus_client's exposition) and one
that accepts connections and never answers."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_router_access import RunningRouter

from kvrelay.config import RouterConfig
from kvrelay.router.metrics import SCRAPE_TIMEOUT_S


def _exposition() -> bytes:
    r = CollectorRegistry()
    Gauge("kvrelay_kv_pages_used", "KV pages in use", registry=r).set(7)
    c = Counter("kvrelay_requests", 'requests "by" reason', ["finish_reason"], registry=r)
    c.labels(finish_reason="stop").inc(3)
    return generate_latest(r)


class MetricsServer:
    def __init__(self) -> None:
        body = _exposition()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def stack():
    frozen = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    live = MetricsServer()
    frozen_url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
    cfg = RouterConfig(
        prefill=(frozen_url,), decode=(live.url,), pd_secret="s", probe_interval_s=60
    )
    router = RunningRouter(cfg)
    yield router, frozen_url, live.url
    router.close()
    live.close()
    frozen.close()


def test_server_metrics_are_relabelled_and_a_frozen_server_does_not_stall(stack):
    router, frozen_url, live_url = stack
    t = time.monotonic()
    r = httpx.get(router.url + "/metrics", timeout=30)
    took = time.monotonic() - t
    assert r.status_code == 200
    assert took < SCRAPE_TIMEOUT_S + 2.0, took  # bounded by the scrape timeout, not the server's
    text = r.text
    live = f'server="{live_url}",role="decode"'
    assert f"kvrelay_kv_pages_used{{{live}}} 7.0" in text
    assert f'kvrelay_requests_total{{{live},finish_reason="stop"}} 3.0' in text
    assert f'kvrelay_router_server_scrape_ok{{server="{frozen_url}",role="prefill"}} 0' in text
    assert f"kvrelay_router_server_scrape_ok{{{live}}} 1" in text
    assert "kvrelay_router_requests" in text  # the router's own are still there
    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition
    assert families["kvrelay_requests"].type == "counter"
    assert families["kvrelay_requests"].documentation == 'requests "by" reason'
    assert text.count("# TYPE kvrelay_kv_pages_used ") == 1
