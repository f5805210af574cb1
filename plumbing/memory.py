"""
The memory a training run takes, estimated before its first step, and the preflight that
refuses a run that would not fit (on a Mac the GPU and the ANE share the host's memory).
"""
import os
import resource
import subprocess

import torch

from .settings import ON_MAC, UserError

RUNTIME = 2**27  # what a process running PyTorch on the CPU holds beyond its tensors
# A Mac's processes also load Metal and MPSGraph (the trainer) or coremltools and Core ML (the
# ANE worker): about 0.75 GiB each, not yet measured (the self-check records it)
MAC_RUNTIME = 3 * 2**28



def total_memory():
    """Bytes of memory this machine has: hw.memsize on macOS, as its own tools read it, else
    (or where sysctl cannot answer) the physical pages times the page size."""
    if ON_MAC:
        try:
            out = subprocess.run(['sysctl', '-n', 'hw.memsize'], capture_output=True, text=True,
                                 timeout=10)
            return int(out.stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')



def memory_estimate(cfg, mode, device, dtype, sizes, ane_batch_size):
    """Bytes each engine holds at its peak, by part; 'gpu', 'ane' and 'total' (what the host's
    memory must hold: all of it on a Mac, whose GPU shares it). The peak is while the
    microbatches run: the sums of gradients (HeteroStep._average) come after activations are freed.
    The training process (gpu_ parts, in every mode: the master weights and AdamW live on its
    device): fp32 weights, the step's gradient and AdamW's two moments, 16 bytes a parameter
    (and autocast's half copies of the weights); a microbatch's own gradients while the sum is
    alive, 4 more (run_engine); the values autograd keeps for one microbatch of N = B*T tokens,
    20 per token and channel and layer (the inputs of both layernorms and of the four linear
    layers, q k v and their contiguous copies, the attention output, the MLP's 4C hidden and its
    GELU), 4 bytes each in fp32 or ~2.2 under autocast; the logits, 16 bytes each (logits,
    log-softmax, their gradients, fp32). On MPS attention with grad takes the math path and keeps
    each layer's (B, H, T, T) probabilities (coreml_and_ane.md section 6).
    ANE engine: in the training process, the worker's gradients copied out, the sum and the
    current call's (8 bytes a parameter; run_engine). In the worker, its shared memory and its own
    fp32 copies (weights and gradients twice, 16 bytes a parameter), each block's input (L + 2 rows
    of n C), its largest program's live memory (the head's logits and softmax, fp16) and Core ML's
    own copies around the head's call (the embedding's chunks in fp16, 2 bytes an element; their
    fp32 gradient twice, as Core ML converts fp16 outputs to a new fp32 array and then to NumPy:
    10 bytes a row and channel).
    Each process's runtime: RUNTIME, MAC_RUNTIME with Metal or Core ML.
    sizes: (the model's parameters, the tied LM head once; the vocabulary's rows, padded to
    the chunks the ANE's head program takes). ane_batch_size: sequences an ANE call (Run.ane_batch_size)."""
    P, vocab_rows = sizes
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    N, half = cfg.batch_size * cfg.block_size, dtype in (torch.float16, torch.bfloat16) and mode != 'ane'
    parts = dict(gpu_state=16 * P + (2 * P if half else 0),
                 gpu_runtime=MAC_RUNTIME if device.type == 'mps' else RUNTIME)
    if mode in ('gpu', 'hetero'):
        parts['gpu_microbatch_grads'] = 4 * P
        parts['gpu_activations'] = L * 20 * N * C * (2.2 if half else 4) + 16 * N * V
        if device.type == 'mps':
            parts['gpu_attention'] = (2 if half else 4) * L * N * cfg.n_head * cfg.block_size
    if mode in ('ane', 'hetero'):
        n = ane_batch_size * cfg.block_size
        parts['ane_host_grads'] = 8 * P
        parts['ane_buffers'] = 16 * P + 4 * (L + 2) * n * C
        parts['ane_programs'] = 2 * 2 * n * vocab_rows
        parts['ane_coreml_copies'] = 10 * vocab_rows * C
        parts['ane_runtime'] = MAC_RUNTIME if ON_MAC else RUNTIME
    parts = {k: int(v) for k, v in parts.items()}
    parts['gpu'] = sum(v for k, v in parts.items() if k.startswith('gpu_'))
    parts['ane'] = sum(v for k, v in parts.items() if k.startswith('ane_'))
    on_host = device.type in ('cpu', 'mps')  # a Mac's GPU shares the host's memory
    parts['total'] = parts['ane'] + (parts['gpu'] if on_host else 0)
    return parts


def max_rss():
    """This process's peak resident memory, bytes. getrusage's ru_maxrss is in bytes on macOS's
    kernel and in KiB on Linux's (getrusage(2) on each): the kernel decides, so os.uname() and
    not sys.platform, which the tests' macOS double sets to 'darwin' over a Linux kernel."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == 'Darwin' else peak * 1024


def rss():
    """This process's resident memory now, bytes: Linux's /proc; macOS has none, so ps (KiB)."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except FileNotFoundError:
        try:
            ps = subprocess.run(['ps', '-o', 'rss=', '-p', str(os.getpid())], capture_output=True, text=True)
            return int(ps.stdout) * 1024
        except (OSError, ValueError):  # no ps to ask (a sandbox): not measured
            return None


def measured(device, ane=None, estimate=None):
    """What a run holds, measured, beside its estimate (bytes; by default the last preflight's),
    to calibrate memory_estimate: this process's resident memory now and at its peak, MPS's
    (the driver's, its cache included; the tensors') and the ANE worker's peak (`ane`: the ANE
    engine, a worker.WorkerEngine once it has answered)."""
    estimate = estimate or preflight.estimate  # (set by the run's preflight)
    out = dict(estimate=estimate['total'], estimate_gpu=estimate['gpu'], estimate_ane=estimate['ane'],
               rss=rss(), max_rss=max_rss())
    if device.type == 'mps':
        out |= dict(mps_driver=torch.mps.driver_allocated_memory(), mps_tensors=torch.mps.current_allocated_memory())
    if getattr(ane, 'max_rss', None) is not None:
        out['worker_max_rss'] = ane.max_rss
    return out


def preflight(cfg, run, sizes, log=print):
    """Before the first step: refuses a run whose estimate passes 90% of this machine's memory
    (naming the settings to lower), warns past 70% (it would swap under other load)."""
    mem, have = memory_estimate(cfg, run.mode, run.device, run.dtype, sizes, run.ane_batch_size), total_memory()
    if run.device.type == 'cuda' and run.mode != 'ane':
        gpu_have = torch.cuda.get_device_properties(run.device).total_memory
        if mem['gpu'] > 0.9 * gpu_have:
            raise UserError(f"the GPU engine would need ~{mem['gpu'] / 2**30:.1f} GiB on {run.device}, which has "
                               f"{gpu_have / 2**30:.1f}: lower --batch_size (the microbatch) or the model")
    check(mem, have, log)
    preflight.estimate = mem  # (what measured() sets beside the run's measurements)
    return mem


def check(mem, have, log=print, warn=True):
    """Refuses an estimate past 90% of `have` bytes (naming the settings to lower); warns past 70%."""
    need = mem['total']
    if need > 0.9 * have:
        raise UserError(f"this run would need ~{need / 2**30:.1f} GiB of this machine's {have / 2**30:.1f} GiB "
                           f"(GPU engine {mem['gpu'] / 2**30:.1f}, ANE engine {mem['ane'] / 2**30:.1f}): lower "
                           "--batch_size (and --gradient_accumulation_steps up to keep the step), --ane_batch_size, "
                           "or the model (--n_layer, --n_embd, --block_size)")
    if warn and need > 0.7 * have:
        log(f"warning: this run needs ~{need / 2**30:.1f} GiB of {have / 2**30:.1f} GiB: with other programs "
            "open it may swap; a smaller --batch_size or --ane_batch_size takes less")


def add_parts(parts, log=print):
    """A GPU engine's own memory beyond what memory_estimate counts (bytes by part, named gpu_...,
    in the host's memory), added to the run's estimate (the last preflight's) and checked as
    preflight checks it. tools/mlx_engine.py's: MLX's cache and its copy of the weights. A part set
    again replaces its value. Without a preflight before it (an engine built by hand): nothing."""
    mem = getattr(preflight, 'estimate', None)
    if mem is None:
        return None
    new = mem | parts
    new['gpu'] = sum(v for k, v in new.items() if k.startswith('gpu_'))
    new['total'] = mem['total'] + new['gpu'] - mem['gpu']
    have = total_memory()
    check(new, have, log, warn=mem['total'] <= 0.7 * have)  # one warning a run
    preflight.estimate = new
    return new
