"""The error of a Hugging Face model this trainer cannot build; model.py and moe.py both raise it (its
own module, so neither imports the other for it)."""
from __future__ import annotations

from megatron_rl.errors import InputError


class UnsupportedModelError(InputError, ValueError):
    pass
