"""Implementations of the `megatron-rl` subcommands (one module each; see megatron_rl/cli.py)."""
