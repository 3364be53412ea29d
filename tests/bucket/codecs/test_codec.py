"""Codec size and accuracy bounds, and error feedback."""

from __future__ import annotations

import typing

import pytest
import torch

from diloco_anywhere.bench.store import sample_tensor as sample
from diloco_anywhere.bucket.codecs.codec import Codec, make_codec
from diloco_anywhere.bucket.codecs.codec_names import CODEC_NAMES
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format import wire

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


def sent(codec, tensor: torch.Tensor) -> torch.Tensor:
    """What the wire carries of ``tensor`` in ``codec``."""
    return wire.decode(wire.encode(tensor, codec, META)).tensor


@pytest.mark.parametrize(
    "codec", [make_codec("int8", block=64), make_codec("sparse", chunk=256, k=8, bits=2)]
)
def test_error_feedback_telescopes(codec):
    """With decay 1, what was sent over many rounds plus the last residual is the sum of the
    true tensors (to float rounding): the error stays one round's worth instead of growing,
    and the sparse codec, which leaves out 31 of every 32 values, delivers them later."""
    feedback = ErrorFeedback(decay=1.0)
    rounds = [sample("student_t", 4096, seed) * 1e-3 for seed in range(50)]
    total = torch.zeros(4096)
    for tensor in rounds:
        total += sent(codec, feedback.compensate(0, [tensor]).clone())
        feedback.applied(0, codec)
    truth = torch.stack(rounds).sum(0)
    assert torch.allclose(total + feedback.residual(0), truth, atol=1e-5)
    plain = sum(sent(codec, tensor) for tensor in rounds)
    assert (total - truth).norm() < 0.5 * (plain - truth).norm()


def test_the_accumulator_decays_and_keeps_exactly_what_the_codec_dropped():
    codec, decay = make_codec("sparse", chunk=64, k=4, bits=2), 0.95
    feedback = ErrorFeedback(decay)
    first, second = sample("gaussian", 200, 1), sample("gaussian", 200, 2)
    compensated = feedback.compensate(0, [first[:50], first[50:]]).clone()  # tensors in order
    assert torch.equal(compensated, first)
    feedback.applied(0, codec)
    assert torch.equal(feedback.residual(0), first - sent(codec, first))
    expected = decay * (first - sent(codec, first)) + second
    assert torch.allclose(feedback.compensate(0, [second]), expected)


def test_a_contribution_the_mean_did_not_hold_is_kept_whole():
    """No ``applied`` (the round failed, was not committed, or sealed without us): the next
    round sends all of it again, decayed once, from a tensor of its own, so a round given up
    on that still reads the last one reads what it was given."""
    feedback = ErrorFeedback(0.5)
    first, second = sample("gaussian", 64, 1), sample("gaussian", 64, 2)
    given_up = feedback.compensate(0, [first])
    assert torch.allclose(feedback.compensate(0, [second]), 0.5 * first + second)
    assert torch.equal(given_up, first)


def test_streams_are_independent_and_one_whose_size_changed_starts_from_zero(caplog):
    feedback, codec = ErrorFeedback(), make_codec("int8", block=8)
    feedback.compensate(0, [torch.randn(16)])
    feedback.applied(0, codec)
    feedback.compensate(1, [torch.ones(4)])
    assert torch.equal(feedback.compensate(0, [torch.ones(8)]), torch.ones(8))
    assert "stream 0 held 16 values" in caplog.text
    assert torch.equal(feedback.residual(1), torch.ones(4))
    feedback.load_state_dict(feedback.state_dict())
    assert set(feedback.state_dict()) == {"0", "1"}
    feedback.clear()
    assert feedback.residual(0) is None


def test_the_decay_is_validated():
    with pytest.raises(ValueError, match=r"decay 0 must be in \(0, 1\]"):
        ErrorFeedback(0)


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
