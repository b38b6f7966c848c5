"""The fake world a simulation runs in: rank r of N on PyTorch's `fake` backend, every tensor a fake one.

    with fake_world(64):                       # this process is rank 0 of 64
        model = GPT(config)                    # shapes, dtypes, devices; no storage

Inside, four things keep the course's meters booking fake tensors as they book real ones (each says why):
fake storages get distinct addresses, their resizes reach `track_memory`, two ops pass the tracker
unbooked, and DDP finds what its C++ side reads from real tensors. `compute_like_a_gpu` makes bf16
weights compute in bf16, as on a GPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

# ---- the fake world -------------------------------------------------------------------------------------

@contextmanager
def _fake_addresses() -> Iterator[None]:
    """A fake (meta) storage reports its C++ object's address as `data_ptr()` (distinct while it lives),
    so that storages keyed by address stay apart, as on real memory."""
    original = torch.UntypedStorage.data_ptr

    def data_ptr(storage: torch.UntypedStorage) -> int:
        return storage._cdata if storage.device.type == "meta" else original(storage)

    torch.UntypedStorage.data_ptr = data_ptr  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.data_ptr = original  # type: ignore[method-assign]


@contextmanager
def _fake_resizes_booked() -> Iterator[None]:
    """FSDP2 frees and re-allocates gathered weights with `untyped_storage().resize_()`, which
    `track_memory` books for CPU storages; a fake storage lives on `meta`, so its resizes are handed
    to the active trackers here, in the same way."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from distlab.meters import memory
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        old_key, old_bytes = storage.data_ptr(), storage.nbytes()
        out = original(storage, size)
        if storage.device.type == "meta":
            for mode in _get_current_dispatch_mode_stack():
                if isinstance(mode, memory._StorageTracker):
                    mode.on_resize(old_key, old_bytes, storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextmanager
def _tracker_on_fake_tensors() -> Iterator[None]:
    """Two ops `track_memory` sees only on fake tensors, passed through unbooked:

    - `aten.lift_fresh`: a tensor made from Python data (`torch.tensor(0.0)`, AdamW's step counter) is
      born outside the dispatcher on a real CPU, so the tracker never books it; a fake run lifts it into
      a fake tensor through the dispatcher. Unbooked, as on real memory.
    - `prim.device`: asking a fake tensor its device is itself an op (half of all ops in a simulation);
      it allocates nothing.
    """
    from distlab.meters import memory
    original = memory._StorageTracker.__torch_dispatch__
    passed = (torch.ops.aten.lift_fresh.default, torch.ops.prim.device.default)

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in passed:
            return func(*args, **(kwargs or {}))
        return original(self, func, types, args, kwargs)

    memory._StorageTracker.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    try:
        yield
    finally:
        memory._StorageTracker.__torch_dispatch__ = original  # type: ignore[method-assign]


@contextmanager
def _ddp_on_fake_backend() -> Iterator[None]:
    """Two things DDP's C++ side needs from real tensors and a real backend: its construction compares
    parameter shapes across ranks by reading tensor data (skipped: one process plays every rank), and
    its default gradient hook takes the all-reduced bucket from the Work's future, which the fake
    backend leaves empty (`fake_ddp_hook` does the same all-reduce and hands the bucket back)."""
    import torch.nn.parallel.distributed as ddp_module
    original = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def fake_ddp_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient hook, as PyTorch writes it in C++ (the bucket divided by N, then one
    all_reduce of it, in place), returning the bucket through a completed future."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks a hook's annotations as objects (this module's are strings: `from __future__ import annotations`).
fake_ddp_hook.__annotations__.update(bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]})


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[Any]:
    """Inside the block this process is rank `rank` of `world_size` (fake backend) and every new
    tensor is a fake one. Yields the FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: need world_size >= 1 and 0 <= rank < world_size")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: a simulation starts its own "
                           "fake one. Run it outside distlab.launch's ranks (in the notebook's kernel).")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with (FakeTensorMode() as mode, _fake_addresses(), _fake_resizes_booked(), _tracker_on_fake_tensors(),
              _ddp_on_fake_backend()):
            yield mode
    finally:
        dist.destroy_process_group()


def device_mesh() -> Any:
    """`distlab.mesh()`; in a simulation built from real tensors (a DeviceMesh reads its rank map)."""
    from distlab.engine.runtime import mesh
    if dist.get_backend() != "fake":
        return mesh()
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return mesh()


@contextmanager
def compute_like_a_gpu(native_bf16: bool = True) -> Iterator[None]:
    """bf16 weights compute in bf16 inside the block (activations in bf16, as on a GPU), whatever this CPU does."""
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {"DISTLAB_NATIVE_BF16": "1"} if native_bf16 else {}):
        yield
