"""
The ANE's Core ML programs on disk: saved atomically with their metadata, read back,
compiled once into a cache, reported on, and run op by op in NumPy off macOS.

The trainer builds the programs (hetero_gpt.build_coreml_program) and hands the builder in;
nothing here knows GPT-2. Each program is an .mlpackage in one folder with heterogpt.json:

    <folder>/block_forward.mlpackage, head.mlpackage, block_backward.mlpackage
    <folder>/heterogpt.json            format, ane_batch_size, seq_len, pieces, the model's sizes
    <folder>/compiled/<piece>-<hash>.mlmodelc   Core ML's compiled programs (macOS)
"""
import atexit
import collections
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import time

import numpy as np

from .settings import ON_MAC, UserError, import_coremltools, one_line, version

# What the ANE takes (docs/coreml_and_ane.md section 2)
ANE_MAX_DIM = 16384  # the largest tensor dimension every ANE takes
ANE_MEMORY = 3.75 * 2**30  # its address space on M1-class chips: a program past it runs on the CPU
FP16_MAX = 65504.0
# matmul outputs go wrong near 32752 = 2^15 - 16 and inf does not propagate. So an output
# of 2^14 or more (within 2x of that) counts as an overflow.
ANE_MATMUL_MAX = 32752.0
ANE_OVERFLOW = 2.0 ** 14

# Ops the ANE does not run (coreml_and_ane.md section 2): Core ML moves them to the CPU.
OFF_ANE_OPS = {'gather', 'gather_nd', 'gather_along_axis', 'scatter', 'scatter_nd', 'scatter_along_axis',
               'one_hot', 'gelu', 'while_loop', 'cond'}


ELEMENTWISE_FLOPS = {'softmax': 5}  # max, subtract, exp, sum, divide per element


def _inputs(op):
    return [u for v in op.inputs.values() for u in (v if isinstance(v, (list, tuple)) else [v])]


def peaks(outputs, piece):
    """The overflow bookkeeping of a program: {'peaks': one fp16 vector whose largest |value|
    is at least that of every matmul result which could saturate unseen}, or {}. The ANE's matmuls
    saturate near 32752 instead of giving inf (coreml_and_ane.md section 2), and a saturated
    value can vanish (in a softmax) before any output shows it. The host reads every output,
    this vector included, and counts |value| >= ANE_OVERFLOW (2^14) as an overflow.

    A live matmul result y (dead ones are removed by the converter) is checked unless the
    arithmetic bounds it:
    - y is an output, or reshaped into one: the host reads it.
    - y does not depend on the input dy in block_backward (its recomputed forward): the
      program block_forward checked the same values, from the same inputs.
    - y is a mean (a matmul with a constant 1/n) of an input, of a sum (x + attention's
      checked output), or of squares of values scaled into [-1, 1] (layernorm's forward):
      a mean is at most its largest term, below 2^15.
    - y sums exp(z - rowmax z): at most n terms of at most 1, n <= 16384.
    - y is a sum over the last axis of a * softmax (the softmax backward's row sum), or
      softmax @ v (attention's P v, the head's softmax @ W): weights that sum to 1 per
      row, so |y| <= max |a| or max |v|: a checked result, or an input (a weight).
    - y feeds only its row max, exp and softmax (the logits): the row max is checked
      instead, N values, not N x V. A row max below 2^14 leaves no value to saturate above;
      a value saturated at -32752 lies > 16000 below it, where exp gives 0 either way.
    Each check is |.| reduced over every axis but the last: the host reduces the rest."""
    from coremltools.converters.mil import Builder as mb
    block, live, todo = outputs[0].op.enclosing_block, {}, [v.op for v in outputs if v.op is not None]
    while todo:  # the ops the outputs depend on
        op = todo.pop()
        if id(op) not in live:
            live[id(op)] = op
            todo += [u.op for u in _inputs(op) if u.op is not None]
    after = 'dy' if piece == 'block_backward' else None
    fresh, order = {after}, {}
    for i, op in enumerate(block.operations):  # the variables that depend on the input `after`
        order[id(op)] = i
        if any(u.name in fresh for u in _inputs(op)):
            fresh |= {v.name for v in op.outputs}
    out_names = {v.name for v in outputs}
    kind = lambda v: v.op.op_type if v.op is not None else 'input'
    users = lambda v: [op for op in v.child_ops if id(op) in live]

    def read(v):  # an output, or reshaped only into outputs
        return v.name in out_names or (bool(users(v)) and all(
            op.op_type == 'reshape' and read(op.outputs[0]) for op in users(v)))

    def bounded(op, y):
        x, w = op.inputs['x'], op.inputs['y']
        if x.val is not None or w.val is not None:  # a sum or mean: a constant vector c
            c, a = (x, w) if x.val is not None else (w, x)
            mean = not np.all(c.val == 1)
            square = kind(a) == 'mul' and a.op.inputs['x'] is a.op.inputs['y']
            return ((mean and (kind(a) in ('input', 'add') or square))
                    or (kind(a) == 'exp' and c.val.size < ANE_MATMUL_MAX)
                    or (kind(a) == 'mul' and c is w and 'softmax' in (kind(a.op.inputs['x']), kind(a.op.inputs['y']))))
        return kind(x) == 'softmax' and not op.inputs['transpose_x'].val

    def row_max(y):  # the row max of y (or of y + a constant) if y feeds only it, exp and softmax
        vs = [y] + [op.outputs[0] for op in users(y) if op.op_type == 'add' and op.inputs['y'].val is not None]
        ops = [op for v in vs for op in users(v) if op.op_type != 'add' or op.outputs[0] not in vs]
        maxes = [op for op in ops if op.op_type == 'reduce_max' and list(op.inputs['axes'].val) in ([-1], [y.rank - 1])]
        if maxes and all(op.op_type in ('reduce_max', 'sub', 'softmax') for op in ops):
            return maxes[0].outputs[0]
        return None

    checks = []
    for op in sorted((o for o in live.values() if o.op_type == 'matmul'), key=lambda o: order[id(o)]):
        y = op.outputs[0]
        if read(y) or (after and y.name not in fresh) or bounded(op, y):
            continue
        v = row_max(y) or y
        checks.append(mb.reduce_max(x=mb.abs(x=v), axes=list(range(v.rank - 1)), keep_dims=False))
    if len(checks) > 1:
        return {'peaks': mb.concat(values=checks, axis=0)}
    return {'peaks': checks[0]} if checks else {}


def check_shapes(B, T, block_size):
    """Calls of B sequences of T tokens: the tokens on one axis, within the ANE's largest dimension."""
    if B < 1 or T < 1:
        raise UserError(f"ANE calls of {B}x{T} tokens (--ane_batch_size x --block_size): both must be at least 1")
    if B * T > ANE_MAX_DIM:
        raise UserError(f"ANE calls of {B}x{T} = {B * T} tokens: the ANE program keeps tokens on one axis, "
                        f"which must be at most {ANE_MAX_DIM}; use a smaller --ane_batch_size")
    if T > block_size:
        raise UserError(f"sequence length {T} is longer than block_size {block_size}")



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


def _needs(outputs):
    """The ids of every op these variables depend on."""
    seen, todo = set(), [v.op for v in outputs]
    while todo:
        op = todo.pop()
        if op is not None and id(op) not in seen:
            seen.add(id(op))
            todo += [u.op for u in _inputs(op)]
    return seen


def peak_ops(f):
    """The ops (not constants) of function f that only its 'peaks' output needs: the overflow bookkeeping."""
    only = _needs([v for v in f.outputs if v.name == 'peaks']) - _needs([v for v in f.outputs if v.name != 'peaks'])
    return [op for op in f.operations if id(op) in only and op.op_type != 'const']


def program_report(prog):
    """What is in one program, computed from the program itself (the saved one, read back)."""
    f = prog.functions['main']
    ops = [op for op in f.operations if op.op_type != 'const']
    kinds = collections.Counter(op.op_type for op in ops)
    dims = [d for op in f.operations for v in op.outputs if hasattr(v, 'shape') for d in v.shape]
    dims += [d for v in f.inputs.values() for d in v.shape]
    ranks = [len(v.shape) for op in f.operations for v in op.outputs if hasattr(v, 'shape')]
    nbytes = lambda vs: sum(int(np.prod(v.shape)) * 2 for v in vs)  # fp16: 2 bytes an element
    return dict(ops=len(ops), outputs=len(f.outputs), peak_ops=len(peak_ops(f)), op_types=dict(kinds.most_common()),
                flops=sum(op_flops(op) for op in ops),
                matmul_flops=sum(op_flops(op) for op in ops if op.op_type == 'matmul' and not is_sum(op)),
                sum_flops=sum(op_flops(op) for op in ops if is_sum(op)),
                bytes_in=nbytes(f.inputs.values()), bytes_out=nbytes(f.outputs), live_bytes=live_bytes(f),
                largest_dim=max(dims), max_rank=max(ranks), off_ane=sorted(k for k in kinds if k in OFF_ANE_OPS))


def check_ane_limits(reports, B):
    """Refuses programs past what the ANE takes (coreml_and_ane.md sections 1, 2): a dimension over
    ANE_MAX_DIM, or live memory past ANE_MEMORY (there Core ML would run it on the CPU)."""
    for piece, r in reports.items():
        if r['largest_dim'] > ANE_MAX_DIM:
            raise UserError(f"program {piece} has a dimension of {r['largest_dim']}, past the ANE's "
                            f"{ANE_MAX_DIM}: use a smaller model or --ane_batch_size")
        if r['live_bytes'] > ANE_MEMORY:
            raise UserError(f"program {piece} needs ~{r['live_bytes'] / 2**30:.1f} GiB live at {B} sequences a "
                            f"call, past the ANE's {ANE_MEMORY / 2**30:.2f} GiB: use a smaller --ane_batch_size")


PROGRAM_FORMAT = 8  # bump when a program changes
META = 'heterogpt.json'


def meta(cfg, B, T, pieces):
    """heterogpt.json: what a folder of programs was made for (cfg: the model's dataclass)."""
    return dict(format=PROGRAM_FORMAT, ane_batch_size=B, seq_len=T, pieces=list(pieces), **dataclasses.asdict(cfg))


def model_flags(m):
    """The model's flags of the trainer from programs' metadata (for messages)."""
    return ' '.join(f'--{k} {v}' for k, v in m.items() if k not in ('format', 'ane_batch_size', 'seq_len', 'pieces'))


def program_path(programs, piece):
    return os.path.join(programs, piece + '.mlpackage')


def is_programs(path):
    """Whether path is a folder of programs this project wrote (of any version)."""
    try:
        with open(os.path.join(path, META)) as f:
            return 'format' in json.load(f)
    except Exception:
        return False


def export_programs(cfg, B, T, path, build, pieces):
    """Builds each piece's program with build(cfg, B, T, piece), checks them against the ANE's
    limits and saves them as .mlpackages in the folder `path` with heterogpt.json, atomically:
    a crash leaves no half-written folder under that name. Only a path that is absent or
    holds HeteroEngine programs is written. Returns {piece: program_report}."""
    ct = import_coremltools()
    if os.path.lexists(path) and not is_programs(path):
        raise UserError(f"{path} exists and is not a folder of HeteroEngine programs: refusing to overwrite "
                        "it; name another folder")
    tmp = path.rstrip('/') + f'.tmp{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        reports = {}
        for piece in pieces:
            model = ct.convert(build(cfg, B, T, piece), convert_to='mlprogram',
                               compute_precision=ct.precision.FLOAT16,
                               minimum_deployment_target=ct.target.macOS13, skip_model_load=True)
            model.short_description = f"HeteroEngine GPT-2 {piece}, {B}x{T} tokens"
            model.save(program_path(tmp, piece))
            reports[piece] = program_report(load_coreml_program(program_path(tmp, piece)))
            check_ane_limits({piece: reports[piece]}, B)  # before the next piece's conversion
        with open(os.path.join(tmp, META), 'w') as f:
            json.dump(meta(cfg, B, T, pieces), f)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return reports


def read_meta(path):
    """The metadata of programs this version of HeteroEngine exported; UserError else."""
    if not os.path.isdir(path):
        raise UserError(f"no ANE programs at {path}: make them with `python export_ane.py --out {path}`")
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        missing = [p for p in meta['pieces'] if not os.path.isdir(program_path(path, p))]
    except Exception as e:
        raise UserError(f"{path} is not a folder of HeteroEngine programs ({e!r}); re-export it with export_ane.py")
    if meta.get('format') != PROGRAM_FORMAT:
        raise UserError(f"{path} was exported by another version of HeteroEngine; re-export it")
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: re-export it with export_ane.py")
    return meta


def ensure(path, cfg, B, T, build, pieces, named=False, log=print):
    """The folder of programs for cfg (the model) at B x T tokens a call: reused if exported
    for them, else exported now with build. A folder the user named (--ane_programs) is never
    overwritten: one for other shapes is an error."""
    want = meta(cfg, B, T, pieces)
    if os.path.isdir(path):
        try:
            have = read_meta(path)
        except UserError:  # another version's (or no) programs: the trainer's own are made again
            if named:
                raise
            have = None
        if have == want or (named and have == want | dict(pieces=['step'])):
            return path
        if named:
            raise UserError(f"--ane_programs {path} was exported for other shapes; re-export it with "
                            f"`python export_ane.py {model_flags(want)} --ane_batch_size {B} --out {path}` "
                            "or name another path")
        log(f"{path} was exported for other shapes or by another version: exporting again")
    log(f"exporting the ANE's Core ML programs to {path} ...")
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    export_programs(cfg, B, T, path, build, pieces)
    return path


def compiled_model(programs, piece):
    """(path, cached): the program compiled (.mlmodelc) into programs/compiled/, once. The entry
    is keyed by a hash of the package's files and of coremltools' and the OS's versions, so a
    changed program is compiled again and an unchanged one is loaded as it is. It is compiled
    under a temporary name that ends in .mlmodelc, as compile_model requires (coreml_and_ane.md section 1),
    marked DONE, then renamed: an entry without DONE, left by a crash, is compiled again."""
    ct = import_coremltools()
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


LOADED = {}  # piece -> (seconds its load took, its ANE share of ops or None)
# A first load on a Mac is the ANE's compile (coreml_and_ane.md section 1): ~0.5 s for one
# layer and ~160 s for an 8-layer program (ANEForge), 40 min for 32 blocks in one model.
LOAD_ESTIMATE = "seconds to a few minutes (an estimate from other programs, not yet measured here)"
LOAD_SECONDS = 'LOAD_SECONDS'  # beside DONE: the last load's time on this Mac


def loading_line(programs, piece, compiled):
    """What the load of one program is, which of the folder's, and what time to expect:
    the last load's on this Mac, else LOAD_ESTIMATE."""
    try:
        with open(os.path.join(programs, META)) as f:
            pieces = json.load(f)['pieces']
        where = f", {pieces.index(piece) + 1} of {len(pieces)}"
    except (OSError, ValueError, KeyError):
        where = ''
    try:
        with open(os.path.join(compiled, LOAD_SECONDS)) as f:
            expect = f"its last load here took {float(f.read()):.1f} s"
    except (OSError, ValueError):
        expect = LOAD_ESTIMATE
    return f"loading {piece} onto the Neural Engine{where}: {expect}"


def load_compiled(programs, piece, load, log=print):
    """load(path of the compiled program), timed, and where Core ML places it (LOADED); a
    cached entry that fails to load is compiled again, once. log: which program loads and
    what time to expect; the time taken is kept beside it for the next load."""
    path, cached = compiled_model(programs, piece)
    log(loading_line(programs, piece, path))
    t0 = time.perf_counter()
    try:
        model = load(path)
    except Exception:
        if not cached:
            raise
        shutil.rmtree(path, ignore_errors=True)
        path = compiled_model(programs, piece)[0]
        t0 = time.perf_counter()
        model = load(path)
    seconds = time.perf_counter() - t0
    LOADED[piece] = (seconds, macos_placement(path).get('ane_share_of_ops'))
    try:
        with open(os.path.join(path, LOAD_SECONDS), 'w') as f:
            f.write(f"{seconds:.3f}")
    except OSError:  # a read-only cache: the estimate stays
        pass
    return model


def load_summary():
    """One line on the programs loaded: their load time (the ANE compile, minutes the first
    time) and the share of each one's ops Core ML places on the ANE. A load can fall back to
    the CPU without an error; this line is where that shows (coreml_and_ane.md section 1)."""
    shares = {p: s for p, (_, s) in LOADED.items()}
    line = (f"loaded in {sum(t for t, _ in LOADED.values()):.1f} s, ANE share of ops "
            + ' '.join(f"{p} {'unknown' if s is None else s}" for p, s in shares.items()))
    if any(s is not None and s < 1 for s in shares.values()):
        line += "; the rest runs on the CPU, slower: `python export_ane.py --check` lists it"
    return line


HELD = collections.deque()  # [when the call returned, the inputs of one Core ML call]


def coreml_predict(model, inputs):
    """model.predict(inputs) through fresh views of the arrays, each held here until 10 s after
    its call. Core ML drops its reference to its inputs about a second after a call, on its own
    queue and without the GIL (coreml_and_ane.md section 1; coremltools PRs #2827, #2829):
    these views are objects whose reference counts nothing else changes meanwhile, and which
    it never frees."""
    while HELD and HELD[0][0] < time.monotonic() - 10:
        HELD.popleft()
    entry = [math.inf, {k: v[...] for k, v in inputs.items()}]
    HELD.append(entry)
    try:
        return model.predict(entry[1])
    finally:
        entry[0] = time.monotonic()


@atexit.register
def _outlive_core_ml():  # the last calls' inputs are freed at exit: after Core ML's release
    if HELD:
        time.sleep(max(0.0, HELD[-1][0] + 2 - time.monotonic()))


def load_coreml_program(path):
    """The saved package read back into a MIL Program (works on Linux; coreml_and_ane.md section 5)."""
    ct = import_coremltools()
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    model = ct.models.MLModel(path, skip_model_load=True)
    spec = model.get_spec()
    return milproto_load(spec, specification_version=spec.specificationVersion,
                         file_weights_dir=model.weights_dir or '')


# The ANE's functions by lookup table (coreml_and_ane.md section 2): the relative error each
# carries in numpy_predict's ANE mode. Published: about half an fp16 ulp (2^-11 at 1) for the
# activation tables; none per function. Imitated at 2^-10, twice that.
LUT_ERROR = dict.fromkeys(('exp', 'log', 'tanh', 'rsqrt', 'softmax'), 2.0 ** -10)

# The ANE mode's other numerics, environment variables (the macOS double's switches), from
# ane-guide part 1 chapter 3, measured on M1 (coreml_and_ane.md section 2):
#   MACOS_DOUBLE_ANE_LUT         knots: a piecewise-linear table's error, smooth between knots,
#                                as M1's 33-knot tables (default); hash: hashed from each input
#   MACOS_DOUBLE_ANE_LUT_BIAS    b: every table off by b, one sign (default 0: size unknown)
#   MACOS_DOUBLE_ANE_SUBNORMALS  matmul: matmul flushes them to +0, as M1 (default)
#                                keep: as M5; all: every op flushes them
#   MACOS_DOUBLE_ANE_NAN         engine: a NaN input is +inf, a NaN result +0, as M1 (default)
#                                ieee: NaN stays NaN
ANE_SWITCHES = {'MACOS_DOUBLE_ANE_LUT': ('knots', 'hash'),
                'MACOS_DOUBLE_ANE_SUBNORMALS': ('matmul', 'keep', 'all'),
                'MACOS_DOUBLE_ANE_NAN': ('engine', 'ieee')}
FP16_TINY = 2.0 ** -14  # the smallest normal fp16: below it, subnormals

# Where each table's 33 knots are evenly spaced (ane-guide: 32 linear segments a table):
# exp and softmax's exp on 2^x's mantissa, log and rsqrt on log2 |x|, a binade in 32 segments;
# tanh on x itself, about [-4, 4], a segment 1/4 wide.
LUT_KNOT_SPACING = {'exp': 1 / 32, 'softmax': 1 / 32, 'log': 1 / 32, 'rsqrt': 1 / 32, 'tanh': 1 / 4}
# The chord's side of the curve: above a convex table (exp, rsqrt), below a concave one
LUT_CURVE = {'exp': 1, 'softmax': 1, 'rsqrt': 1, 'log': -1, 'tanh': -1}
# Both origin biases ane-guide measured (gelu, swish) are negative
LUT_BIAS_SIGN = -1


def ane_switches():
    """{variable: value} of the ANE mode's switches, from the environment; UserError if bad."""
    out = {k: os.environ.get(k, v[0]) for k, v in ANE_SWITCHES.items()}
    for k, v in out.items():
        if v not in ANE_SWITCHES[k]:
            raise UserError(f"{k}={v}: it takes {', '.join(ANE_SWITCHES[k])}")
    bias = os.environ.get('MACOS_DOUBLE_ANE_LUT_BIAS', '0')
    try:
        b = float(bias)
    except ValueError:
        b = math.nan  # refused below
    if not 0 <= b < 1:
        raise UserError(f"MACOS_DOUBLE_ANE_LUT_BIAS={bias}: it takes a number in [0, 1)")
    return out | {'MACOS_DOUBLE_ANE_LUT_BIAS': b}


def lut_error(x, size):
    """A relative error in [-size, size) that is a fixed function of each input's fp16 bits, as
    a table's error is: the same input always gives the same error, neighbours unrelated."""
    bits = np.asarray(x, np.float16).view(np.uint16).astype(np.uint32)
    return size * (((bits * 2654435761) >> 16 & 0xFFFF).astype(np.float32) / 32768 - 1)


def lut_knots_error(op, x, size, axis=-1):
    """The relative error of a piecewise-linear table: between two knots the chord leaves the
    curve by a parabola, 0 at the knots, size at the middle, on the side LUT_CURVE gives.
    Neighbouring inputs share it; it never changes sign, so it does not cancel in sums."""
    x = np.asarray(x, np.float32)
    if op == 'softmax':  # its exp takes x - the row's max
        x = x - x.max(axis, keepdims=True)
    if op in ('exp', 'softmax'):
        t = x * np.float32(math.log2(math.e))
    elif op in ('log', 'rsqrt'):
        t = np.log2(np.maximum(np.abs(x), FP16_TINY))
    else:
        t = x
    u = t / np.float32(LUT_KNOT_SPACING[op])
    u = u - np.floor(u)
    return LUT_CURVE[op] * size * 4 * u * (1 - u)


def lut_bias(op, y, size):
    """A table's systematic bias, b = size, of one sign: a relative -b on the positive tables
    (exp, rsqrt, softmax), an absolute -b on those through 0 (tanh, log), as at gelu's origin."""
    if op in ('tanh', 'log'):
        return y + LUT_BIAS_SIGN * size
    return y * (1 + LUT_BIAS_SIGN * size)


def flush_subnormals(a):
    """fp16 subnormals (|a| < 2^-14) to +0, in place."""
    a[np.abs(a) < FP16_TINY] = 0
    return a


def numpy_predict(prog, ane=False, lut=None):
    """A stand-in for Core ML's predict off macOS: evaluates the program op by op in NumPy,
    each op's result rounded to the dtype the program declares (fp16 here), through the
    ops' own value_inference, each value freed after its last reader. Slow; for checks, not training.
    matmul: fp16 operands, fp32 accumulation (as the ANE; its products are rounded to fp16
    first, which this does not imitate), one rounding of the result.
    ane=True imitates what is known of the ANE's fp16 (coreml_and_ane.md section 2), the rest as
    above: reduce_sum and reduce_mean add the terms one after another along the axis in fp16
    (every partial sum rounded: the worst case of a narrow accumulator; the mean divides that
    sum by n), and no result overflows to inf: matmul outputs saturate at +-ANE_MATMUL_MAX,
    every other op's at +-65504; and the lookup tables are inexact: {op: relative error}
    (lut_error of the op's input), LUT_ERROR unless given; lut={} computes them exactly.
    The switches (ane_switches) shape the tables' error, add their bias, flush subnormals
    and coerce NaN, as read when this is called."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, types
    f = prog.functions['main']
    lut = (LUT_ERROR if lut is None else lut) if ane else {}
    switch = ane_switches() if ane else {}
    knots = switch.get('MACOS_DOUBLE_ANE_LUT') == 'knots'
    bias = switch.get('MACOS_DOUBLE_ANE_LUT_BIAS', 0.0)
    flush = switch.get('MACOS_DOUBLE_ANE_SUBNORMALS', 'keep')
    engine_nan = switch.get('MACOS_DOUBLE_ANE_NAN') == 'engine'

    def plain(v):  # NumPy 2: loaded bool params are np.bool_, which reductions reject
        return bool(v) if isinstance(v, np.bool_) or (isinstance(v, np.ndarray) and v.dtype == np.bool_ and v.ndim == 0) else v

    def matmul(kw):  # fp16 operands, fp32 accumulation (as the ANE), fp16 result; and fast
        x, y = kw['x'].astype(np.float32), kw['y'].astype(np.float32)
        x = np.swapaxes(x, -1, -2) if kw.get('transpose_x') else x
        y = np.swapaxes(y, -1, -2) if kw.get('transpose_y') else y
        if flush != 'keep':  # M1's accumulator flushes subnormals, in and out
            x, y = flush_subnormals(x), flush_subnormals(y)
            return (flush_subnormals(np.clip(x @ y, -ANE_MATMUL_MAX, ANE_MATMUL_MAX)),)
        return (np.clip(x @ y, -ANE_MATMUL_MAX, ANE_MATMUL_MAX) if ane else x @ y,)

    def table(op, kw, y):  # a table's result: its error (a function of the input), its bias
        if knots:
            y = y * (1 + lut_knots_error(op.op_type, kw['x'], lut[op.op_type], kw.get('axis', -1)))
        else:
            y = y * (1 + lut_error(kw['x'], lut[op.op_type]))
        return lut_bias(op.op_type, y, bias) if bias else y

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
        env, made = {}, 0
        for name, var in f.inputs.items():
            a = np.asarray(inputs[name]).astype(types.nptype_from_builtin(var.dtype))
            if a.shape != tuple(var.shape):
                raise ValueError(f"input {name}: shape {a.shape}, program expects {tuple(var.shape)}")
            if engine_nan:  # a NaN enters as +inf, saturated here
                a[np.isnan(a)] = FP16_MAX
            env[name] = flush_subnormals(a) if flush == 'all' else a

        def val(v):
            return env[v.name] if v.name in env else v.val
        quiet = dict(over='ignore', invalid='ignore') if ane else {}  # inf and NaN are handled below
        with Function({}, opset_version=f.opset_version), np.errstate(**quiet):
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
                    if lut.get(op.op_type):  # the table's error, a function of the input
                        res = (table(op, kw, res[0]),)
                for o, r in zip(op.outputs, res):
                    env[o.name] = r = np.asarray(r).astype(types.nptype_from_builtin(o.dtype))
                    made += r.nbytes
                    if ane and r.dtype == np.float16:  # saturate: +-inf -> +-65504 (np.clip is 10x slower)
                        inf = np.isinf(r)
                        r[inf] = np.copysign(FP16_MAX, r[inf])
                        if engine_nan:  # 0 * inf, log(-1), rsqrt(-1): +0, never NaN
                            r[np.isnan(r)] = 0
                        if flush == 'all':
                            flush_subnormals(r)
                for name in frees[i]:
                    env.pop(name, None)
        out = {o.name: env[o.name] for o in f.outputs}
        env.clear()
        if made > 2**26:  # the MIL ops made above hold their values in reference cycles: free
            gc.collect()  # large ones now (a full collection is slow beside PyTorch's objects)
        return out
    return predict


def numpy_programs(programs, pieces, ane=False, lut=None):
    """predict(piece, inputs) -> outputs: the saved programs in numpy_predict (off macOS)."""
    fns = {p: numpy_predict(load_coreml_program(program_path(programs, p)), ane, lut) for p in pieces}
    return lambda piece, inputs: fns[piece](inputs)


def macos_placement(compiled):
    """Where Core ML places a compiled program's ops (its compute plan, macOS 14.4+): the share
    of ops and of the estimated cost on the Neural Engine, and the ops elsewhere by device."""
    if version(platform.mac_ver()[0]) < (14, 4):
        return dict(unavailable=f"the compute plan needs macOS 14.4 (this is {platform.mac_ver()[0]})")
    ct = import_coremltools()
    from coremltools.models.compute_plan import MLComputePlan
    share, elsewhere = collections.Counter(), collections.Counter()
    try:  # a plan that cannot be loaded or read is reported, never a failed load
        plan = MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
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
    except Exception as e:
        return dict(unavailable=one_line(e))
    return {f'ane_share_of_{w}': round(share[w, True] / max(share[w, True] + share[w, False], 1e-12), 4)
            for w in ('ops', 'cost')} | dict(not_on_ane=dict(elsewhere.most_common()))
