"""diloco-anywhere: DiLoCo across platforms that share nothing but an object store."""

from importlib.metadata import version

__version__ = version("diloco-anywhere")
