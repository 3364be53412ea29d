"""run.toml: validation with one line per bad field, defaults, paths, environment overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomli_w

from diloco_anywhere.config import ConfigError, load_config, parse_codec, parse_config
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
        "run.toml: diloco.codec = 'fp4': Input should be 'fp32', 'bf16', 'int8' or 'sparse'",
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


def test_a_sparse_run_takes_sparselocos_outer_step_unless_it_sets_its_own():
    """SparseLoCo (arXiv 2508.15706): error feedback stands in for outer momentum, and the
    mean is applied as it is; what run.toml sets wins, and a dumped config loads the same."""
    sparse = parse_config('[diloco]\ncodec = "sparse"\n', "run.toml")
    diloco = sparse.diloco
    assert (diloco.outer_lr, diloco.outer_momentum, diloco.outer_nesterov) == (2.0, 0.0, False)
    assert parse_config(tomli_w.dumps(sparse.model_dump()), "dumped") == sparse
    own = parse_config('[diloco]\ncodec = "sparse"\nouter_lr = 0.5\n', "run.toml").diloco
    assert (own.outer_lr, own.outer_momentum) == (0.5, 0.0)
    dense = parse_config('[diloco]\ncodec = "int8"\n', "run.toml").diloco
    assert (dense.outer_lr, dense.outer_momentum, dense.outer_nesterov) == (0.7, 0.9, True)


def test_the_sparse_settings_reach_the_codec():
    config = parse_config(
        '[diloco]\ncodec = "sparse"\n[diloco.sparse]\ndensity = 0.03\nbits = 3\nchunk = 2048\n',
        "run.toml",
    )
    codec = config.collective_config().codec
    assert (codec.name, codec.chunk, codec.k, codec.bits) == ("sparse", 2048, 61, 3)
    assert config.diloco.sparse.error_decay == 0.95


@pytest.mark.parametrize(
    ("sparse", "message"),
    [
        ("bits = 5", "diloco.sparse.bits = 5: Input should be less than or equal to 4"),
        ("chunk = 100", "diloco.sparse.chunk = 100: Input should be a multiple of 64"),
        ("density = 0", "diloco.sparse.density = 0: Input should be greater than 0"),
        ("error_decay = 1.5", "diloco.sparse.error_decay = 1.5: Input should be less than"),
    ],
)
def test_sparse_settings_are_checked_on_load(sparse, message):
    with pytest.raises(ConfigError, match=re.escape(f"run.toml: {message}")):
        parse_config(f'[diloco]\ncodec = "sparse"\n[diloco.sparse]\n{sparse}\n', "run.toml")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fp4", "codec 'fp4': the name is one of fp32, bf16, int8, sparse"),
        ("sparse:rate=2", "keys bits, chunk, density, error_decay"),
        ("int8:block=64", "keys (none for int8)"),
        ("sparse:bits=9", "codec 'sparse:bits=9': sparse.bits = '9': Input should be less"),
    ],
)
def test_a_benchmarks_codec_is_a_name_and_its_run_toml_settings(spec, message):
    assert parse_codec("sparse:density=0.03:bits=4")[1].k == 123
    assert parse_codec("int8")[0] == "int8"
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_codec(spec)


@pytest.mark.parametrize(
    ("value", "loaded"),
    [
        ("false", False),
        ("true", True),
        ('"aot_eager"', "aot_eager"),
        ('"cudagraphs"', "cudagraphs"),
    ],
)
def test_compile_is_a_switch_or_one_of_torchs_backends(value, loaded):
    assert parse_config(f"[task]\ncompile = {value}", "run.toml").task.compile == loaded


def test_a_compile_backend_torch_lacks_is_one_line_naming_those_allowed():
    with pytest.raises(ConfigError) as caught:
        parse_config('[task]\ncompile = "tensorrt"', "run.toml")
    message = str(caught.value)
    assert message.startswith("run.toml: task.compile = 'tensorrt': ")
    assert "False, True, 'inductor', 'cudagraphs', 'aot_eager' or 'eager'" in message
    assert len(message.splitlines()) == 1
