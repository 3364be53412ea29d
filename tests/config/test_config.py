"""run.toml: validation with one line per bad field, defaults, paths, environment overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomli_w

from diloco_anywhere.config import ConfigError, load_config, parse_config
from diloco_anywhere.contract import replica_index, with_overrides


def test_the_embedded_default_is_a_complete_local_run(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    config = load_config()
    assert (config.run.name, config.run.replicas, config.diloco.outer_lr) == ("demo", 4, 0.7)
    assert config.task.entrypoint == "diloco_anywhere.tasks.gpt:build"
    assert config.store_url() == str(tmp_path / ".diloco" / "demo" / "store")


def test_a_relative_store_is_relative_to_the_run_toml_folder(tmp_path):
    (tmp_path / "runs").mkdir()
    path = tmp_path / "runs" / "run.toml"
    path.write_text('[run]\nstore = "bucket"\n')
    assert load_config(path).store_url() == str(tmp_path / "runs" / "bucket")
    path.write_text('[run]\nstore = "s3://bucket/prefix"\n')
    assert load_config(path).store_url() == "s3://bucket/prefix"


def test_every_bad_field_gets_its_own_line_with_path_value_and_what_is_allowed():
    text = """
[run]
replicas = 0
colour = "blue"
[diloco]
codec = "fp4"
outer_momentum = 1.5
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "run.toml")
    assert str(caught.value).splitlines() == [
        "run.toml: run.replicas = 0: Input should be greater than or equal to 1",
        "run.toml: run.colour = 'blue': Extra inputs are not permitted",
        "run.toml: diloco.codec = 'fp4': Input should be 'fp32', 'bf16' or 'int8'",
        "run.toml: diloco.outer_momentum = 1.5: Input should be less than 1",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[run]\nreplicas = 2\nmin_replicas = 3", "run: min_replicas (3) must be at most replicas"),
        ("[diloco]\nsync_every = 10\nfragments = 3", "sync_every (10) must be a multiple of"),
        (
            "[diloco]\nsync_every = 10\nfragments = 2\nfragment_sync_delay = 5",
            "fragment_sync_delay (5) must be less than sync_every / fragments (5)",
        ),
        (
            "[diloco]\nouter_momentum = 0",
            "outer_nesterov = true needs outer_momentum > 0 (e.g. 0.9); for plain SGD",
        ),
        ('[task]\nentrypoint = "no_colon"', "task.entrypoint = 'no_colon': String should match"),
        ("[sync]\nwindow = 0", "sync.window = 0: Input should be greater than or equal to 1"),
        ('[sync]\npart_size = "1KiB"', "sync.part_size = '1KiB': Input should be greater"),
        ('[sync]\npart_size = "lots"', "sync.part_size = 'lots': could not parse value and unit"),
        ("[run\nname = 1", "run.toml: not valid TOML"),
    ],
)
def test_rules_across_fields_and_syntax_errors_say_what_is_allowed(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(text, "run.toml")


def test_a_missing_file_is_one_line():
    with pytest.raises(ConfigError, match=r"^nowhere/run.toml: cannot read it \(No such file"):
        load_config(Path("nowhere/run.toml"))


def test_environment_overrides_are_validated_like_the_file():
    config = load_config()
    changed = with_overrides(config, {"DILOCO_RUN": "r2", "DILOCO_REPLICAS": "6"})
    assert (changed.run.name, changed.run.replicas) == ("r2", 6)
    assert with_overrides(config, {}) is config
    with pytest.raises(ConfigError, match=r"DILOCO_REPLICAS: run: min_replicas \(2\) must be"):
        with_overrides(config, {"DILOCO_REPLICAS": "1"})
    with pytest.raises(ConfigError, match=r"run.name = 'a/b': String should match"):
        with_overrides(config, {"DILOCO_RUN": "a/b"})


@pytest.mark.parametrize(
    ("replica", "given", "index"), [("local-3", None, 3), ("modal-0", None, 0), ("x", 2, 2)]
)
def test_replica_index_comes_from_the_id_or_is_given(replica, given, index):
    assert replica_index(replica, given, replicas=4) == index


@pytest.mark.parametrize(
    ("replica", "given", "message"),
    [("worker", None, "no trailing number"), ("local-4", None, r"index 4 is not in 0..3")],
)
def test_bad_replica_index_says_the_fix(replica, given, message):
    with pytest.raises(ValueError, match=message):
        replica_index(replica, given, replicas=4)


def test_sync_window_and_part_size_reach_the_collective():
    config = parse_config('[sync]\nwindow = 3\npart_size = "2MiB"\n', "run.toml")
    policy = config.collective_config().round
    assert (policy.window, policy.part_elements) == (3, (2 << 20) // 4)


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5000 + "]" * 5000,  # arrays: the TOML parser's recursion
        "a = " + "{b = " * 3000 + "1" + "}" * 3000,  # inline tables
        "[run]\nname = " + "[" * 480 + "]" * 480,  # parses, then fails validation
    ],
)
def test_a_run_toml_nested_too_deeply_is_one_line(text):
    with pytest.raises(ConfigError, match=r"^run.toml: "):
        parse_config(text, "run.toml")


def test_a_run_toml_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b'[run]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match=r"run.toml: not UTF-8 text \(byte 14\)"):
        load_config(path)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://host/runs", "scheme 'ftp' has no create-only"),
        ("http://example.com/x", "scheme 'http' has no create-only"),
        ("hf://owner/repo", "only Hugging Face Storage Buckets can be a store"),
    ],
)
def test_a_store_url_no_store_can_open_is_refused_on_load(url, why):
    with pytest.raises(ConfigError, match=rf"run\.store = '{url}': .*{why}"):
        parse_config(f'[run]\nstore = "{url}"\n', "run.toml")
    with pytest.raises(ConfigError, match=rf"checkpoint\.mirrors\.0 = '{url}': .*{why}"):
        parse_config(f'[checkpoint]\nmirrors = ["{url}"]\n', "run.toml")


@pytest.mark.parametrize(
    ("mirrors", "store", "refused"),
    [
        (["s3://b/r"], "s3://b/r", "mirrors.0 = 's3://b/r' is also run.store"),
        (["gs://m/r", "az://c/r", "gs://m/r"], "s", "2 = 'gs://m/r' is also checkpoint.mirrors.0"),
    ],
)  # fmt: skip
def test_each_mirror_is_a_store_of_its_own(mirrors, store, refused):
    text = f'[run]\nstore = "{store}"\n[checkpoint]\nmirrors = {mirrors}\n'.replace("'", '"')
    with pytest.raises(ConfigError, match=re.escape(refused)):
        parse_config(text, "run.toml")


def test_every_setting_dumps_to_toml_and_loads_back_the_same():
    """TOML has no null: a setting defaulting to None would make every config written out by a
    launcher, a benchmark or a user's script (``tomli_w.dumps(config.model_dump())``) fail."""
    config = load_config()
    text = tomli_w.dumps(config.model_dump())
    assert parse_config(text, "dumped") == config
