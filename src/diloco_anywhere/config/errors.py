"""Why a run.toml cannot start a run: one ``ConfigError`` line per bad field."""

from __future__ import annotations

from pydantic import ValidationError


class ConfigError(ValueError):
    """A run.toml that cannot start a run; the message has one line per problem."""


def problems(exc: ValidationError, where: str, prefix: str = "") -> str:
    """One line per bad field: where, its dotted path (under ``prefix``), the value, the rule."""
    lines = []
    for error in exc.errors(include_url=False):
        path = ".".join([prefix] * bool(prefix) + [str(part) for part in error["loc"]])
        shown = error["type"] != "missing" and not isinstance(error["input"], dict)
        found = f" = {error['input']!r:.60}" if shown else ""
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {path or '(top level)'}{found}: {message}")
    return "\n".join(lines)
