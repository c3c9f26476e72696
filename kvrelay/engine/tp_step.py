"""Rank 0 hands each step to the other tensor-parallel ranks, for every model family.

The scheduler lives on rank 0 only. Every step it broadcasts the family's step inputs in their
wire form (`StepInputs.wire`: a few header ints and an int64 payload) as two int64 tensors, a
header and the payload; the other ranks rebuild the same step (`from_wire`) and run the same
forward, so every collective inside it pairs up. A header of kind STOP ends the followers'
loop; INSTALL and GATHER carry a PD piece between steps (tp_install, tp_gather).
"""

from __future__ import annotations

import torch

from kvrelay.engine import tp_gather, tp_install
from kvrelay.engine.tp_gather import GatherPiece
from kvrelay.engine.tp_install import InstallPiece
from kvrelay.layers.parallel import TPGroup
from kvrelay.models.base import WIRE_FIELDS, Runnable, StepInputs

STEP, STOP = 1, 0
HEADER = 2 + WIRE_FIELDS  # kind, payload length, the step's header ints


def send_step(inputs: StepInputs, tp: TPGroup, device: torch.device) -> None:
    fields, payload = inputs.wire()
    head = [STEP, payload.numel(), *fields] + [0] * (WIRE_FIELDS - len(fields))
    tp.broadcast(torch.tensor(head, dtype=torch.int64, device=device))
    tp.broadcast(payload.to(device))


def send_stop(tp: TPGroup, device: torch.device) -> None:
    tp.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64, device=device))


def recv(
    tp: TPGroup, device: torch.device, family: Runnable
) -> StepInputs | InstallPiece | GatherPiece | None:
    """The step rank 0 sent (or a KV piece to install or to gather), or None when it said stop."""
    header = tp.broadcast(torch.empty(HEADER, dtype=torch.int64, device=device)).tolist()
    kind = header[0]
    if kind == STOP:
        return None
    if kind == tp_install.INSTALL:  # a PD decode server: KV rank 0 received, for every rank
        return tp_install.recv(tp, device, header)
    if kind == tp_gather.GATHER:  # a PD prefill server: rank 0 sends a piece of every rank's KV
        return tp_gather.recv(tp, device, header)
    payload = tp.broadcast(torch.empty(header[1], dtype=torch.int64, device=device))
    return family.from_wire(header[2:], payload)
