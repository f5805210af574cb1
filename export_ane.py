"""
Export HeteroEngine's training step (forward + loss + backward of GPT-2) as the Core ML
programs the ANE engine chains (a block's forward, a block's backward, the head), and
report what is in them.

    python export_ane.py                                           # GPT-2 124M, 4x1024 tokens a call
    python export_ane.py --n_layer 4 --n_head 4 --n_embd 128 --block_size 64 --microbatch 8 --out tiny
    python export_ane.py --whole_step --out ane_step               # the whole step as one program
    python export_ane.py ... --check                               # on macOS: on the ANE

The report (any OS), per program: calls per microbatch, ops, FLOPs, bytes in and out, an
estimate of its largest live memory, the largest tensor dimension, ops known to fall off
the ANE; per microbatch: FLOPs against the analytic count. Programs past the ANE's limits
are refused. --check runs the staged self-check (ane_check.py) and writes ane_check.json.
"""
import argparse
import collections
import dataclasses
import gc
import json
import os
import shutil
import sys
import time

import numpy as np

import hetero_gpt as hg
import settings

# Ops the ANE does not run (coreml_and_ane.md section 2): Core ML moves them to the CPU.
OFF_ANE_OPS = {'gather', 'gather_nd', 'gather_along_axis', 'scatter', 'scatter_nd', 'scatter_along_axis',
               'one_hot', 'gelu', 'while_loop', 'cond'}
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


def last_use(f):
    """Variable name -> the index of the last op that reads it (the program's outputs: past the end)."""
    last = {}
    for i, op in enumerate(f.operations):
        for v in op.inputs.values():
            for u in v if isinstance(v, (list, tuple)) else [v]:
                last[u.name] = i
    return last | {v.name: len(f.operations) for v in f.outputs}


def live_bytes(f):
    """An estimate of a program's largest live memory: walking its ops in order, each
    tensor (fp16, 2 bytes an element; inputs from the start) lives from the op that makes it
    to the last op that reads it; the largest sum over that walk. Core ML plans its own
    memory and may reuse or split buffers: this is the plan without reuse across ops."""
    size = lambda v: int(np.prod(v.shape)) * 2 if hasattr(v, 'shape') else 0
    last = last_use(f)
    alive = {v.name: size(v) for v in f.inputs.values()}
    peak = total = sum(alive.values())
    for i, op in enumerate(f.operations):
        for v in op.outputs:
            alive[v.name] = size(v)
            total += alive[v.name]
        peak = max(peak, total)
        for name in [n for n in alive if last.get(n, -1) <= i]:
            total -= alive.pop(name)
    return peak


def program_report(prog):
    """What is in one program, computed from the program itself (the saved one, read back)."""
    f = prog.functions['main']
    ops = [op for op in f.operations if op.op_type != 'const']
    kinds = collections.Counter(op.op_type for op in ops)
    dims = [d for op in f.operations for v in op.outputs if hasattr(v, 'shape') for d in v.shape]
    dims += [d for v in f.inputs.values() for d in v.shape]
    ranks = [len(v.shape) for op in f.operations for v in op.outputs if hasattr(v, 'shape')]
    nbytes = lambda vs: sum(int(np.prod(v.shape)) * 2 for v in vs)  # fp16: 2 bytes an element
    return dict(ops=len(ops), op_types=dict(kinds.most_common()), flops=sum(op_flops(op) for op in ops),
                matmul_flops=sum(op_flops(op) for op in ops if op.op_type == 'matmul' and not is_sum(op)),
                sum_flops=sum(op_flops(op) for op in ops if is_sum(op)),
                bytes_in=nbytes(f.inputs.values()), bytes_out=nbytes(f.outputs), live_bytes=live_bytes(f),
                largest_dim=max(dims), max_rank=max(ranks), off_ane=sorted(k for k in kinds if k in OFF_ANE_OPS))


def step_report(reports, cfg, B, T):
    """One microbatch of B sequences through every program: each piece's calls (L blocks
    forward and backward, one head), its totals, against the analytic count."""
    calls = {'step': 1, 'block_forward': cfg.n_layer, 'head': 1, 'block_backward': cfg.n_layer}
    total = {k: sum(calls[p] * r[k] for p, r in reports.items())
             for k in ('flops', 'matmul_flops', 'sum_flops', 'bytes_in', 'bytes_out')}
    exact, estimate = analytic_flops(cfg, B, T)
    return total | dict(calls={p: calls[p] for p in reports}, analytic_matmul_flops=exact, estimate_flops=estimate,
                        live_bytes=max(r['live_bytes'] for r in reports.values()),
                        largest_dim=max(r['largest_dim'] for r in reports.values()))


def check_ane_limits(reports, B):
    """Refuses programs past what the ANE takes (coreml_and_ane.md sections 1, 2): a dimension over
    ANE_MAX_DIM, or live memory past ANE_MEMORY (there Core ML would run it on the CPU)."""
    for piece, r in reports.items():
        if r['largest_dim'] > hg.ANE_MAX_DIM:
            raise hg.UserError(f"program {piece} has a dimension of {r['largest_dim']}, past the ANE's "
                               f"{hg.ANE_MAX_DIM}: use a smaller model or --microbatch")
        if r['live_bytes'] > hg.ANE_MEMORY:
            raise hg.UserError(f"program {piece} needs ~{r['live_bytes'] / 2**30:.1f} GiB live at {B} sequences a "
                               f"call, past the ANE's {hg.ANE_MEMORY / 2**30:.2f} GiB: use a smaller --microbatch "
                               "(--ane_batch_size in the trainer)")


PROGRAM_FORMAT = 6  # bump when a program changes (6: per-piece programs, the peaks as outputs)
META = 'heterogpt.json'


def programs_meta(cfg, B, T, pieces):
    return dict(format=PROGRAM_FORMAT, microbatch=B, seq_len=T, pieces=list(pieces), **dataclasses.asdict(cfg))


def program_path(programs, piece):
    return os.path.join(programs, piece + '.mlpackage')


def is_programs(path):
    """Whether path is a folder of programs this project wrote (of any version)."""
    try:
        with open(os.path.join(path, META)) as f:
            return 'format' in json.load(f)
    except Exception:
        return False


def export_programs(cfg, B, T, path, whole_step=False, log=None):
    """Builds the programs (hg.build_coreml_program: the three pieces, or with whole_step the
    step as one), checks them against the ANE's limits and saves them as .mlpackages in the
    folder `path` with heterogpt.json, atomically: a crash leaves no half-written folder
    under that name. Only a path that is absent or holds HeteroEngine programs is written.
    Returns {piece: program_report}."""
    ct = hg.import_coremltools()
    if os.path.lexists(path) and not is_programs(path):
        raise hg.UserError(f"{path} exists and is not a folder of HeteroEngine programs: refusing to overwrite "
                           "it; choose another --out")
    pieces = ('step',) if whole_step else hg.ANE_PIECES
    tmp = path.rstrip('/') + f'.tmp{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        reports = {}
        for piece in pieces:
            model = ct.convert(hg.build_coreml_program(cfg, B, T, piece), convert_to='mlprogram',
                               compute_precision=ct.precision.FLOAT16,
                               minimum_deployment_target=ct.target.macOS13, skip_model_load=True)
            model.short_description = f"HeteroEngine GPT-2 {piece}, {B}x{T} tokens"
            model.save(program_path(tmp, piece))
            reports[piece] = program_report(load_coreml_program(program_path(tmp, piece)))
        check_ane_limits(reports, B)
        with open(os.path.join(tmp, META), 'w') as f:
            json.dump(programs_meta(cfg, B, T, pieces), f)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return reports


def read_programs_meta(path):
    """The metadata of programs this version of HeteroEngine exported; UserError else."""
    if not os.path.isdir(path):
        raise hg.UserError(f"no ANE programs at {path}: make them with `python export_ane.py --out {path}`")
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        missing = [p for p in meta['pieces'] if not os.path.isdir(program_path(path, p))]
    except Exception as e:
        raise hg.UserError(f"{path} is not a folder of HeteroEngine programs ({e!r}); re-export it with export_ane.py")
    if meta.get('format') != PROGRAM_FORMAT:
        raise hg.UserError(f"{path} was exported by another version of HeteroEngine; re-export it")
    if missing:
        raise hg.UserError(f"{path} lacks {', '.join(missing)}: re-export it with export_ane.py")
    return meta


def ane_batch(cfg):
    """The ANE's microbatch: --ane_batch_size, or the largest divisor of batch_size up to hg.ANE_BATCH."""
    return cfg.ane_batch_size or max(b for b in range(1, min(cfg.batch_size, hg.ANE_BATCH) + 1) if cfg.batch_size % b == 0)


def ensure_programs(cfg, log=print):
    """The programs --mode ane/hetero needs: reused if exported for this configuration, else
    exported now. A folder the user named (--ane_programs) is never overwritten: one for
    other shapes is an error."""
    mcfg, B = hg.model_config(cfg), ane_batch(cfg)
    path = cfg.ane_programs or os.path.join(cfg.out_dir, f'ane_B{B}_T{cfg.block_size}')
    want = programs_meta(mcfg, B, cfg.block_size, hg.ANE_PIECES)
    if os.path.isdir(path):
        try:
            meta = read_programs_meta(path)
        except hg.UserError:  # another version's (or no) programs: the trainer's own are made again
            if cfg.ane_programs:
                raise
            meta = None
        if meta == want or (cfg.ane_programs and meta == want | dict(pieces=['step'])):
            return path
        if cfg.ane_programs:
            raise hg.UserError(f"--ane_programs {path} was exported for other shapes; re-export it with "
                               f"`python export_ane.py {mcfg.flags()} --microbatch {B} --seq_len {cfg.block_size} "
                               f"--out {path}` or name another path")
        log(f"{path} was exported for other shapes or by another version: exporting again")
    log(f"exporting the ANE's Core ML programs to {path} ...")
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    export_programs(mcfg, B, cfg.block_size, path)
    return path


def open_programs(path, predict=None, scaler=None):
    """A CoreMLEngine on the programs in `path`, in this process: by Core ML on macOS, the
    NumPy evaluator elsewhere (hg.coreml_predict_fn), unless `predict` is given."""
    meta = read_programs_meta(path)
    cfg = hg.GPTConfig(**{f.name: meta[f.name] for f in dataclasses.fields(hg.GPTConfig)})
    label = f"Core ML programs {os.path.basename(path.rstrip('/'))}" + ('' if hg.ON_MAC else ' (NumPy evaluator)')
    return hg.CoreMLEngine(cfg, meta['microbatch'], meta['seq_len'],
                           predict or hg.coreml_predict_fn(path, meta['pieces']), meta['pieces'],
                           scaler=scaler, label=label)


def compiled_model(programs, piece):
    """(path, cached): the program compiled (.mlmodelc) into programs/compiled/, once. The entry
    is keyed by a hash of the package's files and of coremltools' and the OS's versions, so a
    changed program is compiled again and an unchanged one is loaded as it is. It is compiled
    under a temporary name that ends in .mlmodelc, as compile_model requires (coreml_and_ane.md section 1),
    marked DONE, then renamed: an entry without DONE, left by a crash, is compiled again."""
    import hashlib
    import platform
    ct = hg.import_coremltools()
    pkg = program_path(programs, piece)
    h = hashlib.sha256(f"{ct.__version__} {platform.platform()} {platform.mac_ver()[0]}".encode())
    for root, dirs, files in sorted(os.walk(pkg)):
        dirs.sort()
        for name in sorted(files):
            h.update(os.path.relpath(os.path.join(root, name), pkg).encode())
            with open(os.path.join(root, name), 'rb') as f:
                h.update(f.read())
    cache = os.path.join(programs, 'compiled')
    dest = os.path.join(cache, f'{piece}-{h.hexdigest()[:16]}.mlmodelc')
    if os.path.isfile(os.path.join(dest, 'DONE')):
        return dest, True
    os.makedirs(cache, exist_ok=True)
    for old in os.listdir(cache):  # this piece's other entries, and temporaries of processes that are gone
        pid = old.split('.tmp')[-1].split('.')[0] if '.tmp' in old else ''
        if old.startswith(piece + '-') or (old.startswith(f'.{piece}-') and not _alive(pid)):
            shutil.rmtree(os.path.join(cache, old), ignore_errors=True)
    tmp = os.path.join(cache, f'.{piece}-{h.hexdigest()[:16]}.tmp{os.getpid()}.mlmodelc')
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ct.utils.compile_model(pkg, tmp)
        open(os.path.join(tmp, 'DONE'), 'w').close()
        os.replace(tmp, dest)
    except OSError:  # another process put its copy there first
        if not os.path.isfile(os.path.join(dest, 'DONE')):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest, False


def _alive(pid):
    try:
        os.kill(int(pid), 0)
        return True
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True


def load_compiled(programs, piece, load):
    """load(path of the compiled program); a cached entry that fails to load is compiled again, once."""
    path, cached = compiled_model(programs, piece)
    try:
        return load(path)
    except Exception:
        if not cached:
            raise
        shutil.rmtree(path, ignore_errors=True)
        return load(compiled_model(programs, piece)[0])


def load_coreml_program(path):
    """The saved package read back into a MIL Program (works on Linux; coreml_and_ane.md section 5)."""
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
    ops' own value_inference, each value freed after its last reader. Slow; for checks, not training.
    matmul: fp16 operands, fp32 accumulation (as the ANE; its products are rounded to fp16
    first, which this does not imitate), one rounding of the result.
    ane=True imitates what is known of the ANE's fp16 (coreml_and_ane.md section 2), the rest as
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

    frees = collections.defaultdict(list)  # op index -> the values no later op reads: freed after it
    for name, i in last_use(f).items():
        frees[i].append(name)

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
            for i, op in enumerate(f.operations):
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
                for name in frees[i]:
                    env.pop(name, None)
        out = {o.name: env[o.name] for o in f.outputs}
        env.clear()
        gc.collect()  # the MIL ops made above hold their values in reference cycles: free them now
        return out
    return predict


def mil_program(fn, **shapes):
    """A MIL program of fn(**fp16 inputs of these shapes as MILTensors) -> {name: MILTensor}."""
    ct = hg.import_coremltools()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types
    with Function({k: mb.placeholder(shape=s, dtype=types.fp16) for k, s in shapes.items()},
                  opset_version=ct.target.macOS13) as f:
        out = fn(**{k: hg.MILTensor(v) for k, v in f.inputs.items()})
        f.set_outputs([mb.identity(x=v.v, name=k) for k, v in out.items()])
    prog = Program()
    prog.add_function('main', f)
    return prog


def numpy_programs(programs, pieces, ane=False):
    """predict(piece, inputs) -> outputs: the saved programs in numpy_predict (off macOS)."""
    fns = {p: numpy_predict(load_coreml_program(program_path(programs, p)), ane) for p in pieces}
    return lambda piece, inputs: fns[piece](inputs)


def print_report(reports, cfg, B, T):
    """One line per program, then one microbatch of B sequences through all of them."""
    print(f"{'program':<15}{'calls':>6}{'ops':>6}{'GFLOP':>9}{'MiB in':>9}{'MiB out':>9}{'MiB live':>10}"
          f"{'largest dim':>13}  off the ANE")
    st = step_report(reports, cfg, B, T)
    for p, r in reports.items():
        print(f"{p:<15}{st['calls'][p]:>6}{r['ops']:>6}{r['flops'] / 1e9:>9.2f}{r['bytes_in'] / 2**20:>9.1f}"
              f"{r['bytes_out'] / 2**20:>9.1f}{r['live_bytes'] / 2**20:>10.1f}{r['largest_dim']:>13}  "
              + (', '.join(r['off_ane']) or 'none'))
    print(f"per microbatch of {B}x{T} tokens: {st['flops'] / 1e9:.1f} GFLOP, of which {st['matmul_flops'] / 1e9:.1f} "
          f"in the derivation's matmuls and {st['sum_flops'] / 1e9:.2f} in sums as matmuls; "
          f"{st['bytes_in'] / 2**20:.0f} MiB in, {st['bytes_out'] / 2**20:.0f} MiB out (fp16)")
    print(f"  analytic matmul count {st['analytic_matmul_flops'] / 1e9:.1f} GFLOP: ratio "
          f"{st['matmul_flops'] / st['analytic_matmul_flops']:.3f}" + (
              " (the block backward recomputes its forward)" if 'block_backward' in reports else '')
          + f"; 6*params*tokens + attention {st['estimate_flops'] / 1e9:.1f} GFLOP (ratio of all FLOPs "
          f"{st['flops'] / st['estimate_flops']:.3f})")
    print(f"largest live memory {st['live_bytes'] / 2**20:.0f} MiB (ANE limit ~{hg.ANE_MEMORY / 2**30:.2f} GiB); "
          f"largest dimension {st['largest_dim']} (ANE limit {hg.ANE_MAX_DIM})")


def macos_placement(compiled):
    """Where Core ML places a compiled program's ops (its compute plan, macOS 14.4+): the share
    of ops and of the estimated cost on the Neural Engine, and the ops elsewhere by device."""
    import platform
    if settings.version(platform.mac_ver()[0]) < (14, 4):
        return dict(unavailable=f"the compute plan needs macOS 14.4 (this is {platform.mac_ver()[0]})")
    ct = hg.import_coremltools()
    from coremltools.models.compute_plan import MLComputePlan
    try:
        plan = MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    except Exception as e:  # reported; the stage goes on
        return dict(unavailable=settings.one_line(e))
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
            elsewhere[f"{op.operator_name} -> {dev}"] += 1
    return {f'ane_share_of_{w}': round(share[w, True] / max(share[w, True] + share[w, False], 1e-12), 4)
            for w in ('ops', 'cost')} | dict(not_on_ane=dict(elsewhere.most_common()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_flags(p, hg.GPTConfig)  # the model's flags, as hetero_gpt.py's
    p.add_argument('--microbatch', type=int, help="sequences per call (B; the trainer's --ane_batch_size; "
                   f"default {hg.ANE_BATCH}, with --check the trainer's on a Mac)")
    p.add_argument('--seq_len', type=int, default=0, help="tokens per sequence (T; default block_size)")
    p.add_argument('--out', default='ane_programs', help="the folder to save the programs in")
    p.add_argument('--whole_step', action='store_true', help="the whole step as one program, to compare")
    p.add_argument('--check', action='store_true', help="the staged self-check (ane_check.py): what the ANE path does here")
    p.add_argument('--gpu_batch', type=int, default=0, help="with --check: the GPU engine's microbatch (default: the trainer's on a Mac)")
    p.add_argument('--check_report', default='ane_check.json', help="with --check: the report (and its .md summary)")
    p.add_argument('--stage_timeout', type=float, default=3600.0, help="with --check: seconds a stage may take")
    p.add_argument('--stages', default='', help="with --check: only these stages, comma-separated (default: all)")
    a = p.parse_args(argv)
    try:
        cfg = hg.GPTConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(hg.GPTConfig)})
        mac = hg.Config(**hg.MAC_DEFAULTS)  # what the trainer uses on a Mac
        B = a.microbatch if a.microbatch is not None else ane_batch(mac) if a.check else hg.ANE_BATCH
        T = a.seq_len or a.block_size
        if hg.ON_MAC:  # (a coremltools without its native libraries cannot save a program either)
            settings.check_coreml()
            settings.check_ane_alignment(cfg, T)
        if a.check:  # the programs are exported by its own stage, in a process of their own
            import ane_check
            return ane_check.main(cfg, B, T, a.out, a.gpu_batch or mac.batch_size, a.check_report, a.stage_timeout,
                                  a.stages)
        t0 = time.perf_counter()
        reports = export_programs(cfg, B, T, a.out, a.whole_step)
        print(f"saved {a.out} ({cfg}, {B}x{T} tokens a call) in {time.perf_counter() - t0:.1f} s")
        print_report(reports, cfg, B, T)
    except hg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
