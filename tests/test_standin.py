"""tools/fast_standin.py, the stand-in's fast paths: each fused piece and the whole step against
fp64 autograd (CPU, at test_grads.py's bounds), the padded LM head, the CUDA graph, the engine
on a second GPU and each attention kernel (skipped without CUDA, as in CI; on a GPU machine:
python -m pytest -q tests/test_standin.py). And the reference without it: a copy of the
project with the file deleted still trains in every mode and passes every other test."""
import fnmatch
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import hetero_gpt as hg
import helpers
import test_grads as tg
from tools import gradcheck

standin = pytest.importorskip('tools.fast_standin')  # absent in the copy made by copy_without_standin
FusedOps = standin.FusedOps
CFG = hg.GPTConfig(block_size=32, vocab_size=20000, n_layer=2, n_head=2, n_embd=32)  # 2 vocab chunks
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # (torch.compile on the CPU: 6 s)
def test_compiled_derivation_matches_autograd():
    # --compile runs the same derivation through torch.compile (standin.CompiledOps): fused
    # kernels reorder fp32 sums, so it is held to the fp32 bound against fp64 autograd.
    # Each compiled piece must be one graph: a graph break splits it into eager parts
    case = tg.CONFIGS[0]
    params, idx, targets, ref_loss, ref = tg.autograd_reference(case['cfg'], case['B'], case['T'])
    w = {k: v.detach().float() for k, v in params.items()}
    torch._dynamo.utils.counters.clear()
    o = standin.CompiledOps(torch.float32, 'cpu')
    for _ in range(2):  # a second call with a new backend object of the same kind: no recompile
        loss, grads = hg.eager_loss_and_grads(o, case['cfg'], w, idx, targets, 1.0)
        o = standin.CompiledOps(torch.float32, 'cpu')
    assert not torch._dynamo.utils.counters['graph_break'], dict(torch._dynamo.utils.counters['graph_break'])
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] <= 4, dict(torch._dynamo.utils.counters['stats'])
    assert abs(loss.item() - ref_loss) / ref_loss < tg.TOL[torch.float32]
    worst = max((tg.rel_err(grads[k], ref[k]), k) for k in ref)
    assert worst[0] <= tg.TOL[torch.float32], worst
    assert not (bad := gradcheck.check(grads, ref, torch.float32)), bad  # each q/k/v third too


# ---- each fused piece at the derivation's own fp64 bound (test_grads.check_*)

def test_fused_pieces():
    tg.check_linear(FusedOps)
    for bias in (True, False):
        tg.check_layernorm(FusedOps, bias)
        tg.check_qkv(FusedOps, bias)
    tg.check_gelu(FusedOps)
    tg.check_attention(FusedOps, 2, 5, 3)
    tg.check_attention(FusedOps, 1, 8, 1)
    tg.check_logsumexp(FusedOps)  # can fail: its +1000 offset overflows without the max
    tg.check_lm_head_loss(FusedOps, 0)
    tg.check_lm_head_loss(FusedOps, 5)


@pytest.mark.parametrize('case', [tg.CONFIGS[0], tg.CONFIGS[2]], ids=[tg.IDS[0], tg.IDS[2]])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fused_kernels_model_grads(dtype, case):
    # --fused_kernels: the same step with attention, layernorm, GELU, the bias adds, the
    # stacked QKV matmul and log-sum-exp by PyTorch's fused kernels, every gradient against
    # fp64 autograd at the same bounds as the derivation's own ops (test_grads.model_check:
    # each element in fp64/fp32, each tensor and q/k/v third by direction and size in all;
    # with biases, and without: bias=False); bf16 at gradcheck's bf16 bounds
    assert not (bad := tg.model_check(case, dtype, ops=FusedOps)), bad


def test_classes_are_passed_not_swapped_in():
    # the run's classes come from the flags, and the reference's stay its own
    cpu = torch.device('cpu')
    cfg, _ = hg.parse_args(['--fused_kernels'], cls=standin.FastConfig)
    c = standin.classes(cfg)
    assert (c.model, c.step) == (standin.PaddedHeadGPT, standin.NoWaitStep) and hg.Classes().model is hg.GPT
    eng = c.eager_engine(CFG, cpu, torch.float32, hg.LossScaler(1.0, 0, enabled=False))
    assert isinstance(eng, standin.FastEagerEngine) and isinstance(eng.ops, FusedOps) and 'fused' in eng.label
    assert eng.stream is None and not eng.use_graph
    plain = standin.FastEagerEngine(CFG, cpu, torch.float32, hg.LossScaler(1.0, 0, enabled=False))
    assert type(plain.ops) is hg.TorchOps and 'fused' not in plain.label


@pytest.mark.parametrize('kind', ['fused', 'unfused', 'resumed unfused'])
def test_no_wait_step_skips_a_nonfinite_update_on_the_device(kind):
    # fused AdamW: the flag stays on the device until the update is queued, and AdamW skips by
    # it. Another AdamW, or a fused one resumed from an unfused one's checkpoint (load_state_dict
    # keeps the saved fused=False; it takes no found_inf): the reference's step, the host reads first
    def adamw(params, fused):
        opt = torch.optim.AdamW(params, fused=kind != 'unfused')
        if kind == 'resumed unfused':
            opt.load_state_dict(torch.optim.AdamW(opt.param_groups[0]['params'], fused=False).state_dict())
        return opt
    helpers.lone_gpu_skips_a_nonfinite_update(standin.NoWaitStep, adamw, None, read_before=kind != 'fused')


def test_padded_head_gives_gpt2s_loss_and_gradients():
    # the LM head on 20032 rows (20000 padded to a multiple of 64, -inf bias on the padding):
    # the same loss and gradients as the plain head, in fp64 to its rounding (a different
    # summation order over the padded vocabulary: 1e-12 relative)
    torch.manual_seed(0)
    plain = hg.GPT(CFG).double()
    padded = standin.PaddedHeadGPT(CFG).double()
    padded.load_state_dict(plain.state_dict())
    idx, targets = (torch.randint(0, CFG.vocab_size, (2, CFG.block_size)) for _ in range(2))
    (logits_a, a), (logits_b, b) = plain(idx, targets), padded(idx, targets)
    a.backward()
    b.backward()
    assert padded.pad == 32 and logits_b.shape == logits_a.shape and abs(a.item() - b.item()) <= 1e-12 * a.item()
    for (k, p), q in zip(plain.named_parameters(), padded.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14), k


# ---- without fast_standin.py

def project_files(folder, names):
    """shutil.copytree's ignore: what a checkout, an archive's user or a run adds to the project
    (as .gitignore lists it: git, environments, caches, data, runs), and tools/fast_standin.py."""
    top = os.path.samefile(folder, ROOT)
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in IGNORED) or top and fnmatch.fnmatch(n, 'out*')
            or top and n == 'data' or os.path.join(folder, n) == os.path.join(ROOT, 'tools', 'fast_standin.py')]


IGNORED = ('.git', '.venv', 'venv-*', '.pytest_cache', '.bench', '__pycache__', '*.pyc', '*.mlpackage')


def copy_without_standin(dest):
    """The project's files, tools/fast_standin.py left out, in dest (a git checkout or not)."""
    shutil.copytree(ROOT, dest, ignore=project_files, dirs_exist_ok=True)
    with open(dest / 'tiny.txt', 'w') as f:
        f.write('\n'.join(f"line {i} of the king and the queen" for i in range(300)))
    env = dict(os.environ, HETERO_WITHOUT_STANDIN='1', PYTHONPATH=str(dest))
    return lambda *cmd: subprocess.run([sys.executable, *cmd], cwd=dest, env=env, capture_output=True, text=True)


WITHOUT = """
import importlib.util, json, bench, hetero_gpt as hg, prepare_data
assert importlib.util.find_spec('tools.fast_standin') is None
prepare_data.prepare('tiny', data_dir='data', input_path='tiny.txt')
tiny = ['--dataset', 'tiny', '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '16', '--device', 'cpu',
        '--max_iters', '3', '--eval_iters', '1', '--sample_tokens', '0', '--quiet', '--ane_worker', 'false']
for mode in ('gpu', 'ane', 'hetero'):  # (hetero: half each, not a split that timings decide)
    hg.main(tiny + ['--mode', mode, '--out_dir', 'out_' + mode] + (['--ane_fraction', '0.5'] if mode == 'hetero' else []))
try:
    hg.main(tiny + ['--fast', '--out_dir', 'out_fast'], job=bench.bench, cls=bench.BenchConfig)
except SystemExit as e:
    print('bench --fast', e.code)
"""


def test_every_mode_trains_without_standin(tmp_path):
    # a copy of the project without tools/fast_standin.py: every mode trains there (the
    # reference's own classes, the eager derivation for the ANE's share), logged each step it
    # should be, the same training as the GPU engine's alone: the step's gradient norm within
    # fp16's 2% (gradcheck's bound; the stand-in is fp16), its loss within 1e-2 (test_grads'),
    # and after 3 updates (each ~1e-4 of a weight) the validation loss within 1e-4 (measured
    # 3e-7; a mode that did not update is 6e-4 off). bench.py --fast says what it lacks
    run = copy_without_standin(tmp_path)
    r = run('-c', WITHOUT)
    assert r.returncode == 0 and 'Traceback' not in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    gpu = helpers.rows(tmp_path / 'out_gpu')[0]
    for mode in ('gpu', 'ane', 'hetero'):
        rows = helpers.rows(tmp_path / f'out_{mode}')
        assert [row['step'] for row in rows] == [3] and rows[0]['mode'] == mode, rows
        assert rows[0]['ane_microbatches'] == {'gpu': 0, 'ane': 2, 'hetero': 1}[mode]
        assert abs(rows[0]['grad_norm'] / gpu['grad_norm'] - 1) <= 0.02 and abs(rows[0]['loss'] / gpu['loss'] - 1) <= 1e-2
        assert abs(rows[0]['val_loss'] / gpu['val_loss'] - 1) <= 1e-4, (rows[0], gpu)
    assert 'the ANE engine is the eager derivation on cpu (float16)' in r.stdout and 'fused' not in r.stdout
    assert 'bench --fast 2' in r.stdout and 'needs tools/fast_standin.py' in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get('HETERO_WITHOUT_STANDIN') == '1', reason="already the copy without it")
def test_every_test_passes_without_standin(tmp_path):
    # the same copy: every mode trains there from the command line, and every other test
    # passes (this file's own are skipped)
    run = copy_without_standin(tmp_path)
    assert run('prepare_data.py', '--input', 'tiny.txt').returncode == 0
    tiny = ['--dataset', 'tiny', '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '16',
            '--max_iters', '3', '--eval_iters', '1', '--sample_tokens', '0', '--quiet']
    for mode in ('gpu', 'ane', 'hetero'):
        r = run('hetero_gpt.py', *tiny, '--mode', mode, '--out_dir', f'out_{mode}')
        assert r.returncode == 0 and re.search(r'step 3/3, loss [\d.]+, val [\d.]+', r.stdout), \
            (mode, r.stdout[-1000:], r.stderr[-2000:])
    r = run('bench.py', *tiny, '--fast', '--out_dir', 'out_fast')
    assert r.returncode == 2 and 'needs tools/fast_standin.py' in r.stderr, r.stderr[-2000:]
    # (the ANE programs at GPT-2's real shapes, and the Mac path, whose ANE engine is Core ML,
    # never reach an engine the fast file could serve: not twice)
    r = run('-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m', 'not slow', '--ignore', 'tests/test_macos.py')
    assert r.returncode == 0 and ' passed' in r.stdout and 'failed' not in r.stdout, r.stdout[-3000:]


# ---- CUDA

def model_and_batches(device, n, B=2, seed=0):
    torch.manual_seed(seed)
    model = hg.GPT(CFG).to(device)
    mbs = [(torch.randint(0, CFG.vocab_size, (B, CFG.block_size)),
            torch.randint(0, CFG.vocab_size, (B, CFG.block_size))) for _ in range(n)]
    return model, mbs


def close(a, b, rel):
    return (a - b).abs().max() <= rel * b.abs().max()


@pytest.fixture(autouse=True)
def fp32_matmuls():
    """fp32 means fp32 here: a CUDA run of the trainer earlier in this process (hg.setup) turned on
    TF32, whose matmuls keep 10 bits (unit roundoff 4.9e-4, fp16's), past the fp32 bounds below."""
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    before = [f.allow_tf32 for f in flags]
    for f in flags:
        f.allow_tf32 = False
    yield
    for f, b in zip(flags, before):
        f.allow_tf32 = b


@cuda
@pytest.mark.parametrize('fused', [False, True], ids=['derivation', 'fused kernels'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_cuda_graph_replays_the_eager_step(dtype, fused):
    # the engine's graph against the eager derivation on the same weights and batch, for
    # two batches, two loss scales (a new scale: a new graph) and weights changed between
    # steps (the graph reads them from its buffers, so a new load_weights must show). Same
    # kernels on the same data: fp32 to 1e-5 of the largest element (cuBLAS may pick
    # another algorithm outside the capture), fp16 to 1e-2 (fp16 rounding over a few sums).
    dev = torch.device('cuda')
    model, mbs = model_and_batches(dev, 2)
    eng = standin.FastEagerEngine(CFG, dev, dtype, hg.LossScaler(8.0, 1000), fused_kernels=fused)
    params = dict(model.named_parameters())
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    for step, scale in enumerate((8.0, 64.0)):
        eng.scaler.scale = scale
        eng.load_weights(params)
        with eng.running():
            outs = [eng.loss_and_grads(x, y) for x, y in mbs]  # the caller's own: the 2nd replay leaves the 1st
        assert eng.graph is not None and eng.graph_key == ((2, CFG.block_size), scale)
        for (x, y), (l, g) in zip(mbs, outs):
            ref_l, ref_g = tg.manual_loss_and_grads(params, x, y, n_head=CFG.n_head, dtype=dtype, device=dev,
                                                    loss_scale=scale, ops=FusedOps if fused else hg.TorchOps)
            assert close(l, ref_l, rel), (step, l, ref_l)
            for k in ref_g:
                assert close(g[k], ref_g[k], rel), (step, k)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=cuda)])
def test_a_step_that_cannot_be_captured_runs_op_by_op(device, monkeypatch, capsys):
    # a capture that runs out of memory (on CUDA: raised inside the captured step, so the
    # capture itself ends cleanly; on the CPU, where the engine captures nothing, by the
    # capture): one line says so, and the engine runs the eager step instead, from then on,
    # the derivation's own result (same kernels on the same data: fp32 to 1e-5 of the largest element)
    dev = torch.device(device)
    model, [(x, y)] = model_and_batches(dev, 1)
    params = dict(model.named_parameters())
    eng = standin.FastEagerEngine(CFG, dev, torch.float32, hg.LossScaler(1.0, 0, enabled=False))
    if device == 'cpu':
        def capture(shape, scale):
            raise torch.cuda.OutOfMemoryError('out of memory (test)')
        eng.use_graph, eng.capture = True, capture
    else:
        real = hg.eager_loss_and_grads

        def out_of_memory_while_captured(*a):
            if torch.cuda.is_current_stream_capturing():
                raise torch.cuda.OutOfMemoryError('out of memory (test)')
            return real(*a)
        monkeypatch.setattr(hg, 'eager_loss_and_grads', out_of_memory_while_captured)
    eng.load_weights(params)
    ref_l, ref_g = tg.manual_loss_and_grads(params, x, y, n_head=CFG.n_head, dtype=torch.float32, device=dev)
    for _ in range(2):  # (the second: op by op again, no capture tried)
        with eng.running():
            l, g = eng.loss_and_grads(x, y)
        assert close(l, ref_l, 1e-5) and all(close(g[k], ref_g[k], 1e-5) for k in ref_g)
        assert not eng.use_graph and eng.graph is None
    said = capsys.readouterr().out
    assert said.count('CUDA graph capture failed') == 1 and 'running the step op by op' in said, said
    if device == 'cuda':  # the device as it was: random numbers, and the allocator out of capture
        assert torch.rand(1000, device=dev).std() > 0.2
        torch.cuda.empty_cache()


@two_gpus
def test_engine_on_a_second_gpu_gives_the_one_gpu_step():
    # autograd on cuda:0 and the eager derivation (fp32, CUDA graph) on cuda:1, half of the
    # microbatches each, against autograd alone on cuda:0: the same averaged gradient, to
    # fp32 rounding over the two paths' different sums (1e-4 of the largest element)
    a, mbs = model_and_batches('cuda:0', 4)
    b, _ = model_and_batches('cuda:0', 4)
    d0, d1 = torch.device('cuda:0'), torch.device('cuda:1')
    het = hg.HeteroStep(a, {'gpu': hg.AutogradEngine(a, d0, torch.float32),
                            'ane': standin.FastEagerEngine(CFG, d1, torch.float32,
                                                           hg.LossScaler(1.0, 0, enabled=False))}, hg.Split(4, 0.5))
    one = hg.HeteroStep(b, {'gpu': hg.AutogradEngine(b, d0, torch.float32)}, hg.Split(4, 0))
    for step in range(2):  # the second step reuses the engine's buffers and graph
        out_h, out_1 = het(mbs), one(mbs)
        assert out_h.used == ['ane', 'gpu'] and abs(out_h.loss - out_1.loss) < 1e-5 * out_1.loss
        for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert pa.grad.device == d0 and close(pa.grad, pb.grad, 1e-4), (step, k)
        for m in (a, b):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            m.zero_grad(set_to_none=True)


KERNELS = {'flash': SDPBackend.FLASH_ATTENTION, 'efficient': SDPBackend.EFFICIENT_ATTENTION,
           'cudnn': SDPBackend.CUDNN_ATTENTION}


@cuda
@pytest.mark.parametrize('dtype,kernel', [(torch.float32, 'efficient')] + [
    (d, k) for d in (torch.bfloat16, torch.float16) for k in ('flash', 'efficient', 'cudnn')])
def test_fused_kernels_on_cuda(dtype, kernel):
    # the CUDA kernels (each attention kernel pair that scaled_dot_product_attention may
    # pick, forced here one at a time; layernorm, GELU, log-sum-exp, the bias add in the
    # matmul) inside the whole step, against fp64 autograd on the CPU: fp32 at its bound
    # of test_grads.py (1e-4 of each tensor's largest element; fp32 matmuls, not TF32), and
    # every dtype at gradcheck's bounds for it, each tensor and q/k/v third by direction and size
    q = torch.randn(2, CFG.n_head, CFG.block_size, CFG.n_embd // CFG.n_head, dtype=dtype, device='cuda',
                    requires_grad=True)
    with sdpa_kernel([KERNELS[kernel]]):
        try:  # with only that kernel allowed, the dispatcher raises where it cannot run
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        except RuntimeError:
            pytest.skip(f"{kernel} attention does not take these {dtype} tensors on this GPU")
    model, [(x, y)] = model_and_batches('cpu', 1)
    model = model.double()
    _, loss = model(x, y)
    loss.backward()
    params = {k: p.detach() for k, p in model.named_parameters()}
    scale = 1024.0 if dtype == torch.float16 else 1.0
    with sdpa_kernel([KERNELS[kernel]]):  # only that kernel pair: the fp64 reference above ran outside
        l, g = tg.manual_loss_and_grads(params, x, y, n_head=CFG.n_head, dtype=dtype, device='cuda',
                                        loss_scale=scale, ops=FusedOps)
    assert abs(l.item() - loss.item()) < 1e-2 * loss.item()
    ref, got = {k: p.grad for k, p in model.named_parameters()}, {k: v.double().cpu() for k, v in g.items()}
    for k in ref:
        assert torch.isfinite(got[k]).all() and (dtype != torch.float32 or close(got[k], ref[k], 1e-4)), k
    assert not (bad := gradcheck.check(got, ref, dtype)), bad
