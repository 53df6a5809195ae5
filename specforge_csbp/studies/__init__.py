"""Controlled studies built from the package's own commands (capture, train, eval); see docs/long_context.md."""

__all__: list[str] = []
