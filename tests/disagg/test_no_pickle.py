"""No pickle on any wire: a hello crafted to run a command (what the old CUDA IPC path unpickled)
runs nothing now, CUDA IPC descriptions are typed fields checked before torch sees them, and no
module of the package can load code from bytes."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import time

import msgspec
import pytest
from engine_pair import PARAMS, PD_SECRET
from engine_pair import dense_engine as engine
from fake_peer import FakeDecode, FakePeer, hello

import kvrelay
from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.cuda_ipc import IpcDescriptorError, check, open_tensors
from kvrelay.engine.messages import AddRequest


def _evil_pickle(marker: pathlib.Path) -> bytes:
    """A pickle that calls os.system through a dotted name under `torch.` (what an allow-list of
    module prefixes let through): torch.serialization's `os`, then its `system`."""

    def short(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    cmd = f"touch {marker}"
    return (
        b"\x80\x04"  # PROTO 4
        + short("torch.serialization")
        + short("os.system")
        + b"\x93"  # STACK_GLOBAL
        + short(cmd)
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )


OLD_UNPICKLER = """
import io, pickle, sys
class TorchOnly(pickle.Unpickler):  # the allow-list the CUDA IPC hello used to be opened with
    def find_class(self, module, name):
        if module.startswith("torch"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(module)
TorchOnly(io.BytesIO(sys.stdin.buffer.read())).load()
"""


def _raw(tag: str, **fields) -> bytes:
    """A msgpack frame header with any fields (what a hostile peer can put on the wire)."""
    return msgspec.msgpack.encode({"type": tag, **fields})


def test_the_crafted_payload_is_live_under_the_old_allow_list(tmp_path):
    """The control: the payload really runs a command when unpickled as before (in a child)."""
    marker = tmp_path / "old-path-ran"
    subprocess.run(
        [sys.executable, "-c", OLD_UNPICKLER], input=_evil_pickle(marker), check=False, timeout=60
    )
    assert marker.exists()


def test_a_crafted_hello_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil = _evil_pickle(marker)
    # The old hello shape, handles in `ipc`: the field no longer exists, its bytes are dropped.
    old = P.decode(_raw("Hello", instance_id="x", role="decode", layout="l", version=2, ipc=evil))
    assert isinstance(old, P.Hello) and not hasattr(old, "ipc")
    # Where the handles travel now, the bytes are not even a list of typed fields.
    with pytest.raises(msgspec.ValidationError):
        P.decode(_raw("Auth", proof=b"\0" * 32, ipc=evil))
    with pytest.raises(msgspec.ValidationError):
        P.decode(_raw("Auth", proof=b"\0" * 32, ipc=[{"name": "L0.k", "dtype": evil}]))
    with pytest.raises(msgspec.DecodeError):
        P.decode(evil)  # the pickle itself as a frame header
    assert not marker.exists()


def test_a_crafted_hello_sent_to_real_engines_runs_nothing(tmp_path):
    """Both directions over real sockets, from a peer that even holds the secret."""
    marker = tmp_path / "pwned"
    evil = _evil_pickle(marker)
    d = engine("decode")
    p = engine("prefill", connect_timeout_s=2.0)
    try:
        peer = FakePeer.connect(d.agent.addr)  # to decode: the old hello, handles and all
        peer.send(_raw("Hello", instance_id="x", role="prefill", layout=d.agent.layout, ipc=evil))
        refusal = peer.recv()
        assert isinstance(refusal, P.Failure) and refusal.cause == P.Cause.PROTOCOL
        assert peer.hung_up()

        def script(peer: FakePeer, prefill_hello: P.Hello) -> None:  # to prefill: a decode
            mine = hello(d, "decode")
            peer.send(_raw("Hello", ipc=evil, **msgspec.structs.asdict(mine)))
            peer.recv()  # prefill's proof
            ids = (prefill_hello.nonce, mine.nonce, prefill_hello.instance_id, mine.instance_id)
            peer.send(_raw("Auth", proof=H.proof(PD_SECRET, "decode", *ids), ipc=evil))

        fake = FakeDecode(script)
        pd = P.PDParams("prefill", "t-e1", fake.addr)
        p.add(AddRequest("e1", [5, 6, 7], PARAMS, pd))
        fake.join()
        out, deadline = [], time.time() + 10
        while not out and time.time() < deadline:  # the dial ends on its thread; poll adopts it
            p.poll_transfers()
            out = [o for o in (p.step().outputs if p.has_work else []) if o.rid == "e1"]
            time.sleep(0.01)
        assert out and out[0].cause == P.Cause.PROTOCOL, out
        assert "invalid handshake message" in out[0].error
    finally:
        d.agent.close()
        p.agent.close()
    assert not marker.exists()


def _handle(**kw) -> P.IpcTensor:
    fields = dict(
        name="L0.k",
        dtype="uint8",
        shape=[16, 128],
        stride=[128, 1],
        storage_offset=0,
        device=0,
        handle=b"\1" * 64,
        storage_size_bytes=16 * 128,
        storage_offset_bytes=0,
        ref_counter_handle=b"/torch_1234_5678_0",
        ref_counter_offset=3,
        event_handle=b"\2" * 64,
        event_sync_required=True,
    )
    return P.IpcTensor(**(fields | kw))


@pytest.mark.parametrize(
    "bad,why",
    [
        (dict(dtype="torch.serialization.os.system"), "is not one of"),
        (dict(dtype="float64"), "is not one of"),
        (dict(shape=[17, 128]), "reaches past"),
        (dict(storage_offset=1), "reaches past"),
        (dict(shape=[16, 64], stride=[128, 2], storage_offset=3), "reaches past"),
        (dict(dtype="float32"), "reaches past"),  # 4-byte elements: four times the bytes
        (dict(shape=[16], stride=[128, 1]), "do not match"),
        (dict(storage_size_bytes=0), "empty storage"),
        (dict(ref_counter_handle=b"/../../etc/passwd"), "shared-memory name"),
        (dict(ref_counter_handle=b"/torch\0x"), "shared-memory name"),
        (dict(ref_counter_offset=10_000), "out of range"),
        (dict(event_handle=b""), "no event handle"),
    ],
)
def test_ipc_descriptions_are_checked_before_torch_sees_them(bad, why):
    assert check(_handle()) is not None  # the well-formed one passes
    with pytest.raises(IpcDescriptorError, match=why):
        open_tensors([_handle(**bad)])  # refused before any CUDA call (this may be a CPU box)


def test_ipc_descriptions_survive_the_wire_exactly():
    handles = [_handle(), _handle(name="L0.v", storage_offset_bytes=4096)]
    auth = P.decode(P.encode(P.Auth(b"\0" * 32, handles)))
    assert auth.ipc == handles


def test_no_module_can_load_code_from_bytes():
    """pickle, marshal, shelve, or torch.load without weights_only: none anywhere in kvrelay."""
    root = pathlib.Path(kvrelay.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if {"pickle", "marshal", "shelve", "dill", "cloudpickle"} & {
                    n.split(".")[0] for n in names
                }:
                    found.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load":
                base = getattr(node.func.value, "id", "")
                safe = any(k.arg == "weights_only" for k in node.keywords)
                if base == "torch" and not safe:
                    found.append(f"{path}:{node.lineno} torch.load")
    assert not found, found
