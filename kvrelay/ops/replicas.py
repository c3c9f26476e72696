"""How `kvrelay up`'s N prefill x M decode replicas are named and share GPUs and ports.

GPUs of a side (`--prefill-gpus` / `--decode-gpus`), for R replicas of it:
- unset: no CUDA_VISIBLE_DEVICES (every replica sees what the launcher sees: the CPU, or all GPUs);
- a list (`0,1,2,3`, ranges `0-3`): split in order into R equal groups, replica i the i-th (with
  R=2: 0,1 and 2,3); its length must be a multiple of R, and each GPU named once;
- groups separated by `/` (`0,1/2`, `0/0`): one per replica, exactly R of them, each GPU named
  once within a group; groups may differ in size or share GPUs (said explicitly, never guessed).
A replica's GPUs are its tensor-parallel ranks (as with one replica).
Ports: an explicit base port P gives replica i port P+i; 0 picks a free port per replica. Every
port of the stack must differ from every other (else a clear error).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable

_RANGE = re.compile(r"^(\d+)-(\d+)$")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_name(role: str, i: int, replicas: int) -> str:
    """'prefill' when a side has one replica (as before replicas existed), else 'prefill-<i>'."""
    return role if replicas == 1 else f"{role}-{i}"


def _expand(group: str, flag: str) -> list[str]:
    """'0-2,5' -> ['0', '1', '2', '5']; a name that is not a number (a GPU UUID) stays whole."""
    out: list[str] = []
    for part in group.split(","):
        part = part.strip()
        if not part:
            continue
        if m := _RANGE.match(part):
            lo, hi = int(m[1]), int(m[2])
            if hi < lo:
                raise ValueError(f"{flag}: the range {part!r} is empty")
            out += [str(i) for i in range(lo, hi + 1)]
        else:
            out.append(part)
    if not out:
        raise ValueError(f"{flag}: an empty GPU group in {group!r}")
    return out


def _once(gpus: list[str], flag: str, where: str) -> None:
    seen: set[str] = set()
    for g in gpus:
        if g in seen:
            raise ValueError(
                f"{flag}: GPU {g} is named twice {where} (one tensor-parallel rank per GPU; to "
                "let replicas share a GPU, give one group per replica: e.g. 0/0)"
            )
        seen.add(g)


def gpu_groups(spec: str | None, replicas: int, side: str) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of a side's `replicas` (the rule in the module docstring)."""
    flag = f"--{side}-gpus"
    if replicas < 1:
        raise ValueError(f"--{side}-replicas must be at least 1, not {replicas}")
    if spec is None or not spec.strip():
        return [None] * replicas
    if "/" in spec:
        groups = [_expand(g, flag) for g in spec.split("/")]
        if len(groups) != replicas:
            raise ValueError(
                f"{flag} {spec!r} names {len(groups)} GPU groups for {replicas} {side} "
                f"replica(s): give exactly one group per replica"
            )
        for g in groups:
            _once(g, flag, "in one replica's group")
    else:
        gpus = _expand(spec, flag)
        _once(gpus, flag, "in the list")
        if len(gpus) % replicas:
            raise ValueError(
                f"{flag} {spec!r} has {len(gpus)} GPU(s) for {replicas} {side} replicas, which "
                f"do not split evenly: give a multiple of {replicas} GPUs, or one group per "
                f"replica separated by '/' (e.g. 0,1/2)"
            )
        k = len(gpus) // replicas
        groups = [gpus[i * k : (i + 1) * k] for i in range(replicas)]
    return [",".join(g) for g in groups]


def replica_ports(base: int, replicas: int) -> list[int]:
    """base, base+1, ... (0: each picked later, free)."""
    return [base + i if base else 0 for i in range(replicas)]


def check_distinct(named_ports: Iterable[tuple[str, int]]) -> None:
    """Refuse two children (or a child's two listeners) on one explicit port (0s are skipped)."""
    owner: dict[int, str] = {}
    for name, port in named_ports:
        if not port:
            continue
        if port in owner:
            raise ValueError(
                f"port {port} is given to both {owner[port]} and {name}: replica i of a side "
                "listens on its base port + i, so leave room between the base ports (or use 0)"
            )
        owner[port] = name


def pick_free(host: str, taken: set[int]) -> int:
    """A free port not already given to another child of the stack."""
    while True:
        p = free_port(host)
        if p not in taken:
            taken.add(p)
            return p
