"""`kvrelay repro --deterministic-check`: the operator's A/B question (is a divergent turn
corruption or numerics?) in one command. A server in `--deterministic` mode computes every row
the same way whatever the batch, so its replies at any concurrency must equal the reference's
bit for bit: every divergent turn is a defect, with no near-tie allowance. The check first
confirms from `/server_info` that each server under test runs the mode (through a router: every
server behind it), since against a batch-variant server the verdict would mean nothing."""

from __future__ import annotations

import httpx

from kvrelay.bench.loadgen import BenchError


def _deterministic(info: dict) -> bool:
    return bool(((info.get("config") or {}).get("engine") or {}).get("deterministic"))


async def confirm_deterministic(client: httpx.AsyncClient, url: str) -> list[str]:
    """The servers at `url` (itself, or each server behind a router) that run `--deterministic`;
    raises BenchError unless every one does."""
    try:
        r = await client.get(url + "/server_info", timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"--deterministic-check: GET {url}/server_info failed: {e}") from e
    if r.status_code != 200:
        raise BenchError(
            f"--deterministic-check: GET {url}/server_info answered {r.status_code}: the check "
            "needs the server's configuration to confirm it runs --deterministic"
        )
    info = r.json()
    servers = info.get("servers") if info.get("role") == "router" else {url: info}
    if not servers:
        raise BenchError(f"--deterministic-check: the router at {url} lists no servers")
    off = [u for u, i in servers.items() if not _deterministic(i)]
    if off:
        raise BenchError(
            f"--deterministic-check: {', '.join(off)} does not run --deterministic, so a "
            "divergence there could be numerics; start it with --deterministic"
        )
    return sorted(servers)
