"""Reading run.toml (a file, a text, or the embedded default) into a ``RunConfig``, or into one
``ConfigError``."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from diloco_anywhere.config.errors import ConfigError, problems
from diloco_anywhere.config.run_config import RunConfig

DEFAULT_CONFIG = "default_run.toml"


def validate_config(data: dict[str, Any], where: str, source: Path | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate({**data, "source": source})
    except ValidationError as exc:
        raise ConfigError(problems(exc, where)) from None


def with_changes(config: RunConfig, **changes: Any) -> RunConfig:
    """``config`` with ``section__field=value`` changes (``keep__max_restarts=3``), validated
    as a file is, from the same file (relative paths still read from its folder)."""
    data = config.model_dump()
    for path, value in changes.items():
        section, _, name = path.partition("__")
        data[section][name] = value
    where = f"{config.source or 'the embedded run'} with {', '.join(changes)}"
    return validate_config(data, where, config.source)


def parse_config(text: str, where: str, source: Path | None = None) -> RunConfig:
    """Every way ``text`` can fail to be a run config is one ``ConfigError`` line: the CLI
    prints it and exits 2, never a traceback (a TOML nested thousands of levels deep exhausts
    the parser's recursion)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid TOML: nested too deeply") from None
    try:
        return validate_config(data, where, source)
    except RecursionError:
        raise ConfigError(f"{where}: a value is nested too deeply") from None


def load_config(path: str | Path | None = None) -> RunConfig:
    """run.toml at ``path``, or the embedded default (local processes, a local store)."""
    if path is None:
        text = resources.files("diloco_anywhere").joinpath(DEFAULT_CONFIG).read_text()
        return parse_config(text, f"(embedded {DEFAULT_CONFIG})")
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); TOML is UTF-8") from None
    return parse_config(text, str(path), source=path.resolve())
