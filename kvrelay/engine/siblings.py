"""The n samples of one prompt share its prefill: the first sample of a group to arrive (the
leader) prefills the prompt; the others wait here, holding no KV, until the leader's prompt pages
are in the prefix cache (or it leaves the running set: it finished, was aborted or preempted).
Then they queue for admission and find the prompt cached, computing only its last partial page.

Held samples own nothing, so holding them can never starve the pool: the leader runs alone and
the usual admission, eviction and preemption rules apply to everyone afterwards.
"""

from __future__ import annotations

from kvrelay.engine.request import Request


class SiblingHold:
    def __init__(self) -> None:
        self.leaders: dict[str, Request] = {}  # group -> the sample prefilling its prompt
        self.held: dict[str, list[Request]] = {}  # group -> samples waiting for the leader

    def __len__(self) -> int:
        return sum(len(v) for v in self.held.values())

    def hold(self, req: Request) -> bool:
        """True when req waits for its group's leader; otherwise req leads its group now."""
        leader = self.leaders.get(req.group)
        if leader is None:
            self.leaders[req.group] = req
            return False
        self.held.setdefault(req.group, []).append(req)
        return True

    def release(self, leader: Request) -> list[Request]:
        """The samples that waited for `leader` (none when it leads nothing); its group has no
        leader afterwards (a later sample of it runs on its own)."""
        if not leader.group or self.leaders.get(leader.group) is not leader:
            return []
        del self.leaders[leader.group]
        return self.held.pop(leader.group, [])

    def remove(self, req: Request) -> None:
        """A held sample ends (aborted) before it was released."""
        group = self.held[req.group]
        group.remove(req)
        if not group:
            del self.held[req.group]

    def find(self, rid: str) -> Request | None:
        for group in self.held.values():
            for r in group:
                if r.rid == rid:
                    return r
        return None

    def check(self, live: list[Request]) -> list[str]:
        """Problems: a held sample owning KV, a group held without a live leader, a leader that
        is not live (`live`: running and waiting requests)."""
        problems = []
        ids = {id(r) for r in live}
        for group, reqs in self.held.items():
            if id(self.leaders.get(group)) not in ids:
                problems.append(f"group {group} is held without a live leader")
            for r in reqs:
                if r.pages or r.state_slot or r.prefix_node is not None:
                    problems.append(f"held sample {r.rid} owns KV")
        for group, leader in self.leaders.items():
            if id(leader) not in ids:
                problems.append(f"group {group}'s leader {leader.rid} is not live")
        return problems
