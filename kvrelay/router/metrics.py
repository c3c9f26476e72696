"""The router's `/metrics` with its servers' engine metrics in it: each server's own `/metrics`
is fetched (all at once, each within SCRAPE_TIMEOUT_S, so a frozen server cannot stall the
router's), every sample relabelled `server="<url>",role="prefill|decode"`, and families merged
across servers (one HELP/TYPE each). `kvrelay_router_server_scrape_ok{server,role}` is 1 for a
server whose metrics are in this answer, 0 for one that failed or was too slow (its samples are
then absent, never stale)."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 1.0  # per server; the fetches run concurrently


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


async def _fetch(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        r = await client.get(url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def servers_text(client: httpx.AsyncClient, servers: list[tuple[str, str]]) -> str:
    """`servers`: (url, role) pairs. The exposition text of their metrics, relabelled."""
    texts = await asyncio.gather(*(_fetch(client, url) for url, _ in servers))
    families: dict[str, dict] = {}  # name -> {"help", "type", "samples": [lines]}
    ok_lines = []
    for (url, role), text in zip(servers, texts, strict=True):
        labels = f'server="{_escape(url)}",role="{role}"'
        ok_lines.append(f"kvrelay_router_server_scrape_ok{{{labels}}} {int(text is not None)}")
        if text is None:
            continue
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:  # unparseable: counted as a failed scrape
            ok_lines[-1] = f"kvrelay_router_server_scrape_ok{{{labels}}} 0"
            continue
        for fam in parsed:
            entry = families.setdefault(
                fam.name, {"help": fam.documentation, "type": fam.type, "samples": []}
            )
            for s in fam.samples:
                extra = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
                lab = labels + ("," + extra if extra else "")
                entry["samples"].append(f"{s.name}{{{lab}}} {_value(s.value)}")
    out = [
        "# HELP kvrelay_router_server_scrape_ok whether a server's metrics are in this answer",
        "# TYPE kvrelay_router_server_scrape_ok gauge",
        *ok_lines,
    ]
    for name, e in families.items():
        help_text = e["help"].replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {'untyped' if e['type'] == 'unknown' else e['type']}")
        out.extend(e["samples"])
    return "\n".join(out) + "\n"
