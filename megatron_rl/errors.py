"""The base of the errors about input the user must fix; imports nothing, so every layer may use it."""
from __future__ import annotations


class InputError(Exception):
    """Input the user must fix (a config key, a problem file, a model, a checkpoint): the same on every
    start. A run reports one in one line, without a traceback and without advising to start it again."""
