"""The generator's part of a weight update (coordinator.py): answer PauseForUpdate and FinishUpdate,
restarting a server that died meanwhile.

`Generator.begin_update` / `finish_update` (rollout/generator.py) are the SGLang calls; this module
says what each answer carries: the generator's `GeneratorStatus`, from which the coordinator learns
where to push and whether the server serves the weights it should (a restarted server serves its
disk weights: the coordinator pushes again).
"""
from __future__ import annotations

from typing import Callable

from megatron_rl.rollout.client import ServerUnreachable
from megatron_rl.rollout.generator import Generator
from megatron_rl.sync.messages import FinishUpdate, GeneratorStatus, Paused, PauseForUpdate, Resumed
from megatron_rl.sync.update import target_of


def status_of(gen: Generator) -> GeneratorStatus:
    return GeneratorStatus(target_of(gen), gen.version)


def answer(gen: Generator, message: PauseForUpdate | FinishUpdate) -> Paused | Resumed:
    """Pause in place and open the update session (Paused), or stamp the version and continue
    (Resumed); either answer carries the status after the step."""
    if isinstance(message, PauseForUpdate):
        _with_live_server(gen, gen.begin_update)
        return Paused(status_of(gen))
    _with_live_server(gen, lambda: gen.finish_update(message.version), retry=False)
    return Resumed(status_of(gen))


def _with_live_server(gen: Generator, action: Callable[[], None], retry: bool = True) -> None:
    """Run an update step; if the server died meanwhile, relaunch it (its unfinished samples are
    re-issued by the Generator) and, with `retry`, run the step on the new incarnation. The status
    sent next tells the coordinator the server serves disk weights: it pushes the current ones."""
    try:
        action()
    except ServerUnreachable:
        if gen.server.healthy():
            raise
        gen.restart()
        if retry:
            action()
