"""Codec size and accuracy bounds, and error feedback."""

from __future__ import annotations

import typing

import pytest
import torch

from diloco_anywhere.bench.store import sample_tensor as sample
from diloco_anywhere.bucket import wire
from diloco_anywhere.bucket.codec import Codec, make_codec
from diloco_anywhere.bucket.codec_names import CODEC_NAMES
from diloco_anywhere.bucket.feedback import ErrorFeedback

META = wire.ObjectMeta(run="r", round=0, replica="a", incarnation=0, shard=0)
NUMEL = 1 << 20


def relative_l2(codec_name: str, tensor: torch.Tensor, **params: int) -> float:
    decoded = wire.decode(wire.encode(tensor, make_codec(codec_name, **params), META)).tensor
    return float((decoded - tensor).norm() / tensor.norm())


def test_int8_is_at_most_027_of_fp32_bytes():
    tensor = sample("gaussian", NUMEL)
    fp32 = len(wire.encode(tensor, make_codec("fp32"), META))
    int8 = len(wire.encode(tensor, make_codec("int8", block=64), META))
    assert int8 / fp32 <= 0.27


def test_int8_block64_error_on_heavy_tails_is_within_two_percent():
    assert relative_l2("int8", sample("student_t", NUMEL), block=64) <= 0.02


@pytest.mark.parametrize(("codec", "bound"), [("fp32", 0.0), ("bf16", 2**-8), ("int8", 0.01)])
def test_gaussian_error_bounds(codec, bound):
    assert relative_l2(codec, sample("gaussian", NUMEL)) <= bound


def test_smaller_blocks_are_more_accurate_on_heavy_tails():
    tensor = sample("student_t", NUMEL)
    errors = [relative_l2("int8", tensor, block=b) for b in (4096, 512, 64)]
    assert errors == sorted(errors, reverse=True)


def test_codec_parameters_are_validated():
    with pytest.raises(ValueError, match="unknown codec 'fp4'; choose one of fp32, bf16, int8"):
        make_codec("fp4")
    with pytest.raises(ValueError, match="block"):
        make_codec("int8", block=4)


def test_error_feedback_telescopes():
    """Sum of what was sent + final residual == sum of the true tensors (to float rounding),
    so over many rounds the error stays one round's worth instead of growing."""
    feedback, codec = ErrorFeedback(), make_codec("int8", block=64)
    rounds = [sample("student_t", 4096, seed) * 1e-3 for seed in range(50)]
    sent = torch.zeros(4096)
    for tensor in rounds:
        sent += wire.decode(feedback.encode("fragment-0", tensor, codec, META)).tensor
    truth = torch.stack(rounds).sum(0)
    residual = feedback.residual("fragment-0")
    assert torch.allclose(sent + residual, truth, atol=1e-5)
    plain = sum(wire.decode(wire.encode(t, codec, META)).tensor for t in rounds)
    assert (sent - truth).norm() < 0.5 * (plain - truth).norm()


def test_error_feedback_streams_are_independent_and_shape_checked():
    feedback, codec = ErrorFeedback(), make_codec("int8", block=8)
    feedback.encode("a", torch.randn(16), codec, META)
    feedback.encode("b", torch.randn(4), codec, META)
    with pytest.raises(ValueError, match="stream 'a' changed shape"):
        feedback.encode("a", torch.randn(8), codec, META)
    feedback.reset("a")
    feedback.encode("a", torch.randn(8), codec, META)
    assert feedback.residual("a").shape == (8,)


def test_every_codec_name_run_toml_accepts_is_a_codec_and_back():
    """run.toml's names (``codec_names.py``, torch-free) and the codecs (``codec.py``) agree."""
    [union] = typing.get_args(Codec)[:1]
    defined = {
        typing.get_args(c.model_fields["name"].annotation)[0] for c in typing.get_args(union)
    }
    assert defined == set(CODEC_NAMES)
    assert [make_codec(name).name for name in CODEC_NAMES] == list(CODEC_NAMES)
    with pytest.raises(ValueError, match="unknown codec 'int4'; choose one of fp32, bf16, int8"):
        make_codec("int4")
