"""Cross-node in-place recovery: a trainer killed on node 1 → the shadows of both nodes take
over through the recovery epoch; no node restarts; digests equal the fault-free run's."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_exact, fault_free_digests
from tests.multinode.harness import all_events, log_tail, start_nodes, wait_nodes

STEPS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], set[str]]:
    """The fault-free run: the same 4 ranks under one agent (gloo's ring is the same)."""
    return fault_free_digests(tmp_path_factory.mktemp("ref4"), steps=STEPS, nproc=4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_kill_on_node1_promotes_shadows_on_every_node(tmp_path, reference, backend: str) -> None:
    faults = [
        FaultSpec(rank=3, step=6, phase="backward"),
        FaultSpec(rank=2, step=11, phase="update"),
    ]
    nodes = start_nodes(tmp_path, backend=backend, steps=STEPS, faults=faults)
    codes = wait_nodes(nodes, timeout_s=240)
    assert codes == [0, 0], log_tail(tmp_path)
    events = all_events(nodes)
    assert_exact(reference, events)
    assert len([e for e in events if e["kind"] == Kind.FAULT_INJECTED]) == 2
    promoted = [e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]
    assert sorted((e["epoch"], e["node"]) for e in promoted) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    epochs = [e for e in events if e["kind"] == Kind.EPOCH]
    assert {(e["epoch"], e["remote"]) for e in epochs} == {
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    }
    assert all(e["action"] == "in_place" for e in epochs)
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART], (
        "no node may restart its workers"
    )
    assert [e["restart"] for e in events if e["kind"] == Kind.WORKERS_STARTED] == [0, 0]
