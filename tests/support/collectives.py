"""Record the device of every tensor the training step sends through torch.distributed."""
from __future__ import annotations

import torch.distributed as dist


def spy_collectives(monkeypatch, seen: list, names=("all_reduce", "broadcast")) -> None:
    """Append (collective name, tensor device) to `seen` for each call of `names` (step and update
    call them through torch.distributed), then run the real collective."""
    for name in names:
        real = getattr(dist, name)

        def call(tensor, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, tensor.device))
            return _real(tensor, *args, **kwargs)
        monkeypatch.setattr(dist, name, call)
