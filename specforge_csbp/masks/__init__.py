"""The one visibility rule, and the masks every backend builds from it."""

from .visibility import CLEAN_RULES, Visibility, visible

__all__ = ["CLEAN_RULES", "Visibility", "visible"]
