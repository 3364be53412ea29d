"""How ``make image-test`` sets podman up here (tests/support/image_engine.py): pip inside the
build configured as this machine's pip, and the engine's limits within what podman holds.
Building and running the image is tests/image's."""

from __future__ import annotations

import resource
from pathlib import Path

import tomllib

from support.image_engine import HOST_FILES, build_pip_conf, containers_conf


def test_pip_inside_the_build_sees_this_machines_files_under_one_folder(tmp_path):
    wheels, index = tmp_path / "wheels", tmp_path / "mirror/simple"
    wheels.mkdir()
    index.mkdir(parents=True)
    settings = {
        "find-links": str(wheels),
        "extra-index-url": f"file://{index} https://example.org/simple",
        "default-timeout": "180",
        "cert": str(tmp_path / "absent.crt"),  # not on this machine: left as it is
    }
    conf, volumes = build_pip_conf(settings, tmp_path)

    written = conf.read_text().splitlines()
    assert written[0] == "[global]"
    assert f"find-links = {HOST_FILES}{wheels}" in written
    assert f"extra-index-url = file://{HOST_FILES}{index} https://example.org/simple" in written
    assert "default-timeout = 180" in written
    assert f"cert = {tmp_path / 'absent.crt'}" in written
    assert volumes[0] == f"{conf}:/etc/pip.conf:ro"
    # a local index is mounted with its parent, where its pages' relative links lead
    mirror = tmp_path / "mirror"
    assert sorted(volumes[1:]) == sorted(
        [f"{wheels}:{HOST_FILES}{wheels}:ro", f"{mirror}:{HOST_FILES}{mirror}:ro"]
    )


def test_the_engines_limits_are_no_higher_than_podman_holds(tmp_path):
    conf = tomllib.loads(containers_conf(tmp_path).read_text())
    assert conf["engine"]["runtime"] == "runc"
    limits = dict(item.split("=") for item in conf["containers"]["default_ulimits"])
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    assert limits["nofile"] == f"{nofile}:{nofile}"
    assert limits["nproc"] == f"{min(nproc, pid_max)}:{min(nproc, pid_max)}"
