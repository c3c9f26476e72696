"""The PD shared secret at work: the proofs of the transfer handshake, and the token that lets a
server accept PD routing fields (`kvrelay_pd`) only from a holder of the secret (the router).

Handshake (one per transport connection, before any other message is accepted):
    prefill -> decode   Hello(nonce_p)
    decode  -> prefill  Hello(nonce_d)
    prefill -> decode   Auth(proof("prefill"))          decode checks it, else refuses the peer
    decode  -> prefill  Auth(proof("decode"), ipc=...)  prefill checks it, else refuses the peer
(nixl backend: each Auth names its side's NIXL agent, decode's with its metadata and page pools;
the proof covers that field too (`binding`), so neither side loads or trusts an agent that a
holder of the secret did not vouch for on this connection.)
A proof is HMAC-SHA256 with the secret over the role, both nonces and both instance ids: fresh per
connection (each side's own nonce is in the other's proof, so a recorded proof is worthless) and
bound to its direction (a proof cannot be reflected back). Compared in constant time. The frames
after the handshake are not signed: the handshake keeps out peers without the secret, not an
attacker on the path (run PD on a network you trust, as for any unencrypted transport).

A PD request body the router sends a server carries a token (request_token) bound to the body,
a time and a nonce: the server takes it once, within REQUEST_WINDOW_S of its time
(RequestVerifier); a replay, a stale or a forged token is refused (403) and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict

import msgspec

from kvrelay.config import env

NONCE_BYTES = 32
PD_AUTH_HEADER = "X-Kvrelay-PD-Auth"  # the router's token over a request body with `kvrelay_pd`


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(secret: str, *parts: bytes) -> bytes:
    # Each part length-prefixed: no two different part lists hash the same bytes.
    msg = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def proof(
    secret: str,
    role: str,
    prefill_nonce: bytes,
    decode_nonce: bytes,
    prefill_instance: str,
    decode_instance: str,
    bound: bytes = b"",
) -> bytes:
    """What `role` ("prefill" or "decode") sends to prove it holds `secret` on this connection;
    `bound`: what else of its Auth the proof vouches for (`binding`; b"": nothing, the proof of
    a tcp or cuda_ipc Auth)."""
    parts = [
        b"kvrelay-pd-handshake-v1",
        role.encode(),
        prefill_nonce,
        decode_nonce,
        prefill_instance.encode(),
        decode_instance.encode(),
    ]
    return _mac(secret, *parts, *([b"bound", bound] if bound else []))


def binding(nixl) -> bytes:
    """What an Auth's proof covers of its NIXL agent (protocol.NixlAgent, None: nothing): the
    SHA-256 of its encoding (msgpack of a struct is canonical: the same fields, the same bytes)."""
    if nixl is None:
        return b""
    return hashlib.sha256(msgspec.msgpack.encode(nixl)).digest()


def proof_ok(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


# A signed request is good for this long either side of its time (the router's and the server's
# clocks may differ that much); within it, each nonce is taken once. KVRELAY_PD_REQUEST_WINDOW_S.
REQUEST_WINDOW_S = 60.0
TOKEN_VERSION = "v2"


def _request_mac(secret: str, when_ms: int, nonce: bytes, body: bytes) -> str:
    return _mac(secret, b"kvrelay-pd-request-v2", str(when_ms).encode(), nonce, body).hex()


def request_token(secret: str, body: bytes, now: float | None = None) -> str:
    """The router's `X-Kvrelay-PD-Auth` value for a request body: `v2:<unix ms>:<nonce>:<mac>`,
    the mac HMAC-SHA256 over the time, a fresh nonce and the exact body bytes. So the token
    vouches for this request's PD fields (decode address included) and nothing else, for
    REQUEST_WINDOW_S around its time, once (the server remembers nonces: RequestVerifier); the
    secret itself never travels."""
    when_ms = int((time.time() if now is None else now) * 1000)
    nonce = secrets.token_bytes(16)
    return f"{TOKEN_VERSION}:{when_ms}:{nonce.hex()}:{_request_mac(secret, when_ms, nonce, body)}"


class RequestVerifier:
    """Checks PD request tokens and refuses replays: a nonce seen within the window is refused
    (`replays` counts them), a token outside the window too (`stale`). Remembers each nonce for
    twice the window, at most `max_nonces` (past that the oldest go; each is past its window by
    then unless more than max_nonces signed requests came within one window)."""

    def __init__(self, window_s: float | None = None, max_nonces: int = 1 << 20) -> None:
        if window_s is None:
            window_s = float(env("KVRELAY_PD_REQUEST_WINDOW_S"))
        self.window_s, self.max_nonces = window_s, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it was taken
        self._lock = threading.Lock()
        self.counts = {"replayed": 0, "stale": 0, "bad": 0, "ok": 0}

    def problem(self, secret: str, body: bytes, token: str | None) -> str | None:
        """Why the token does not vouch for `body` now (None: it does; its nonce is now taken)."""
        why = self._problem(secret, body, token)
        with self._lock:
            kind = "ok" if why is None else why.split(":", 1)[0]
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return why

    def _problem(self, secret: str, body: bytes, token: str | None) -> str | None:
        if not secret or not token:
            return "bad: no token"
        parts = token.split(":")
        if len(parts) != 4 or parts[0] != TOKEN_VERSION or not parts[1].isdigit():
            return "bad: not a v2 token"
        when_ms, nonce_hex, mac = int(parts[1]), parts[2], parts[3]
        try:
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            return "bad: the nonce is not hex"
        expected = _request_mac(secret, when_ms, nonce, body).encode()
        # As bytes: compare_digest refuses str with non-ASCII characters (a header may hold any).
        if not hmac.compare_digest(expected, mac.encode("latin-1", errors="replace")):
            return "bad: the signature does not match the body"
        now = time.time()
        if abs(now - when_ms / 1000) > self.window_s:
            return f"stale: signed {now - when_ms / 1000:.0f}s ago (window {self.window_s:g}s)"
        with self._lock:
            self._forget_old(time.monotonic())
            if nonce_hex in self._seen:
                return "replayed: this signed request was already taken"
            self._seen[nonce_hex] = time.monotonic()
        return None

    def _forget_old(self, now: float) -> None:
        keep_s = 2 * self.window_s
        while self._seen and (
            len(self._seen) >= self.max_nonces or now - next(iter(self._seen.values())) > keep_s
        ):
            self._seen.popitem(last=False)

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


# The verifier of this process's server (its API holds one PD secret): request_token_ok's.
SERVER_VERIFIER = RequestVerifier()


def request_token_ok(secret: str, body: bytes, token: str | None) -> bool:
    return SERVER_VERIFIER.problem(secret, body, token) is None
