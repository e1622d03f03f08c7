"""The Appendix C iteration-time model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leto.sim.itermodel import (
    IterationModelConfig,
    bucket_sizes,
    exposed_comm_s,
    pipeline_time_s,
)

positive = st.floats(min_value=1e-4, max_value=10.0, allow_nan=False)


@given(st.lists(positive, min_size=1, max_size=12), positive)
def test_bucket_queue_bounds(transfer_s: list[float], window_s: float) -> None:
    """Exposure E is at least the serial excess over the window, at most all of it."""
    n = len(transfer_s)
    ready = [(i + 1) / n for i in range(n)]
    exposed = exposed_comm_s(transfer_s, ready, window_s)
    assert max(0.0, sum(transfer_s) - window_s) - 1e-9 <= exposed <= sum(transfer_s) + 1e-9
    assert exposed >= transfer_s[-1] - 1e-9  # the last bucket is ready only at the window's end


def test_bucket_queue_hides_early_buckets() -> None:
    """Two buckets ready at half and end of a 1 s window, 0.3 s each: the first is hidden,
    the second is exposed entirely."""
    assert exposed_comm_s([0.3, 0.3], [0.5, 1.0], 1.0) == pytest.approx(0.3)


@given(st.floats(min_value=1e6, max_value=5e9), st.integers(min_value=1, max_value=4096))
def test_buckets_cover_the_stage(stage_params: float, dp: int) -> None:
    """Buckets of max(40M, 1M x d_p) parameters add up to the stage's parameters."""
    sizes = bucket_sizes(stage_params, dp)
    assert sum(sizes) == pytest.approx(stage_params)
    assert all(s <= max(40e6, 1e6 * dp) + 1e-6 for s in sizes)


def test_pipeline_time() -> None:
    """(M + (S-1)/v) x slowest stage; one stage is M microbatches back to back."""
    assert pipeline_time_s(8, 1, 1, [0.5]) == pytest.approx(4.0)
    assert pipeline_time_s(8, 4, 2, [0.1, 0.5, 0.2, 0.3]) == pytest.approx((8 + 1.5) * 0.5)


def _model(**changes: object) -> IterationModelConfig:
    base: dict[str, object] = {
        "microbatches": 16,
        "pipeline_stages": 4,
        "virtual_stages": 2,
        "stage_times_s": [0.1],
        "stage_params": 200e6,
        "data_parallel": 8,
        "collective_bandwidth_gbps": 10.0,
        "update_s": 0.2,
    }
    return IterationModelConfig(**(base | changes))  # type: ignore[arg-type]


def test_overlap_never_costs_more_than_serial() -> None:
    """Without interference, overlapping hides part of the gradient synchronisation."""
    off = _model(overlap="off").predict()
    on = _model(overlap="dense", interference=0.0).predict()
    assert on.sync_serial_s == off.sync_serial_s == off.sync_s > 0
    assert on.sync_s < off.sync_s
    assert on.iteration_s == pytest.approx(on.pipeline_s + on.sync_s + on.update_s)


def test_moe_interference_stretches_the_window() -> None:
    """f x min(G, A) is charged once, and the queue runs against the stretched window."""
    base = _model(overlap="moe", interference=0.0, alltoall_s=0.05).predict()
    shared = _model(overlap="moe", interference=1.0, alltoall_s=0.05).predict()
    assert base.sync_s < shared.sync_s <= base.sync_s + 0.05 + 1e-9
