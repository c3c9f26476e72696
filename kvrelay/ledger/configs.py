"""Naming server configurations: a stable key, a readable label, and the difference of two.

A configuration is what `GET /server_info` reports (engine and server settings, the server's
environment knobs, device, GPU), without where the server listens: the same settings on another
port are the same configuration.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from kvrelay.config import ENV_KNOBS, ServerConfig

# Where a server listens or records, and who may use it: not how it serves.
IGNORED = frozenset(
    {
        "host",
        "port",
        "env.KVRELAY_LEDGER",
        "api_key",
        "engine.disagg.pd_secret",
        "env.KVRELAY_API_KEY",
        "env.KVRELAY_PD_SECRET",
    }
)


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """{'engine': {'cache': {'page_size': 16}}} -> {'engine.cache.page_size': 16}."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out


def settings(info: dict) -> dict[str, object]:
    """The flattened settings and environment knobs of a server_info (none for a server that
    reports none)."""
    flat = flatten(info.get("config") or {}) | flatten(info.get("env") or {}, "env.")
    return {k: v for k, v in flat.items() if k not in IGNORED}


def config_key(info: dict) -> str:
    """12 hex digits naming the configuration; a server without /server_info is named by its URL
    and model."""
    if info.get("config"):
        ident = {"settings": settings(info), "engine": info.get("engine"), "gpu": info.get("gpu")}
    else:
        ident = {"url": info.get("url"), "model": info.get("model")}
    blob = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def non_defaults(info: dict) -> dict[str, object]:
    """The settings that differ from kvrelay's defaults."""
    defaults = flatten(asdict(ServerConfig())) | {
        f"env.{k.name}": k.default for k in ENV_KNOBS.values()
    }
    return {k: v for k, v in settings(info).items() if defaults.get(k, object()) != v}


def config_label(info: dict) -> str:
    """'smollm2 · cpu float32 · engine.scheduler.max_num_batched_tokens=128'."""
    if not info.get("config"):
        return f"{info.get('model') or '?'} at {info.get('url') or '?'} (no /server_info)"
    eng = info.get("engine") or {}
    parts = [str(info.get("model")), f"{info.get('gpu')} {eng.get('dtype', '')}".strip()]
    diff = non_defaults(info)
    diff.pop("engine.model", None)  # already named
    if diff:
        parts.append(", ".join(f"{_short(k)}={v}" for k, v in sorted(diff.items())))
    return " · ".join(parts)


def config_diff(a: dict, b: dict) -> str:
    """What B changes relative to A, e.g. 'attention_backend: torch -> triton'; '' when equal."""
    sa, sb = settings(a), settings(b)
    changed = [k for k in sorted(sa.keys() | sb.keys()) if sa.get(k) != sb.get(k)]
    for key in ("gpu", "model"):
        if a.get(key) != b.get(key):
            changed.append(key)
            sa[key], sb[key] = a.get(key), b.get(key)
    return "; ".join(f"{_short(k)}: {sa.get(k)} -> {sb.get(k)}" for k in changed)


def _short(key: str) -> str:
    """Drop the section names: 'engine.scheduler.max_num_batched_tokens' -> 'max_num_batched_tokens'."""
    return key.rsplit(".", 1)[-1]
