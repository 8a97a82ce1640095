"""Stand-ins for driving the controller in-process: the MPI communicator and a tokenizer."""
from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

from megatron_rl.control.protocol import Graded, Tag


class PickleComm:
    """Stands in for the MPI communicator under the controller's Mailbox: records what is sent,
    pickled as MPI would, with the tag the Mailbox derived from the message type."""

    def __init__(self):
        self.sent: list[tuple[int, int, object]] = []

    def Get_rank(self) -> int:
        return 0

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


def grade_until(ctrl, comm: PickleComm, pool, settled) -> None:
    """Run the controller's grading until `settled()` (its own poll with `pool` None, else a verifier
    rank serving `pool`: the body of grading.verifier_loop for each GradeRequest, minus MPI)."""
    from megatron_rl.control.grading import grade

    deadline = time.time() + 120
    while not settled():
        assert time.time() < deadline, "grading did not finish"
        if pool is None:
            ctrl.flow.collect_grades()
            time.sleep(0.05)
        else:
            for dest, request in comm.take(Tag.GRADE):
                ctrl._dispatch(dest, pickle.loads(pickle.dumps(Graded(grade(pool, request.items)))))
