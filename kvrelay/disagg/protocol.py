"""The PD wire protocol (msgspec messages) and the explicit per-request transfer state machine.

A transfer piece names its request and transfer identity, the cache kinds it carries (names from
the runner's `transfer_layout()`: "L3.k", "L1.c4_index_k", "L1.c4_state.pending_kv", ...), the
token range it covers, its byte count and a checksum over its bytes. The receiver checks every
field against what it reserved before it installs a byte.
"""

from __future__ import annotations

import enum
import time
import zlib

import msgspec

PROTOCOL_VERSION = 2  # 2: pieces name their cache kinds


class PDParams(msgspec.Struct, frozen=True):
    """What the router tells each side about one request."""

    role: str  # prefill | decode
    transfer_id: str
    decode_addr: str = ""  # prefill only: the decode engine's transfer listener, host:port
    decode_instance: str = (
        ""  # prefill only: the decode instance the router saw (restart detection)
    )


# ---- messages (prefill <-> decode, over one transport connection) --------------------------------


class Hello(msgspec.Struct, tag=True):
    instance_id: str
    role: str
    layout: str  # cache layout fingerprint: both sides must agree before any bytes move
    version: int = PROTOCOL_VERSION
    description: list[str] = []  # the layout, one line per cache kind: names what differs
    ipc: bytes = b""  # decode on the cuda_ipc backend: CUDA IPC handles of its cache kinds


class ReserveRequest(msgspec.Struct, tag=True):
    """prefill -> decode: reserve pages for this request (decode answers with ReserveAck)."""

    transfer_id: str
    rid: str
    num_tokens: int
    prompt_hash: str


class ReserveAck(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool
    reason: str = ""
    pages: list[int] = []  # decode's pages and state slot for the prompt: where a backend
    slot: int = 0  # that writes into decode's memory (cuda_ipc) puts the rows


class ChunkHeader(msgspec.Struct, tag=True):
    """One piece: the rows of some cache kinds that tokens [token_start, token_end) filled (a
    slot kind: its state after them). The payload follows the header in the same frame: each
    kind's rows in the order named."""

    transfer_id: str
    rid: str
    kinds: list[str]
    token_start: int
    token_end: int
    nbytes: int
    checksum: int | None  # crc32 of the payload; None when checksums are off
    in_place: bool = False  # cuda_ipc: the rows were written into decode's pages, no payload;
    # the checksum is then `device_checksum` of those rows


class FirstToken(msgspec.Struct, tag=True):
    """prefill -> decode: the sampled first token, sent after the last chunk."""

    transfer_id: str
    rid: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    num_chunks: int


class TransferDone(msgspec.Struct, tag=True):
    """decode -> prefill: everything verified and installed."""

    transfer_id: str


class Failure(msgspec.Struct, tag=True):
    """Either direction: the transfer failed; the receiver fails its side of the request."""

    transfer_id: str
    cause: str  # a short machine name (see Cause)
    message: str


class Heartbeat(msgspec.Struct, tag=True):
    instance_id: str
    sent_at: float


Message = (
    Hello
    | ReserveRequest
    | ReserveAck
    | ChunkHeader
    | FirstToken
    | TransferDone
    | Failure
    | Heartbeat
)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _enc.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    return _dec.decode(data)


class Cause:
    """Failure causes: the label of the failure counter and the `code` of the HTTP error."""

    NO_KV = "decode_no_kv"
    REFUSED = "reservation_refused"
    TIMEOUT = "transfer_timeout"
    PEER_LOST = "peer_connection_lost"
    PEER_FAILED = "peer_failed"
    CHECKSUM = "checksum_mismatch"
    IDENTITY = "identity_mismatch"
    LAYOUT = "layout_mismatch"
    ABORTED = "aborted"
    CONNECT = "connect_failed"


def pd_status(cause: str) -> int:
    """The HTTP status of a PD failure: 503 when decode has no room, 504 on timeouts, else 502."""
    if cause in (Cause.NO_KV, Cause.REFUSED):
        return 503
    return 504 if cause == Cause.TIMEOUT else 502


def checksum(buffers) -> int:
    c = 0
    for b in buffers:
        c = zlib.crc32(b, c)
    return c


def prompt_hash(ids: list[int]) -> str:
    return f"{zlib.crc32(msgspec.msgpack.encode(ids)):08x}:{len(ids)}"


# ---- state machine ---------------------------------------------------------------------------------


class TState(enum.Enum):
    # prefill side
    BOOTSTRAPPING = "bootstrapping"  # ReserveRequest sent, waiting for decode's ack
    PREFILLING = "prefilling"  # reserved on decode, prompt being computed here
    SENDING = "sending"  # chunks + first token queued/sent, waiting for TransferDone
    # decode side
    RESERVED = "reserved"  # pages held, waiting for prefill's ReserveRequest
    RECEIVING = "receiving"  # prefill matched, chunks arriving
    # both
    DONE = "done"
    FAILED = "failed"


PREFILL_TRANSITIONS: dict[TState, set[TState]] = {
    TState.BOOTSTRAPPING: {TState.PREFILLING, TState.FAILED},
    TState.PREFILLING: {TState.SENDING, TState.FAILED},
    TState.SENDING: {TState.DONE, TState.FAILED},
    TState.DONE: set(),
    TState.FAILED: set(),
}
DECODE_TRANSITIONS: dict[TState, set[TState]] = {
    TState.RESERVED: {TState.RECEIVING, TState.FAILED},
    TState.RECEIVING: {TState.DONE, TState.FAILED},
    TState.DONE: set(),
    TState.FAILED: set(),
}


class InvalidTransition(Exception):
    pass


class TransferStateMachine:
    """One request's transfer state on one side; every non-final state has a deadline."""

    def __init__(
        self,
        initial: TState,
        transitions: dict[TState, set[TState]],
        timeouts_s: dict[TState, float],
        clock=time.monotonic,
    ) -> None:
        self.transitions, self.timeouts_s, self.clock = transitions, timeouts_s, clock
        self.state = initial
        self.entered_at = clock()
        self.history: list[TState] = [initial]

    @property
    def final(self) -> bool:
        return not self.transitions[self.state]

    @property
    def deadline(self) -> float | None:
        t = self.timeouts_s.get(self.state)
        return None if t is None or self.final else self.entered_at + t

    def to(self, new: TState) -> None:
        if new not in self.transitions[self.state]:
            raise InvalidTransition(f"{self.state.value} -> {new.value} is not allowed")
        self.state = new
        self.entered_at = self.clock()
        self.history.append(new)

    def expired(self, now: float | None = None) -> bool:
        d = self.deadline
        return d is not None and (self.clock() if now is None else now) > d


def prefill_machine(
    bootstrap_s: float, prefill_s: float, send_s: float, clock=time.monotonic
) -> TransferStateMachine:
    timeouts = {
        TState.BOOTSTRAPPING: bootstrap_s,
        TState.PREFILLING: prefill_s,
        TState.SENDING: send_s,
    }
    return TransferStateMachine(TState.BOOTSTRAPPING, PREFILL_TRANSITIONS, timeouts, clock)


def decode_machine(wait_s: float, receive_s: float, clock=time.monotonic) -> TransferStateMachine:
    timeouts = {TState.RESERVED: wait_s, TState.RECEIVING: receive_s}
    return TransferStateMachine(TState.RESERVED, DECODE_TRANSITIONS, timeouts, clock)
