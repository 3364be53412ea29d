"""run.toml in the store: how a replica on another platform gets the run's configuration.

A remote replica starts the project image, which has no copy of the user's run.toml (and should
not need a rebuild when it changes). The launcher therefore writes the validated configuration
to ``{run}/configs/{crc32c:08x}.toml``, content-addressed and create-only, and passes that key
in ``DILOCO_CONFIG_KEY``. The replica reads it back, checks the CRC32C against the key and
validates it like a file. A relaunch with a changed run.toml writes a new key; replicas of the
earlier launch keep reading the one they were started with. run.toml holds no secrets.
"""

from __future__ import annotations

import re

import crc32c
import tomli_w

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, RunConfig, parse_config

ENV_CONFIG_KEY = "DILOCO_CONFIG_KEY"
_KEY = re.compile(r"(?P<run>[^/]+)/configs/(?P<crc>[0-9a-f]{8})\.toml")
# A run.toml is a few KiB; a published one over 1 MiB is refused after 1 MiB is read.
MAX_CONFIG_BYTES = 1 << 20


def config_text(config: RunConfig) -> bytes:
    """The configuration as replicas will load it (defaults filled in, store made absolute)."""
    data = config.model_dump(exclude={"source"})
    data["run"]["store"] = config.store_url()
    data["checkpoint"]["mirrors"] = config.mirror_urls()
    return tomli_w.dumps(data).encode()


def config_key(config: RunConfig) -> str:
    return RunLayout(config.run.name).config(crc32c.crc32c(config_text(config)))


def publish_config(store: Store, config: RunConfig) -> str:
    """Write the configuration (once; the same bytes again are a no-op) and return its key."""
    key, text = config_key(config), config_text(config)
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{config.source or 'run.toml'}: {len(text)} bytes as published; at most "
            f"{MAX_CONFIG_BYTES} (replicas refuse a larger one)"
        )
    store.put(key, text)
    return key


class PublishedConfigMissingError(ConfigError):
    """No run.toml at the key the launcher gave: the run's objects were deleted since, or
    the replica was started without ``diloco launch`` publishing it."""


def read_config(store: Store, key: str) -> RunConfig:
    """The configuration a launcher published under ``key``, checked and validated."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ConfigError(
            f"${ENV_CONFIG_KEY} = {key!r}: expected '<run>/configs/<8 hex digits>.toml', "
            f"as `diloco launch` sets it"
        )
    where = f"{store.url}/{key}"
    try:
        data = store.get(key, 0, MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise PublishedConfigMissingError(
            f"{where}: not found; the launcher publishes it before starting replicas, so the "
            f"run's objects were deleted (diloco launch --fresh?) after this replica was started"
        ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: over {MAX_CONFIG_BYTES} bytes, the most a run.toml may be")
    if f"{crc32c.crc32c(data):08x}" != match["crc"]:
        raise ConfigError(f"{where}: CRC32C {crc32c.crc32c(data):08x} does not match the key")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    config = parse_config(text, where)
    if config.run.name != match["run"]:
        raise ConfigError(f"{where}: run.name = {config.run.name!r}, not this key's run")
    return config
