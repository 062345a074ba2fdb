"""Gradient codecs (runtime/ps_compression.py): what each message carries, its size, and error feedback."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.runtime.ps_compression import (CODECS, ErrorFeedback, Float32, OneBit, TopK, column_segments, make_codec,
                                          message_bytes, row_segments)


def _vector(size: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def _encode(codec, vector: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(message, what the receiver decodes) of a lossy codec; checks that compress left vector - decoded."""
    lost = vector.copy()
    message = codec.compress(lost)
    decoded = codec.decode(message, vector.size)
    np.testing.assert_array_equal(lost, vector - decoded)
    return message, decoded


def test_float32_sends_the_vector_as_it_is():
    vector = _vector()
    message = ErrorFeedback(Float32(), vector.size).encode(vector)
    assert message.nbytes == 4 * vector.size
    np.testing.assert_array_equal(Float32().decode(message, vector.size), vector)
    total = np.ones(vector.size, np.float32)
    Float32().decode_add(message, total)
    np.testing.assert_array_equal(total, vector + 1)


def test_one_bit_sends_signs_and_each_segments_two_means():
    vector = _vector(1000)
    codec = OneBit([600, 400])
    message, decoded = _encode(codec, vector)
    assert message.nbytes == 2 * 4 + 1000 // 8
    first = vector[:600]
    # The means travel as bfloat16: 8 significant bits.
    mean = first[first >= 0].mean() if vector[0] >= 0 else first[first < 0].mean()
    assert decoded[0] == pytest.approx(mean, rel=2 ** -8)
    assert np.all(np.sign(decoded) == np.where(vector >= 0, 1, -1))
    # Means keep each segment's sum of positive and of negative parts.
    assert decoded[:600].sum() == pytest.approx(first.sum(), abs=2 ** -8 * float(np.abs(first).sum()))


def test_one_bit_refuses_a_vector_its_segments_do_not_cover():
    with pytest.raises(ValueError, match="1-bit codec for 1000 floats given 1008"):
        OneBit([600, 400]).compress(_vector(1008))


def test_one_bit_matches_numpy_on_segments_of_any_size():
    segments = [13, 0, 5, 5, 5, 1, 970, 3]  # empty, single and odd-sized segments, a partial last byte
    vector = _vector(sum(segments), seed=3)
    vector[[0, 7, 20]] = [0.0, -0.0, -1e-30]
    codec = OneBit(segments)
    message, decoded = _encode(codec, vector)
    header = 4 * len(segments)
    np.testing.assert_array_equal(message[header:], np.packbits(vector >= 0))
    means = (message[:header].view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, 2)
    start = 0
    for segment, (up, down) in zip(segments, means):
        part = vector[start:start + segment]
        expected = [part[part >= 0].astype(np.float64).mean() if (part >= 0).any() else 0.0,
                    part[part < 0].astype(np.float64).mean() if (part < 0).any() else 0.0]
        np.testing.assert_allclose([up, down], expected, rtol=2 ** -8)
        np.testing.assert_array_equal(decoded[start:start + segment], np.where(part >= 0, up, down))
        start += segment
    total = np.full(vector.size, 2.0, np.float32)
    codec.decode_add(message, total)
    np.testing.assert_array_equal(total, decoded + np.float32(2))


def test_one_bit_segments_are_output_channels():
    assert column_segments([(4, 3, 2, 2), (5,), (), (2, 6)]) == [12] * 4 + [5, 1, 6, 6]


def test_one_bit_is_over_25_times_smaller_than_float32_for_the_digits_cnns_shards():
    shards = ([(16, 1, 3, 3), (16,), (16,), (32,), (32,), (32, 32, 3, 3), (32,), (10,)],
              [(32, 16, 3, 3), (10, 512)])  # examples/digits on 2 servers
    for shapes in shards:
        segments = column_segments(shapes)
        vector = _vector(sum(segments))
        message, _ = _encode(OneBit(segments), vector)
        assert 4 * vector.size / message.nbytes >= 25


def test_top_k_sends_the_largest_magnitudes():
    vector = _vector(1000)
    codec = TopK(0.01)
    message, decoded = _encode(codec, vector)
    assert message.nbytes == 10 * 8
    kept = np.flatnonzero(decoded)
    assert set(kept) == set(np.argsort(-np.abs(vector))[:10])
    np.testing.assert_array_equal(decoded[kept], vector[kept])


@pytest.mark.parametrize("name", ["1bit", "topk"])
def test_error_feedback_delays_what_a_message_loses_but_drops_nothing(name):
    codec = make_codec(name, [500, 500], topk_ratio=0.05)
    sender = ErrorFeedback(codec, 1000)
    sent = np.zeros(1000, np.float32)
    total = np.zeros(1000, np.float32)
    for step in range(50):
        gradient = _vector(1000, seed=step)
        total += gradient
        sent += codec.decode(sender.encode(gradient), 1000)
    # What arrived plus what waits in the residual is everything that was sent.
    np.testing.assert_allclose(sent + sender.residual, total, atol=1e-3)


def test_an_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        make_codec("zip", [4])


def test_message_bytes_are_what_the_codecs_send():
    segments = column_segments([(3, 40), (7,)])
    vector = _vector(sum(segments))
    for name in CODECS:
        message = ErrorFeedback(make_codec(name, segments, topk_ratio=0.1), vector.size).encode(vector)
        assert message_bytes(name, segments, topk_ratio=0.1) == message.nbytes
    assert row_segments([120, 7], [3, 1]) == segments


def test_error_feedback_of_float32_sends_each_vector_whole_and_keeps_no_residual():
    sender = ErrorFeedback(Float32(), 1000)
    first, second = _vector(seed=1), _vector(seed=2)
    message = sender.encode(first)
    later = sender.encode(second)  # a message stays intact when the next one is encoded
    np.testing.assert_array_equal(message.view(np.float32), first)
    np.testing.assert_array_equal(later.view(np.float32), second)
    assert not sender.residual.any()
