"""``torch.cuda`` shims that let Megatron-Core's GPTModel run on a machine without CUDA.

For CPU runs only (tests, CI, the example with no GPU); ``install()`` refuses to run when
CUDA is available, so none of this can leak into a GPU job. Megatron-Core 0.16.1 needs:

* ``torch.cuda.current_device()`` → the CPU device (Megatron allocates its scratch
  buffers, e.g. the attention matmul buffer, with ``device=torch.cuda.current_device()``);
* an RNG tracker whose states are CPU generator states (``CudaRNGStatesTracker`` reads
  and writes ``torch.cuda`` generators); forks swap the default CPU generator in and out;
* pipeline parallelism: the schedules allocate their token counter with ``device="cuda"``
  by name (``forward_backward_pipelining_without_interleaving``,
  ``forward_backward_no_pipelining``), ``LanguageModule.setup_embeddings_and_output_layer``
  moves the shared embedding with ``.cuda()`` before its all-reduce, and the batched p2p
  path calls ``torch.cuda.synchronize()`` (``batch_p2p_sync``). Those three entry points run
  under ``CudaToCpu`` (``"cuda"`` devices become the CPU, ``Tensor.cuda()`` returns the
  tensor), and ``torch.cuda.synchronize`` is a no-op (there is no device to wait for).

Callers must also pass an explicit attention mask (``leto.integrations.megatron.causal_mask``):
Megatron's default causal mask is allocated on ``"cuda"`` by name.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def install() -> None:
    """Patch ``torch.cuda.current_device`` and Megatron's RNG tracker for CPU (idempotent)."""
    global _installed
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_cpu_shims are for machines without CUDA; do not install them on a GPU"
        )
    if _installed:
        return
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's tracker with CPU generator states in place of CUDA ones."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"rng state {name} / seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _install_pipeline()
    _install_moe()
    _installed = True


class CudaToCpu(TorchFunctionMode):
    """``device="cuda"`` (by name or ``torch.device``) becomes the CPU; ``Tensor.cuda()`` is
    the tensor itself. Everything else passes through unchanged."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


def _on_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CudaToCpu():
            return fn(*args, **kwargs)

    return wrapper


def _install_pipeline() -> None:
    """Megatron's schedules and the shared-embedding set-up under ``CudaToCpu``."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules

    for name in (
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_no_pipelining",
    ):
        setattr(schedules, name, _on_cpu(getattr(schedules, name)))
    LanguageModule.setup_embeddings_and_output_layer = _on_cpu(
        LanguageModule.setup_embeddings_and_output_layer
    )


class CpuStream:
    """An inert stand-in for ``torch.cuda.Stream`` on the host: work is already in order."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> CpuEvent:
        return CpuEvent()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


class CpuEvent:
    def synchronize(self) -> None:
        pass


def _install_moe() -> None:
    """The all-to-all token dispatcher's host copies and side stream on CPU."""
    from megatron.core.transformer.moe import token_dispatcher

    stream = CpuStream()
    torch.cuda.Stream = lambda *args, **kwargs: stream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment]
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.detach().clone().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
