"""`Launcher` over three tiny HTTP children (no model): fast tests of supervision and SIGHUP.

Run as a script: `python fake_stack.py LOG_DIR`; each child answers /health and /pd/info.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from kvrelay.ops.launcher import LaunchConfig, Launcher

CHILD = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"model": "fake"}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def main(log_dir: str) -> int:
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    launcher = Launcher(
        LaunchConfig(port=0, log_dir=log_dir, health_timeout_s=20),
        on_ready=lambda url, model: print(f"kvrelay up ready: {url} (model {model})", flush=True),
        poll_s=0.05,
    )
    for c in launcher.children:
        port = c.spec.url.rsplit(":", 1)[1]
        c.spec = dataclasses.replace(c.spec, argv=[sys.executable, "-c", CHILD, port])
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
