"""
A double of PyTorch's MPS backend for the macOS double: the GPU engine runs on the CPU, presented
as the device 'mps'. Installed by sitecustomize.py as torch is imported (MACOS_DOUBLE_MPS=0 leaves it out).

What it imitates, and where PyTorch says so:
- torch.backends.mps.is_built() True (a macOS arm64 wheel); is_available() only on macOS 14 or
  newer, since torch 2.10: MPSDevice.mm creates the device only where MPSGraph has a macOS-14
  selector (pytorch #164943, 2.10 on macOS 13.7.4: "MPS backend unavailable"; #159275, "Remove
  MacOS-13 support").
- A tensor on 'mps' reports device mps (so torch's own code takes its MPS paths: fused AdamW's
  MPS branch in torch/optim/adam.py refuses found_inf and grad_scale); its values live in a CPU
  tensor. Ops run in stream order: a queued host-to-device copy lands before the next op, and
  reading a value back (.item(), .cpu(), torch.mps.synchronize) waits for the stream.
- Fused Adam and AdamW on MPS ignore found_inf and update anyway (docs/coreml_and_ane.md
  section 6, pytorch PR #186360).
- Mixing an 'mps' tensor with a CPU tensor of one or more dimensions is refused, as
  "Expected all tensors to be on the same device" (0-dim CPU tensors pass as scalars).
- torch.mps.synchronize, current_allocated_memory (bytes held by live tensors),
  driver_allocated_memory (those plus the allocator's cache of freed blocks, which
  empty_cache releases): torch/mps/__init__.py's docstrings.
- The non-blocking host-to-device copy of aten/src/ATen/native/mps/operations/Copy.mm as
  released before the storage was retained (pytorch #139550, fixed by PR #181017; #189690 open):
  copy_to_mps_ clones a source that is not dense in storage, wraps the clone's host pages
  without a copy (newBufferWithBytesNoCopy, deallocator nil), queues the blit and returns,
  which frees the clone. The blit reads those pages when the stream reaches it. Here the
  clone's block goes back to a pool of freed host blocks at once, the next clone of the same
  size takes it (as malloc reuses a freed block), and the copy reads the block when the
  stream runs, so `idx` can arrive holding `targets`. A dense source is read, uncopied, when
  the stream runs too: writing it before then changes what arrives. A blocking copy waits.
  MACOS_DOUBLE_MPS_COPY=retain: the fixed release, which keeps the source until the copy ran.
- MACOS_DOUBLE_MPS_SLOW=seconds: each backward pass of a graph on 'mps' queues that much GPU
  work (a long step of a large model, without its size). The backward returns, as MPS queues
  its kernels; the next op or read in any thread waits until the work is done, as one MPS
  stream serves every thread (MPSStream.mm, getDefaultMPSStream). That wait is Metal's
  waitUntilCompleted, in C: a signal arriving meanwhile runs its Python handler only after it.
- Causal attention in float16 and bfloat16 that sees the future (pytorch #195910, reported on
  torch 2.10, closed; a report on YuE #176 finds 2.14.0 right): scaled_dot_product_attention
  with is_causal=True applies the mask once per group of four query positions, so query i sees
  keys up to 4 * (i // 4) + 3, silently. On for torch before 2.14, where it is not known fixed.
  MACOS_DOUBLE_MPS_SDPA=leaky turns it on, exact off, whatever the version.
"""
import os
import signal
import threading
import time
import weakref

import torch
from torch.utils._pytree import tree_leaves, tree_map

MPS = torch.device('mps', 0)  # as a real MPS tensor reports it
aten = torch.ops.aten
_lock = threading.RLock()  # one stream for the process: ops of all threads in one order
_pending = []  # queued host-to-device copies: (destination, source read when the stream runs)
_free_blocks = {}  # freed host blocks by size, reused by the next clone of that size
_mem = dict(live={}, current=0, cached=0)  # storage data_ptr -> [bytes, wrappers]; bytes held; cached
_busy = dict(until=0.0)  # monotonic time the queued GPU work ends (MACOS_DOUBLE_MPS_SLOW)


def macos_version():
    import platform
    return tuple(int(x) for x in (platform.mac_ver()[0] or '0').split('.')[:2])


def is_available():
    return macos_version() >= (14, 0)


class MPSTensor(torch.Tensor):
    """A tensor on 'mps' whose values are the CPU tensor `inner`."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=torch.device('cpu'), requires_grad=False)

    def __init__(self, inner):
        self.inner = inner
        _track(self, inner)

    __torch_function__ = torch._C._disabled_torch_function_impl
    # PyTorch's C++ side sees a CPU tensor (device guards, the autograd engine's CPU queue:
    # a CPU build has no MPS guard); Python sees 'mps', as the project and torch.optim read it
    device, is_mps, is_cpu = property(lambda self: MPS), property(lambda self: True), property(lambda self: False)

    def cpu(self, memory_format=torch.preserve_format):
        return self.to('cpu', memory_format=memory_format)

    def numpy(self, *, force=False):
        raise TypeError("can't convert mps:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    def tolist(self):
        return self.cpu().tolist()

    def __format__(self, spec):
        return self.item().__format__(spec) if self.dim() == 0 else object.__format__(self, spec)

    def __repr__(self, *, tensor_contents=None):
        with _lock:
            _run_stream()
            return f"MPSTensor({self.inner!r}, device='mps')"

    def __reduce_ex__(self, proto):  # torch.save: the values, as a CPU tensor (loaded back with map_location)
        return torch.Tensor.__reduce_ex__(self.cpu(), proto)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _wait_busy()  # outside the lock, so no thread waits on it meanwhile
        with _lock:
            if func is aten.copy_.default:
                return _copy(*args, **kwargs)
            if func is aten._foreach_copy_.default:  # its slow path: copy_ tensor by tensor, any devices
                for dst, src in zip(args[0], args[1]):
                    _copy(dst, src, *args[2:], **kwargs)
                return None
            _run_stream()  # every op runs after what is queued before it
            if func in _CAUSAL and _causal(func, args, kwargs) and _leaky(args[0]):
                args, kwargs = _group_mask(func, args, kwargs)
            if func in (aten._fused_adamw_.default, aten._fused_adam_.default):  # MPS's updates anyway
                kwargs = dict(kwargs, found_inf=None)  # (coreml_and_ane.md section 6)
            if func is aten._to_copy.default and torch.device(kwargs.get('device') or MPS).type == 'cpu':
                return func(args[0].inner, **{k: v for k, v in kwargs.items() if k != 'device'})  # to the host
            _same_device(func, args, kwargs)
            owners = {id(t.inner): t for t in tree_leaves((args, kwargs)) if isinstance(t, MPSTensor)}
            out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
            # a result on the device; an input the op returns (in place) is that input itself
            return tree_map(lambda t: _outer(t, owners) if type(t) is torch.Tensor else t, out)


# SDPA on a CPU-looking tensor: forward and backward, (..., dropout_p, is_causal, *, attn_mask)
_CAUSAL = {aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7}


def _causal(func, args, kwargs):
    n = _CAUSAL[func]
    return (args[n] if len(args) > n else kwargs.get('is_causal', False)) is True


def _leaky(q):
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    setting = os.environ.get('MACOS_DOUBLE_MPS_SDPA', '')
    if setting in ('leaky', 'exact'):
        return setting == 'leaky'
    return tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) < (2, 14)


def _group_mask(func, args, kwargs):
    """is_causal as MPS applies it in fp16 and bf16: query i sees keys up to 4 * (i // 4) + 3."""
    q, k = args[0 if func is aten._scaled_dot_product_flash_attention_for_cpu.default else 1:][:2]
    i = torch.arange(q.shape[-2]).unsqueeze(1)
    j = torch.arange(k.shape[-2]).unsqueeze(0)
    hidden = j > 4 * (i // 4) + 3  # (T, T), True where the key is masked
    mask = MPSTensor(torch.zeros(hidden.shape, dtype=q.dtype).masked_fill(hidden, float('-inf')))
    n = _CAUSAL[func]
    if len(args) > n:
        return args[:n] + (False,) + args[n + 1:], dict(kwargs, attn_mask=mask)
    return args, dict(kwargs, is_causal=False, attn_mask=mask)


def _inner(t):
    return t.inner if isinstance(t, MPSTensor) else t


def _outer(t, owners):
    return owners[id(t)] if id(t) in owners else MPSTensor(t)


def _same_device(func, args, kwargs):
    # indices may stay on the CPU: advanced indexing moves them (x[:, [-1]] makes a CPU index)
    if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
        args = args[:1] + args[2:]
    flat = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if any(type(t) is torch.Tensor and t.device.type == 'cpu' and t.dim() > 0 for t in flat):
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"mps:0 and cpu! ({func})")


def _copy(dst, src, non_blocking=False):
    """copy_ where either side is on 'mps' (Copy.mm's copy_to_mps_, copy_from_mps_, copy_kernel_mps)."""
    if not isinstance(dst, MPSTensor):  # device to host: waits for the stream
        _run_stream()
        dst.copy_(src.inner)
        return dst
    if isinstance(src, MPSTensor):  # on the device: in stream order
        _run_stream()
        dst.inner.copy_(src.inner)
        return dst
    temporary = src.dtype != dst.dtype or not _dense_in_storage(src.expand(dst.shape))  # a cast or a clone
    src = (src if src.dtype == dst.dtype else src.to(dst.dtype)).expand(dst.shape)
    if not _dense_in_storage(src):
        src = src.clone()  # contiguous
    if not non_blocking or src.stride() != dst.stride():  # host to device, blocking: queued, then waited for
        _run_stream()
        dst.inner.copy_(src)
        return dst
    if temporary and os.environ.get('MACOS_DOUBLE_MPS_COPY') != 'retain':
        n = src.numel() * src.element_size()
        blocks = _free_blocks.setdefault(n, [])
        block = blocks.pop() if blocks else torch.empty(n, dtype=torch.uint8)
        src = block.view(src.dtype).as_strided(src.shape, src.stride()).copy_(src)  # the temporary's host block
        blocks.append(block)  # freed as copy_to_mps_ returns, while the blit is queued
    _pending.append((dst.inner, src))  # the host pages, read when the stream reaches the blit
    return dst


def _dense_in_storage(t):  # Copy.mm's is_dense_in_storage: the elements span no more storage than their count
    return t.numel() == 0 or t.numel() == 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def _run_stream():
    with _lock:
        _wait_busy()
        while _pending:
            dst, src = _pending.pop(0)
            dst.copy_(src)


def _wait_busy():
    """Waits for queued GPU work, deaf to signals as a C wait is; their handlers run after."""
    left = _busy['until'] - time.monotonic()
    if left <= 0:
        return
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # this thread only
    try:
        while left > 0:  # time.sleep wakes early only for a signal, now blocked here
            time.sleep(left)
            left = _busy['until'] - time.monotonic()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def slow_backward(backward, seconds):
    """torch.autograd.backward whose pass on 'mps' queues `seconds` of GPU work."""
    def queued(tensors, *args, **kwargs):
        out = backward(tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if any(isinstance(t, MPSTensor) for t in roots):
            with _lock:
                _busy['until'] = max(_busy['until'], time.monotonic()) + seconds
        return out
    return queued


def _track(wrapper, inner):
    """current_allocated_memory and driver_allocated_memory: bytes of live storages; freed ones cached."""
    storage = inner.untyped_storage()
    key = storage.data_ptr()
    with _lock:
        entry = _mem['live'].get(key)
        if entry is None:
            entry = _mem['live'][key] = [storage.nbytes(), 0]
            _mem['current'] += entry[0]
            _mem['cached'] = max(0, _mem['cached'] - entry[0])  # a cached block reused
        entry[1] += 1
    weakref.finalize(inner, _untrack, key)  # (the wrapper itself: no weakref, so Module.to can swap it)


def _untrack(key):
    with _lock:
        entry = _mem['live'].get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _mem['live'][key]
            _mem['current'] -= entry[0]
            _mem['cached'] += entry[0]


def _host(kwargs):  # a factory's arguments for 'mps', for its CPU tensor that holds the values
    return {k: v for k, v in kwargs.items() if k != 'pin_memory'} | dict(device=torch.device('cpu'))


def synchronize():
    _wait_busy()
    _run_stream()


def empty_cache():
    with _lock:
        _mem['cached'] = 0


_to = torch.Tensor.to


def to(self, *args, **kwargs):
    """Tensor.to with 'mps' (a CPU build refuses the device): a new tensor on 'mps' and copy_."""
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    dtype, copy = dtype or self.dtype, kwargs.get('copy', False)
    if device is None or (device.type == 'mps') == isinstance(self, MPSTensor):
        return _to(self, dtype=dtype, non_blocking=non_blocking, copy=copy,
                   memory_format=memory_format or torch.preserve_format)
    if torch.is_grad_enabled() and self.requires_grad:
        raise NotImplementedError("the MPS double copies between devices without autograd")
    if device.type == 'mps':
        dst = torch.empty(self.shape, dtype=dtype, device=MPS)
        return dst.copy_(self, non_blocking=non_blocking)
    _wait_busy()
    with _lock:
        _run_stream()
        return _to(self.inner, dtype=dtype, copy=True)


def factory(f):  # torch.tensor and torch.as_tensor with device='mps': made on the CPU, then copied
    def made(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == 'mps':
            return to(f(*args, **kwargs), MPS)
        return f(*args, device=device, **kwargs)
    return made


def install():
    lib = torch.library.Library('aten', 'IMPL')
    # factories on 'mps' (torch.zeros, empty_like, ...) reach these: the dispatcher's MPS key
    lib.impl('empty.memory_format', lambda size, **kw: MPSTensor(torch.empty(size, **_host(kw))), 'MPS')
    lib.impl('empty_strided', lambda size, stride, **kw: MPSTensor(torch.empty_strided(size, stride, **_host(kw))), 'MPS')
    install.lib = lib  # (registrations last as long as the library object)
    # torch.load(map_location='mps'): the values stay on the CPU; load_state_dict copies them over
    torch.serialization.register_package(15, lambda obj: None,
                                         lambda obj, location: obj if location.startswith('mps') else None)
    torch.Tensor.to = to
    torch.tensor, torch.as_tensor = factory(torch.tensor), factory(torch.as_tensor)
    # Module.to keeps a parameter's identity (tied weights stay tied) by swapping in the new tensor
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.backends.mps.is_built = lambda: True
    torch.backends.mps.is_available = is_available
    torch.mps.is_available = is_available
    torch.mps.device_count = lambda: int(is_available())
    torch.mps.synchronize = synchronize
    torch.mps.empty_cache = empty_cache
    torch.mps.current_allocated_memory = lambda: _mem['current']
    torch.mps.driver_allocated_memory = lambda: _mem['current'] + _mem['cached']
    if float(os.environ.get('MACOS_DOUBLE_MPS_SLOW', 0)) > 0:  # Tensor.backward calls this one
        torch.autograd.backward = slow_backward(torch.autograd.backward, float(os.environ['MACOS_DOUBLE_MPS_SLOW']))
    torch.mps.recommended_max_memory = lambda: int(0.75 * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
