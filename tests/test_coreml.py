"""The Core ML programs, built and saved on Linux, read back from disk and evaluated op by
op in NumPy in their own precision (fp16), chained as on a Mac, against fp64 autograd."""
import json
import os
import shutil

import coremltools  # noqa: F401  (a test requirement: requirements.txt)
import numpy as np
import pytest
import torch

import export_ane
import hetero_gpt as hg
import helpers
from plumbing import programs as coreml_programs
from plumbing import settings
from tools import ane_check, gradcheck

# vocabulary 20000 > 16384: two chunks; T = 7: not a power of two; 4 heads
CFG = hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=32)
B, T = 3, 7


@pytest.fixture(scope='module')
def package(exported):
    """The three programs: {'pieces': folder, 'reports': {'pieces': their reports}}."""
    return {'pieces': exported(CFG, B, T), 'reports': {'pieces': exported.reports[exported(CFG, B, T)]}}


@pytest.fixture(scope='module')
def whole_step(exported):
    """The whole step as one program (export_ane.py --whole_step, to compare): (folder, reports)."""
    path = exported(CFG, B, T, whole_step=True)
    return path, exported.reports[path]


def reference(seed=0, b=B):
    """A GPT (fp64), a batch of b sequences, and fp64 autograd's loss; model.grads: its gradients."""
    torch.manual_seed(seed)
    model = hg.GPT(CFG).double()
    idx, targets = (torch.randint(0, CFG.vocab_size, (b, T)) for _ in range(2))
    loss, model.grads = helpers.autograd_fp64(model, idx, targets)
    return model, idx, targets, loss


@pytest.mark.parametrize('kind', ['pieces', pytest.param('step', marks=pytest.mark.slow)])
def test_saved_programs_match_autograd(request, kind):
    # fp16 programs (unit roundoff 4.9e-4): the loss, a mean of log-sum-exps of ~10, within
    # 1e-2 relative; every gradient, and each q/k/v third of c_attn, by direction and size
    # (gradcheck's fp16 bounds), all finite. The engine's microbatch is 3 sequences; it takes 6
    # as two calls, the mean of the two (their sum would be twice the norm).
    model, idx, targets, ref_loss = reference(b=2 * B)
    path = request.getfixturevalue('package')['pieces'] if kind == 'pieces' else request.getfixturevalue('whole_step')[0]
    engine = helpers.open_programs(path, scaler=hg.LossScaler(1024.0, 0))
    assert engine.pieces == ((kind,) if kind == 'step' else hg.ANE_PIECES)
    engine.load_weights(dict(model.named_parameters()))
    loss, grads = engine.loss_and_grads(idx, targets)
    assert abs(loss.item() - ref_loss) / ref_loss < 1e-2
    assert hg.grads_finite(grads)
    assert {k: g.shape for k, g in grads.items()} == {k: p.shape for k, p in model.named_parameters()}
    assert not (bad := gradcheck.check(grads, model.grads, torch.float16)), bad


def fp64_pieces(cfg, b, t):
    """predict(piece, inputs) -> outputs in fp64: each piece's derivation (run_piece, what its
    program records) on TorchOps, where the saved programs compute in fp16."""
    ops = hg.TorchOps(torch.float64, torch.device('cpu'))

    def predict(piece, inputs):
        inp = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in inputs.items()}
        return {k: v.numpy() for k, v in hg.run_piece(ops, cfg, b, t, piece, inp).items()}
    return predict


def test_the_engines_own_work_gives_autograds_gradients_to_fp32_rounding():
    # the Core ML engine's work around its programs (weights into its fp32 buffers, embeddings,
    # the chain of calls, the gradients' scatter, join and unscaling, the mean over its calls)
    # with the programs evaluated in fp64: 6 sequences as two calls of 3 against fp64 autograd.
    # What is left is fp32's rounding (2^-24) of the buffers between the programs and of the
    # outputs, a few roundings an element: measured 1.1e-7 of each tensor's largest element at
    # worst, bound 1e-6. One gradient off by 0.1% (1e-3) fails it, as would the sum of the
    # calls for their mean (2x)
    model, idx, targets, ref_loss = reference(b=2 * B)
    engine = hg.CoreMLEngine(CFG, B, T, fp64_pieces(CFG, B, T), scaler=hg.LossScaler(1024.0, 0))
    engine.load_weights(dict(model.named_parameters()))
    loss, grads = engine.loss_and_grads(idx, targets)
    assert abs(loss.item() - ref_loss) <= 1e-6 * ref_loss
    assert grads.keys() == model.grads.keys()
    for k, g in model.grads.items():
        assert (grads[k].double() - g).abs().max() <= 1e-6 * g.abs().max(), k


def test_programs_are_ane_shaped(package):
    reports = package['reports']['pieces']
    for piece, r in reports.items():
        assert r['off_ane'] == [], piece
        assert not set(r['op_types']) & {'gather', 'gather_nd', 'one_hot', 'scatter', 'scatter_nd', 'gelu'}
        assert r['op_types'].get('concat', 0) <= 1  # only the peaks vector's (the derivation has none)
        assert r['largest_dim'] <= hg.ANE_MAX_DIM and r['max_rank'] <= 5
        # the sums and means are matmuls with a constant vector (the ANE's reduce_sum is fp16)
        assert not {'reduce_sum', 'reduce_mean'} & set(r['op_types']) and 0 < r['sum_flops'] < 0.05 * r['matmul_flops']
        # fp16 in and out: 2 bytes per element of every input and output
        shapes = hg.piece_input_shapes(CFG, B, T, piece)
        assert r['bytes_in'] == 2 * sum(int(np.prod(s)) for s in shapes.values())
        # live memory, counted here op by op: at least what any one op reads and writes (all live
        # at once), less than every tensor of the program (each freed after its last reader)
        f = coreml_programs.load_coreml_program(coreml_programs.program_path(package['pieces'], piece)).functions['main']
        size = lambda v: 2 * int(np.prod(v.shape))
        touched = [{v.name: size(v) for v in op.outputs} | {u.name: size(u) for v in op.inputs.values()
                                                             for u in (v if isinstance(v, (list, tuple)) else [v])}
                   for op in f.operations]
        every = sum(size(v) for v in f.inputs.values()) + sum(size(v) for op in f.operations for v in op.outputs)
        assert max(sum(t.values()) for t in touched) <= r['live_bytes'] < every, piece
    head = coreml_programs.load_coreml_program(coreml_programs.program_path(package['pieces'], 'head')).functions['main']
    peaks = [int(np.prod(v.shape)) for v in head.outputs if v.name == 'peaks']
    outs = sum(int(np.prod(s)) for k, s in hg.piece_input_shapes(CFG, B, T, 'head').items() if k != 'loss_scale') + 1
    assert reports['head']['bytes_out'] == 2 * (outs + sum(peaks))  # a gradient per input but loss_scale; the loss; the peaks vector
    for piece, r in reports.items():  # the peaks: abs and reduce_max of each checked matmul result, no chain of maximum
        assert r['op_types'].get('maximum', 0) <= 2, piece  # (layernorm's floor on its row scale: one each)
    # every matmul of the derivation and nothing else: the analytic count, plus one forward of
    # each block (its backward recomputes it) but for the MLP's projection (2 N 4C C), whose
    # output the backward does not need (dead, removed). (The whole step as one program: the
    # analytic count alone, test_the_whole_step_is_the_analytic_count.)
    st = ane_check.step_report(reports, CFG, B, T)
    N, C = B * T, CFG.n_embd
    assert st['matmul_flops'] == st['analytic_matmul_flops'] + CFG.n_layer * (
        reports['block_forward']['matmul_flops'] - 8 * N * C * C)


@pytest.mark.slow
def test_the_whole_step_is_the_analytic_count(whole_step):
    whole = ane_check.step_report(whole_step[1], CFG, B, T)
    assert whole['matmul_flops'] == whole['analytic_matmul_flops'] and whole['calls'] == {'step': 1}
    assert whole_step[1]['step']['off_ane'] == []


def test_the_export_report(package, capsys):
    # what `python export_ane.py` prints after saving: a row per program (its calls per ANE
    # call, ops, GFLOP, MiB in, out, live, largest dimension, ops off the ANE), then the call's
    # totals against the analytic count
    reports = package['reports']['pieces']
    export_ane.print_report(reports, CFG, B, T)
    lines = capsys.readouterr().out.splitlines()
    st = ane_check.step_report(reports, CFG, B, T)
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    for piece, r in reports.items():
        assert rows[piece][1:3] == [str(st['calls'][piece]), str(r['ops'])] and rows[piece][-1] == 'none'
        assert rows[piece][-2] == str(r['largest_dim']) and float(rows[piece][3]) == round(r['flops'] / 1e9, 2)
    assert st['calls'] == {'block_forward': 2, 'head': 1, 'block_backward': 2}
    assert f"ratio {st['matmul_flops'] / st['analytic_matmul_flops']:.3f} (the block backward recomputes" in lines[5]
    assert lines[6].startswith(f"largest live memory {st['live_bytes'] / 2**20:.0f} MiB")


def test_flops_for_gpt2_124m_analytic_within_2_percent():
    # the analytic count for GPT-2 124M at B=4, T=1024 against the usual 6*N*params + attention:
    # params is GPT-2 124M's count without the position table, 123.65M as nanoGPT prints it,
    # attention 12*L*B*T^2*C (q k^T and P v, 2*2*B*T^2*C forward a layer, twice that backward)
    exact, estimate = ane_check.analytic_flops(hg.GPTConfig(), 4, 1024)
    assert estimate == 6 * 4 * 1024 * 123_653_376 + 12 * 12 * 4 * 1024 ** 2 * 768
    assert abs(exact / estimate - 1) < 0.02


@pytest.mark.parametrize('V', [128, 200])
def test_analytic_flops_are_autograds(V):
    # autograd's own matmuls, counted by PyTorch (FlopCounterMode, attention on its math path,
    # which keeps the whole T x T as the count does): the analytic count exactly; the programs'
    # LM head multiplies whole 64-row-aligned chunks, so a vocabulary of 200 costs 256 rows
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    cfg, b, t = hg.GPTConfig(block_size=16, vocab_size=V, n_layer=2, n_head=2, n_embd=32), 3, 16
    model = hg.GPT(cfg)
    idx, targets = (torch.randint(0, V, (b, t)) for _ in range(2))
    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as count:
        model(idx, targets)[1].backward()
    padding = hg.vocab_chunks(V)[0] * len(hg.vocab_chunks(V)[1]) - V
    assert ane_check.analytic_flops(cfg, b, t)[0] == count.get_total_flops() + 6 * b * t * padding * cfg.n_embd


def test_live_memory_estimate_by_hand():
    # y = (x * x) + x on a (4, 8) fp16 input (64 B a tensor): x and x*x live until the add,
    # whose result makes 3 x 64 B live; after it only the sum (then its identity, the output)
    prog = hg.mil_program(lambda _, x: {'y': x * x + x}, {'x': (4, 8)})
    assert coreml_programs.live_bytes(prog.functions['main']) == 3 * 64


def test_programs_past_the_ane_memory_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(coreml_programs, 'ANE_MEMORY', 2**20)  # 1 MiB: the tiny head's logits need more
    rc = export_ane.main(['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '64',
                          '--vocab_size', '500', '--ane_batch_size', '8', '--out', str(tmp_path / 'big')])
    err = capsys.readouterr().err
    assert rc == 2 and 'program head needs' in err and 'past the ANE' in err and not os.path.exists(tmp_path / 'big')


def test_programs_for_other_shapes_are_refused(package):
    engine = helpers.open_programs(package['pieces'], predict=lambda piece, inputs: pytest.fail('must not run'))
    engine.load_weights(dict(reference()[0].named_parameters()))
    for b, t in ((4, 7), (3, 8)):  # 4 is no multiple of the programs' 3 sequences; 8 tokens are not 7
        with pytest.raises(hg.UserError, match=f'cannot run a microbatch of {b}x{t}'):
            engine.loss_and_grads(torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long))


def test_weights_of_another_model_are_refused(package):
    engine = helpers.open_programs(package['pieces'], predict=lambda piece, inputs: pytest.fail('must not run'))
    other = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=64))
    with pytest.raises(hg.UserError, match='export_ane.py'):
        engine.load_weights(dict(other.named_parameters()))


def test_not_a_folder_of_programs(tmp_path, package):
    with pytest.raises(hg.UserError, match='no ANE programs'):
        helpers.open_programs(str(tmp_path / 'missing'))
    (tmp_path / 'junk').mkdir()
    with pytest.raises(hg.UserError, match='not a folder of HeteroEngine programs'):
        helpers.open_programs(str(tmp_path / 'junk'))
    half = tmp_path / 'half'
    shutil.copytree(package['pieces'], half)
    shutil.rmtree(half / 'head.mlpackage')
    with pytest.raises(hg.UserError, match='lacks head'):
        helpers.open_programs(str(half))
    meta = json.loads((half / coreml_programs.META).read_text())
    (half / coreml_programs.META).write_text(json.dumps(meta | {'format': 1}))
    with pytest.raises(hg.UserError, match='another version'):
        helpers.open_programs(str(half))
    with pytest.raises(hg.UserError, match='refusing to overwrite'):  # export never writes over what it did not make
        export_ane.export_programs(CFG, B, T, str(tmp_path / 'junk'))


def test_custom_predict_and_input_lifetime(package):
    # a test's own predict (here: the NumPy evaluator wrapped) receives each program's inputs
    # by name, in fp32 (which coremltools wraps without converting), in the engine's persistent
    # buffers (Core ML frees its inputs late: these are never freed under it), 2L + 1 calls
    seen = []
    evaluate = coreml_programs.numpy_programs(package['pieces'], hg.ANE_PIECES)

    def predict(piece, inputs):
        seen.append((piece, inputs))
        return evaluate(piece, inputs)
    engine = helpers.open_programs(package['pieces'], predict=predict)
    model, idx, targets, ref_loss = reference(1)
    engine.load_weights(dict(model.named_parameters()))
    engine.loss_and_grads(idx, targets)
    L = CFG.n_layer
    assert [p for p, _ in seen] == ['block_forward'] * L + ['head'] + ['block_backward'] * L
    buffers = [engine.dy, *engine.xs, *engine.inputs.values()]
    for piece, inputs in seen:
        assert set(inputs) == set(hg.piece_input_shapes(CFG, B, T, piece))
        assert all(v.dtype == np.float32 and any(v is b for b in buffers) for v in inputs.values())


def test_export_cli_refuses_too_many_tokens(tmp_path, capsys):
    rc = export_ane.main(['--n_layer', '1', '--n_head', '1', '--n_embd', '8', '--block_size', '1024',
                          '--vocab_size', '50', '--ane_batch_size', '17', '--out', str(tmp_path / 'x')])
    assert rc == 2 and 'at most 16384' in capsys.readouterr().err


def test_trainer_exports_once_and_reuses(tmp_path, monkeypatch):
    # what --mode ane/hetero does on macOS: export for the run's shapes, reuse them next time,
    # export again when the shapes change (that export, as the first, by export_programs: here
    # only its call is seen)
    said = []
    cfg, _ = hg.parse_args(['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '8',
                            '--vocab_size', '100', '--batch_size', '6', '--out_dir', str(tmp_path),
                            '--ane_evaluator', 'numpy'])
    cpu = torch.device('cpu')
    run = lambda cfg: settings.Run('ane', cpu, torch.float32, cpu, torch.float16, ane_in_worker=False, ane_programs=True,
                                   ane_batch_size=settings.ane_batch_size(cfg))

    def ensure_programs(cfg, log):
        hg.export_programs(cfg, run(cfg), log)
        return hg.ane_spec(cfg, run(cfg)).programs
    path = ensure_programs(cfg, log=said.append)
    assert path == str(tmp_path / 'ane_B3_T8')  # the largest divisor of 6 up to ANE_BATCH = 4
    spec = tmp_path / 'ane_B3_T8' / 'head.mlpackage' / 'Data' / 'com.apple.CoreML' / 'model.mlmodel'
    stamp = spec.stat().st_mtime_ns
    assert ensure_programs(cfg, log=said.append) == path and len(said) == 1
    assert spec.stat().st_mtime_ns == stamp
    assert helpers.open_programs(path).cfg.n_layer == 1
    exports = []
    monkeypatch.setattr(coreml_programs, 'export_programs', lambda *a: exports.append(a))
    cfg.n_layer = 2  # same folder name, other model: exported again
    assert ensure_programs(cfg, log=said.append) == path
    assert 'other shapes' in said[1] and [(a[0].n_layer, a[1:4]) for a in exports] == [(2, (3, 8, path))]
    cfg.ane_programs = path  # a folder the user names is never overwritten: its programs are n_layer 1's
    with pytest.raises(hg.UserError, match='other shapes'):
        ensure_programs(cfg, log=said.append)
    assert len(exports) == 1


@pytest.mark.slow
def test_a_folder_of_the_whole_step_is_taken_if_named(whole_step):
    # --ane_programs naming a folder of the whole step as one program (export_ane.py --whole_step)
    # for the run's shapes: taken as it is, not exported again; one the run did not name is
    # the trainer's own, made again as its three programs
    build = lambda *a: pytest.fail('not exported again')
    assert coreml_programs.ensure(whole_step[0], CFG, B, T, build, hg.ANE_PIECES, named=True) == whole_step[0]
    with pytest.raises(hg.UserError, match='other shapes'):
        coreml_programs.ensure(whole_step[0], CFG, B + 1, T, build, hg.ANE_PIECES, named=True)


def test_programs_without_biases(exported):
    # nanoGPT's bias=False: the programs have no bias inputs or outputs, and their fp16
    # gradients are fp64 autograd's to fp16 rounding (gradcheck's bounds, as above)
    cfg = hg.GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=16, bias=False)
    path = exported(cfg, 2, 5)
    names = {k for p in hg.ANE_PIECES for k in hg.piece_input_shapes(cfg, 2, 5, p)}
    assert not any(k.endswith('_b') or k in ('bq', 'bk', 'bv', 'bo', 'bfc', 'bpr') for k in names)
    assert {'wq', 'lnf_w', 'ln1_w'} <= names
    torch.manual_seed(0)
    model = hg.GPT(cfg).double()
    idx, targets = (torch.randint(0, cfg.vocab_size, (2, 5)) for _ in range(2))
    loss, ref = helpers.autograd_fp64(model, idx, targets)
    engine = helpers.open_programs(path, scaler=hg.LossScaler(1024.0, 0))
    engine.load_weights(dict(model.named_parameters()))
    l, grads = engine.loss_and_grads(idx, targets)
    assert abs(l.item() - loss) / loss < 1e-2
    assert set(grads) == {k for k, _ in model.named_parameters()}
    assert not (bad := gradcheck.check(grads, ref, torch.float16)), bad
