"""The messages of a weight update (coordinator.py), whatever carries them.

    coordinator -> generator   PauseForUpdate, FinishUpdate(version)
    generator -> coordinator   GeneratorStatus (start-up, server restart), Paused(status), Resumed(status)
    coordinator -> trainers    PushRequest(version, targets)
    trainers -> coordinator    Pushed(PushReport)

Plain dataclasses: the transport (today MPI, control/protocol.py gives each its tag) pickles them.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.sync.sender import SyncTarget


@dataclass
class GeneratorStatus:
    """A generator's server: where senders reach it (its incarnation counts restarts) and the
    weight version it serves. Sent at start-up and after a server restart."""

    target: SyncTarget
    version: int


@dataclass
class PauseForUpdate:
    """Pause in place and open the weight-update session."""


@dataclass
class Paused:
    status: GeneratorStatus


@dataclass
class FinishUpdate:
    version: int


@dataclass
class Resumed:
    status: GeneratorStatus


@dataclass
class PushRequest:
    version: int
    targets: list[SyncTarget]  # every live generator


@dataclass(frozen=True)
class PushReport:
    """What the trainers sent in one push (trainer_push.py), over all sending ranks."""

    version: int
    tensors: int  # distinct HF tensor names
    bytes: int
    send_s: float  # the slowest sender's time
    mode: str = "merged"  # trainer.lora.push: merged (the whole model's weights) or adapter (LoRA adapters only)


@dataclass
class Pushed:
    report: PushReport
