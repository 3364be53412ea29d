"""The codecs' names, as run.toml and the wire header spell them, and the default one.

Apart from ``codec.py`` (which defines a codec per name, in torch) so that reading a run's
configuration, as every ``diloco`` command does, never loads torch.
"""

from typing import Literal, get_args

CodecName = Literal["fp32", "bf16", "int8", "sparse"]
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)
DEFAULT_CODEC: CodecName = "fp32"
