"""What a run's metrics.jsonl holds as numbers, and what its TensorBoard event files hold read back with
TensorBoard's own reader: both as {name: {update: value}}, so a test can compare them."""
from __future__ import annotations

import math
from pathlib import Path

from megatron_rl.control.metrics import METRICS_FILE, read_jsonl


def jsonl_numbers(run_dir: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for row in read_jsonl(run_dir / METRICS_FILE):
        for key, value in row.items():
            if key not in ("update", "time") and isinstance(value, (int, float)):
                out.setdefault(key, {})[row["update"]] = float(value)
    return out


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def assert_same(backend: dict[str, dict[int, float]], reference: dict[str, dict[int, float]]) -> None:
    """Same names, same steps per name, same values (TensorBoard keeps float32)."""
    assert sorted(backend) == sorted(reference)
    for key, by_step in reference.items():
        assert sorted(backend[key]) == sorted(by_step), key
        for step, value in by_step.items():
            assert math.isclose(backend[key][step], value, rel_tol=1e-6, abs_tol=1e-30), (key, step)
