"""The package's version is its installed distribution's: diloco-anywhere, or a project
rendered from the template, which ships this runtime under its own distribution name."""

from __future__ import annotations

from importlib.metadata import version

import diloco_anywhere
from diloco_anywhere import _installed_version


def test_the_version_is_the_installed_distributions() -> None:
    assert diloco_anywhere.__version__ == version("diloco-anywhere")


def test_under_another_name_the_version_is_the_distribution_that_ships_the_package() -> None:
    """A rendered project has no distribution named diloco-anywhere: the version is that of
    the one that installed ``diloco_anywhere`` (here, this checkout under its own name)."""
    assert _installed_version("a-rendered-project") == version("diloco-anywhere")
