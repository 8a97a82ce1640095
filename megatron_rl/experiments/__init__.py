"""Ablation experiments: arms x seeds of normal training runs, a table and a figure (docs/experiments.md)."""
