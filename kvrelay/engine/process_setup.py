"""How an engine-side process (rank 0's engine, a tensor-parallel follower) starts and ends:
logging, dying with its parent, exiting at once after a clean stop."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from kvrelay.config import env


def setup_logging() -> None:
    logging.basicConfig(
        level=env("KVRELAY_LOG_LEVEL"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


def die_with_parent() -> None:
    """An engine outliving its API process (SIGKILLed) would keep its memory and its PD transfer
    listener, which peers would still trust: on Linux the kernel kills us with our parent."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the kernel was told
        os._exit(1)


def exit_now() -> None:
    """Ends the engine process at once, after a clean stop (followers, transfer agent and sockets
    closed): logs flushed, then os._exit(0), the exit code a return would give. A normal
    interpreter exit tears torch and the loaded model down object by object (1-3 s on a small
    CPU machine, on every server stop and restart) for nothing the OS does not free anyway.
    (The API process needs no such thing: uvicorn re-raises the SIGTERM it stopped on.)"""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
