"""The Mac's GPU side under the macOS double, whose MPS double (tests/macos_double/torch_mps.py)
runs the GPU engine on the CPU presented as 'mps': the double itself, the copies to the device,
the Mac's default configuration, its memory estimate and what a run measures beside it, and a
Mac whose torch cannot use MPS."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hetero_gpt as hg
from plumbing import memory, settings
from tools import gradcheck

pytest.importorskip('coremltools')
from test_macos import DOUBLE, ROOT, TINY, TRAIN, TRAIN_MODEL, cwd_with_data, error_lines, mac, programs_in, rows  # noqa: E402

GIB = 2**30


def on_mac(code, cwd, **switches):
    """The last line of what `code` prints, as JSON, run under the double (switches: MACOS_DOUBLE_*)."""
    r = mac(['-c', textwrap.dedent(code)], cwd, **switches)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


DOUBLE_FACTS = """
    import json, torch
    facts = dict(built=torch.backends.mps.is_built(), available=torch.backends.mps.is_available())
    if facts['available']:
        base = torch.mps.current_allocated_memory()
        a = torch.zeros(1000, device='mps')  # 4000 bytes
        b = torch.ones(2, 3).to('mps')
        grown = torch.mps.current_allocated_memory() - base
        c = (b * 2).sum()
        facts |= dict(device=str(b.device), is_mps=b.is_mps, value=c.item(), grown=grown)
        try:
            b.numpy()
        except TypeError as e:
            facts['numpy'] = str(e)
        try:
            b + torch.ones(2, 3)
        except RuntimeError as e:
            facts['mixed'] = str(e)
        driver, now = torch.mps.driver_allocated_memory(), torch.mps.current_allocated_memory()
        del a
        facts |= dict(freed=now - torch.mps.current_allocated_memory(), cached=torch.mps.driver_allocated_memory() - driver)
        torch.mps.empty_cache()
        torch.mps.synchronize()
        facts['emptied'] = driver - torch.mps.driver_allocated_memory()
    print(json.dumps(facts))
"""


@pytest.mark.slow  # the double's own facts, in three processes
def test_the_double_presents_the_cpu_as_mps(tmp_path):
    f = on_mac(DOUBLE_FACTS, tmp_path)
    assert f['built'] and f['available'] and f['device'] == 'mps:0' and f['is_mps'] and f['value'] == 12.0
    assert f['grown'] >= 4000 + 24  # a's 1000 fp32 and b's 6 (an allocator may round up)
    assert f['freed'] >= 4000 and f['cached'] == 0 and f['emptied'] >= 4000  # freed: cached until empty_cache
    assert 'Use Tensor.cpu()' in f['numpy'] and 'same device' in f['mixed']
    assert on_mac(DOUBLE_FACTS, tmp_path, mps=0) == dict(built=False, available=False)  # the switch: no MPS


HAZARD = """
    import json, os, torch
    xy = torch.arange(2 * 9).view(2, 9)
    x, y = xy[:, :-1], xy[:, 1:]  # strides (9, 1): not dense in storage, so cloned
    out = dict(want_x=x.tolist(), want_y=y.tolist())
    for name, nb, retain in (('default', True, ''), ('blocking', False, ''), ('retain', True, 'retain')):
        os.environ['MACOS_DOUBLE_MPS_COPY'] = retain
        xs, ys = x.to('mps', non_blocking=nb), y.to('mps', non_blocking=nb)
        out[name] = [xs.tolist(), ys.tolist()]
    print(json.dumps(out))
"""


@pytest.mark.slow  # the double's hazard alone: the engine's test below is the fast one
def test_a_non_blocking_copy_of_a_view_can_arrive_holding_the_next_one(tmp_path):
    # Copy.mm before the source was retained: the clone is freed as the copy is queued, the next
    # clone of that size takes its memory, and the queued copy reads it later; a blocking copy
    # and the fixed release (MACOS_DOUBLE_MPS_COPY=retain) copy what they were given
    r = on_mac(HAZARD, tmp_path)
    assert r['want_x'] != r['want_y'] and r['default'] == [r['want_y'], r['want_y']]
    assert r['blocking'] == r['retain'] == [r['want_x'], r['want_y']]


GPU_ENGINE = """
    import json, sys, numpy as np, torch
    import hetero_gpt as hg
    cfg = hg.Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=128, batch_size=2,
                    gradient_accumulation_steps=3)
    torch.manual_seed(0)
    model = hg.GPT(hg.model_config(cfg)).to('mps')
    weights = {k: v.cpu() for k, v in model.state_dict().items()}
    data = np.random.default_rng(0).integers(0, 128, 5000).astype(np.uint16)
    xy = torch.from_numpy(np.stack([data[i:i + 33].astype(np.int64) for i in range(0, 600, 100)]))
    mbs = list(zip(xy[:, :-1].split(2), xy[:, 1:].split(2)))  # views, not dense in storage
    engine = hg.AutogradEngine(model, torch.device('mps'), torch.float32)
    step = hg.HeteroStep(model, {'gpu': engine}, hg.Split(3, 0), optimizer=hg.make_optimizer(model, cfg))
    out = step(mbs)  # the mean gradient into p.grad
    grads = {k: p.grad.cpu() for k, p in model.named_parameters()}
    step.update(out)  # fused AdamW on MPS
    torch.save(dict(weights=weights, batches=mbs, grads=grads, loss=out.loss,
                    fused=[g['fused'] for g in step.optimizer.param_groups],
                    updated={k: v.cpu() for k, v in model.state_dict().items()}), sys.argv[-1])
    print(json.dumps(dict(device=str(next(model.parameters()).device))))
"""


def test_the_gpu_engine_on_mps_gets_the_batch_it_was_given(tmp_path):
    # a step of the GPU engine over three microbatches on MPS, given views that are not dense
    # in storage (the step copies them whole and keeps them until its wait, as its copies to
    # MPS do not wait), against the same step on the CPU from contiguous batches (blocking
    # copies): the same arithmetic, so float32's tolerances;
    # then fused AdamW's update on MPS, after the host's check of the gradients, against the CPU's
    r = mac(['-c', textwrap.dedent(GPU_ENGINE), str(tmp_path / 'mps.pt')], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / 'mps.pt')
    cfg = hg.Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=128)
    model = hg.GPT(hg.model_config(cfg))
    model.load_state_dict(got['weights'])
    step = hg.HeteroStep(model, {'gpu': hg.AutogradEngine(model, torch.device('cpu'), torch.float32)}, hg.Split(3, 0),
                         optimizer=hg.make_optimizer(model, cfg))
    ref = step([(x.contiguous(), y.contiguous()) for x, y in got['batches']])
    assert abs(got['loss'] - ref.loss) <= 1e-6 * ref.loss  # fp32: the mean of 3 losses of ~5
    assert gradcheck.check(got['grads'], {k: p.grad for k, p in model.named_parameters()}, torch.float32) == ''
    step.update(ref)
    assert got['fused'] == [True, True]
    for k, v in model.state_dict().items():  # the same update: fp32 rounding at most
        assert torch.allclose(got['updated'][k], v, rtol=1e-6, atol=1e-7), k
    assert all(not torch.equal(got['updated'][k], got['weights'][k]) for k in got['weights'] if k.endswith('weight'))


def test_memory_estimate_item_by_item_for_gpt2_on_a_mac(monkeypatch):
    # --preset gpt2 on a Mac: GPT-2 124M, hetero, fp32, microbatches of 2 x 1024 on MPS, the ANE 2 x 1024 a call
    monkeypatch.setattr(memory, 'ON_MAC', True)
    cfg = hg.Config(**hg.MAC_GPT2)
    C, L, V, T, N, H = 768, 12, 50257, 1024, 2 * 1024, 12
    P = V * C + T * C + L * (2 * C + C * 3 * C + 3 * C + C * C + C + 2 * C + C * 4 * C + 4 * C + 4 * C * C + C) + 2 * C
    R = 4 * 12608  # the vocabulary in 4 chunks of ceil(50257 / 4) rows, rounded up to a multiple of 64
    assert hg.model_sizes(cfg) == (P, R)
    want = dict(gpu_state=16 * P,  # weights, the step's gradient, AdamW's two moments
                gpu_microbatch_grads=4 * P,  # a microbatch's own, beside the sum
                gpu_activations=L * 20 * N * C * 4 + 16 * N * V,
                gpu_attention=4 * L * 2 * H * T * T,  # (B, H, T, T) fp32 each layer
                gpu_runtime=0.75 * GIB,  # Metal and MPSGraph
                ane_host_grads=2 * 4 * P,  # the worker's, copied out: the sum and the current call's
                ane_buffers=4 * P * 4 + 4 * (L + 2) * N * C,
                ane_programs=2 * 2 * N * R,  # the head's logits and softmax, fp16
                ane_coreml_copies=2 * R * C + 2 * 4 * R * C,  # the embedding in fp16; its gradient in fp32, twice
                ane_runtime=0.75 * GIB)  # coremltools and Core ML
    mem = memory.memory_estimate(cfg, 'hetero', torch.device('mps'), torch.float32, hg.model_sizes(cfg), settings.ane_batch_size(cfg))
    assert {k: v for k, v in mem.items() if k not in ('gpu', 'ane', 'total')} == {k: int(v) for k, v in want.items()}
    assert mem['total'] == mem['gpu'] + mem['ane'] == sum(int(v) for v in want.values())
    assert 11 * GIB < mem['total'] < 12 * GIB  # the ~11-12 GiB a run of these sizes is expected to take
    # --mode ane: the master weights and AdamW are still on MPS, the step's gradient with them
    ane = memory.memory_estimate(cfg, 'ane', torch.device('mps'), torch.float32, hg.model_sizes(cfg), settings.ane_batch_size(cfg))
    assert ane['gpu'] == 16 * P + int(0.75 * GIB) and ane['ane'] == mem['ane']
    # a 16 GB Mac runs it, with the warning that other programs may make it swap
    monkeypatch.setattr(memory, 'total_memory', lambda: 16 * GIB)
    said = []
    mps = torch.device('mps')
    run = settings.Run('hetero', mps, torch.float32, mps, torch.float16, ane_in_worker=True, ane_programs=True,
                       ane_batch_size=settings.ane_batch_size(cfg))
    memory.preflight(cfg, run, hg.model_sizes(cfg), log=said.append)
    assert len(said) == 1 and 'may swap' in said[0]


def test_max_rss_is_in_bytes_whatever_sys_platform_says(tmp_path):
    # ru_maxrss: KiB from Linux's kernel, bytes from macOS's; under the double sys.platform is
    # 'darwin' over Linux, and the peak must still come out in bytes: at least the 64 MiB made here
    code = """
        import json, sys, numpy as np
        from plumbing import memory, settings
        a = np.ones(2**26, np.uint8)
        print(json.dumps(dict(platform=sys.platform, rss=memory.rss(), max_rss=memory.max_rss())))  # (in this order)
    """
    r = on_mac(code, tmp_path)
    # (a KiB count read as bytes would be 1024 times too small; the kernel's two counts differ a little)
    assert r['platform'] == 'darwin' and 2**26 < r['rss'] < 1.1 * r['max_rss'] < 2**35
    now = memory.rss()
    assert 2**26 < now < 1.1 * memory.max_rss() < 2**35  # (here, without the double)


@pytest.mark.slow  # a trainer under both doubles (the engine's copies: the fast test above)
def test_the_macs_defaults_train_on_mps_and_record_their_memory(shakespeare, exported, tmp_path):
    # no batch flags: the Mac's own (2 sequences, 16 microbatches), the GPU engine on MPS with
    # fused AdamW, both engines each step; each row: the memory measured beside the estimate
    cwd = cwd_with_data(shakespeare, tmp_path)
    p = programs_in(cwd, exported, TRAIN_MODEL)
    i = TRAIN.index('--batch_size')
    flags = TRAIN[:i] + TRAIN[i + 4:]  # TRAIN without its batch_size and gradient_accumulation_steps
    assert '--gradient_accumulation_steps' not in flags and '--n_layer' in flags
    # (one microbatch of 16 on the ANE: the double's Core ML evaluates in NumPy, slowly)
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), *flags, '--preset', 'gpt2', '--max_iters', '1', '--ane_fraction', '0.0625',
             '--ane_programs', p], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'on a Mac: GPT-2 124M in microbatches that fit a 16 GB one (any flag overrides): batch_size=2 ' \
           'gradient_accumulation_steps=16' in r.stdout
    assert 'gpu: autograd on mps (float32)' in r.stdout and 'mode hetero' in r.stdout
    out = rows(cwd)
    assert [row['step'] for row in out] == [1] and all(row['ane_microbatches'] == 1 for row in out)
    for row in out:
        m = row['memory']
        assert m['estimate'] == m['estimate_gpu'] + m['estimate_ane'] > 0
        assert 0 < m['mps_tensors'] <= m['mps_driver'] and 2**24 < m['rss'] < 1.1 * m['max_rss']
        assert 2**24 < m['worker_max_rss'] < 2**34  # bytes: a worker holds more than 16 MiB, less than 16 GiB


@pytest.mark.slow  # a second engine pair under the double: the trainer's test above is the fast one
def test_the_concurrency_stage_records_memory_beside_the_estimate(exported, tmp_path):
    code = f"""
        import json, torch
        import hetero_gpt as hg
        from tools import ane_check
        cfg = hg.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
        r = ane_check.overlap(cfg, 2, 2, torch.device('mps'), program_dir={programs_in(tmp_path, exported, TRAIN_MODEL)!r},
                              gpu_iters=2, ane_iters=1)
        print(json.dumps(r))
    """
    r = on_mac(code, tmp_path)
    m = r['memory']
    assert r['gpu_label'] == 'autograd on mps (float32)'
    assert m['estimate'] == m['estimate_gpu'] + m['estimate_ane'] > 0 and 0 < m['mps_tensors'] <= m['mps_driver']
    assert 2**24 < m['rss'] < 1.1 * m['max_rss'] and 2**24 < m['worker_max_rss'] < 2**34


@pytest.mark.slow  # two processes under the double
def test_a_mac_whose_torch_cannot_use_mps_is_told_what_to_change(tmp_path):
    # macOS 13 with torch 2.10 or newer: MPS built, not available; not a silent small CPU run
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), '--dataset', 'shakespeare', '--max_iters', '1'], tmp_path, version='13.6')
    err = error_lines(r)
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    for words in ('macOS 13.6', f'torch {torch.__version__}', 'macOS 14', "torch<2.10", '--device cpu'):
        assert words in err[0]
    assert os.listdir(tmp_path) == ['coreml.log'] or not os.path.exists(tmp_path / 'out')
    code = """
        import json, torch
        from plumbing import settings
        try:
            settings.resolve_device('mps')
        except settings.UserError as e:
            said = str(e)
        print(json.dumps(dict(cpu=str(settings.resolve_device('cpu')), mps=said, built=torch.backends.mps.is_built(),
                              available=torch.backends.mps.is_available())))
    """
    r = on_mac(code, tmp_path, version='13.6')  # the double as torch 2.10+ on macOS 13: built, not available
    assert r['built'] and not r['available']
    assert r['cpu'] == 'cpu' and r['mps'].startswith('--device mps: MPS is not available here (torch')


@pytest.mark.slow
def test_a_step_at_the_macs_default_shapes(shakespeare, tmp_path):
    # 2 x 1024 tokens a microbatch, 768 wide, the ANE 2 sequences a call, on MPS; one layer and
    # two microbatches (one each engine), so that NumPy and the CPU finish within minutes
    cwd = cwd_with_data(shakespeare, tmp_path)
    r = mac([os.path.join(ROOT, 'hetero_gpt.py'), '--dataset', 'shakespeare', '--preset', 'gpt2', '--n_layer', '1',
             '--gradient_accumulation_steps', '2', '--ane_batch_size', '2', '--ane_fraction', '0.5', '--max_iters', '1',
             '--eval_iters', '1', '--sample_tokens', '0', '--quiet'], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'gpu: autograd on mps (float32)' in r.stdout and 'batch_size=2' in r.stdout
    row = rows(cwd)[-1]
    assert row['ane_microbatches'] == 1 and row['microbatches'] == 2
    assert abs(row['gpu_loss'] - row['ane_loss']) < 0.05 * row['gpu_loss']  # ln(50304) ~ 10.8 at the start, fp16 on the ANE
    m, P = row['memory'], hg.model_sizes(hg.Config(n_layer=1))[0]
    assert 16 * P < m['mps_driver'] < m['estimate_gpu']  # at least weights, gradient, moments; within the estimate
