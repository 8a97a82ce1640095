"""Stand-ins for driving the controller in-process: the MPI communicator and a tokenizer."""
from __future__ import annotations

import pickle
from types import SimpleNamespace

from megatron_rl.control.protocol import Tag


class PickleComm:
    """Stands in for the MPI communicator: records what the controller sends, pickled as MPI would."""

    def __init__(self):
        self.sent: list[tuple[int, int, object]] = []

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, pickle.loads(pickle.dumps(obj))))

    def take(self, tag: Tag) -> list[tuple[int, object]]:
        hit = [(d, o) for d, t, o in self.sent if t == tag]
        self.sent = [(d, t, o) for d, t, o in self.sent if t != tag]
        return hit


class CharTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) % 251 for c in text])
