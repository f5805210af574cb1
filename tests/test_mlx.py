"""tools/mlx_engine.py, the GPU engine in MLX, on Linux with MLX's CPU backend (mlx[cpu]): one
block and the whole model against autograd, the gradients' layout and the fused-AdamW trap it
avoids, HeteroStep in gpu and hetero mode, three calling threads, bf16, the refusals, one trace,
the command line with --resume, and the reference without the file. Skipped without MLX.
What Linux cannot test (Metal, the zero-copy weights, the MPS ordering): docs/mlx.md section 8."""
import copy
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import hetero_gpt as hg
import helpers

os.environ.setdefault('MLX_ENABLE_TF32', '0')  # fp32 means fp32 on an M5's GPU too (mlx.md 6)
mx = pytest.importorskip('mlx.core')
me = pytest.importorskip('tools.mlx_engine')  # absent in the copy made without it
from plumbing import memory  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device('cpu')
# MLX's CPU backend multiplies with a reference BLAS: a small vocabulary keeps these fast
CFG = hg.GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=4, n_embd=64)


@pytest.fixture
def engines():
    """make(model, dtype): an MLXEngine, closed after the test (its MLX thread ended)."""
    made = []

    def make(model, dtype=torch.float32):
        made.append(me.MLXEngine(model, CPU, dtype))
        return made[-1]
    yield make
    for e in made:
        e.close()


def perturbed_model(cfg=CFG, seed=0):
    """GPT-2 at init plus noise, so that no gradient is special (zero biases, unit norms)."""
    torch.manual_seed(seed)
    model = hg.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(cfg=CFG, B=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g) for _ in range(2))


def worst(grads, ref):
    """The largest difference over all tensors, each relative to its own largest value, and
    the tensor: (error, name). A tensor whose true gradient is 0 (the key biases': softmax
    ignores a shift shared by a query's scores) is measured against the largest gradient."""
    top = max(r.abs().max().item() for r in ref.values())
    errs = []
    for k, r in ref.items():
        scale = max(r.abs().max().item(), 1e-6 * top)
        errs.append(((grads[k].double() - r.double()).abs().max().item() / scale, k))
    return max(errs)


# ---- numbers: MLX against autograd, fp32

def test_one_block_matches_autograd():
    # hetero_gpt.Block and mlx_engine.block on the same weights, x and upstream gradient dy:
    # d(x) and every weight's gradient. fp32 against fp32, sums of C = 64 to 4C = 256 terms in
    # a different order: ~1e-7 relative (measured 1.2e-7 and 7e-7); bounds 1e-6 and 1e-5
    torch.manual_seed(0)
    B, T, C, H = 4, 16, 64, 4
    blk = hg.Block(hg.GPTConfig(n_embd=C, n_head=H, block_size=T))
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(B, T, C, requires_grad=True)
    dy = torch.randn(B, T, C)
    (blk(x) * dy).sum().backward()
    p = {'transformer.h.0.' + k: mx.array(v.detach().numpy()) for k, v in blk.named_parameters()}

    def loss(p, x):
        return (me.block(p, x, 0, H, None) * mx.array(dy.numpy())).sum()
    gp, gx = mx.grad(loss, argnums=(0, 1))(p, mx.array(x.detach().numpy()))
    ref = {'transformer.h.0.' + k: v.grad for k, v in blk.named_parameters()} | {'x': x.grad}
    got = {k: torch.from_numpy(np.array(v)) for k, v in (gp | {'x': gx}).items()}
    assert worst({'x': got['x']}, {'x': ref['x']})[0] <= 1e-6
    assert worst(got, ref)[0] <= 1e-5, worst(got, ref)


@pytest.mark.parametrize('bias', [True, False])
def test_model_matches_autograd_and_hands_over_its_own_buffers(engines, bias):
    # the whole model, MLXEngine against fp64 autograd, and AutogradEngine's fp32 beside it:
    # fp32 rounding through 2 blocks and a 512-way softmax, ~1e-6 relative (measured: MLX
    # 1.5e-6, torch 1.2e-6); bound 1e-5 for each tensor, 1e-6 for the loss
    model = perturbed_model(hg.GPTConfig(**{**vars(CFG), 'bias': bias}))
    idx, targets = batch()
    ref_loss, ref = helpers.autograd_fp64(model, idx, targets)
    eng = engines(model)
    loss, grads = eng.loss_and_grads(idx, targets)
    _, torch_grads = hg.AutogradEngine(model, CPU, torch.float32).loss_and_grads(idx, targets)
    assert loss.shape == () and loss.dtype == torch.float32 and abs(loss.item() / ref_loss - 1) <= 1e-6
    assert worst(grads, ref)[0] <= 1e-5, worst(grads, ref)
    assert worst(torch_grads, ref)[0] <= 1e-5, worst(torch_grads, ref)
    # the layout fused AdamW and sum_grads need: the parameters' keys (the tied head once),
    # fp32, contiguous with the parameter's strides, each in its own buffer, writable in place
    params = dict(model.named_parameters())
    assert list(grads) == list(params) and 'lm_head.weight' not in grads
    for k, g in grads.items():
        assert g.dtype == torch.float32 and g.device == CPU, k
        assert g.is_contiguous() and g.stride() == params[k].stride(), k
    assert len({g.data_ptr() for g in grads.values()}) == len(grads)
    again = eng.loss_and_grads(idx, targets)[1]
    for k in grads:  # (sum_grads adds a call's gradients into the first call's)
        grads[k] += again[k]
    assert worst({k: g / 2 for k, g in grads.items()}, ref)[0] <= 1e-5
    assert 'weights copied each call' in eng.label and 'float32' in eng.label


def test_fused_adamw_takes_a_wrong_step_from_a_transposed_view_and_not_from_the_engine(engines):
    # The trap: MLX hands W's gradient in x @ W.T as a transposed view, and fused AdamW reads
    # a gradient as flat memory in the parameter's order. One step (lr 1e-3, weight decay
    # 0.1) of fused AdamW against for-loop AdamW from the same gradients: a transposed view
    # moves weights ~lr off (measured 2e-3), the engine's gradients agree to fp32 rounding of
    # one step (measured 0)
    model = perturbed_model()
    idx, targets = batch()
    grads = engines(model).loss_and_grads(idx, targets)[1]
    w = dict(model.named_parameters())
    name = 'transformer.h.0.attn.c_attn.weight'
    raw = mx.grad(lambda p: me.gpt_loss(p, mx.array(idx.numpy()), mx.array(targets.numpy()), 2, 4))(
        {k: mx.array(v.detach().numpy()) for k, v in w.items()})
    assert torch.from_dlpack(raw[name]).stride() == (1, 3 * CFG.n_embd)  # MLX's own: the view (mlx.md 5)

    def adamw_step(grad, fused):
        p = torch.nn.Parameter(w[name].detach().clone())
        p.grad = grad
        torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=fused, foreach=False).step()
        return p.detach()
    p = torch.nn.Parameter(w[name].detach().clone())
    p.grad = grads[name]
    version = p._version
    torch.optim.AdamW([p], fused=True).step()
    assert p._version == version  # fused AdamW bumps no version: never cache by it (mlx.md 5)
    g = grads[name]
    view = g.t().contiguous().t()  # the same values, strides (1, rows)
    assert torch.equal(view, g) and view.stride() == (1, g.shape[0])
    assert (adamw_step(view, True) - adamw_step(view, False)).abs().max() > 1e-4  # the trap, still there
    assert (adamw_step(g, True) - adamw_step(g, False)).abs().max() <= 1e-7  # the engine's: none


def test_gradients_come_through_the_host_without_torch_dlpack(engines, monkeypatch, capsys):
    # a torch without MLX's DLPack device (kDLMetal before torch 2.9): the same gradients,
    # copied through NumPy, said in one line
    model = perturbed_model()
    idx, targets = batch()
    eng = engines(model)
    ref = eng.loss_and_grads(idx, targets)[1]

    def refuse(x):
        raise BufferError("no such DLPack device")
    monkeypatch.setattr(torch, 'from_dlpack', refuse)
    for _ in range(2):
        grads = eng.loss_and_grads(idx, targets)[1]
        assert all(torch.equal(g, ref[k]) and g.stride() == ref[k].stride() for k, g in grads.items())
    assert capsys.readouterr().out.count('gradients copied through the host') == 1


REAL_MAC = os.uname().sysname == 'Darwin' and torch.backends.mps.is_available()  # not the double


@pytest.mark.skipif(not REAL_MAC, reason="needs a Mac's Metal and MPS")
def test_on_a_mac_the_weights_are_shared_and_the_gradients_land_on_mps():
    # torch >= 2.12 and mlx >= 0.32: MLX reads the MPS weights in place, so an in-place update
    # by torch shows in MLX's arrays with no call between; the gradients come back on MPS,
    # laid out as the parameters, in torch's own memory (resizable storage: not a DLPack
    # import of MLX's untracked buffers, mlx.md 3), and equal autograd's on MPS after a fused
    # AdamW step (fp32 on both GPUs, ~1e-6 relative; bound 1e-4 as test_grads' fp32)
    mps = torch.device('mps')
    model = perturbed_model().to(mps)
    eng = me.MLXEngine(model, mps, torch.float32)
    try:
        assert eng.alias and 'weights shared' in eng.label
        idx, targets = batch()
        grads = eng.loss_and_grads(idx, targets)[1]
        params = dict(model.named_parameters())
        assert all(g.device.type == 'mps' and g.stride() == params[k].stride() for k, g in grads.items())
        assert all(g.untyped_storage().resizable() for g in grads.values())
        with torch.no_grad():
            params['transformer.wpe.weight'].add_(1.0)
        torch.ones((), device=mps).item()
        seen = np.array(eng.w['transformer.wpe.weight'])
        assert np.array_equal(seen, params['transformer.wpe.weight'].detach().cpu().numpy())
        for k, p in params.items():
            p.grad = grads[k]
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True).step()
        grads = eng.loss_and_grads(idx, targets)[1]
        ref = hg.AutogradEngine(model, mps, torch.float32).loss_and_grads(idx, targets)[1]
        assert worst({k: g.cpu() for k, g in grads.items()}, {k: r.cpu() for k, r in ref.items()})[0] <= 1e-4
    finally:
        eng.close()


# ---- the engine in the step, in threads, in bf16

def run_steps(model, gpu, mode, n=10):
    """n HeteroStep updates of model (4 microbatches of 4 x 32), gpu its GPU engine, in mode
    gpu or hetero (half of them to the fp16 eager stand-in): the losses."""
    cfg = hg.Config(**{**vars(CFG), 'learning_rate': 1e-3})
    engines = {'gpu': gpu}
    if mode == 'hetero':
        engines['ane'] = hg.EagerEngine(CFG, CPU, torch.float16, hg.LossScaler(4096.0, 200))
    opt = hg.make_optimizer(model, cfg)
    split = hg.Split(4, {'gpu': 0.0, 'hetero': 0.5}[mode])
    step = hg.HeteroStep(model, engines, split, log=print, optimizer=opt)
    losses = []
    try:
        for i in range(n):
            mbs = [batch(seed=100 * i + j) for j in range(4)]
            losses.append(step.update(step(mbs), cfg.grad_clip).loss)
    finally:
        step.close()
    return losses


@pytest.mark.parametrize('mode', ['gpu', 'hetero'])
def test_hetero_step_trains_as_with_the_autograd_engine(mode):
    # 10 AdamW steps from the same weights on the same batches, MLX or autograd as the GPU
    # engine; the step's loss, and the weights' move (all of them as one vector) against the
    # autograd run's. gpu: fp32 differences (~1e-7 relative a step) within 1e-6 relative for
    # the loss (measured 1.5e-7), 1e-3 for the move (measured 2.7e-4: AdamW's m/sqrt(v) turns a
    # near-zero gradient's fp32 noise into a step of up to lr). hetero: half of each step is
    # the fp16 stand-in's, whose roundings (2^-11) flip as the weights differ in fp32: the loss
    # within 1e-3 relative (measured 1.5e-4), the move within 5% (measured 2.4%; gradcheck's
    # fp16 bound is 2% for one step's gradient)
    model = perturbed_model()
    other = copy.deepcopy(model)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    mlx_engine = me.MLXEngine(model, CPU, torch.float32)
    a = run_steps(model, mlx_engine, mode)  # (the step closes the engine)
    b = run_steps(other, hg.AutogradEngine(other, CPU, torch.float32), mode)
    assert mlx_engine.traces == 1  # one microbatch shape, one trace
    loss_bound, move_bound = {'gpu': (1e-6, 1e-3), 'hetero': (1e-3, 0.05)}[mode]
    assert max(abs(x / y - 1) for x, y in zip(a, b)) <= loss_bound, (a, b)
    move_a = torch.cat([p.detach().flatten() for p in model.parameters()]) - start
    move_b = torch.cat([p.detach().flatten() for p in other.parameters()]) - start
    assert move_b.abs().max() > 5e-3 and (move_a - move_b).norm() <= move_bound * move_b.norm()


def test_three_calling_threads_get_the_same_answer_from_one_trace(engines):
    # the step's thread, the main thread and the self-check's background thread all call the
    # engine; MLX runs in its own thread, so each answer is the same bits, traced once
    model = perturbed_model()
    eng = engines(model)
    idx, targets = batch()
    out = [eng.loss_and_grads(idx, targets)]
    t = threading.Thread(target=lambda: out.append(eng.loss_and_grads(idx, targets)))
    t.start()
    t.join()
    with ThreadPoolExecutor(1) as pool:
        out.append(pool.submit(eng.loss_and_grads, idx, targets).result())
    assert len(out) == 3 and eng.traces == 1
    for loss, grads in out[1:]:
        assert torch.equal(loss, out[0][0])
        assert all(torch.equal(g, out[0][1][k]) for k, g in grads.items())


def test_the_torch_weights_are_read_in_the_calling_thread(engines, monkeypatch):
    # where the weights are copied (Linux; a Mac whose torch keeps MPS private), the caller's
    # thread reads them and the MLX thread gets host tensors: only the caller touches torch's
    # MPS during a call (mlx.md 4). Every Tensor.cpu() call is recorded with its thread
    model = perturbed_model()
    eng = engines(model)
    callers = []
    cpu = torch.Tensor.cpu

    def spy(self, *args, **kwargs):
        callers.append(threading.current_thread().name)
        return cpu(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, 'cpu', spy)
    eng.loss_and_grads(*batch())
    assert len(callers) > len(eng.params)  # each weight and the batch
    assert set(callers) == {threading.current_thread().name}


def test_bf16_casts_the_fp32_weights_and_returns_fp32_gradients(engines):
    # bf16 as torch's autocast does it: each linear and attention in bf16 (8 bits of mantissa,
    # 0.4% a rounding), layernorms and the loss in fp32. Against fp32 autograd: the loss within
    # 1%, each gradient's norm within 3% (measured 1.1% worst); evaluation gets bf16 autocast
    model = perturbed_model()
    idx, targets = batch()
    ref_loss, ref = hg.AutogradEngine(model, CPU, torch.float32).loss_and_grads(idx, targets)
    eng = engines(model, torch.bfloat16)
    loss, grads = eng.loss_and_grads(idx, targets)
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert abs(loss.item() / ref_loss.item() - 1) <= 0.01
    top = max(r.norm() for r in ref.values())
    errs = {k: ((grads[k] - r).norm() / max(r.norm(), 1e-3 * top)).item() for k, r in ref.items()}
    assert max(errs.values()) <= 0.03, max(errs.items(), key=lambda kv: kv[1])
    assert eng.autocast.fast_dtype == torch.bfloat16 and 'bfloat16' in eng.label


@pytest.mark.parametrize('dtype', ['float16', 'float64'])
def test_fp16_and_fp64_are_refused_in_one_line(data_dir, tmp_path, capsys, dtype):
    # no loss scaling in the MLX engine, and MLX's float64 is CPU-only: one error line, exit 2
    argv = helpers.flags(data_dir, tmp_path / 'out', mode='gpu', dtype=dtype)
    with pytest.raises(SystemExit) as e:
        hg.main(argv, job=me.train, cls=me.MLXConfig)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].startswith('error: the MLX engine trains in float32 or bfloat16')
    assert dtype in err[0]


def test_a_negative_cache_limit_is_refused_in_one_line(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        hg.main(helpers.flags(data_dir, tmp_path, mlx_cache_gb=-1), job=me.train, cls=me.MLXConfig)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["error: --mlx_cache_gb -1.0 is negative: pass a size in GiB (0: no cache)"]


def test_without_mlx_it_says_how_to_install_it(data_dir, tmp_path):
    # an mlx that cannot be imported: `python -m tools.mlx_engine` prints one error line
    # naming the install command, exit 2; --help still works
    fake = tmp_path / 'nomlx' / 'mlx'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text("raise ImportError(\"No module named 'mlx'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), ROOT]))
    flags = helpers.flags(data_dir, tmp_path / 'out', mode='gpu')
    argv = [sys.executable, '-m', 'tools.mlx_engine', *flags]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith('error: the MLX engine needs MLX') and "pip install 'mlx" in err[0]
    argv = argv[:3] + ['--help']
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and '--mlx_cache_gb' in r.stdout


# ---- the command line

def test_the_command_line_trains_stops_and_resumes_with_mlx(data_dir, tmp_path, capsys, ctrl_c):
    # python -m tools.mlx_engine's job in this process, gpu mode to 6 steps: Ctrl-C at step 4
    # saves it and ends the MLX thread; --resume goes on to 6, the rows continue; the header
    # names MLX; the preflight counted MLX's own memory
    out = tmp_path / 'out'
    argv = helpers.flags(data_dir, out, mode='gpu', max_iters=6, log_interval=2, eval_interval=2)
    ctrl_c.at(4)
    with pytest.raises(SystemExit) as e:
        hg.main(argv, job=me.train, cls=me.MLXConfig)
    assert e.value.code == 130 and 'gpu: MLX ' in capsys.readouterr().out
    assert not [t for t in threading.enumerate() if t.name == 'mlx']
    est = memory.preflight.estimate
    tiny = {k: helpers.TINY[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size')}
    params = sum(p.numel() for p in hg.GPT(hg.GPTConfig(**tiny)).parameters())
    assert est['gpu_mlx_weights'] == 4 * params
    assert est['gpu_mlx_cache'] == int(memory.total_memory() / 16)
    assert torch.load(out / 'ckpt.pt', weights_only=False)['iter_num'] == 4
    ctrl_c.off()
    hg.main(argv + ['--resume', 'True'], job=me.train, cls=me.MLXConfig)
    assert [r['step'] for r in helpers.rows(out)] == [2, 4, 6]


def test_mlx_and_the_reference_train_alike_in_gpu_mode(data_dir, tmp_path):
    # the same run, seed and data, 20 steps in gpu mode, with MLX and with hetero_gpt.py's own
    # engine: every step's loss within 1e-4 (fp32's ~1e-6 a step, carried through 20 AdamW
    # updates), the validation losses too
    kw = dict(mode='gpu', max_iters=20, log_interval=1, eval_interval=10)
    hg.main(helpers.flags(data_dir, tmp_path / 'mlx', **kw), job=me.train, cls=me.MLXConfig)
    hg.main(helpers.flags(data_dir, tmp_path / 'torch', **kw))
    a = helpers.rows(tmp_path / 'mlx')
    b = helpers.rows(tmp_path / 'torch')
    assert [r['step'] for r in a] == [r['step'] for r in b] == list(range(1, 21))
    assert max(abs(x['loss'] - y['loss']) for x, y in zip(a, b)) <= 1e-4
    assert max(abs(x['val_loss'] - y['val_loss']) for x, y in zip(a, b) if 'val_loss' in x) <= 1e-4


@pytest.mark.slow
def test_the_cli_in_hetero_mode_then_resumed(data_dir, tmp_path):
    # `python -m tools.mlx_engine` as a user runs it: hetero (MLX beside the eager stand-in, in
    # its worker process), 4 steps, then --resume to 6
    kw = dict(mode='hetero', ane_worker=True, log_interval=2, eval_interval=2)
    for more in (dict(max_iters=4), dict(max_iters=6, resume=True)):
        argv = helpers.flags(data_dir, tmp_path / 'out', **kw, **more)
        argv = [sys.executable, '-m', 'tools.mlx_engine', *argv]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and 'Traceback' not in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    assert 'gpu: MLX ' in r.stdout
    assert [row['step'] for row in helpers.rows(tmp_path / 'out')] == [2, 4, 6]


def on_the_double(data_dir, cwd, program, out_dir):
    """A 3-step gpu-mode run of program under the macOS double, whose MPS is the CPU presented
    as 'mps': (what it printed, its metrics rows)."""
    from test_macos import mac
    argv = helpers.flags(data_dir, out_dir, mode='gpu', device=None, max_iters=3, log_interval=1,
                         eval_interval=3)
    r = mac([*program, *argv], cwd)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, helpers.rows(cwd / out_dir)


def test_the_mac_path_under_the_macos_double(data_dir, tmp_path):
    # the Mac's code path: the wait on MPS before each call, the weights that cannot be shared
    # (the double's are host memory, as torch's private MPS storage before 2.12) copied each
    # call and said in one line, the gradients moved to 'mps'; it trains
    out, rows = on_the_double(data_dir, tmp_path, ['-m', 'tools.mlx_engine'], 'mlx')
    assert out.count('MLX engine: the weights are copied each call') == 1 and 'gpu: MLX ' in out
    assert [r['step'] for r in rows] == [1, 2, 3] and all(0 < r['loss'] < 20 for r in rows)


@pytest.mark.slow
def test_the_mac_path_trains_as_hetero_gpt_under_the_macos_double(data_dir, tmp_path):
    # the same run by hetero_gpt.py's own engine on the double's MPS: losses within 1e-4
    a = on_the_double(data_dir, tmp_path, ['-m', 'tools.mlx_engine'], 'mlx')[1]
    b = on_the_double(data_dir, tmp_path, [os.path.join(ROOT, 'hetero_gpt.py')], 'torch')[1]
    assert len(a) == len(b) == 3 and max(abs(x['loss'] - y['loss']) for x, y in zip(a, b)) <= 1e-4


# ---- the reference without tools/mlx_engine.py

WITHOUT = """
import importlib.util, hetero_gpt as hg, prepare_data
assert importlib.util.find_spec('tools.mlx_engine') is None
prepare_data.prepare('tiny', data_dir='data', input_path='tiny.txt')
tiny = ['--dataset', 'tiny', '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '16',
        '--device', 'cpu', '--max_iters', '2', '--eval_iters', '1', '--sample_tokens', '0', '--quiet',
        '--ane_worker', 'false']
for mode in ('gpu', 'ane', 'hetero'):
    hg.main(tiny + ['--mode', mode, '--out_dir', 'out_' + mode, '--ane_fraction', '0.5'])
"""


def test_every_mode_trains_without_the_mlx_engine(tmp_path):
    # a copy of the project without tools/mlx_engine.py: nothing imports it, every mode trains
    skip = shutil.ignore_patterns('.git', '.venv', 'venv-*', '.pytest_cache', '.bench', '__pycache__',
                                  '*.pyc', '*.mlpackage', 'data', 'out*', 'mlx_engine.py')
    shutil.copytree(ROOT, tmp_path, ignore=skip, dirs_exist_ok=True)
    lines = [f"line {i} of the king and the queen" for i in range(300)]
    (tmp_path / 'tiny.txt').write_text('\n'.join(lines))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, '-c', WITHOUT], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and 'Traceback' not in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    for mode in ('gpu', 'ane', 'hetero'):
        assert [row['step'] for row in helpers.rows(tmp_path / f'out_{mode}')] == [2], mode
