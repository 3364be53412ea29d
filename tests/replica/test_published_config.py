"""How a remote replica learns its run: run.toml published in the store, and its identity from
the launcher's variables or an Indexed Job's completion index."""

from __future__ import annotations

import re

import pytest

from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, RunConfig, parse_config
from diloco_anywhere.contract import configuration, identity
from diloco_anywhere.published_config import config_key, publish_config, read_config

RUN = '[run]\nname = "pub"\nstore = "s3://bucket/runs"\n[diloco]\nouter_steps = 7\n'


def test_a_published_config_reads_back_equal_under_a_content_address(tmp_path):
    config = parse_config(RUN, "run.toml")
    store = Store(str(tmp_path))
    key = publish_config(store, config)
    assert key == config_key(config)
    assert re.fullmatch(r"pub/configs/[0-9a-f]{8}\.toml", key)
    assert publish_config(store, config) == key  # the same bytes again: a no-op
    assert read_config(store, key) == config
    changed = parse_config(RUN.replace("7", "8"), "run.toml")
    assert config_key(changed) != key  # a relaunch with changes does not touch this one


def test_the_replica_reads_it_from_the_variables_the_launcher_sets(tmp_path):
    config = parse_config(RUN, "run.toml")
    key = publish_config(Store(str(tmp_path)), config)
    environ = {"DILOCO_CONFIG_KEY": key, "DILOCO_STORE": str(tmp_path), "DILOCO_REPLICAS": "3"}
    loaded = configuration(None, environ)
    assert loaded.diloco.outer_steps == 7
    assert (loaded.run.replicas, loaded.run.store) == (3, str(tmp_path))


def test_a_file_that_trains_otherwise_than_the_run_is_refused_naming_each_setting(tmp_path):
    """run.toml edited after the launch, then a local replica restarted from it (or a script's
    ``join("run.toml")`` reading an older copy in the image): the launch's published copy is
    the run's, and a file of another sync_every or outer_lr is refused at once (exit 2)."""
    store = tmp_path / "store"
    key = publish_config(Store(str(store)), parse_config(RUN, "run.toml"))
    environ = {"DILOCO_CONFIG_KEY": key, "DILOCO_STORE": str(store), "DILOCO_REPLICAS": "3"}
    same = tmp_path / "same.toml"
    same.write_text(RUN + "[task]\nlog_every = 5\n")  # not a training setting
    assert configuration(str(same), environ).task.log_every == 5
    edited = tmp_path / "run.toml"
    edited.write_text(RUN.replace("outer_steps = 7", "outer_steps = 7\nsync_every = 20\n"
                                  "outer_lr = 0.5"))  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        configuration(str(edited), environ)
    said = str(refused.value)
    assert f"trains otherwise than the run's run.toml, which its launch published ({key})" in said
    assert "diloco.sync_every = 20 here, 50 in the run" in said
    assert "diloco.outer_lr = 0.5 here, 0.7 in the run" in said
    assert "undo the edit (or launch again" in said


def test_a_changed_object_is_refused_naming_its_key(tmp_path):
    store = Store(str(tmp_path))
    key = publish_config(store, RunConfig())
    (tmp_path / key).write_text((tmp_path / key).read_text().replace("0.7", "0.9"))
    with pytest.raises(ConfigError, match=rf"{key}: CRC32C [0-9a-f]{{8}} does not match the key"):
        read_config(store, key)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("pub/configs/nothex00.toml", "expected '<run>/configs/<8 hex digits>.toml'"),
        ("pub/configs/0badc0de.toml", "not found; the launcher publishes it"),
    ],
)
def test_a_bad_or_missing_key_says_why(tmp_path, key, message):
    with pytest.raises(ConfigError, match=message):
        read_config(Store(str(tmp_path)), key)


def test_without_a_store_the_key_alone_is_refused():
    with pytest.raises(ConfigError, match=r"\$DILOCO_CONFIG_KEY is set but \$DILOCO_STORE is not"):
        configuration(None, {"DILOCO_CONFIG_KEY": "pub/configs/0badc0de.toml"})


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"DILOCO_REPLICA_ID": "modal-1", "DILOCO_REPLICA_INDEX": "3"}, ("modal-1", 3)),
        ({"DILOCO_REPLICA_ID": "local-2"}, ("local-2", None)),
        # an Indexed Job: one pod template, the index from Kubernetes
        ({"DILOCO_PLATFORM": "k8s", "DILOCO_REPLICA_INDEX_BASE": "4", "JOB_COMPLETION_INDEX": "2"},
         ("k8s-2", 6)),
    ],
)  # fmt: skip
def test_identity_from_the_launcher_or_the_completion_index(environ, expected):
    assert identity(None, None, environ) == expected


def test_arguments_win_and_bad_numbers_are_named():
    assert identity("x-1", 0, {"JOB_COMPLETION_INDEX": "5"}) == ("x-1", 0)
    with pytest.raises(ValueError, match=r"\$JOB_COMPLETION_INDEX = '-1': expected a whole"):
        identity(None, None, {"JOB_COMPLETION_INDEX": "-1"})
