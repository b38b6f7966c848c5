"""Host memory for ZeRO-Offload: buffers, a meter for device <-> host copies, and who holds what.

    buf = host_like(p)                       # CPU memory (pinned when the rank computes on a GPU)
    with track_transfers(model) as meter:    # count the bytes that cross the host link
        loss.backward(); opt.step()
    meter.down_bytes, meter.up_bytes         # device -> host, host -> device
    host_device_split(model, opt)            # bytes held on the device and on the host

On a GPU the host link is PCIe (or NVLink-C2C): a copy whose source and
destination sit on different devices crosses it, and the meter counts the
bytes of the device-side tensor (a copy that also changes the dtype converts
on the CPU, so the 16-bit side is what travels).

On CPU ranks "device" and "host" are the same memory, so no copy crosses
anything; the meter then calls the model's parameters and gradients the
device side and every other tensor the host side, and counts each `copy_`
between the two. So the same code measures the same bytes on both: copy
into preallocated host buffers with `copy_` (what a GPU wants anyway:
pinned buffers and `non_blocking=True`), not with `.to("cpu")`, which on a
CPU rank returns the very same tensor.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from distlab.meters.dispatch import EagerMode
from distlab.meters.memory import storages

_aten = torch.ops.aten


def host_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty CPU tensor shaped like `t` (dtype `dtype` or `t`'s): host memory for offload.

    Pinned (page-locked) when this rank computes on a GPU, so copies to and from
    the device can run asynchronously (`non_blocking=True`); plain CPU memory otherwise
    (pinning needs a GPU).
    """
    from distlab.engine.runtime import device
    pin = device().type == "cuda" and torch.cuda.is_available()
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=pin)


def _key(t: torch.Tensor) -> tuple[str, int]:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t     # a DTensor (FSDP2): its local shard
    return (str(t.device), local.untyped_storage().data_ptr())


def _model_tensors(roots: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for r in roots:
        if isinstance(r, torch.nn.Module):
            out += list(r.parameters()) + list(r.buffers())
        elif isinstance(r, torch.Tensor):
            out.append(r)
        else:
            out += [t for t in r if isinstance(t, torch.Tensor)]
    return out


class _TransferMeter(EagerMode):
    def __init__(self, device_side: tuple[Any, ...]) -> None:
        super().__init__()
        self._roots = device_side
        self.down_bytes = self.up_bytes = self.down_calls = self.up_calls = 0

    def _device_keys(self) -> set[tuple[str, int]]:
        keys = set()
        for t in _model_tensors(self._roots):
            keys.add(_key(t))
            if t.grad is not None:
                keys.add(_key(t.grad))
        return keys

    def _book(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.device.type != dst.device.type:
            if dst.device.type == "cpu":
                self.down_bytes += src.numel() * src.element_size()
                self.down_calls += 1
            elif src.device.type == "cpu":
                self.up_bytes += dst.numel() * dst.element_size()
                self.up_calls += 1
            return
        if src.device.type != "cpu":
            return  # a copy inside one GPU (or between GPUs) never crosses the host link
        from distlab.engine.runtime import device
        if device().type != "cpu":
            return  # a GPU rank: CPU-to-CPU copies are host-side only
        keys = self._device_keys()
        src_dev, dst_dev = _key(src) in keys, _key(dst) in keys
        if src_dev and not dst_dev:
            self.down_bytes += src.numel() * src.element_size()
            self.down_calls += 1
        elif dst_dev and not src_dev:
            self.up_bytes += dst.numel() * dst.element_size()
            self.up_calls += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _aten.copy_.default:
            self._book(args[1], args[0])
        elif func is _aten._to_copy.default and isinstance(out, torch.Tensor):
            if out.device.type != args[0].device.type:
                self._book(args[0], out)
        return out

    def stats(self) -> dict[str, int]:
        return {"down_bytes": self.down_bytes, "up_bytes": self.up_bytes,
                "down_calls": self.down_calls, "up_calls": self.up_calls}


@contextmanager
def track_transfers(*device_side: Any) -> Iterator[_TransferMeter]:
    """Count bytes copied device -> host (`down_bytes`) and host -> device (`up_bytes`) in the block.

    `device_side`: the modules (or tensors) that live on the device; on CPU
    ranks their parameters, buffers and gradients are the device side (see the
    module docstring). `.stats()` gives a picklable dict.
    """
    with _TransferMeter(device_side) as meter:
        yield meter


def _storages(*roots: Any) -> dict[tuple[str, int], int]:
    """Every tensor storage reachable from `roots` (an optimizer's param_groups included), storage -> bytes."""
    return storages(*roots, depth=4, optimizer_groups=True)


def host_device_split(device_side: Any, host_side: Any = ()) -> dict[str, int]:
    """Bytes held on each side: {"device": ..., "host": ...}, each storage once.

    `device_side`: what the code keeps on the device (a model, a plain optimizer);
    `host_side`: what it keeps in host memory (an offloaded optimizer and its buffers).
    On a GPU rank each storage is booked where it really is. On a CPU rank both
    sides are the same memory, so the split is the one the code declares:
    storages reachable from `device_side` are the device's, the others reachable
    from `host_side` the host's.
    """
    dev_roots = device_side if isinstance(device_side, (tuple, list)) else (device_side,)
    host_roots = host_side if isinstance(host_side, (tuple, list)) else (host_side,)
    on_device = _storages(*dev_roots)
    everything = dict(on_device)
    everything.update(_storages(*host_roots))
    from distlab.engine.runtime import device
    if device().type == "cuda":
        dev = sum(b for (d, _), b in everything.items() if d.startswith("cuda"))
        return {"device": dev, "host": sum(everything.values()) - dev}
    return {"device": sum(on_device.values()),
            "host": sum(b for k, b in everything.items() if k not in on_device)}


class CopyStream:
    """Device -> host copies that run beside the backward, as DeepSpeed's ZeRO-Offload issues them.

        side = CopyStream()
        side.copy(host_buffer, p.grad)     # in a gradient hook: returns at once
        side.wait()                        # before the host reads the buffers (the optimizer step)
        side.busy                          # [(start, end)] of each copy, on perf_counter's clock (CPU ranks)

    On a GPU: a side `torch.cuda.Stream`. `copy` records an event on the current stream (the kernels
    that made the gradient), makes the side stream wait for it, issues the copy there with
    `non_blocking=True` into pinned memory, and tells the allocator the source is in use on the side
    stream (`record_stream`), so dropping `p.grad` at once is safe. The copy engine then moves the
    bytes while the compute stream runs the layers before; `wait` blocks the host on each copy's
    event. Issued on the current stream instead, each copy would sit in the kernel queue between
    the backward's kernels and delay every kernel after it.

    On CPU ranks there is no copy engine: a worker thread stands in for the side stream (one
    thread: copies run in issue order, as on a stream), so a copy overlaps the backward on another
    core. The caller's `track_transfers` books each copy when it is issued (dispatch modes are per
    thread, and by the time the worker runs it the hook has dropped `p.grad`, which tells the
    meter the source was the model's); the copy allocates nothing, so `track_memory` misses nothing.
    """

    def __init__(self, device: Any = None) -> None:
        from distlab.engine.runtime import device as rank_device
        self.device = torch.device(device or rank_device())
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.busy: list[tuple[float, float]] = []
        self._pending: list[Any] = []
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
        else:
            from concurrent.futures import ThreadPoolExecutor
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="distlab-copy-stream")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst.copy_(src) on the side stream; returns before the copy has run."""
        if self.cuda:
            made = torch.cuda.Event()
            made.record()                                   # on the current (compute) stream
            self.stream.wait_event(made)
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
            self._pending.append(done)
            return
        import time
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, _TransferMeter):
                mode._book(src, dst)                        # booked now: src is still the model's gradient

        def run() -> None:
            t0 = time.perf_counter()
            dst.copy_(src)                                  # no meter here: booked above, allocates nothing
            self.busy.append((t0, time.perf_counter()))
        self._pending.append(self._worker.submit(run))     # the closure keeps src alive until copied

    def wait(self) -> None:
        """Block until every queued copy has landed in host memory."""
        for work in self._pending:
            work.synchronize() if self.cuda else work.result()
        self._pending.clear()
