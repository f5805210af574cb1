"""
Export HeteroEngine's training step (forward + loss + backward of GPT-2) as a Core ML
program for the Neural Engine, and report what is in it.

    python export_ane.py --microbatch 4 --out ane.mlpackage        # GPT-2 124M, T=1024
    python export_ane.py --n_layer 4 --n_head 4 --n_embd 128 --block_size 64 --microbatch 8 --out tiny.mlpackage
    python export_ane.py ... --check                               # on macOS: on the ANE

The report (any OS): ops by type, FLOPs per call against the analytic count, bytes in
and out per call, the largest tensor dimension, and ops known to fall off the ANE.
--check compares the program's gradients with autograd: on macOS through Core ML on
CPU_AND_NE (plus the compute plan: which ops Core ML placed on the Neural Engine, and
predict timings); elsewhere through the NumPy evaluator (slow; use a small model).
"""
import argparse
import collections
import sys
import time

import numpy as np
import torch

import hetero_gpt as hg

# Ops the ANE does not run (ANE_NOTES): Core ML moves them to the CPU, with transfers.
OFF_ANE_OPS = {'gather', 'gather_nd', 'gather_along_axis', 'scatter', 'scatter_nd', 'scatter_along_axis',
               'one_hot', 'concat', 'split', 'gelu', 'while_loop', 'cond'}
ELEMENTWISE_FLOPS = {'softmax': 5}  # max, subtract, exp, sum, divide per element


def op_flops(op):
    """FLOPs of one MIL op: 2*M*K*N for matmul, one per element processed otherwise."""
    if op.op_type == 'const':
        return 0
    if op.op_type == 'matmul':
        x = op.inputs['x'].shape
        k = x[-2] if op.inputs['transpose_x'].val else x[-1]
        return 2 * int(np.prod(op.outputs[0].shape)) * k
    if op.op_type in ('reshape', 'transpose', 'identity'):
        return 0
    n = int(np.prod(op.inputs['x'].shape)) if op.op_type.startswith('reduce_') else int(np.prod(op.outputs[0].shape))
    return n * ELEMENTWISE_FLOPS.get(op.op_type, 1)


def analytic_flops(cfg, B, T):
    """(matmul FLOPs the derivation must do, the usual 6*N*params + attention estimate).
    Per token, each weight matrix costs 2 FLOPs per element forward and 4 backward (dx and
    dW): 6*N*W. Attention per layer: q k^T and P v forward (2*2*B*T^2*C), twice that
    backward. The usual estimate uses every parameter but the position table (biases and
    norms are not matmuls) and adds nothing for elementwise work."""
    C, L, N = cfg.n_embd, cfg.n_layer, B * T
    rows, spans = hg.vocab_chunks(cfg.vocab_size)
    V = rows * len(spans)  # the LM head multiplies the aligned chunks, padding rows included
    matrices = L * 12 * C * C + V * C  # qkv 3C^2, proj C^2, fc 4C^2, proj 4C^2; tied LM head
    attention = 12 * L * B * T * T * C
    params = sum(p.numel() for k, p in hg.GPT_param_shapes(cfg).items() if k != 'transformer.wpe.weight')
    return 6 * N * matrices + attention, 6 * N * params + attention


def program_report(prog, cfg, B, T):
    """What is in the program, computed from the program itself (the saved one, read back)."""
    f = prog.functions['main']
    ops = [op for op in f.operations if op.op_type != 'const']
    kinds = collections.Counter(op.op_type for op in ops)
    flops = sum(op_flops(op) for op in ops)
    mm = sum(op_flops(op) for op in ops if op.op_type == 'matmul')
    dims = [d for op in f.operations for v in op.outputs if hasattr(v, 'shape') for d in v.shape]
    dims += [d for v in f.inputs.values() for d in v.shape]
    ranks = [len(v.shape) for op in f.operations for v in op.outputs if hasattr(v, 'shape')]
    nbytes = lambda vs: sum(int(np.prod(v.shape)) * 2 for v in vs)  # fp16: 2 bytes an element
    exact, estimate = analytic_flops(cfg, B, T)
    return dict(ops=len(ops), op_types=dict(kinds.most_common()), flops=flops, matmul_flops=mm,
                analytic_matmul_flops=exact, estimate_flops=estimate,
                bytes_in=nbytes(f.inputs.values()), bytes_out=nbytes(f.outputs),
                largest_dim=max(dims), max_rank=max(ranks),
                off_ane=sorted(k for k in kinds if k in OFF_ANE_OPS))


def print_report(r):
    print(f"ops: {r['ops']}  " + ', '.join(f'{k} {v}' for k, v in r['op_types'].items()))
    print(f"FLOPs per call: {r['flops'] / 1e9:.3f} G total, {r['matmul_flops'] / 1e9:.3f} G in matmuls")
    print(f"  analytic matmul count {r['analytic_matmul_flops'] / 1e9:.3f} G "
          f"({100 * (r['matmul_flops'] / r['analytic_matmul_flops'] - 1):+.2f}%); 6*params*tokens + attention "
          f"{r['estimate_flops'] / 1e9:.3f} G (total {100 * (r['flops'] / r['estimate_flops'] - 1):+.2f}%)")
    print(f"bytes per call: {r['bytes_in'] / 2**20:.1f} MiB in, {r['bytes_out'] / 2**20:.1f} MiB out (fp16)")
    print(f"largest tensor dimension: {r['largest_dim']} (ANE limit {hg.ANE_MAX_DIM}); highest rank {r['max_rank']} (limit 5)")
    print("ops known to fall off the ANE: " + (', '.join(r['off_ane']) or 'none'))


def check_gradients(engine, cfg, B, T, seed=0):
    """The engine's loss and gradients against fp64 autograd on one random microbatch:
    prints the worst cosine similarity and returns it (1.0 is perfect)."""
    torch.manual_seed(seed)
    model = hg.GPT(cfg).double()
    idx, targets = (torch.randint(0, cfg.vocab_size, (B, T)) for _ in range(2))
    _, loss = model(idx, targets)
    loss.backward()
    engine.load_weights(dict(model.named_parameters()))
    t0 = time.perf_counter()
    l, grads = engine.loss_and_grads(idx, targets)
    dt = time.perf_counter() - t0
    cos = {k: torch.nn.functional.cosine_similarity(grads[k].double().flatten(), p.grad.flatten(), dim=0).item()
           for k, p in model.named_parameters()}
    worst = min(cos, key=cos.get)
    finite = hg.grads_finite(grads)
    print(f"loss {l.item():.5f} vs autograd {loss.item():.5f}; worst gradient cosine {cos[worst]:.6f} ({worst}); "
          f"all finite: {finite}; one call {dt:.2f} s")
    return cos[worst] if finite else float('nan')


def macos_compute_plan(path):
    """macOS 14.4+: where Core ML placed each op, and its estimated share of the cost."""
    ct = hg.import_coremltools()
    from coremltools.models.compute_plan import MLComputePlan
    m = ct.models.MLModel(path, compute_units=ct.ComputeUnit.CPU_AND_NE)
    plan = MLComputePlan.load_from_path(path=m.get_compiled_model_path(), compute_units=ct.ComputeUnit.CPU_AND_NE)
    share, elsewhere = collections.Counter(), collections.Counter()
    for op in plan.model_structure.program.functions['main'].block.operations:
        if op.operator_name == 'const':
            continue
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        dev = type(usage.preferred_compute_device).__name__ if usage else 'unknown'
        on_ane = 'NeuralEngine' in dev
        share['ops', on_ane] += 1
        share['cost', on_ane] += cost.weight if cost else 0.0
        if not on_ane:
            elsewhere[op.operator_name, dev] += 1
    for what in ('ops', 'cost'):
        total = share[what, True] + share[what, False]
        print(f"share of {what} on the Neural Engine: {100 * share[what, True] / max(total, 1e-12):.1f}%")
    for (name, dev), n in elsewhere.most_common():
        print(f"  not on the ANE: {name} x{n} -> {dev}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = hg.GPTConfig()
    for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'):
        p.add_argument(f'--{k}', type=int, default=getattr(defaults, k))
    p.add_argument('--bias', type=hg._parse_bool, default=True, help="biases as GPT-2 (False: nanoGPT's bias=False)")
    p.add_argument('--microbatch', type=int, default=4, help="sequences per call (B)")
    p.add_argument('--seq_len', type=int, default=0, help="tokens per sequence (T; default block_size)")
    p.add_argument('--out', default='ane.mlpackage', help="where to save the .mlpackage")
    p.add_argument('--check', action='store_true', help="compare gradients with autograd (and, on macOS, the compute plan)")
    p.add_argument('--check_calls', type=int, default=5, help="timed predict calls with --check on macOS")
    a = p.parse_args(argv)
    try:
        cfg = hg.GPTConfig(block_size=a.block_size, vocab_size=a.vocab_size, n_layer=a.n_layer,
                           n_head=a.n_head, n_embd=a.n_embd, bias=a.bias)
        B, T = a.microbatch, a.seq_len or a.block_size
        t0 = time.perf_counter()
        hg.export_coreml(cfg, B, T, a.out)
        print(f"saved {a.out} ({cfg}, microbatch {B}x{T}) in {time.perf_counter() - t0:.1f} s")
        print_report(program_report(hg.load_coreml_program(a.out), cfg, B, T))
        if a.check:
            engine = hg.CoreMLEngine(a.out, config=cfg, microbatch=(B, T),
                                     scaler=hg.LossScaler(1024.0, 0))
            print(f"checking through {engine.label}")
            worst = check_gradients(engine, cfg, B, T)
            if hg.ON_MAC:
                macos_compute_plan(a.out)
                times = []
                for _ in range(a.check_calls):
                    t0 = time.perf_counter()
                    engine.loss_and_grads(*(torch.randint(0, cfg.vocab_size, (B, T)) for _ in range(2)))
                    times.append(time.perf_counter() - t0)
                print(f"predict + host work: median {1e3 * sorted(times)[len(times) // 2]:.1f} ms per call "
                      f"({B * T / sorted(times)[len(times) // 2]:.0f} tokens/s)")
            if not worst >= 0.999:
                print("gradient check FAILED (worst cosine below 0.999)")
                return 1
    except hg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
