"""Chapter 8's closed forms, by hand."""
from __future__ import annotations

import pytest

from distlab.theory import pipeline as pt


def test_bubble_fraction_and_interleaving():
    assert pt.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pt.bubble_fraction(1, 5) == 0
    assert pt.bubble_fraction(4, 8, v=2) == pytest.approx(1.5 / 9.5)
    assert pt.bubble_ratio(4, 8) == pytest.approx(3 / 8)
    assert pt.bubble_ratio(4, 8, v=3) == pytest.approx(1 / 8)
    assert pt.step_time(4, 8, 1, 2) == pytest.approx(11 * 3)
    # idle share = 1 - useful / total
    assert pt.bubble_fraction(4, 8) == pytest.approx(1 - 8 * 3 / pt.step_time(4, 8, 1, 2))
    with pytest.raises(ValueError):
        pt.bubble_fraction(0, 4)


def test_zero_bubble_is_a_third_of_1f1b_with_equal_costs():
    f1b = (4 - 1) * 3
    zb = (4 - 1) * 1
    assert pt.zero_bubble_fraction(4, 8) == pytest.approx(zb / (8 * 3 + zb))
    assert pt.bubble_fraction(4, 8) == pytest.approx(f1b / (8 * 3 + f1b))


def test_micro_batches_for_a_target_bubble():
    m = pt.micro_batches_for_bubble(8, 0.1)
    assert pt.bubble_fraction(8, m) <= 0.1 < pt.bubble_fraction(8, m - 1)
    assert pt.micro_batches_for_bubble(8, 0.1, v=2) < m


def test_activations_in_flight():
    assert pt.activations_in_flight("gpipe", 4, 8, 0) == 8
    assert [pt.activations_in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert pt.activations_in_flight("1f1b", 4, 2, 0) == 2
    assert pt.activations_in_flight("interleaved", 4, 16, 0, v=2) == pytest.approx((6 + 4 + 1) / 2)
    with pytest.raises(ValueError):
        pt.activations_in_flight("gpipe", 4, 8, 4)


def test_global_batch_offload_and_3d():
    assert pt.global_batch(8, 16, 2) == 256
    o = pt.offload(1000)
    assert (o.down_bytes, o.up_bytes, o.device_bytes, o.host_bytes) == (2000, 2000, 2000, 14000)
    psi = 1200
    assert pt.memory_3d(psi, 2, 2, 2, zero=1) == pytest.approx((4 + 12 / 2) * psi / 4)
    assert pt.memory_3d(psi, 2, 2, 2, zero=3) == pytest.approx(16 * psi / 8)
    assert pt.memory_3d(psi, 1, 1, 1, zero=0) == 16 * psi
    assert pt.dp_bytes(1000, 4, zero=1) == pytest.approx(2 * 1000 * 2 * 3 / 4)
    assert pt.dp_bytes(1000, 4, zero=3, m=2) == pytest.approx(6 * 1000 * 2 * 3 / 4)
    assert pt.dp_bytes(1000, 4, zero=2, m=3) == pytest.approx(4 * 1000 * 2 * 3 / 4)
    assert pt.tp_bytes(100, 4, 2) == pytest.approx(4 * 100 * 2 * 1)
    assert pt.pp_bytes(100, 8, 0, 4) == 8 * 100 * 2
    assert pt.pp_bytes(100, 8, 1, 4) == 2 * 8 * 100 * 2
