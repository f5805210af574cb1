"""The ANE programs' overflow bookkeeping (programs.peaks): one 'peaks' output per program,
checks only where a matmul result can saturate unseen, and a saturated value still drops
the step. The ANE saturates instead of giving inf (coreml_and_ane.md section 2), imitated by
programs.numpy_predict(ane=True)."""
import numpy as np
import pytest
import torch

import export_ane
import hetero_gpt as hg
import helpers
from plumbing import programs

pytest.importorskip('coremltools')


def bookkeeping(path, piece):
    """(ops, outputs, ops that only the peaks output needs, its checks) of a saved program."""
    f = programs.load_coreml_program(programs.program_path(path, piece)).functions['main']
    extra = programs.peak_ops(f)
    return (len([op for op in f.operations if op.op_type != 'const']), len(f.outputs), extra,
            sum(op.op_type == 'reduce_max' for op in extra))


# What programs.peaks checks, per program, from its rules (the matmul results that can saturate unseen):
# block_forward: q, k, v, the scores, attention's projection, the MLP's two (P v is an average of v).
# head: each chunk's row max of the logits, the chunk's two backward matmuls (their softmax is scaled
# up by PROBS_UP, so no longer bounded by the weights), the target logit, the final layernorm backward's
# two means.
# block_backward (its forward was checked by block_forward): dg, dm, the projection's dy, dv, dP, dq,
# dk, the three parts of d(ln_1 output), and both layernorms' backward means (two each).
CHECKS = {'block_forward': 7, 'head': lambda chunks: 3 * chunks + 3, 'block_backward': 14}


def test_one_peaks_output_and_only_the_checks(exported):
    cfg = hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=32)  # two vocabulary chunks
    path = exported(cfg, 3, 7)
    chunks = len(hg.vocab_chunks(cfg.vocab_size)[1])
    for piece in hg.ANE_PIECES:
        n_ops, n_out, extra, checks = bookkeeping(path, piece)
        want = CHECKS[piece](chunks) if callable(CHECKS[piece]) else CHECKS[piece]
        # each check is abs + reduce_max; one concat; the output's identity
        assert checks == want and len(extra) == 2 * want + 2, (piece, [op.op_type for op in extra])
        outputs = hg.piece_input_shapes(cfg, 3, 7, piece)
        assert n_out == {'block_forward': 2, 'head': len(outputs) + 1, 'block_backward': len(outputs)}[piece]


@pytest.mark.slow
def test_bookkeeping_counts_at_the_macs_defaults(tmp_path):
    # GPT-2 124M at 2x1024 tokens a call (the Mac's ANE microbatch): the ops and outputs of each
    # program, and the bookkeeping's share; 4 vocabulary chunks
    path = str(tmp_path / 'p')
    export_ane.export_programs(hg.GPTConfig(), 2, 1024, path)
    counts = {p: bookkeeping(path, p) for p in hg.ANE_PIECES}
    print({p: (n, out, len(extra)) for p, (n, out, extra, _) in counts.items()})
    assert {p: (n, out, len(extra)) for p, (n, out, extra, _) in counts.items()} == {
        'block_forward': (83, 2, 16), 'head': (176, 10, 32), 'block_backward': (197, 18, 30)}
    # head: the 8 matmuls of the scaled softmax (two a chunk) are checked too; block_backward:
    # the scaled dS and its two divisions


def block_weights(cfg, model):
    params = {k: p.detach() for k, p in model.named_parameters()}
    return {k[3:]: v.float().numpy() for k, v in hg.host_weights(params, cfg).items() if k.startswith('h0_')}


def test_saturated_scores_show_only_in_the_peaks(exported):
    # Query and key weights 2000x: q and k stay below 2^14 (~200), their dot products, the
    # attention scores, pass 32752 and saturate in the ANE mode. The softmax hides that: y
    # is finite and small, only 'peaks' reaches 2^14. In the engine the loss becomes inf (the
    # step drops these gradients); with programs.peaks returning nothing, it passes unseen.
    cfg, B, T = helpers.PROGRAMS['cfg'], helpers.PROGRAMS['B'], helpers.PROGRAMS['T']
    torch.manual_seed(0)
    model = hg.GPT(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:2 * cfg.n_embd].mul_(2000)
    x = np.random.default_rng(0).standard_normal((B * T, cfg.n_embd)).astype(np.float32)
    path = exported(**helpers.PROGRAMS)
    out = programs.numpy_programs(path, ('block_forward',), ane=True)('block_forward', {'x': x} | block_weights(cfg, model))
    assert np.isfinite(out['y']).all() and np.abs(out['y']).max() < programs.ANE_OVERFLOW
    assert np.abs(out['peaks']).max() >= programs.ANE_OVERFLOW
    idx, targets = (torch.randint(0, cfg.vocab_size, (B, T)) for _ in range(2))
    engine = helpers.open_programs(path, predict=programs.numpy_programs(path, hg.ANE_PIECES, ane=True))
    engine.load_weights(dict(model.named_parameters()))
    assert engine.loss_and_grads(idx, targets)[0].item() == float('inf')


def test_without_the_peaks_the_saturation_passes(exported, monkeypatch, tmp_path):
    # The same saturated scores, in programs exported without the check: every output stays
    # below 2^14 and the engine reports a finite loss (what the check is for).
    cfg, B, T = helpers.PROGRAMS['cfg'], helpers.PROGRAMS['B'], helpers.PROGRAMS['T']
    monkeypatch.setattr(programs, 'peaks', lambda outputs, piece: {})
    path = str(tmp_path / 'p')
    export_ane.export_programs(cfg, B, T, path)
    torch.manual_seed(0)
    model = hg.GPT(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:2 * cfg.n_embd].mul_(2000)
    engine = helpers.open_programs(path, predict=programs.numpy_programs(path, hg.ANE_PIECES, ane=True))
    engine.load_weights(dict(model.named_parameters()))
    idx, targets = (torch.randint(0, cfg.vocab_size, (B, T)) for _ in range(2))
    loss, grads = engine.loss_and_grads(idx, targets)
    assert np.isfinite(loss.item()) and engine.scaler.peak < programs.ANE_OVERFLOW


def row_sum_dropped(self, x, axis, keep=True):  # the softmax backward's row sum (the only 4-D sum) as 0
    return ORIGINAL_SUM(self, x, axis, keep) if len(x.shape) < 4 else self.sum_as_matmul(x, axis, 0.0)


def bias_sums_doubled(self, x, axis, keep=True):  # every sum over rows (the bias and norm gradients) x2
    return ORIGINAL_SUM(self, x, axis, keep) if axis != 0 else self.reshape(self.sum_as_matmul(x, 0, 2.0), [x.shape[1]])


ORIGINAL_SUM = hg.MILOps.sum
GATE_CFG = hg.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128)


@pytest.mark.slow  # the self-check's stage thrice (the programs' own gradients: tests/test_coreml.py)
@pytest.mark.parametrize('mutation', [None, row_sum_dropped, bias_sums_doubled])
def test_the_gradient_gate_catches_what_a_whole_tensor_cosine_misses(mutation, monkeypatch, tmp_path):
    # The self-check's gate (ane_check.gradients, judge_gradients) on programs with a defect, in the NumPy
    # evaluator's ANE mode (its default tables' errors), against fp64 autograd. The old gate
    # (worst cosine of whole tensors >= 0.999, c_attn's bias left out) passed both defects:
    # the row sum dropped leaves the q and k thirds of c_attn wrong, 1% of the tensor's norm;
    # doubled sums leave every direction right. The new gate fails both, passes the programs as they are.
    from tools import ane_check
    if mutation:
        monkeypatch.setattr(hg.MILOps, 'sum', mutation)
    path = str(tmp_path / 'p')
    export_ane.export_programs(GATE_CFG, 2, 16, path)
    monkeypatch.setattr(hg.MILOps, 'sum', ORIGINAL_SUM)
    ctx = dict(cfg=GATE_CFG.__dict__, B=2, T=16, out=path)
    _, grads, _, ref, _ = ane_check.gradient_pair(ctx)
    old = min(torch.nn.functional.cosine_similarity(grads[k].double().flatten(), r.flatten(), dim=0).item()
              for k, r in ref.items() if not k.endswith('attn.c_attn.bias'))
    res = ane_check.judge_gradients(grads, ref)
    assert old >= 0.999 and res['passed'] == (mutation is None), (old, res)
    assert set(res['per_layer']) == {'other', 'h0', 'h1'}
    if mutation is row_sum_dropped:  # q and k thirds, in every layer
        assert {f'transformer.h.{l}.attn.c_attn.weight[{c}]' for l in (0, 1) for c in 'qk'} <= set(res['failures'])
    if mutation is bias_sums_doubled:  # the norm ratio, at 2 (fp16 rounding aside: the tolerance is 2%)
        assert abs(res['worst_norm_ratio'] - 2) < 0.02 and res['worst_cosine'] >= 0.999


def gate_context(path):
    """The self-check's gradient stage at GATE_CFG, 2 x 16 tokens, on programs exported to path."""
    export_ane.export_programs(GATE_CFG, 2, 16, path)
    return dict(cfg=GATE_CFG.__dict__, B=2, T=16, out=path)


# (variable, value) beside the defaults: the switches whose value on a Mac is known
# (M1: knots, flushing matmul, NaN as the engine makes it) or that bound what is not
M1_AND_OTHERS = [(), (('MACOS_DOUBLE_ANE_LUT', 'hash'),), (('MACOS_DOUBLE_ANE_SUBNORMALS', 'keep'),),
                 (('MACOS_DOUBLE_ANE_SUBNORMALS', 'all'),), (('MACOS_DOUBLE_ANE_NAN', 'ieee'),),
                 (('MACOS_DOUBLE_ANE_LUT_BIAS', str(2.0 ** -9)),)]
SWITCH_IDS = [','.join(f'{k[16:]}={v}' for k, v in s) or 'defaults' for s in M1_AND_OTHERS]


@pytest.mark.parametrize('switches', M1_AND_OTHERS, ids=SWITCH_IDS)
def test_the_gradient_gate_passes_under_the_ane_switches(switches, monkeypatch, tmp_path):
    # The programs as they are, in the ANE mode at its default tables (2^-10), pass the
    # self-check's gate under every switch: M1's defaults, each alternative, and a bias of
    # 2^-9 on every table at once (1.95e-3: above both measured origin biases, gelu's 5.4e-4
    # and swish's 1.26e-3; the gate fails at 2^-8, benchmarks/lut_margins.py).
    from tools import ane_check
    for k, v in switches:
        monkeypatch.setenv(k, v)
    _, grads, _, ref, _ = ane_check.gradient_pair(gate_context(str(tmp_path / 'p')))
    res = ane_check.judge_gradients(grads, ref)
    assert res['passed'], res


# The smallest size 2^-k at which the gate may fail, by error model: measured first failures
# (benchmarks/lut_margins.py --model small; docs/coreml_and_ane.md, "Lookup tables") are
# 2^-5 hashed, 2^-7 between knots and 2^-8 for a bias on every table at once.
MARGIN = {'hash': 2.0 ** -5, 'knots': 2.0 ** -7, 'bias': 2.0 ** -8}


@pytest.mark.slow
@pytest.mark.parametrize('error', list(MARGIN))
def test_lookup_table_margin(error, monkeypatch, tmp_path):
    # How large each table's error (one function inexact at a time, then all five) may grow
    # before the self-check's gate fails, at GATE_CFG: hashed per input, smooth between knots
    # (the default), or a bias of one sign beside the hashed 2^-10. Every function passes at
    # 2^-9, twice the evaluator's 2^-10 and four times the published half ulp (2^-11).
    from tools import ane_check
    ctx = gate_context(str(tmp_path / 'p'))
    _, _, _, ref, _ = ane_check.gradient_pair(dict(ctx, lut={}))
    monkeypatch.setenv('MACOS_DOUBLE_ANE_LUT', 'knots' if error == 'knots' else 'hash')
    first = {}
    for fn in [*programs.LUT_ERROR, 'all']:
        names = list(programs.LUT_ERROR) if fn == 'all' else [fn]
        for e in [2.0 ** -k for k in range(9, 0, -1)]:
            monkeypatch.setenv('MACOS_DOUBLE_ANE_LUT_BIAS', str(e) if error == 'bias' else '0')
            lut = dict.fromkeys(names, 2.0 ** -10 if error == 'bias' else e)
            if not ane_check.judge_gradients(ane_check.gradient_pair(dict(ctx, lut=lut))[1], ref)['passed']:
                first[fn] = e
                break
    print(f'{error}: first failing size per table:', first)
    assert all(e >= MARGIN[error] for e in first.values()) and 'rsqrt' in first and 'all' in first


@pytest.mark.parametrize('shape', ['knots', 'hash'])
def test_the_ane_modes_tables_are_inexact_by_default(shape, monkeypatch):
    # exp, log, tanh, rsqrt and softmax in the ANE mode: by default each result is off by a
    # relative error up to programs.LUT_ERROR (2^-10), the same for the same input, under
    # either error model (knots, the default, or hashed), plus fp16's
    # roundings (u = 2^-11): the function's own value_inference rounds up to twice (rsqrt is
    # 1/sqrt, softmax exp/sum), the perturbed value once more; with lut={} only the function's
    # own are left. Inputs: 4096 fp16 values.
    monkeypatch.setenv('MACOS_DOUBLE_ANE_LUT', shape)
    x = np.linspace(1.5, 6, 4096).astype(np.float16).reshape(64, 64)  # (log: away from 1, where it is 0)
    exact = dict(exp=np.exp, log=np.log, tanh=np.tanh, rsqrt=lambda v: 1 / np.sqrt(v),
                 softmax=lambda v: np.exp(v) / np.exp(v).sum(-1, keepdims=True))
    for name, f in exact.items():
        prog = hg.mil_program(lambda o, x: {'y': getattr(o, name)(x, -1) if name == 'softmax' else getattr(o, name)(x)},
                              {'x': x.shape})
        ref = f(x.astype(np.float64))
        rel = {k: np.abs(programs.numpy_predict(prog, ane=True, lut=lut)({'x': x})['y'] / ref - 1)
               for k, lut in (('default', None), ('exact', {}))}
        assert rel['exact'].max() <= 2 * 2.0 ** -11 * 1.01, name
        assert 2 * 2.0 ** -11 < rel['default'].max() <= programs.LUT_ERROR[name] + 3 * 2.0 ** -11 * 1.01, name
        assert np.array_equal(*(programs.numpy_predict(prog, ane=True)({'x': x})['y'] for _ in range(2)))


LOADS = """
import json, time, coremltools as ct
from plumbing import programs
lines = []
log = lambda s: lines.append([time.monotonic(), s])
started = []
def load(compiled):  # Core ML's load, after the line is out
    started.append(time.monotonic())
    return ct.models.CompiledMLModel(compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
rounds = []
for _ in range(2):
    for piece in ('block_forward', 'head', 'block_backward'):
        programs.load_compiled('p', piece, load, log)
    rounds.append({p: t for p, (t, _) in programs.LOADED.items()})
print(json.dumps(dict(lines=lines, started=started, rounds=rounds)))
"""


@pytest.mark.slow  # three slow loads under the double
def test_each_load_says_which_program_and_what_to_expect(exported, tmp_path):
    # Under the macOS double, each Neural Engine load (the ANE's compile) takes
    # MACOS_DOUBLE_LOAD_SECONDS = 0.5 s. Before each, one line names the program, its place
    # among the folder's three, and the time to expect: the notes' estimate the first time,
    # the last load's own time after.
    import json
    import os
    import shutil
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(exported(**helpers.PROGRAMS), tmp_path / 'p')
    env = dict(os.environ, HETERO_MACOS_DOUBLE='1', MACOS_DOUBLE_LOAD_SECONDS='0.5',
               PYTHONPATH=os.pathsep.join([os.path.join(root, 'tests', 'macos_double'), root]))
    r = subprocess.run([sys.executable, '-c', LOADS], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    said = [s for _, s in out['lines']]
    order = ('block_forward', 'head', 'block_backward')
    where = {p: f"loading {p} onto the Neural Engine, {hg.ANE_PIECES.index(p) + 1} of 3: "
             for p in order}
    assert said[:3] == [where[p] + programs.LOAD_ESTIMATE for p in order], said
    last = out['rounds'][0]
    assert said[3:] == [where[p] + f"its last load here took {last[p]:.1f} s" for p in order], said
    assert all(t < s for (t, _), s in zip(out['lines'], out['started']))  # said before it waits
    assert all(t >= 0.5 for r in out['rounds'] for t in r.values())
