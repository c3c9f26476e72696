"""The PD wire protocol (msgspec messages) and the explicit per-request transfer state machine.

A connection starts with a mutual handshake (Hello each way, then Auth each way: prefill's
proof of the PD secret first, decode's after it checked prefill's; see handshake.py). A transfer
piece names its request and transfer identity, the cache kinds it carries (names from the
runner's `transfer_layout()`: "L3.k", "L1.c4_index_k", "L1.c4_state.pending_kv", ...), the token
range it covers, its byte count and a checksum over its bytes. The receiver checks every field
against what it reserved before it installs a byte.

Everything on the wire is msgpack decoded into these typed structs, with length and range limits
on every field (no field is ever a code-loading format such as pickle): a peer can send wrong
values, never objects.
"""

from __future__ import annotations

import enum
import time
import zlib
from typing import Annotated, Literal

import msgspec

# Its home is engine/messages.py (AddRequest carries it); the PD agents name it P.PDParams.
from kvrelay.engine.messages import PDParams  # noqa: F401

# 2: pieces name their cache kinds; 3: authenticated handshake, typed IPC; 4: Released (the fence);
# 5: ReserveAck.skip_tokens (decode holds a cached prefix); 6: ReserveAck.every_row, and a skip
# for models with per-request state (DeepSeek-V4's per-page compressor state travels as a kind);
# 7: ReserveAck.resume_rows replaces every_row (only the window rows a hit at the prompt's last
# full page boundary reads, not every row; a page's end state: the last full page's only)
# 8: Auth.nixl (the NIXL agents' names, decode's metadata and page pools; bound to the proofs)
PROTOCOL_VERSION = 8

# Field limits: a received message that breaks one is refused whole (msgspec.ValidationError).
Id = Annotated[str, msgspec.Meta(max_length=256)]  # ids, names, addresses, fingerprints
MAX_TEXT = 16384
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]  # reasons and messages
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
MAX_KINDS = 4096  # cache kinds of one layout (DeepSeek-V4-Flash has a few hundred)
MAX_PAGES = 1 << 22  # pages of one request
Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(max_length=64)]
Blob = Annotated[bytes, msgspec.Meta(max_length=4096)]  # an opaque CUDA handle
Description = Annotated[
    list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=MAX_KINDS + 1)
]


# ---- messages (prefill <-> decode, over one transport connection) --------------------------------


class Hello(msgspec.Struct, tag=True):
    """Each side's first frame: who it is, its cache layout, and a fresh nonce that the other
    side's proof of the PD secret must cover."""

    instance_id: Id
    role: Literal["prefill", "decode"]
    layout: Id  # cache layout fingerprint: both sides must agree before any bytes move
    nonce: Nonce = b""  # handshake.NONCE_BYTES fresh random bytes (empty: an older peer)
    version: int = PROTOCOL_VERSION
    description: Description = []  # the layout, one line per cache kind: names what differs


class IpcTensor(msgspec.Struct, frozen=True):
    """One CUDA tensor of decode's, shared with prefill through CUDA IPC: the fields that
    `UntypedStorage._share_cuda_()` produces for its storage, and the tensor's geometry. Plain
    values; `cuda_ipc.open_tensors` checks them all before it hands any to torch."""

    name: Id  # the cache kind
    dtype: Annotated[str, msgspec.Meta(max_length=32)]  # a name from cuda_ipc.DTYPES
    shape: Annotated[list[Count], msgspec.Meta(max_length=8)]
    stride: Annotated[list[Count], msgspec.Meta(max_length=8)]
    storage_offset: Count  # elements
    device: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    handle: Blob  # cudaIpcMemHandle of the allocation the storage lives in
    storage_size_bytes: Count
    storage_offset_bytes: Count  # the storage's offset in that allocation
    ref_counter_handle: Blob  # the exporter's shared-memory reference counter (a file name)
    ref_counter_offset: Count
    event_handle: Blob
    event_sync_required: bool


MAX_NIXL_METADATA = 512 << 10  # a NIXL agent's metadata (connection info + memory keys)


class NixlRegion(msgspec.Struct, frozen=True):
    """One cache kind's byte rows in decode's memory, registered with its NIXL agent: where
    prefill's one-sided writes of that kind land. Plain numbers: NIXL itself refuses a write
    outside what decode registered (its metadata's memory keys)."""

    name: Id  # the cache kind
    addr: Count  # row 0, in decode's address space
    rows: Count
    row_bytes: Count
    row_stride: Count  # bytes from one row to the next
    device: Annotated[int, msgspec.Meta(ge=-1, le=1024)]  # -1: host memory (DRAM), else a GPU


class NixlAgent(msgspec.Struct, frozen=True):
    """A side's NIXL agent, in its Auth (nixl backend): prefill names its agent (decode takes
    notifications from that name only, on this connection); decode adds its agent's metadata and
    page pools (prefill loads them to write into decode's pages). The proof of the Auth that
    carries it covers it (handshake.binding)."""

    name: Id
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)] = b""
    regions: Annotated[list[NixlRegion], msgspec.Meta(max_length=MAX_KINDS)] = []


class Auth(msgspec.Struct, tag=True):
    """Each side's proof that it holds the PD secret (handshake.proof over both nonces, and
    the Auth's nixl field when it has one). Prefill sends it first; decode answers with its own
    only once prefill's checked, and only then shares its cache tensors (cuda_ipc backend) or
    its NIXL agent's metadata and page pools (nixl backend)."""

    proof: Proof
    ipc: Annotated[list[IpcTensor], msgspec.Meta(max_length=MAX_KINDS)] = []
    nixl: NixlAgent | None = None


class ReserveRequest(msgspec.Struct, tag=True):
    """prefill -> decode: reserve pages for this request (decode answers with ReserveAck)."""

    transfer_id: Id
    rid: Id
    num_tokens: Count
    prompt_hash: Id


class ReserveAck(msgspec.Struct, tag=True):
    transfer_id: Id
    ok: bool
    reason: Text = ""
    # decode's pages and state slot for the prompt: where a backend that writes into decode's
    # memory (cuda_ipc) puts the rows
    pages: Annotated[list[Count], msgspec.Meta(max_length=MAX_PAGES)] = []
    slot: Count = 0
    # prompt tokens whose paged KV decode already holds (its prefix cache; whole pages, fewer
    # than the prompt): prefill sends page rows only for tokens from here on
    skip_tokens: Count = 0
    # decode caches the prompt's pages for later hits: send a sliding window's rows from the
    # prompt's last full page boundary - (window - 1) on (what a hit ending there reads), not
    # only the prompt's last window (layout.CacheKind.row_range)
    resume_rows: bool = False

    def __post_init__(self) -> None:
        self.reason = self.reason[:MAX_TEXT]  # ours may quote a peer's: stay within the limit


class ChunkHeader(msgspec.Struct, tag=True):
    """One piece: the rows of some cache kinds that tokens [token_start, token_end) filled (a
    slot kind: its state after them). The payload follows the header in the same frame: each
    kind's rows in the order named."""

    transfer_id: Id
    rid: Id
    kinds: Annotated[list[Id], msgspec.Meta(max_length=MAX_KINDS)]
    token_start: Count
    token_end: Count
    nbytes: Count
    checksum: Count | None  # crc32 of the payload; None when checksums are off
    in_place: bool = False  # cuda_ipc: the rows were written into decode's pages, no payload;
    # the checksum is then `device_checksum` of those rows


class FirstToken(msgspec.Struct, tag=True):
    """prefill -> decode: the sampled first token, sent after the last chunk."""

    transfer_id: Id
    rid: Id
    token_id: int
    logprob: float | None
    top_logprobs: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=1024)] | None
    num_chunks: Count
    cached_tokens: Count = 0  # prompt tokens prefill found in its prefix cache (usage)


class TransferDone(msgspec.Struct, tag=True):
    """decode -> prefill: everything verified and installed."""

    transfer_id: Id


class Failure(msgspec.Struct, tag=True):
    """Either direction: the transfer failed; the receiver fails its side of the request. During
    the handshake (transfer_id ""): why the peer refuses this connection."""

    transfer_id: Id
    cause: Id  # a short machine name (see Cause)
    message: Text

    def __post_init__(self) -> None:
        self.message = self.message[:MAX_TEXT]  # ours may quote a peer's: stay within the limit


class Released(msgspec.Struct, tag=True):
    """prefill -> decode, the answer to decode's Failure: prefill sends and writes nothing more
    for this transfer, so decode may hand its pages to another request (until then they are
    fenced: an in-place backend writes into them directly)."""

    transfer_id: Id


class Heartbeat(msgspec.Struct, tag=True):
    instance_id: Id
    sent_at: float


Message = (
    Hello
    | Auth
    | ReserveRequest
    | ReserveAck
    | ChunkHeader
    | FirstToken
    | TransferDone
    | Failure
    | Released
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
    CONNECT = "connect_failed"  # no connection, or no complete handshake in time
    UNAUTHENTICATED = "peer_unauthenticated"  # a side lacks the PD secret or proved a wrong one
    PROTOCOL = "protocol_mismatch"  # the peer speaks another protocol version
    IPC = "ipc_open_failed"  # decode's CUDA IPC handles could not be opened here


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
