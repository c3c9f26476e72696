"""Raise this process's open-file limit to what its connections need: a router holds three sockets
per request in flight (the client's, prefill's, decode's), and a soft limit of 1024 (a common
default) would refuse connections near 300 concurrent requests."""

from __future__ import annotations

import logging

log = logging.getLogger("kvrelay.ops")


def raise_open_files_limit(needed: int) -> int:
    """Soft RLIMIT_NOFILE up to max(needed, current), capped by the hard limit; returns it."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    if soft < needed:
        log.warning(
            "open files limit %d is below the %d this process may need (hard limit %d): "
            "connections past it are refused",
            soft,
            needed,
            hard,
        )
    return soft
