"""
The memory a training run takes, estimated before its first step, and the preflight that
refuses a run that would not fit (on a Mac the GPU and the ANE share the host's memory).
"""
import os

import torch

from .settings import UserError, ane_batch

RUNTIME = 2**27  # what a process running PyTorch holds beyond its tensors



def total_memory():
    """Bytes of memory this machine has (Linux and macOS)."""
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')



def memory_estimate(cfg, mode, device, dtype, sizes):
    """Bytes each engine holds at its peak, by part; 'gpu', 'ane' and 'total' (what the host's
    memory must hold: all of it on a Mac, whose GPU shares it).
    GPU engine (autograd): fp32 weights, gradients and AdamW's two moments, 16 bytes a
    parameter (and autocast's half copies of the weights); the values autograd keeps for one
    microbatch of N = B*T tokens, 20 per token and channel and layer (the inputs of both
    layernorms and of the four linear layers, q k v and their contiguous copies, the
    attention output, the MLP's 4C hidden and its GELU), 4 bytes each in fp32 or ~2.2 under
    autocast; the logits, 16 bytes each (logits, log-softmax, their gradients, fp32). On MPS
    attention with grad takes the math path and keeps each layer's (B, H, T, T) probabilities
    (coreml_and_ane.md section 6).
    ANE worker: its shared memory and its own fp32 copies (weights and gradients twice, 16
    bytes a parameter), each block's input (L + 2 rows of N C), its largest program's live
    memory (the head's logits and softmax, fp16), and a process of its own.
    sizes: (the model's parameters, the tied LM head once; the vocabulary's rows, padded to
    the chunks the ANE's head program takes)."""
    P, vocab_rows = sizes
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    N, half = cfg.batch_size * cfg.block_size, dtype in (torch.float16, torch.bfloat16)
    parts = {}
    if mode in ('gpu', 'hetero'):
        parts['gpu_state'] = 16 * P + (2 * P if half else 0)
        parts['gpu_activations'] = L * 20 * N * C * (2.2 if half else 4) + 16 * N * V
        if device.type == 'mps':
            parts['gpu_attention'] = (2 if half else 4) * L * N * cfg.n_head * cfg.block_size
        parts['gpu_runtime'] = RUNTIME
    if mode in ('ane', 'hetero'):
        n = ane_batch(cfg) * cfg.block_size
        parts['ane_buffers'] = 16 * P + 4 * (L + 2) * n * C
        parts['ane_programs'] = 2 * 2 * n * vocab_rows
        parts['ane_runtime'] = RUNTIME
    parts = {k: int(v) for k, v in parts.items()}
    parts['gpu'] = sum(v for k, v in parts.items() if k.startswith('gpu_'))
    parts['ane'] = sum(v for k, v in parts.items() if k.startswith('ane_'))
    on_host = device.type in ('cpu', 'mps')  # a Mac's GPU shares the host's memory
    parts['total'] = parts['ane'] + (parts['gpu'] if on_host else 0)
    return parts



def preflight(cfg, mode, device, dtype, sizes, log=print):
    """Before the first step: refuses a run whose estimate passes 90% of this machine's memory
    (naming the settings to lower), warns past 70% (it would swap under other load)."""
    mem, have = memory_estimate(cfg, mode, device, dtype, sizes), total_memory()
    if device.type == 'cuda' and mode != 'ane':
        gpu_have = torch.cuda.get_device_properties(device).total_memory
        if mem['gpu'] > 0.9 * gpu_have:
            raise UserError(f"the GPU engine would need ~{mem['gpu'] / 2**30:.1f} GiB on {device}, which has "
                               f"{gpu_have / 2**30:.1f}: lower --batch_size (the microbatch) or the model")
    need = mem['total']
    if need > 0.9 * have:
        raise UserError(f"this run would need ~{need / 2**30:.1f} GiB of this machine's {have / 2**30:.1f} GiB "
                           f"(GPU engine {mem['gpu'] / 2**30:.1f}, ANE engine {mem['ane'] / 2**30:.1f}): lower "
                           "--batch_size (and --gradient_accumulation_steps up to keep the step), --ane_batch_size, "
                           "or the model (--n_layer, --n_embd, --block_size)")
    if need > 0.7 * have:
        log(f"warning: this run needs ~{need / 2**30:.1f} GiB of {have / 2**30:.1f} GiB: with other programs "
            "open it may swap; a smaller --batch_size or --ane_batch_size takes less")
    return mem
