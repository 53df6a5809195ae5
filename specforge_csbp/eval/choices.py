"""The `eval` command's device and dtype choices: plain names, importable without torch, so building the
CLI's parser (`specforge-csbp --help`) does not start torch or transformers."""

from __future__ import annotations

__all__ = ["DEVICES", "DTYPES"]

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
