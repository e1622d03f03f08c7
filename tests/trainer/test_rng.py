"""The step's RNG blob (``leto.trainer.rng``) brings back every generator a step's code
draws from without naming it: torch's, Python's ``random`` and NumPy's global generator,
Gaussian caches included; NumPy's capture is reused only while nothing drew from it."""

from __future__ import annotations

import random

import numpy as np
import torch

from leto.trainer.rng import rng_blob, set_rng_blob

CPU = torch.device("cpu")


def _draws() -> list[float]:
    return [
        random.random(),
        random.gauss(0.0, 1.0),  # leaves Python's Gaussian cache set
        float(np.random.rand()),
        *np.random.randn(3).tolist(),  # an odd count: NumPy's cache holds one
        float(torch.rand(())),
    ]


def test_every_global_generator_comes_back() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    for _ in range(3):
        blob = rng_blob(CPU)
        first = _draws()
        set_rng_blob(blob, CPU)
        assert _draws() == first


def test_a_draw_from_numpys_gaussian_cache_alone_is_captured() -> None:
    """Serving a cached Gaussian moves no word of the generator's state: the capture must
    not be reused across it."""
    np.random.seed(4)
    np.random.randn(1)  # caches the pair's second value
    before = rng_blob(CPU)
    served = np.random.randn(1)  # from the cache
    after = rng_blob(CPU)
    assert not torch.equal(before, after)
    set_rng_blob(before, CPU)
    assert np.array_equal(np.random.randn(1), served)
    set_rng_blob(after, CPU)
    assert not np.array_equal(np.random.randn(1), served)  # a fresh pair


def test_numpys_capture_follows_a_reseed() -> None:
    np.random.seed(5)
    a = rng_blob(CPU)
    np.random.seed(6)
    b = rng_blob(CPU)
    assert not torch.equal(a, b)
    set_rng_blob(a, CPU)
    x = np.random.rand()
    np.random.seed(5)
    assert x == np.random.rand()


def test_the_digest_leaves_out_the_host_generators_in_whole_words(monkeypatch) -> None:
    """Two runs of an unseeded script differ in Python's and NumPy's states only: their
    digests agree; torch's generator stays in. Each digested piece starts on an 8-byte
    word (the GPU digest sums int64 words of it)."""
    from torch import nn

    from tests.trainer.local import local_context

    with local_context(monkeypatch) as ctx:
        net = nn.Linear(3, 5)  # an odd size: the RNG slot does not start on its own word
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        digest = state.memory.digest

        def aligned(region: torch.Tensor) -> str:
            assert region.storage_offset() % 8 == 0, region.storage_offset()
            return digest(region)

        monkeypatch.setattr(state.memory, "digest", aligned)
        for _ in state.steps(1):
            state.compute(lambda: net(torch.ones(2, 3)).sum().backward())
            state.step()
        before = state.emit_digest()
        slot = state.layout.rng.view(state.state_region)
        slot[-1] ^= 0xFF  # NumPy's cached Gaussian
        slot[-3000] ^= 0xFF  # Python's Mersenne Twister
        assert state.emit_digest() == before
        slot[0] ^= 0xFF  # torch's CPU generator
        assert state.emit_digest() != before
