"""The supported stack: the releases of torch, transformers and SpecForge this package is tested on, and the
start-up check that refuses any other in one line (docs/reliability.md, "The supported stack").

The ranges are pyproject.toml's bounds (tests/test_stack.py holds them equal). The low end is SpecForge
0.2.0's pinned stack (transformers 5.8.1; torch 2.11.0 on the GPU machines, its nearest CPU build 2.13.0 in
CI), the high end the newest releases CI runs (`scripts/setup_env.sh --latest`). Checked from installed
metadata only: nothing here imports torch, so the CLI parser and the plugin's routing stay fast.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet

__all__ = ["CORE", "PLUGIN", "SUPPORTED", "check_stack", "unsupported"]

SUPPORTED: dict[str, str] = {
    "torch": ">=2.11,<2.14",
    "transformers": ">=5.8.1,<5.26",
    "specforge": "==0.2.0",
}
CORE = ("torch", "transformers")  # every command
PLUGIN = (*CORE, "specforge")  # a CSBP run through SpecForge's trainer


def unsupported(package: str) -> str | None:
    """Why the installed `package` is outside its supported range (one line), or None when it is inside."""
    allowed = SUPPORTED[package]
    try:
        found = version(package)
    except PackageNotFoundError:
        return f"{package} is not installed (supported: {package}{allowed}; scripts/setup_env.sh builds the stack)"
    # local build tags (2.13.0+cpu, 2.11.0+cu130) name the same release
    if not SpecifierSet(allowed).contains(found.split("+", 1)[0], prereleases=True):
        return (
            f"{package} {found} is outside the supported range {package}{allowed} "
            "(scripts/setup_env.sh builds the tested stack)"
        )
    return None


def check_stack(packages: tuple[str, ...] = CORE) -> None:
    """ValueError (a user error: one line) naming the first package of `packages` outside its range."""
    for package in packages:
        reason = unsupported(package)
        if reason is not None:
            raise ValueError(reason)
