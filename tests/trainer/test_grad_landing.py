"""Gradients land in retained memory by one copy (``leto.trainer.grad_landing``): each step's
gradients equal plain torch's (``zero_grad()`` then backward) whatever the script does
with ``zero_grad`` before backward, however many backward passes accumulate, and a
parameter that gets no gradient in a step commits a zero one, not the last step's. A real
trainer ``Context`` in this process (tests/trainer/local.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from leto.errors import ScriptError
from tests.trainer.local import local_context


class Branchy(torch.nn.Module):
    """Two heads; ``head_b`` takes part only in even steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 4)
        self.head_a, self.head_b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        h = self.trunk(x).tanh()
        out = self.head_a(h)
        if step % 2 == 0:
            out = out + self.head_b(h)
        return out.square().mean()


def _inputs(step: int, micro: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + micro))


def _plain_grads(
    steps: int, micro_batches: int, model_cls: type[torch.nn.Module] = Branchy
) -> list[list[torch.Tensor | None]]:
    """Each step's gradients under plain torch: ``zero_grad()`` then the backward passes."""
    model = model_cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            model(_inputs(step, micro), step, micro).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _leto_grads(
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    micro_batches: int,
    before_backward: Callable[[torch.optim.Optimizer], None] = lambda opt: None,
    after_compute: Callable[[torch.nn.Module], None] = lambda model: None,
    model_cls: type[torch.nn.Module] = Branchy,
) -> list[list[torch.Tensor]]:
    with local_context(monkeypatch) as ctx:
        model = model_cls()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = ctx.retain(model, opt)
        views = [copy.copy(p.grad) for p in model.parameters()]  # the retained views
        grads = []
        for step in state.steps(steps):

            def fb(step: int = step) -> torch.Tensor:
                before_backward(opt)
                for micro in range(micro_batches):
                    loss = model(_inputs(step, micro), step, micro)
                    loss.backward()
                return loss

            loss = state.compute(fb)
            after_compute(model)
            state.step(loss=loss)
            for p, view in zip(model.parameters(), views, strict=True):
                assert p.grad is not None and p.grad.data_ptr() == view.data_ptr()
            grads.append([p.grad.clone() for p in model.parameters()])
        return grads


def _assert_same(leto: list[list[torch.Tensor]], plain: list[list[torch.Tensor | None]]) -> None:
    for step, (got, want) in enumerate(zip(leto, plain, strict=True)):
        for g, w in zip(got, want, strict=True):
            expected = torch.zeros_like(g) if w is None else w  # no gradient: a zero one
            assert torch.equal(g, expected), f"step {step}"


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_gradients_land_as_plain_torch_computes_them(
    monkeypatch: pytest.MonkeyPatch, micro_batches: int
) -> None:
    plain = _plain_grads(4, micro_batches)
    assert plain[1][-1] is None and plain[2][-1] is not None  # head_b skips odd steps
    _assert_same(_leto_grads(monkeypatch, 4, micro_batches), plain)


def test_zero_grad_before_backward_is_the_script_s_own_business(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usual loop calls ``optimizer.zero_grad()`` (``set_to_none=True``) before backward:
    the gradients still land in retained memory, the same as without it."""
    plain = _plain_grads(3, 2)
    _assert_same(_leto_grads(monkeypatch, 3, 2, lambda opt: opt.zero_grad()), plain)
    _assert_same(
        _leto_grads(monkeypatch, 3, 2, lambda opt: opt.zero_grad(set_to_none=False)), plain
    )


def test_a_gradient_set_outside_backward_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def set_by_hand(opt: torch.optim.Optimizer) -> None:
        p = opt.param_groups[0]["params"][-1]  # head_b's bias: no gradient in odd steps
        p.grad = torch.ones_like(p)

    with pytest.raises(ScriptError, match="set outside backward"):
        _leto_grads(monkeypatch, 2, 1, set_by_hand)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_gradient_clipped_before_state_step_is_refused(
    monkeypatch: pytest.MonkeyPatch, micro_batches: int
) -> None:
    """A torchrun loop's ``clip_grad_norm_`` left before ``state.step()`` would clip this
    rank's gradients, not their mean (``GradWrites``): refused, whatever the clip did."""

    def clip(model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # a no-op by value

    with pytest.raises(ScriptError, match="written between backward and state.step"):
        _leto_grads(monkeypatch, 2, micro_batches, after_compute=clip)


def test_gradients_read_or_zeroed_before_backward_are_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the gradients (a norm for the log) writes nothing; a zeroing before backward
    comes before the first arrival."""

    def log_norm(model: torch.nn.Module) -> None:
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])

    plain = _plain_grads(3, 2)
    grads = _leto_grads(
        monkeypatch, 3, 2, lambda opt: opt.zero_grad(set_to_none=False), after_compute=log_norm
    )
    _assert_same(grads, plain)


class Wide(torch.nn.Module):
    """Large and small gradients in one backward: two 1 MiB weights (copied as they arrive)
    and the rest (waiting to land together when backward ends)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)
        self.c = torch.nn.Linear(512, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).tanh()).tanh()).square().mean()


def _doubled_on_arrival(model: torch.nn.Module, seen: list[float]) -> None:
    """A script's own post-accumulate hook, after Leto's: it reads each gradient, then
    doubles it in place."""

    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None
        seen.append(float(p.grad.double().sum()))
        p.grad.mul_(2)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def test_waiting_gradients_land_with_the_large_ones_and_a_script_hook_sees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small gradients wait and land together in one multi-tensor copy when backward ends;
    until then each stays the parameter's ``.grad``, so a hook of the script's that runs
    after Leto's reads its value and its in-place change lands, as in plain torch."""
    steps = 3

    def batch(step: int) -> torch.Tensor:
        return torch.randn(8, 512, generator=torch.Generator().manual_seed(step))

    model = Wide()
    plain_seen: list[float] = []
    _doubled_on_arrival(model, plain_seen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = []
    for step in range(steps):
        opt.zero_grad()
        model(batch(step)).backward()
        plain.append([p.grad.clone() for p in model.parameters()])
        opt.step()

    copies: list[int] = []
    foreach_copy = torch._foreach_copy_

    def counted(targets, sources, *args, **kwargs):
        copies.append(len(targets))
        return foreach_copy(targets, sources, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    leto_seen: list[float] = []
    with local_context(monkeypatch) as ctx:
        model = Wide()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = ctx.retain(model, opt)
        _doubled_on_arrival(model, leto_seen)
        got = []
        for step in state.steps(steps):
            loss = state.compute(lambda step=step: model(batch(step)).backward())
            state.step(loss=loss)
            got.append([p.grad.clone() for p in model.parameters()])
    assert leto_seen == plain_seen
    _assert_same(got, plain)
    # per step, one multi-tensor copy: c's weight and the three biases
    assert copies == [4] * steps


class Alternating(torch.nn.Module):
    """Micro-batch ``k`` of a step goes through head ``k % 2``: a parameter's first
    gradient of the step arrives in the second backward pass, after others have landed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 4)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        return self.heads[micro % 2](self.trunk(x).tanh()).square().mean()


def test_a_gradient_first_arriving_in_a_later_backward_pass_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = _plain_grads(3, 3, Alternating)
    _assert_same(_leto_grads(monkeypatch, 3, 3, model_cls=Alternating), plain)


def test_the_side_stream_is_taken_only_where_letos_hook_runs_last() -> None:
    """``GradLanding(copy_stream=...)`` copies off the compute stream only where no hook of
    the script's runs after Leto's (one would read or write the gradient in flight); a hook
    registered before Leto's has run already. The GPU behaviour is
    tests/gpu/test_grad_landing_stream_gpu.py; this is the choice."""
    from leto.trainer.grad_landing import _runs_last

    def leto(t: torch.Tensor) -> None: ...

    def script(t: torch.Tensor) -> None: ...

    alone, before, after = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    alone.register_post_accumulate_grad_hook(leto)
    before.register_post_accumulate_grad_hook(script)
    before.register_post_accumulate_grad_hook(leto)
    after.register_post_accumulate_grad_hook(leto)
    handle = after.register_post_accumulate_grad_hook(script)
    assert _runs_last(alone, leto) and _runs_last(before, leto)
    assert not _runs_last(after, leto)
    handle.remove()  # the script's hook removed: Leto's runs last again
    assert _runs_last(after, leto)
    assert not _runs_last(torch.nn.Parameter(torch.zeros(2)), leto)  # no hook at all
