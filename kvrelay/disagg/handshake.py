"""The PD shared secret at work: the proofs of the transfer handshake, and the token that lets a
server accept PD routing fields (`kvrelay_pd`) only from a holder of the secret (the router).

Handshake (one per transport connection, before any other message is accepted):
    prefill -> decode   Hello(nonce_p)
    decode  -> prefill  Hello(nonce_d)
    prefill -> decode   Auth(proof("prefill"))          decode checks it, else refuses the peer
    decode  -> prefill  Auth(proof("decode"), ipc=...)  prefill checks it, else refuses the peer
A proof is HMAC-SHA256 with the secret over the role, both nonces and both instance ids: fresh per
connection (each side's own nonce is in the other's proof, so a recorded proof is worthless) and
bound to its direction (a proof cannot be reflected back). Compared in constant time. The frames
after the handshake are not signed: the handshake keeps out peers without the secret, not an
attacker on the path (run PD on a network you trust, as for any unencrypted transport).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

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
) -> bytes:
    """What `role` ("prefill" or "decode") sends to prove it holds `secret` on this connection."""
    return _mac(
        secret,
        b"kvrelay-pd-handshake-v1",
        role.encode(),
        prefill_nonce,
        decode_nonce,
        prefill_instance.encode(),
        decode_instance.encode(),
    )


def proof_ok(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def request_token(secret: str, body: bytes) -> str:
    """The router's `X-Kvrelay-PD-Auth` value for a request body: HMAC-SHA256 over the exact
    bytes, so the token vouches for this request's PD fields (decode address included) and
    nothing else, and the secret itself never travels."""
    return _mac(secret, b"kvrelay-pd-request-v1", body).hex()


def request_token_ok(secret: str, body: bytes, token: str | None) -> bool:
    if not secret or not token:
        return False
    # As bytes: compare_digest refuses str with non-ASCII characters (a header may hold any).
    expected = request_token(secret, body).encode()
    return hmac.compare_digest(expected, token.encode("latin-1", errors="replace"))
