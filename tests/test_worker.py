"""The ANE engine in its worker process (plumbing/worker.py): the process boundary, the shared
buffers, the timeouts and every fault path, with stand-ins for Core ML (tests/worker_faults.py)."""
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch

import export_ane
import hetero_gpt as hg
import helpers
import worker_faults
from plumbing import settings
from plumbing import worker as plumbing_worker
from tools import gradcheck

CFG = hg.GPTConfig(block_size=16, vocab_size=300, n_layer=2, n_head=2, n_embd=32)
B, T = 4, 16  # the microbatch


def spec(**kw):
    return hg.AneSpec(CFG, T, max_batch=B, **kw)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, CFG.vocab_size, (B, T), generator=g) for _ in range(2)) for _ in range(n)]


@pytest.fixture
def worker():
    made = []

    def start(scaler=None, make=hg.engine_from_spec, **kw):
        timeouts = {k: kw.pop(k) for k in ('timeout_factor', 'min_timeout') if k in kw}
        made.append(plumbing_worker.WorkerEngine(spec(**kw), make, scaler or hg.LossScaler(1.0, 0, enabled=False),
                                                 log=lambda s: None, load_timeout=120, **timeouts))
        return made[-1]
    yield start
    for w in made:
        w.close()


@pytest.fixture(scope='module')
def healthy():
    """One worker of the eager derivation (fp32), for the tests that do not stop it."""
    w = plumbing_worker.WorkerEngine(spec(), hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False), log=lambda s: None,
                                     load_timeout=120)
    yield w
    w.close()


def test_worker_computes_what_the_engine_computes_here(healthy, monkeypatch):
    # The eager derivation (fp32) in the worker and in this
    # process: the same arithmetic on the same inputs, so equal to fp32 rounding (the
    # worker's thread count may order a sum otherwise: 1e-5 relative); and against fp64
    # autograd at fp32's bounds, each part by direction and size (tools/gradcheck.py).
    torch.manual_seed(0)
    model = hg.GPT(CFG)
    params = dict(model.named_parameters())
    w = healthy
    here = hg.engine_from_spec(spec())
    (idx, targets), = batches(1)
    for e in (w, here):
        e.load_weights(params)
    # a call works out no shapes (a meta model of Python that holds the GIL): the worker's are kept
    monkeypatch.setattr(hg, 'gpt_param_shapes', lambda cfg: pytest.fail("shapes worked out in a call"))
    lw, gw = w.loss_and_grads(idx, targets)
    monkeypatch.undo()
    lh, gh = here.loss_and_grads(idx, targets)
    assert abs(lw.item() - lh.item()) <= 1e-5 * lh.item()
    _, ref = helpers.autograd_fp64(model, idx, targets)
    for k in ref:
        assert torch.allclose(gw[k], gh[k], rtol=1e-5, atol=1e-5 * gh[k].abs().max().item()), k
    assert not (bad := gradcheck.check(gw, ref, torch.float32)), bad
    gw['transformer.wte.weight'].zero_()  # the caller's own tensors, not views of the shared memory
    assert w.bufs.g['transformer.wte.weight'].any()


def test_ctrl_c_is_the_trainers(healthy):
    # Ctrl-C in a terminal reaches every process of the group, the worker too: the trainer
    # handles it (a checkpoint) and stops the worker; the worker itself carries on until then
    healthy.load_weights(dict(hg.GPT(CFG).named_parameters()))
    os.kill(healthy.proc.pid, signal.SIGINT)
    loss, _ = healthy.loss_and_grads(*batches(1)[0])
    assert healthy.proc.is_alive() and torch.isfinite(loss)


def test_weights_are_sent_once_per_step(healthy, monkeypatch):
    w = healthy
    model = hg.GPT(CFG)
    w.load_weights(dict(model.named_parameters()))
    sent = []
    real = w.conn.send
    monkeypatch.setattr(w.conn, 'send', lambda m: (sent.append(m), real(m)))
    for idx, targets in batches(2):
        w.loss_and_grads(idx, targets)
    assert [m[3] for m in sent] == [True, False]  # one exchange per microbatch, new weights at the first
    with pytest.raises(hg.UserError, match='another model'):
        w.load_weights(dict(hg.GPT(dataclasses.replace(CFG, n_embd=16)).named_parameters()))


@pytest.mark.parametrize('fault,said', [('sigkill', 'killed by SIGKILL'), ('hang', 'did not finish computing 4 sequences within 2 s'),
                                        ('raises', "raised while computing 4 sequences: RuntimeError: an evaluator's")])
def test_a_faulty_worker_is_retired_and_no_step_is_lost(worker, fault, said):
    # Step 1 runs on both engines. In step 2 the worker faults at its first call (each
    # engine gets 2 of the 4 microbatches a step: the worker's call 3). The
    # ANE engine is retired with a message that says what happened, the GPU engine runs the
    # ANE's share too, and the update is the one a GPU-only step over the same 4
    # microbatches makes: the same gradient to fp32 rounding of a sum in another order.
    # Each call may take 60 s (the default: tens of times a call here), but for the hang,
    # which is about time: once step 1 has run, a call may take 2 s.
    torch.manual_seed(0)
    model = hg.GPT(CFG)
    w = worker(make=functools.partial(getattr(worker_faults, fault), fault_call=3))
    said_log = []
    engines = {'gpu': hg.AutogradEngine(model, torch.device('cpu'), torch.float32), 'ane': w}
    step = hg.HeteroStep(model, engines, hg.Split(4, 0.5), log=said_log.append,
                         optimizer=torch.optim.AdamW(model.parameters()))
    mb = batches(2 * 4)
    assert step(mb[:4]).used == ['ane', 'gpu']
    proc = w.proc
    if fault == 'hang':
        w.min_timeout, w.factor = 2.0, 1.0
    step.optimizer.zero_grad()
    ref = hg.GPT(CFG)
    ref.load_state_dict(model.state_dict())
    out = step(mb[4:])
    assert out.used == ['gpu'] and out.n == 4 and step.alive == {'gpu'}
    assert len(said_log) == 1 and said in said_log[0] and 'export_ane.py --check' in said_log[0], said_log
    for idx, targets in mb[4:]:
        (ref(idx, targets)[1] / 4).backward()
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), k
    assert w.proc is None and w.bufs is None  # stopped, its shared memory freed
    assert proc.exitcode is not None and proc not in multiprocessing.active_children()  # and reaped


def test_worker_that_cannot_start_is_one_clear_error(worker):
    with pytest.raises(hg.UserError, match='could not start.*no Neural Engine here.*--mode gpu'):
        worker(make=worker_faults.cannot_start)


def test_a_full_dev_shm_is_refused_before_the_worker_starts(monkeypatch):
    # Linux: a tmpfs without room fails at the first write into it (SIGBUS), so its free space
    # is checked first (here: 40 KiB free, for the 0.27 MiB the buffers take)
    class Full:
        f_bavail, f_frsize = 10, 4096
    monkeypatch.setattr(plumbing_worker.os, 'statvfs', lambda path: Full())
    monkeypatch.setattr(plumbing_worker.shared_memory, 'SharedMemory', lambda **kw: pytest.fail('nothing allocated'))
    with pytest.raises(hg.UserError, match=r'could not allocate 0 MiB .*\(/dev/shm has 0 MiB free\).*--ane_worker false'):
        plumbing_worker.WorkerEngine(spec(), hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False))


def test_shared_memory_that_cannot_be_allocated(monkeypatch):
    made = []

    def fake(create=False, size=0, name=None):
        if len(made) == 2:
            raise OSError(28, 'No space left on device')
        made.append(real(create=create, size=size))
        return made[-1]
    real = plumbing_worker.shared_memory.SharedMemory
    monkeypatch.setattr(plumbing_worker.shared_memory, 'SharedMemory', fake)
    with pytest.raises(hg.UserError, match='could not allocate .* MiB of shared memory .*No space left'):
        plumbing_worker.WorkerEngine(spec(), hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False))
    for m in made:  # the blocks made before the failure are freed, none left behind
        assert not os.path.exists(f'/dev/shm/{m.name.lstrip("/")}')


def test_the_worker_runs_exported_programs(exported):
    # the Mac's default ANE engine: the programs --ane_programs names (exported once, for these
    # shapes: 2 sequences of 8 tokens a call) in the worker, through the NumPy evaluator where a
    # Mac has Core ML. Against the same programs in this process: the same fp16 arithmetic on
    # the same inputs (BLAS may order an fp32 sum otherwise, which can move an fp16 output by a
    # rounding: 2^-11 of the largest value); against fp64 autograd at fp16's bounds, each
    # part by direction and size (tools/gradcheck.py). Two calls: the mean of their gradients
    gcfg = helpers.PROGRAMS['cfg']
    path = exported(**helpers.PROGRAMS)
    cfg = hg.Config(**vars(gcfg), batch_size=4, ane_batch_size=2, ane_evaluator='numpy', ane_programs=path)
    cpu = torch.device('cpu')
    run = settings.Run('ane', cpu, torch.float32, cpu, torch.float16, ane_in_worker=True, ane_programs=True, ane_batch_size=2)
    hg.export_programs(cfg, run, log=pytest.fail)  # found, not exported again
    spec = hg.ane_spec(cfg, run)
    w = plumbing_worker.WorkerEngine(spec, hg.engine_from_spec, hg.LossScaler(256.0, 0), log=lambda s: None,
                                     load_timeout=120)
    try:
        here = helpers.open_programs(path, scaler=hg.LossScaler(256.0, 0))
        assert 'NumPy evaluator' in w.label and w.label.startswith(f'Core ML programs {path}')
        torch.manual_seed(0)
        model = hg.GPT(gcfg)
        params = dict(model.named_parameters())
        idx, targets = (torch.randint(0, 100, (4, 8)) for _ in range(2))  # two calls of 2 sequences
        for e in (w, here):
            e.load_weights(params)
        (lw, gw), (lh, gh) = w.loss_and_grads(idx, targets), here.loss_and_grads(idx, targets)
        assert abs(lw.item() - lh.item()) <= 2.0 ** -10 * lh.item()
        assert w.scaler.peak == pytest.approx(here.scaler.peak, rel=2.0 ** -10) and w.scaler.peak > 0
        ref_loss, ref = helpers.autograd_fp64(model, idx, targets)
        for k in ref:
            assert torch.allclose(gw[k], gh[k], rtol=0, atol=2.0 ** -10 * gh[k].abs().max().item()), k
        assert not (bad := gradcheck.check(gw, ref, torch.float16)), bad  # (the key bias, exactly 0: not judged)
        assert abs(lw.item() - ref_loss) <= 1e-2 * ref_loss
    finally:
        w.close()


def test_the_trainer_runs_the_worker_on_the_cpu(tmp_path, monkeypatch):
    # --mode hetero --device cpu: the GPU engine is autograd, the ANE engine the worker (the
    # eager derivation in fp16), as the Mac's structure; it is stopped at the end. Of 15 cores
    # the worker gets 7 and this process 8 (the GPU engine on the CPU: half each), all 15 after
    monkeypatch.setattr(plumbing_worker, 'CPU_THREADS', 15)
    cfg, given = hg.parse_args(['--mode', 'hetero', '--device', 'cpu', '--n_layer', '1', '--n_head', '2',
                                '--n_embd', '16', '--block_size', '8', '--vocab_size', '50', '--out_dir', str(tmp_path)])
    cfg, run = hg.setup(cfg, given, log=lambda s: None)
    model, _, engines, step, _ = hg.build_run(cfg, run, log=lambda s: None)
    try:  # the process's GIL switch interval and threads, set by build_engines, as RESULTS.md section 15 says
        assert sys.getswitchinterval() == plumbing_worker.SWITCH_S < 5e-3
        assert (engines['ane'].spec.threads, torch.get_num_threads()) == (7, 8)
        assert isinstance(engines['ane'], plumbing_worker.WorkerEngine) and 'float16' in engines['ane'].label
        assert engines['ane'].scaler.scale == 4096.0 and engines['ane'].proc.is_alive()
        out = step([tuple(torch.randint(0, 50, (8, 8)) for _ in range(2)) for _ in range(2)])
        assert out.used == ['ane', 'gpu'] and out.shares['ane'].n == 1
    finally:
        engines['ane'].close()
    assert engines['ane'].proc is None
    hg.build_run(dataclasses.replace(cfg, mode='gpu'), dataclasses.replace(run, mode='gpu'), log=lambda s: None)
    assert torch.get_num_threads() == 15  # a GPU-only run next in this process gets every core back


def wait_for(path, seconds=120):
    """Until the file at path exists (a worker's call has begun)."""
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert time.monotonic() - t0 < seconds, path
        time.sleep(0.01)


def gone(names):
    return not any(os.path.exists(f'/dev/shm/{n.lstrip("/")}') for n in names)


@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason="reads /dev/shm")
def test_close_during_a_call_ends_the_call_at_once(worker, tmp_path):
    # Ctrl-C mid-step: the main thread closes the engine while its thread waits for the
    # worker's answer. Asking a busy worker to stop would wait out the whole call, so it is
    # killed: close takes milliseconds (2 s allowed for a loaded machine; asking first took
    # 5 s, the join's limit). The waiting thread ends with WorkerFault as soon as the
    # pipe closes, and nothing is left: the process is reaped, its shared memory unlinked.
    note = tmp_path / 'busy'
    w = worker(make=functools.partial(worker_faults.stalls, note=str(note)))
    w.load_weights(dict(hg.GPT(CFG).named_parameters()))
    proc, names = w.proc, list(w.bufs.names.values())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as HeteroStep runs an engine
        call = pool.submit(w.loss_and_grads, *batches(1)[0])
        wait_for(note)
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 2.0
        stopped = 'was stopped while computing 4 sequences'
        with pytest.raises(plumbing_worker.WorkerFault, match=stopped):
            call.result(timeout=2.0)
    assert proc.exitcode == -signal.SIGKILL and proc not in multiprocessing.active_children()
    assert gone(names)


@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason="reads /dev/shm")
def test_a_second_ctrl_c_during_close_leaves_nothing_behind(worker):
    # A second Ctrl-C while the first one's close runs (here as close waits for the worker
    # to stop) is ignored: close finishes, so the process is reaped and the memory unlinked.
    # Before, it raised KeyboardInterrupt out of the finalizer, which never ran again.
    w = worker()
    proc, names = w.proc, list(w.bufs.names.values())
    join = proc.join

    def join_after_ctrl_c(timeout=None):
        os.kill(os.getpid(), signal.SIGINT)
        return join(timeout)
    proc.join = join_after_ctrl_c
    w.close()
    assert proc.exitcode == 0 and gone(names)  # asked to stop, it stopped


@pytest.mark.parametrize('gpu_on_cpu', [False, True])
def test_the_cores_are_shared_with_the_thread_that_feeds_the_gpu(gpu_on_cpu, monkeypatch):
    # 15 cores: the worker gets all but the feeding thread's one, and this process as many for its copy
    # (the worker waits meanwhile); with the GPU engine on the CPU too, the worker 7 and this process 8.
    # The copy runs in the ANE engine's thread, started later: it takes this process's count too
    # (conftest gives the process its threads back)
    monkeypatch.setattr(plumbing_worker, 'CPU_THREADS', 15)
    worker_threads, mine = plumbing_worker.share_cores(gpu_on_cpu)
    torch.set_num_threads(mine)  # as build_engines does
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_thread = pool.submit(torch.get_num_threads).result()
    assert (worker_threads, torch.get_num_threads(), in_thread) == ((7, 8, 8) if gpu_on_cpu else (14, 14, 14))


KILLED = """
import os, sys, time, hetero_gpt as hg, test_worker as t
from plumbing import worker
w = worker.WorkerEngine(t.spec(), hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False), log=lambda s: None)
print(w.proc.pid, *w.bufs.names.values(), flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir('/dev/shm'), reason="reads /proc and /dev/shm")
def test_a_killed_trainer_leaves_no_worker_and_no_shared_memory():
    # the training process SIGKILLed (no finalizer runs): its worker reads the end of its pipe
    # and exits, and the shared memory is unlinked (multiprocessing's resource tracker outlives
    # the trainer). Bounded at 60 s: the worker exits at once, the tracker within a second
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, '-c', KILLED], stdout=subprocess.PIPE, text=True, cwd=root,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, 'tests')])))
    pid, *names = p.stdout.readline().split()
    p.kill()
    p.wait()
    t0 = time.monotonic()
    while os.path.exists(f'/proc/{pid}') or any(os.path.exists(f'/dev/shm/{n.lstrip("/")}') for n in names):
        assert time.monotonic() - t0 < 60, (pid, names)
        time.sleep(0.1)
