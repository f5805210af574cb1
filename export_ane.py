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
import dataclasses
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

import hetero_gpt as hg
import settings

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


def is_sum(op):
    """A sum or mean as a matmul with a constant vector (MILOps._dot): the derivation's own
    matmuls multiply two runtime tensors (weights are inputs), these one and a constant."""
    return op.op_type == 'matmul' and any(op.inputs[k].val is not None for k in ('x', 'y'))


def program_report(prog, cfg, B, T):
    """What is in the program, computed from the program itself (the saved one, read back)."""
    f = prog.functions['main']
    ops = [op for op in f.operations if op.op_type != 'const']
    kinds = collections.Counter(op.op_type for op in ops)
    flops = sum(op_flops(op) for op in ops)
    mm = sum(op_flops(op) for op in ops if op.op_type == 'matmul' and not is_sum(op))
    sums = sum(op_flops(op) for op in ops if is_sum(op))
    dims = [d for op in f.operations for v in op.outputs if hasattr(v, 'shape') for d in v.shape]
    dims += [d for v in f.inputs.values() for d in v.shape]
    ranks = [len(v.shape) for op in f.operations for v in op.outputs if hasattr(v, 'shape')]
    nbytes = lambda vs: sum(int(np.prod(v.shape)) * 2 for v in vs)  # fp16: 2 bytes an element
    exact, estimate = analytic_flops(cfg, B, T)
    return dict(ops=len(ops), op_types=dict(kinds.most_common()), flops=flops, matmul_flops=mm, sum_flops=sums,
                analytic_matmul_flops=exact, estimate_flops=estimate,
                bytes_in=nbytes(f.inputs.values()), bytes_out=nbytes(f.outputs),
                largest_dim=max(dims), max_rank=max(ranks),
                off_ane=sorted(k for k in kinds if k in OFF_ANE_OPS))


PROGRAM_FORMAT = 4  # bump when the program changes (4: the ANE's fp16: sums as matmuls, safe layernorm)


def package_meta(cfg, B, T):
    return dict(format=PROGRAM_FORMAT, microbatch=B, seq_len=T, **dataclasses.asdict(cfg))


def is_package(path):
    """Whether path holds a package this project wrote (of any version)."""
    try:
        hg.import_coremltools().utils.load_spec(path).description.metadata.userDefined['heterogpt']
        return True
    except Exception:
        return False


def export_coreml(cfg, B, T, path):
    """Builds the program (hg.build_coreml_program) and saves it as an .mlpackage at
    `path`, atomically: a crash leaves no half-written package under that name. Only a
    path that is absent or already holds a HeteroEngine package is written."""
    ct = hg.import_coremltools()
    if os.path.lexists(path) and not is_package(path):
        raise hg.UserError(f"{path} exists and is not a HeteroEngine Core ML package: refusing to overwrite it; "
                           "choose another --out")
    prog = hg.build_coreml_program(cfg, B, T)
    model = ct.convert(prog, convert_to='mlprogram', compute_precision=ct.precision.FLOAT16,
                       minimum_deployment_target=ct.target.macOS13, skip_model_load=True)
    model.user_defined_metadata['heterogpt'] = json.dumps(package_meta(cfg, B, T))
    model.short_description = f"HeteroEngine GPT-2 training step, microbatch {B}x{T}"
    tmp = path.rstrip('/') + '.tmp.mlpackage'  # coremltools insists on the extension
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_package_meta(path):
    """The metadata of a package this version of HeteroEngine exported; UserError else."""
    if not os.path.isdir(path):
        raise hg.UserError(f"no Core ML package at {path}: make one with `python export_ane.py --out {path}`")
    try:
        meta = json.loads(hg.import_coremltools().utils.load_spec(path).description.metadata.userDefined['heterogpt'])
    except Exception as e:
        raise hg.UserError(f"{path} is not a HeteroEngine Core ML package ({e}); re-export it with export_ane.py")
    if meta.get('format') != PROGRAM_FORMAT:
        raise hg.UserError(f"{path} was exported by another version of HeteroEngine; re-export it")
    return meta


def ensure_package(cfg, log=print):
    """The package --mode ane/hetero needs: reused if one exported for this configuration
    exists, else exported now. A package the user named (--ane_package) is never
    overwritten: one for other shapes is an error."""
    mcfg = hg.model_config(cfg)
    path = cfg.ane_package or os.path.join(cfg.out_dir, f'ane_B{cfg.batch_size}_T{cfg.block_size}.mlpackage')
    if os.path.isdir(path):
        try:
            meta = read_package_meta(path)
        except hg.UserError:  # another version's (or no) package: the trainer's own is made again
            if cfg.ane_package:
                raise
            meta = None
        if meta == package_meta(mcfg, cfg.batch_size, cfg.block_size):
            return path
        if cfg.ane_package:
            raise hg.UserError(f"--ane_package {path} was exported for other shapes; re-export it with "
                               f"`python export_ane.py {mcfg.flags()} --microbatch {cfg.batch_size} --out {path}`"
                               " or name another path")
        log(f"{path} was exported for other shapes or by another version: exporting again")
    log(f"exporting the Core ML training program to {path} ...")
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    export_coreml(mcfg, cfg.batch_size, cfg.block_size, path)
    return path


def load_coreml_program(path):
    """The saved package read back into a MIL Program (works on Linux; ANE_NOTES section 5)."""
    ct = hg.import_coremltools()
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    model = ct.models.MLModel(path, skip_model_load=True)
    spec = model.get_spec()
    return milproto_load(spec, specification_version=spec.specificationVersion,
                         file_weights_dir=model.weights_dir or '')


FP16_MAX = 65504.0
# matmul outputs go wrong at ~32752 = 2^15 - 16, the largest fp16 below 2^15, at any K
# (ANEForge docs/numeric-cliffs.md, on M2 Pro and M5: they become inf, which later ops do not
# reliably propagate, docs/faq.md): ane=True saturates them there, finite
ANE_MATMUL_MAX = 32752.0


def numpy_predict(prog, ane=False):
    """A stand-in for Core ML's predict off macOS: evaluates the program op by op in NumPy,
    each op's result rounded to the dtype the program declares (fp16 here), through the
    ops' own value_inference. Slow; for checking the program, not for training.
    matmul: fp16 operands, fp32 accumulation (as the ANE; its products are rounded to fp16
    first, which this does not imitate), one rounding of the result.
    ane=True imitates what is known of the ANE's fp16 (ANE_NOTES section 2), the rest as
    above: reduce_sum and reduce_mean add the terms one after another along the axis in fp16
    (every partial sum rounded: the worst case of a narrow accumulator; the mean divides that
    sum by n), and no result overflows to inf: matmul outputs saturate at +-ANE_MATMUL_MAX,
    every other op's at +-65504."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, types
    f = prog.functions['main']

    def plain(v):  # NumPy 2: loaded bool params are np.bool_, which reductions reject
        return bool(v) if isinstance(v, np.bool_) or (isinstance(v, np.ndarray) and v.dtype == np.bool_ and v.ndim == 0) else v

    def matmul(kw):  # fp16 operands, fp32 accumulation (as the ANE), fp16 result; and fast
        x, y = kw['x'].astype(np.float32), kw['y'].astype(np.float32)
        x = np.swapaxes(x, -1, -2) if kw.get('transpose_x') else x
        y = np.swapaxes(y, -1, -2) if kw.get('transpose_y') else y
        return (np.clip(x @ y, -ANE_MATMUL_MAX, ANE_MATMUL_MAX) if ane else x @ y,)

    def fp16_sum(kw, mean):  # ane=True: term by term along the axis, each partial sum fp16
        if len(kw['axes']) != 1:
            raise NotImplementedError("ane=True sums over one axis at a time")
        x = np.ascontiguousarray(np.moveaxis(kw['x'].astype(np.float16), kw['axes'][0], 0))
        acc = np.zeros(x.shape[1:], np.float16)
        for term in x:
            acc = np.clip(acc + term, -FP16_MAX, FP16_MAX)  # saturating
        acc = acc / np.float16(len(x)) if mean else acc
        return (np.expand_dims(acc, kw['axes'][0]) if kw.get('keep_dims') else acc,)

    def predict(inputs):
        env = {}
        for name, var in f.inputs.items():
            a = np.asarray(inputs[name]).astype(types.nptype_from_builtin(var.dtype))
            if a.shape != tuple(var.shape):
                raise ValueError(f"input {name}: shape {a.shape}, program expects {tuple(var.shape)}")
            env[name] = a

        def val(v):
            return env[v.name] if v.name in env else v.val
        with Function({}, opset_version=f.opset_version), np.errstate(over='ignore' if ane else np.geterr()['over']):
            for op in f.operations:
                if op.op_type == 'const':
                    env[op.outputs[0].name] = op.outputs[0].val
                    continue
                kw = {k: [plain(val(x)) for x in v] if isinstance(v, (list, tuple)) else plain(val(v))
                      for k, v in op.inputs.items()}
                if op.op_type == 'matmul':
                    res = matmul(kw)
                elif ane and op.op_type in ('reduce_sum', 'reduce_mean'):
                    res = fp16_sum(kw, op.op_type == 'reduce_mean')
                else:
                    new = mb._add_op(type(op), name=op.name, **kw)  # runs the op's value_inference
                    res = tuple(o.val for o in (new if isinstance(new, (list, tuple)) else [new]))
                    if any(r is None for r in res):
                        raise NotImplementedError(f"no NumPy evaluation for MIL op {op.op_type}")
                for o, r in zip(op.outputs, res):
                    env[o.name] = r = np.asarray(r).astype(types.nptype_from_builtin(o.dtype))
                    if ane and r.dtype == np.float16:  # saturate: +-inf -> +-65504 (np.clip is 10x slower)
                        inf = np.isinf(r)
                        r[inf] = np.copysign(FP16_MAX, r[inf])
        return {o.name: env[o.name] for o in f.outputs}
    return predict


def print_report(r):
    print(f"ops: {r['ops']}  " + ', '.join(f'{k} {v}' for k, v in r['op_types'].items()))
    print(f"FLOPs per call: {r['flops'] / 1e9:.3f} G total, {r['matmul_flops'] / 1e9:.3f} G in the derivation's "
          f"matmuls, {r['sum_flops'] / 1e9:.3f} G in sums and means as matmuls (a constant vector)")
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
    finite = hg.grads_finite(grads | {'loss': l.reshape(1)})  # an overflow marks the loss (CoreMLEngine)
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
    settings.add_flags(p, hg.GPTConfig)  # the model's flags, as hetero_gpt.py's
    p.add_argument('--microbatch', type=int, default=4, help="sequences per call (B)")
    p.add_argument('--seq_len', type=int, default=0, help="tokens per sequence (T; default block_size)")
    p.add_argument('--out', default='ane.mlpackage', help="where to save the .mlpackage")
    p.add_argument('--check', action='store_true', help="compare gradients with autograd (and, on macOS, the compute plan)")
    p.add_argument('--check_calls', type=int, default=5, help="timed predict calls with --check on macOS")
    a = p.parse_args(argv)
    try:
        cfg = hg.GPTConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(hg.GPTConfig)})
        B, T = a.microbatch, a.seq_len or a.block_size
        t0 = time.perf_counter()
        export_coreml(cfg, B, T, a.out)
        print(f"saved {a.out} ({cfg}, microbatch {B}x{T}) in {time.perf_counter() - t0:.1f} s")
        print_report(program_report(load_coreml_program(a.out), cfg, B, T))
        if a.check:
            engine = hg.CoreMLEngine(a.out, config=cfg, microbatch=(B, T),
                                     scaler=hg.LossScaler(hg.Config.ane_loss_scale, 0))
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
