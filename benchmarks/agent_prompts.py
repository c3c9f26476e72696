"""Prompts from the tiny DeepSeek-V4 agent's own conversations (its make_agent.py generator,
a held-out seed): what its trained MTP block and n-gram drafts meet in real use, for the
speculative-decoding benchmarks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO.parent / "shared" / "models" / "dsv4-tiny-agent"


def agent_prompts(n: int, cut: int, agent: Path = AGENT) -> list[list[int]]:
    """The first `cut` tokens of n of the agent's conversations."""
    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("t", REPO / "scripts" / "train_agent_mtp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.AGENT = str(agent)  # (where make_agent.py is)
    chats = mod.chats(AutoTokenizer.from_pretrained(str(agent)), 4242)
    return [next(chats)[:cut].tolist() for _ in range(n)]
