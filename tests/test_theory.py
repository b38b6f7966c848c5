"""Closed forms, checked against the ZeRO paper's table and by hand."""
import pytest

from distlab import theory


def test_bytes_per_param_recipes():
    assert theory.bytes_per_param("mixed") == 2 + 2 + 12 == 16
    assert theory.bytes_per_param("fp32") == 4 + 4 + 8 == 16
    with pytest.raises(ValueError, match="unknown recipe"):
        theory.bytes_per_param("fp8")


def test_zero_paper_table_7_5B_on_64_devices():
    gb = [theory.zero_memory_per_device(7.5e9, 64, s, k=12) / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_zero_memory_formulas_by_hand():
    psi, n = 1000, 4
    assert theory.zero_memory_per_device(psi, n, 0) == 16 * psi
    assert theory.zero_memory_per_device(psi, n, 1) == 4 * psi + 12 * psi / n
    assert theory.zero_memory_per_device(psi, n, 2) == 2 * psi + 14 * psi / n
    assert theory.zero_memory_per_device(psi, n, 3) == 16 * psi / n
    assert theory.zero_memory_per_device(psi, 1, 3) == theory.zero_memory_per_device(psi, 1, 0)
    with pytest.raises(ValueError):
        theory.zero_memory_per_device(psi, 0, 1)
    with pytest.raises(ValueError):
        theory.zero_memory_per_device(psi, 2, 4)


def test_largest_model_inverts_memory():
    psi = theory.largest_model(80e9, 64, 3)
    assert theory.zero_memory_per_device(psi, 64, 3) == pytest.approx(80e9)


def test_comm_volume_per_stage():
    assert theory.comm_bytes_per_rank(100, 4, 0, 2) == 2 * 100 * 2 * 3 / 4
    assert theory.comm_bytes_per_rank(100, 4, 2, 2) == theory.comm_bytes_per_rank(100, 4, 0, 2)
    assert theory.comm_bytes_per_rank(100, 4, 3, 2) == 1.5 * theory.comm_bytes_per_rank(100, 4, 1, 2)
    assert theory.comm_bytes_per_rank(100, 1, 0, 4) == 0


@pytest.mark.parametrize("op,n,factor", [("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_gather", 4, 0.75),
                                         ("reduce_scatter", 8, 0.875), ("broadcast", 4, 1.0), ("reduce", 3, 1.0)])
def test_busbw_factors_match_nccl_tests(op, n, factor):
    assert theory.busbw_factor(op, n) == factor
    assert theory.busbw(op, 1e9, 1.0, n) == pytest.approx(1e9 * factor)
    assert theory.collective_bytes_sent(op, 1000, n) == round(1000 * factor)


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="no bus-bandwidth factor"):
        theory.busbw_factor("all_reduce_twice", 4)


def test_alpha_beta():
    assert theory.alpha_beta_seconds(1e6, 1e-5, 1e9, steps=3) == pytest.approx(3e-5 + 1e-3)
