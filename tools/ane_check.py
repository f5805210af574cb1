"""
Before a Mac trains: a self-check that finds out, on this machine, whether the ANE path works
and how fast; and the report of what the programs hold against the analytic FLOP count.

    python export_ane.py --check                      # the trainer's defaults: GPT-2 124M
    python export_ane.py --check --n_layer 2 --n_head 2 --n_embd 64 --block_size 64 --ane_batch_size 2

Each stage runs in a child process of its own (spawn) with its own timeout, so a stage that
hangs, raises or is killed (a failed ANE compile kills its process at the first predict,
coremltools #2758) is reported and the next stage still runs. Off macOS the stages that need
Core ML, MPS or powermetrics are marked 'needs macOS'; one that returns {'skipped': why} is
skipped. The programs go to the trainer's folder for the run (out/ane_B{B}_T{T}), compiled, so
the trainer starts from them. The whole record goes to out/ane_check.json (paste it into a bug
report), a verdict per stage to out/ane_check.md. Ctrl-C stops the stage under way within a
second, keeps the report of those before it and exits 130 (SIGTERM 143, SIGHUP 129). A re-run
merges into the report of the same model: a stage it did not finish keeps its earlier verdict.
"""
import dataclasses
import importlib
import importlib.metadata
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import torch

import hetero_gpt as hg  # defines: the model, its derivation, build_coreml_program, coreml_engine,
#   engine_from_spec
from plumbing import memory  # defines: memory_estimate, total_memory, measured
from plumbing.energy import powermetrics_readable  # defines: powermetrics_readable
from plumbing import progress  # defines: Ticker, clock, children_ignore_ctrl_c, stop_signals, exit_code
from plumbing import programs as coreml_programs  # defines: export_programs, read_meta, program_report, compiled_model, macos_placement
from plumbing import settings  # defines: Run, one_line, check_coreml, import_coremltools
from plumbing import worker  # defines: WorkerEngine, exit_text, share_cores, SWITCH_S
from tools import gradcheck  # defines: compare, failures, by_layer, TOLERANCE

# (name, needs macOS, what it finds out)
STAGES = (('environment', False, "macOS, chip, GPU cores, memory, power, versions, MPS, sudo"),
          ('probes', True, "tiny programs for what the design relies on"),
          ('programs', False, "the real programs: export, report, audit"),
          ('coreml', True, "compile, load, placement and time of each program on the ANE and on the CPU"),
          ('gradients', False, "the chained programs against fp64 autograd (Core ML on macOS, else NumPy)"),
          ('concurrency', True, "each engine alone and beside the other"),
          ('energy', True, "watts of CPU, GPU and ANE with each engine alone"),
          ('projection', False, "tokens/s of each mode, the auto split, the memory a run takes"))


# ---- the stage runner

UNFINISHED = ('interrupted', 'not run')  # statuses that replace no earlier verdict
STOP_GRACE_S = 1.0  # a stopped stage frees what it started within this, else it is killed
_parent = []  # in a stage's process: its pipe to the runner


def _send(conn, msg):  # a runner that has gone away reads nothing: no BrokenPipeError
    try:
        conn.send(msg)
    except OSError:
        pass


def announce_segments(names):
    """A stage's shared memory, named to the runner, which unlinks it if it must kill the stage."""
    for conn in _parent:
        _send(conn, ('segments', list(names)))


def _child(conn, target, ctx):
    import warnings

    def stop(*_):  # the runner's stop: unwound here, so that a worker this stage started is stopped
        raise KeyboardInterrupt
    os.setpgid(0, 0)  # a group of its own, with what it starts: the runner can kill them all
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)  # a closed terminal: stop as the runner would ask
    _parent.append(conn)
    os.environ[progress.QUIET_ENV] = '1'  # the runner shows the stage's time
    # the probes' overflow is deliberate: NumPy's warnings of it, in coremltools' constant folding, are not news
    warnings.filterwarnings('ignore', r'(overflow|invalid value) encountered', RuntimeWarning, r'coremltools\.')
    try:
        module, name = target.split(':')
        _send(conn, ('ok', getattr(importlib.import_module(module), name)(ctx)))
    except BaseException as e:  # reported by the parent; the next stage runs
        _send(conn, ('error', settings.one_line(e)))


def run_stage(name, ctx, timeout, target=None):
    """Runs a stage, the function `target` ('module:function', of ctx -> a dict; by default
    this file's function `name`) in a spawned child process, cut at `timeout` seconds, its time
    shown meanwhile: {'name', 'seconds', 'status': ok | skipped | failed | timeout | killed |
    interrupted, 'result' | 'error'}. A stage that returns {'skipped': why} is skipped. Ctrl-C
    (KeyboardInterrupt here, SIGTERM and SIGHUP too; the child ignores SIGINT) stops the child
    (stop_child) and re-raises."""
    mp = multiprocessing.get_context('spawn')
    conn, child = mp.Pipe()
    # not a daemon: a stage may start a process of its own (the ANE worker)
    proc = mp.Process(target=_child, args=(child, target or f'tools.ane_check:{name}', ctx), name=f'check-{name}')
    t0 = time.monotonic()
    out, segments = None, []
    try:
        with progress.Ticker(f"  {name}"):
            with progress.children_ignore_ctrl_c():
                proc.start()
            child.close()
            while out is None:
                left = timeout - (time.monotonic() - t0)
                if not conn.poll(min(1.0, max(0.0, left))):
                    if left <= 0 or not proc.is_alive() and not conn.poll(0):
                        break
                    continue
                try:
                    kind, value = conn.recv()
                except EOFError:  # the child closed its end by dying: reaped before it is asked about
                    proc.join(30)
                    break
                if kind == 'segments':  # shared memory the stage made, unlinked here if it is killed
                    segments += value
                    continue
                out = (dict(status='ok', result=value) if kind == 'ok' else dict(status='failed', error=value))
    except KeyboardInterrupt:
        stop_child(proc, segments)
        raise
    finally:
        conn.close()
    if out and isinstance(out.get('result'), dict) and set(out['result']) == {'skipped'}:
        out = dict(status='skipped', error=str(out['result']['skipped']))
    if out is None:
        if proc.is_alive():
            stop_child(proc, segments, grace=0.0)
            out = dict(status='timeout', error=f"no answer within {timeout:.0f} s: stopped")
        else:
            proc.join()
            out = dict(status='killed', error=f"the stage's process died ({worker.exit_text(proc.exitcode)})")
    proc.join(5)
    if proc.is_alive() or proc.exitcode != 0:  # what it started goes with it
        stop_child(proc, segments, grace=0.0)
    return dict(name=name, seconds=round(time.monotonic() - t0, 2)) | out


def stop_child(proc, segments=(), grace=STOP_GRACE_S):
    """A stage's process asked to stop (SIGTERM: it frees what it started); after `grace`
    seconds its whole group is killed (the ANE worker with it) and the shared memory it named
    is unlinked. Signals that come meanwhile wait until it is done."""
    if proc.pid is None:
        return
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.signal(s, signal.SIG_IGN) for s in stops} if main else {}
    try:
        if proc.is_alive() and grace > 0:
            proc.terminate()
            proc.join(grace)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group _child made: the stage and its worker
        except OSError:  # gone, or its group not made yet
            if proc.is_alive():
                proc.kill()
        proc.join(5)
        for name in segments:
            try:
                m = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:  # the stage freed it
                continue
            m.close()
            m.unlink()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def run_all(ctx, stages, timeout, log=print, targets=None):
    """Every stage in turn, each one's result added to ctx['results'] for those after it.
    targets: {stage name: 'module:function'} in place of this file's functions (tests). Ctrl-C:
    the stage under way and those after it are 'interrupted', and ctx['interrupted'] is set.
    A failed environment stage ends the check at once: the stages after it are 'not run'."""
    ctx = dict(ctx, results={})
    records = []
    for i, (name, needs_mac, what) in enumerate(stages):
        if needs_mac and not hg.ON_MAC:
            rec = dict(name=name, status='needs macOS', seconds=0.0)
        else:
            log(f"stage {name}: {what} ...")
            try:
                rec = run_stage(name, ctx, timeout, (targets or {}).get(name))
            except KeyboardInterrupt:
                records += [dict(name=n, status='interrupted', seconds=0.0) for n, _, _ in stages[i:]]
                ctx['interrupted'] = name
                break
            ctx['results'][name] = rec.get('result')
        verdict, text = verdict_of(rec)
        status = verdict if verdict == 'fail' else rec['status']
        why = text if verdict == 'fail' else rec.get('error')
        log(f"  {name}: {status}" + (f" ({why})" if why else '') + f", {progress.clock(rec['seconds'])}")
        records.append(rec)
        if name == 'environment' and verdict in ('fail', 'failed', 'killed', 'timeout'):
            records += [dict(name=n, status='not run', seconds=0.0, error="the environment stage failed")
                        for n, _, _ in stages[i + 1:]]
            break
    return records


def write_report(records, ctx, path):
    """ane_check.json (everything) and ane_check.md (each stage's verdict and the figure README
    names), atomically; never over a file this check did not write. Stages re-run (--stages) are
    merged into an earlier report of the same model and shapes there; a report of others is kept,
    and this one goes to a file of its own. Returns (the document, the path written, how)."""
    doc = dict(heterogpt_check=1, when=time.strftime('%Y-%m-%d %H:%M:%S'), config=ctx['cfg'],
               ane_batch_size=ctx['B'], block_size=ctx['T'], gpu_batch=ctx['gpu_batch'], stages=records)
    how = 'a new report'
    for r in records:
        r.setdefault('when', doc['when'])
    old = _read(path)
    if old and any(old.get(k) != doc[k] for k in ('config', 'ane_batch_size', 'block_size', 'gpu_batch')):
        c = ctx['cfg']
        mine = os.path.splitext(path)[0] + f"-L{c['n_layer']}-C{c['n_embd']}-B{ctx['B']}-T{ctx['T']}.json"
        how, path, old = f"to a file of its own: {path} holds another model's report, kept", mine, _read(mine)
    if old:  # merged: a stage this run did not finish keeps its earlier record
        kept = {r['name']: r for r in old['stages']}
        done = [r for r in records if r['name'] not in kept or r['status'] not in UNFINISHED]
        kept |= {r['name']: r for r in done}
        order = [s[0] for s in STAGES] + list(kept)  # the check's order, then any other
        doc['stages'] = sorted(kept.values(), key=lambda r: order.index(r['name']))
        how = (f"merged: {', '.join(r['name'] for r in done) or 'no stage'} re-run, the other stages kept from before"
               if len(done) < len(kept) else 'every stage re-run')
    md = os.path.splitext(path)[0] + '.md'
    for p in (path, md):
        if os.path.exists(p) and not _ours(p):
            raise hg.UserError(f"{p} exists and was not written by this check: refusing to overwrite it; "
                               "use --check_report to name another file")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = ['<!-- heterogpt_check -->', '# HeteroEngine ANE self-check', '',
             f"{doc['when']}, {platform.platform()}, model {hg.GPTConfig(**ctx['cfg'])}, "
             f"{ctx['B']}x{ctx['T']} tokens an ANE call, {ctx['gpu_batch']} sequences a GPU microbatch", '',
             'Every figure in full: the .json beside this file.', '',
             '| stage | verdict | time | what to look at |', '|---|---|---|---|']
    for r in doc['stages']:
        verdict, figure = verdict_of(r)
        lines.append(f"| {r['name']} | {verdict} | {progress.clock(r['seconds'])} | {figure.replace('|', '/')} |")
    for p, text in ((path, json.dumps(doc, indent=1, default=str)), (md, '\n'.join(lines) + '\n')):
        with open(p + '.tmp', 'w') as f:
            f.write(text)
        os.replace(p + '.tmp', p)
    return doc, path, how


def _read(path):
    try:
        with open(path) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) and doc.get('heterogpt_check') else None
    except (OSError, ValueError):
        return None


def _ours(p):
    try:
        with open(p) as f:
            head = f.read(200)
        return 'heterogpt_check' in head
    except OSError:
        return False


OVERLAP_OK = 1.25  # beside/alone: each engine at least 80% of its speed alone
ANE_SHARE_OK = 0.95  # of a program's ops on the ANE; below, the CPU's part shows in its time
ANE_TIME_OK = 0.8  # CPU_AND_NE's time at most this of CPU_ONLY's: else it may run on the CPU
LOSS_OK = 1e-2  # |loss / fp64 loss - 1|: fp16's rounding of a mean of B*T log-softmaxes


def verdict_of(r):
    """(pass | warn | fail | skipped | needs macOS | interrupted | failed | killed | timeout, the
    figure README tells the reader to look at, rounded) of a stage's record. warn: a measure
    that lowers hetero's gain, not a fault of the path."""
    status, res = r['status'], r.get('result') or {}
    if status != 'ok':
        return status, r.get('error', {'needs macOS': 'runs on a Mac only',
                                       'interrupted': 'stopped by Ctrl-C before it finished'}.get(status, ''))
    name = r['name']
    if name == 'coreml':
        shares = {p: v.get('placement', {}).get('ane_share_of_ops') for p, v in res.items()}
        text = '; '.join(f"{p}: " + (f"{100 * s:.0f}% of ops on the ANE" if isinstance(s, (int, float)) else
                                     "ANE share unknown (needs macOS 14.4)") + f", {v.get('CPU_AND_NE_ms', 0):.4g} ms "
                         f"(CPU alone {v.get('CPU_ONLY_ms', 0):.4g} ms)" for (p, v), s in zip(res.items(), shares.values()))
        known = [s for s in shares.values() if isinstance(s, (int, float))]
        if known and min(known) <= 0.5:
            return 'fail', text
        # a plan may say ANE for a program that runs on the CPU: its time tells
        slow = [p for p, v in res.items() if v.get('CPU_AND_NE_ms', 0) >= ANE_TIME_OK * v.get('CPU_ONLY_ms', 0)]
        part = [p for p, s in shares.items() if isinstance(s, (int, float)) and s < ANE_SHARE_OK]
        if slow:
            text += f": {', '.join(slow)} not clearly faster on the ANE than on the CPU (at least {ANE_TIME_OK}x)"
        if part:
            text += f"; {', '.join(part)} below {100 * ANE_SHARE_OK:.0f}% of ops on the ANE"
        return ('warn' if slow or part else 'pass'), text
    if name == 'gradients':
        text = f"worst cosine {res.get('worst_cosine', float('nan')):.6f} (at least 0.999), at {res.get('worst')}"
        if 'worst_norm_ratio' in res:
            text += f"; norm ratio {res['worst_norm_ratio']:.4f}"
        if 'loss_ratio' in res:
            text += f"; loss / fp64 loss {res['loss_ratio']:.4f} (within {LOSS_OK:g})"
        return ('pass' if res.get('passed') else 'fail'), text
    if name == 'energy':  # watts of the whole chip while each engine runs alone
        return 'pass', '; '.join(f"{k.split('_')[0].upper()} alone: " + ', '.join(f"{p} {w:.1f} W" for p, w in v.items())
                                 for k, v in res.items() if k.endswith('_alone_watts'))
    if name == 'concurrency' and 'gpu_alone' in res:
        g, a = res['gpu_beside'] / res['gpu_alone'], res['ane_beside'] / res['ane_alone']
        text = (f"GPU step {1e3 * res['gpu_beside']:.4g} ms beside the ANE, {1e3 * res['gpu_alone']:.4g} ms alone "
                f"({g:.2f}x); ANE call {1e3 * res['ane_beside']:.4g} ms beside the GPU, {1e3 * res['ane_alone']:.4g} "
                f"ms alone ({a:.2f}x)")
        if max(g, a) <= OVERLAP_OK:
            return 'pass', text
        return 'warn', text + f": above {OVERLAP_OK}x the engines slow each other, and hetero gains less"
    if name == 'projection':
        if 'gpu_tokens_per_s' not in res:
            return 'pass', f"memory {res['memory_gib']} GiB of {res['machine_gib']}; tokens/s need the concurrency stage (macOS)"
        runs = res.get('run', {})
        return 'pass', '; '.join(f"{m}: {res[f'{m}_tokens_per_s']:,} tokens/s" + (
            f", the training run of these flags in {progress.clock(runs[m])}" if m in runs else '') for m in ('gpu', 'ane', 'hetero')) + (
            f"; memory {res['memory_gib']} GiB of {res['machine_gib']}")
    if name == 'probes':
        bad = [p for p, v in res.items() if not v.get('finite') and not p.startswith('overflow')]
        return ('pass' if not bad else 'fail'), (f"not finite: {', '.join(bad)}" if bad else
                                                 f"{len(res)} probes ran; the overflow probe's NaN is expected")
    if name == 'programs':
        return ('pass' if not res.get('off_ane') else 'fail'), (
            f"{res.get('ops')} ops, largest live {res.get('live_mib')} MiB, largest dimension {res.get('largest_dim')}, "
            f"off the ANE: {', '.join(res.get('off_ane') or []) or 'none'}")
    if name == 'environment':
        if 'gpu_device_error' in res:  # the trainer's own refusal: no run could start
            return 'fail', res['gpu_device_error']
        text = ', '.join(f"{k} {res[k]}" for k in ('macos', 'chip', 'memory_gib', 'torch', 'coremltools',
                                                    'coreml_runtime', 'mps') if k in res)
        leaky = [d for d, sound in res.get('causal_attention', {}).items() if not sound]
        if 'float32' in leaky:
            return 'fail', text + "; causal attention in float32 on MPS sees later tokens"
        if leaky:
            return 'warn', text + (f"; causal attention in {' and '.join(leaky)} on MPS sees later tokens "
                                   "(pytorch #195910): the trainer refuses those dtypes on MPS")
        return 'pass', text
    return 'pass', ', '.join(f"{k} {v}" for k, v in list(res.items())[:4])


# ---- what the programs hold, against the analytic count

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
    params = sum(p.numel() for k, p in hg.gpt_param_shapes(cfg).items() if k != 'transformer.wpe.weight')
    return 6 * N * matrices + attention, 6 * N * params + attention


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



# ---- the machine, as the environment stage and bench.py's rows record it


def _output(*cmd):
    """A command's output, or '' where it cannot run (not this OS, no such tool, too slow)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ''


def chip():
    """'Apple M4 Pro' on a Mac (sysctl), else the CUDA GPU's or the CPU's name."""
    if hg.ON_MAC:
        return _output('sysctl', '-n', 'machdep.cpu.brand_string').strip() or None
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or None


def gpu_cores():
    """A Mac's GPU cores (system_profiler's sppci_cores); None elsewhere or if unreadable."""
    if not hg.ON_MAC:
        return None
    try:
        gpus = json.loads(_output('system_profiler', '-json', 'SPDisplaysDataType'))
        return int(gpus['SPDisplaysDataType'][0]['sppci_cores'])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def power_source():
    """'AC Power' or 'Battery Power' on a Mac, from pmset's "Now drawing from 'AC Power'"."""
    if not hg.ON_MAC:
        return None
    first = (_output('pmset', '-g', 'batt').splitlines() or [''])[0]
    parts = first.split("'")
    return parts[1] if len(parts) >= 3 else None


def gpu_engine_class(name):
    """The GPU engine a --gpu_engine names: torch (autograd on MPS, CUDA or the CPU) or mlx
    (tools/mlx_engine.py). Where MLX is not installed, a UserError that says how to install it."""
    if name == 'torch':
        return hg.AutogradEngine
    if name != 'mlx':
        raise hg.UserError(f"--gpu_engine {name}: unknown; use torch or mlx")
    try:
        from tools import mlx_engine  # defines: require_mlx, MLXEngine
    except ImportError:
        raise hg.UserError("--gpu_engine mlx needs tools/mlx_engine.py, which is absent") from None
    mlx_engine.require_mlx()
    return mlx_engine.MLXEngine


def package_version(name):
    """An installed package's version, without importing it; None where it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine():
    """The machine and the versions, as plain values (None: unknown or absent)."""
    here = f"macOS {platform.mac_ver()[0]}" if hg.ON_MAC else platform.platform()
    gib = round(memory.total_memory() / 2**30, 1)
    return dict(chip=chip(), gpu_cores=gpu_cores(), memory_gib=gib, os=here, power=power_source(),
                python=platform.python_version(), torch=torch.__version__,
                mlx=package_version('mlx'), coremltools=package_version('coremltools'),
                mlx_enable_tf32=os.environ.get('MLX_ENABLE_TF32'))


def machine_line(info):
    """machine() in one line: 'Apple M4 Pro, 20 GPU cores, 48 GiB, macOS 15.5, AC Power;
    Python 3.12.4, torch 2.13.0, mlx 0.32.4, coremltools 9.0'."""
    here = [info['chip'] or 'unknown chip']
    if info['gpu_cores']:
        here.append(f"{info['gpu_cores']} GPU cores")
    here += [f"{info['memory_gib']:g} GiB", info['os']]
    if info['power']:
        here.append(info['power'])
    versions = [f"Python {info['python']}"]
    versions += [f"{k} {info[k]}" for k in ('torch', 'mlx', 'coremltools') if info[k]]
    if info['mlx'] and info['mlx_enable_tf32'] is not None:  # M5's fp32 matmuls: TF32 unless 0
        versions.append(f"MLX_ENABLE_TF32={info['mlx_enable_tf32']}")
    return ', '.join(here) + '; ' + ', '.join(versions)


# ---- the stages: each a function of ctx (plain values) -> a dict of plain values



def environment(ctx):
    import numpy
    info = dict(os=platform.platform(), python=platform.python_version(), machine=platform.machine(),
                cpus=os.cpu_count(), memory_gib=round(memory.total_memory() / 2**30, 1), torch=torch.__version__,
                numpy=numpy.__version__, mps=torch.backends.mps.is_available(), cuda=torch.cuda.is_available())
    info['mlx'] = package_version('mlx')
    try:
        info['coremltools'] = settings.import_coremltools().__version__
    except ImportError:
        info['coremltools'] = None
    try:  # the GPU engine's device, as the trainer resolves it by default
        device = settings.resolve_device('auto', flag=None)
        info['gpu_device'] = str(device)
        if device.type == 'mps':  # each dtype a run may take: does is_causal hide later tokens?
            cfg = hg.GPTConfig(**ctx['cfg'])
            D = cfg.n_embd // cfg.n_head  # the kernel MPS picks depends on the head size
            info['causal_attention'] = {str(d).replace('torch.', ''): settings.causal_attention_sound(device, d, ctx['T'], D)
                                        for d in (torch.float32, torch.float16, torch.bfloat16)}
    except hg.UserError as e:
        info['gpu_device_error'] = str(e)
    if hg.ON_MAC:
        info['macos'] = platform.mac_ver()[0]
        info |= dict(chip=chip(), gpu_cores=gpu_cores(), power=power_source())
        try:
            settings.check_coreml()
            info['coreml_runtime'] = 'ok'
        except hg.UserError as e:
            info['coreml_runtime'] = str(e)
        ok, why = powermetrics_readable()
        info['powermetrics'] = ok or why
    return info


def probes(ctx):
    """macOS: tiny programs on CPU_AND_NE for what the design relies on (coreml_and_ane.md
    sections 2, 3), saved in a folder of their own. Those with a reference report their
    largest error relative to the reference's largest |value| (fp16: a few 4.9e-4)."""
    import shutil
    import tempfile
    ct = settings.import_coremltools()
    cfg, B, T = hg.GPTConfig(**ctx['cfg']), ctx['B'], ctx['T']
    N, C, H = B * T, cfg.n_embd, cfg.n_head
    V = hg.vocab_chunks(cfg.vocab_size)[0]
    rng = np.random.default_rng(0)
    peak = lambda o, x, axes: hg.MILTensor(o.mb.reduce_max(x=o.mb.abs(x=x.var), axes=axes, keep_dims=False))
    q, k = (rng.standard_normal((B, H, T, C // H)) for _ in range(2))
    cases = {  # name: (fn of MILOps and inputs -> outputs, inputs, fp64 reference of y or None)
        'matmul, both operands inputs': (lambda o, x, w: {'y': o.matmul(x, w, tb=True)},
                                        dict(x=rng.standard_normal((N, C)), w=rng.standard_normal((4 * C, C)) / 30), None),
        'long sum as reduce_sum': (lambda o, x: {'y': hg.MILTensor(o.mb.reduce_sum(x=x.var, axes=[0], keep_dims=True))},
                                   dict(x=rng.standard_normal((N, C)) * 0.01 + 0.005), lambda x: x.sum(0)),
        'long sum as a matmul with ones': (lambda o, x: {'y': o.sum(x, 0)}, dict(x=rng.standard_normal((N, C)) * 0.01 + 0.005),
                                           lambda x: x.sum(0, keepdims=True)),
        'softmax over a vocabulary chunk': (lambda o, z: {'y': o.softmax(z, -1)}, dict(z=rng.standard_normal((64, V)) * 2), None),
        'overflow, then a multiply': (lambda o, x: {'y': (x * 1000.0) * 0.0}, dict(x=np.full((8, 8), 100.0)), None),
        'layernorm of rows of RMS ~1000': (lambda o, x, w, b: {'y': o.layernorm_forward(x, w, b)[0]},
                                           dict(x=rng.standard_normal((32, C)) * 1000 + 300, w=np.ones(C), b=np.zeros(C)), None),
        # what the overflow bookkeeping (programs.peaks) relies on, at the real shapes
        'batch-B rank-4 matmul of two inputs (scores)': (lambda o, q, k: {'y': o.matmul(q, k, tb=True)}, dict(q=q, k=k),
                                                         lambda q, k: q @ np.swapaxes(k, -1, -2)),
        'peaks: max |x| over all axes but the last of (B,H,T,T)': (
            lambda o, s: {'y': peak(o, s, [0, 1, 2])}, dict(s=rng.standard_normal((B, H, T, T)) * 30),
            lambda s: np.abs(s).max((0, 1, 2))),
        'peaks: row max of a vocabulary chunk, its max |.| over rows': (
            lambda o, z: {'y': peak(o, o.max(z, -1), [0])}, dict(z=rng.standard_normal((N, V)) * 3 - 2),
            lambda z: np.abs(z.max(-1, keepdims=True)).max(0)),
        'peaks: concat of vectors into one output': (
            lambda o, a, b, c: {'y': hg.MILTensor(o.mb.concat(values=[peak(o, a, [0]).var, peak(o, b, [0]).var,
                                                                      peak(o, c, [0]).var], axis=0))},
            dict(a=rng.standard_normal((N, C)), b=rng.standard_normal((N, 4 * C)), c=rng.standard_normal((N, 1))),
            lambda a, b, c: np.concatenate([np.abs(v).max(0) for v in (a, b, c)])),
        '(N,1) x (N,C) broadcast': (lambda o, x, r: {'y': x * r}, dict(x=rng.standard_normal((N, C)), r=rng.random((N, 1))),
                                    lambda x, r: x * r),
    }
    out, folder = {}, tempfile.mkdtemp(prefix='heterogpt-probes-')
    try:
        for name, (fn, inputs, ref) in cases.items():
            inputs = {k: v.astype(np.float16).astype(np.float32) for k, v in inputs.items()}
            prog = hg.mil_program(fn, {k: v.shape for k, v in inputs.items()})
            path = os.path.join(folder, f'probe{len(out)}.mlpackage')
            model = ct.convert(prog, convert_to='mlprogram', compute_precision=ct.precision.FLOAT16,
                               minimum_deployment_target=ct.target.macOS13, skip_model_load=True)
            model.save(path)
            m = ct.models.MLModel(path, compute_units=ct.ComputeUnit.CPU_AND_NE)
            y = coreml_programs.coreml_predict(m, inputs)['y']
            rec = dict(ms=m.last_predict_duration_in_nano_seconds / 1e6, finite=bool(np.isfinite(y).all()),
                       placement=coreml_programs.macos_placement(m.get_compiled_model_path()))
            if ref is not None:
                exact = ref(**{k: v.astype(np.float64) for k, v in inputs.items()})
                rec['relative_error'] = float(np.abs(np.asarray(y).reshape(exact.shape) - exact).max() / np.abs(exact).max())
            if name.startswith('overflow'):
                rec['values'] = sorted({str(v) for v in np.asarray(y).reshape(-1)})[:3]  # IEEE: nan (inf * 0)
            out[name] = rec
            del m
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def programs(ctx):
    """Export at the configured shapes (reused when already there), the report and the audit."""
    cfg, B, T = hg.GPTConfig(**ctx['cfg']), ctx['B'], ctx['T']
    meta = None
    try:
        meta = coreml_programs.read_meta(ctx['out'])
    except hg.UserError:
        pass
    t0 = time.perf_counter()
    if meta != coreml_programs.meta(cfg, B, T, hg.ANE_PIECES):
        coreml_programs.export_programs(cfg, B, T, ctx['out'], hg.build_coreml_program, hg.ANE_PIECES)
    read = lambda p: coreml_programs.load_coreml_program(coreml_programs.program_path(ctx['out'], p))
    reports = {p: coreml_programs.program_report(read(p)) for p in hg.ANE_PIECES}
    st = step_report(reports, cfg, B, T)
    return dict(seconds=round(time.perf_counter() - t0, 2), ops=sum(r['ops'] for r in reports.values()),
                live_mib=round(st['live_bytes'] / 2**20), largest_dim=st['largest_dim'],
                off_ane=sorted({k for r in reports.values() for k in r['off_ane']}),
                matmul_ratio=round(st['matmul_flops'] / st['analytic_matmul_flops'], 4),
                per_program={p: {k: r[k] for k in ('ops', 'outputs', 'peak_ops', 'flops', 'bytes_in', 'bytes_out',
                                                   'live_bytes', 'largest_dim')}
                             for p, r in reports.items()})


def coreml(ctx):
    """macOS: each program compiled into the trainer's cache (was it there?), loaded from it as
    the trainer loads it, its placement, and the median of three timed calls on CPU_AND_NE and
    on CPU_ONLY (wall time, the Python side's copies included)."""
    ct = settings.import_coremltools()
    cfg, B, T = hg.GPTConfig(**ctx['cfg']), ctx['B'], ctx['T']
    if coreml_programs.read_meta(ctx['out']) != coreml_programs.meta(cfg, B, T, hg.ANE_PIECES):
        raise hg.UserError(f"{ctx['out']} holds programs for other shapes: run the programs stage first")
    out = {}
    for piece in hg.ANE_PIECES:
        t0 = time.perf_counter()
        compiled, cached = coreml_programs.compiled_model(ctx['out'], piece)
        rec = dict(cached=cached, compile_s=round(time.perf_counter() - t0, 2),
                   placement=coreml_programs.macos_placement(compiled))
        inputs = {k: (np.random.default_rng(0).standard_normal(s) * 0.1).astype(np.float32)
                  for k, s in hg.piece_input_shapes(cfg, B, T, piece).items()}
        for units in ('CPU_AND_NE', 'CPU_ONLY'):
            t0 = time.perf_counter()
            m = ct.models.CompiledMLModel(compiled, compute_units=getattr(ct.ComputeUnit, units))
            if units == 'CPU_AND_NE':
                rec['load_s'] = round(time.perf_counter() - t0, 2)
            coreml_programs.coreml_predict(m, inputs)  # the first call may still specialize
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                coreml_programs.coreml_predict(m, inputs)
                times.append(time.perf_counter() - t0)
            rec[f'{units}_ms'] = round(1e3 * float(np.median(times)), 2)
        out[piece] = rec
    return out


def gradient_pair(ctx):
    """(the chained programs' loss and gradients, fp64 autograd's) on one random microbatch.
    Core ML on macOS; elsewhere the NumPy evaluator in its ANE mode, its tables' errors
    ctx['lut'] ({op: relative error}; programs.LUT_ERROR if absent)."""
    cfg, B, T = hg.GPTConfig(**ctx['cfg']), ctx['B'], ctx['T']
    torch.manual_seed(0)
    model = hg.GPT(cfg).double()
    idx, targets = (torch.randint(0, cfg.vocab_size, (B, T)) for _ in range(2))
    loss = 0.0
    for i in range(B):  # the mean's gradient one sequence at a time: an fp64 GPT-2 124M at 4x1024 at once takes ~15 GB
        l64 = model(idx[i:i + 1], targets[i:i + 1])[1] / B
        l64.backward()
        loss += l64.detach()
    engine = hg.coreml_engine(ctx['out'], hg.LossScaler(hg.Config.ane_loss_scale, 0))
    if not hg.ON_MAC:
        engine.predict = coreml_programs.numpy_programs(ctx['out'], engine.pieces, ane=True, lut=ctx.get('lut'))
    engine.load_weights(dict(model.named_parameters()))
    l, grads = engine.loss_and_grads(idx, targets)
    return l.item(), grads, loss.item(), {k: p.grad for k, p in model.named_parameters()}, engine


def gradients(ctx):
    """The chained programs (Core ML on macOS, the NumPy evaluator elsewhere) against fp64
    autograd on one random microbatch, judged by judge_gradients."""
    t0 = time.perf_counter()
    loss, grads, ref_loss, ref, engine = gradient_pair(ctx)
    out = judge_gradients(grads, ref)
    ratio = loss / ref_loss
    if not abs(ratio - 1) <= LOSS_OK:  # (a NaN fails too)
        out |= dict(passed=False, failures=['loss'] + out['failures'])
    return out | dict(loss=round(loss, 5), reference_loss=round(ref_loss, 5), loss_ratio=round(ratio, 6),
                      finite=bool(hg.grads_finite(grads)), seconds=round(time.perf_counter() - t0, 2),
                      largest_output=engine.scaler.peak)


def judge_gradients(grads, ref):
    """tools/gradcheck at fp16's tolerances: each tensor's cosine and norm ratio, each q/k/v
    third of c_attn apart (the key bias's exact gradient is 0, softmax ignores a shift:
    gradcheck leaves it out), and the worst per layer (a table's error shows in every layer
    alike, a derivation bug in one kind of part). 'passed' when no part fails."""
    rows = gradcheck.compare(grads, ref)
    bad = gradcheck.failures(rows, *gradcheck.TOLERANCE[torch.float16])
    worst = min(rows, key=lambda p: p.cosine)
    norm = max(rows, key=lambda p: abs(p.norm_ratio - 1))
    layers = {('other' if k is None else f'h{k}'): dict(worst_cosine=round(c, 6), worst_norm_error=round(n, 6))
              for k, (c, n) in gradcheck.by_layer(rows).items()}
    return dict(worst_cosine=round(worst.cosine, 6), worst=worst.name, worst_norm_ratio=round(norm.norm_ratio, 6),
                worst_norm=norm.name, per_layer=layers, failures=[p.name for p in bad][:10], passed=not bad)


def concurrency(ctx, watts=False):
    """macOS: the GPU engine and the ANE worker (Core ML), each alone and beside the other. The
    GPU engine's device is the trainer's default, resolve_device('auto'): MPS on a Mac; the
    engine is ctx's gpu_engine (export_ane.py --gpu_engine): PyTorch's autograd or MLX."""
    device = settings.resolve_device('auto', flag=None)
    engine = gpu_engine_class(ctx.get('gpu_engine', 'torch'))
    return overlap(hg.GPTConfig(**ctx['cfg']), ctx['gpu_batch'], ctx['B'], device, program_dir=ctx['out'],
                   gpu_iters=10, ane_iters=3, watts=watts, gpu_engine=engine)


def energy(ctx):
    """macOS with powermetrics: the watts of CPU, GPU and ANE while each engine runs alone.
    Skipped, before anything is measured, where sudo -n cannot run powermetrics."""
    ok, why = powermetrics_readable()
    if not ok:
        return dict(skipped=f"powermetrics cannot run ({why}); `sudo -v` and then `python export_ane.py --check "
                            "--stages energy` measures it alone, within sudo's 5 minutes")
    return concurrency(ctx, watts=True)


def projection(ctx):
    """From the measured times: tokens/s of gpu, ane and hetero (each engine's rate while the
    other runs, summed), the share of microbatches auto would give the ANE; and the memory a
    run of these settings takes against this machine's."""
    cfg = hg.Config(**ctx['cfg'], batch_size=ctx['gpu_batch'], ane_batch_size=ctx['B'])
    mem = memory.memory_estimate(cfg, 'hetero', torch.device('mps' if hg.ON_MAC else 'cpu'), torch.float32,
                                 hg.model_sizes(cfg), ctx['B'])  # the Mac's run
    out = dict(memory_gib=round(mem['total'] / 2**30, 2), machine_gib=round(memory.total_memory() / 2**30, 1),
               memory=mem)
    times = (ctx.get('results') or {}).get('concurrency')
    if times:
        tok = ctx['gpu_batch'] * ctx['T']
        r_gpu, r_ane = tok / times['gpu_beside'], tok / times['ane_beside']
        out |= dict(gpu_tokens_per_s=round(tok / times['gpu_alone']), ane_tokens_per_s=round(tok / times['ane_alone']),
                    hetero_tokens_per_s=round(r_gpu + r_ane), ane_share=round(r_ane / (r_gpu + r_ane), 3))
        if ctx.get("run_tokens"):  # the run the trainer starts with these flags, at each rate
            out['run'] = {m: round(ctx['run_tokens'] / out[f'{m}_tokens_per_s']) for m in ('gpu', 'ane', 'hetero')}
            out['run_tokens'] = ctx['run_tokens']
    else:
        out['tokens_per_s'] = 'needs macOS (the concurrency stage)'
    return out







def busy_until(timed, engine, batch, stop):
    """Thread body: one engine's calls until stop is set; once it is, a call that fails (its
    worker closed) ends the thread quietly."""
    try:
        timed(engine, batch, 1, stop)
    except BaseException:
        if not stop.is_set():
            raise


def overlap(cfg, gpu_batch, ane_batch, device, program_dir=None, gpu_iters=30, ane_iters=5,
            watts=False, dtype=torch.float32, ane_dtype='float32', threads=None,
            ane_microbatch=None, gpu_engine=hg.AutogradEngine):
    """The Mac's structure, timed: the GPU engine (gpu_engine on `device`, gpu_batch sequences a
    microbatch) in this process, the worker (Core ML on a Mac, on the programs in program_dir;
    else the eager derivation; ane_microbatch sequences a call, run ane_batch at a time) in its own; each alone, then each while the other computes, in one
    run. Medians in seconds: {gpu,ane}_{alone,beside}; exchange_{alone,beside}: this side's wall
    time per call minus the worker's own; with watts, each part's watts (powermetrics) alone;
    memory: the peaks measured (memory.measured) beside the estimate. gpu_engine: autograd, or
    MLX (tools/mlx_engine.py)."""
    from plumbing.energy import PowermetricsMeter
    ane_microbatch = ane_microbatch or gpu_batch
    torch.manual_seed(0)
    model = hg.GPT(cfg).to(device)
    gpu = gpu_engine(model, device, dtype)
    ane_cfg = hg.Config(**dataclasses.asdict(cfg), batch_size=ane_microbatch, ane_batch_size=ane_batch,
                        ane_programs=program_dir or '')
    # the worker: Core ML's programs on a Mac, else the eager derivation (settings.check's choice)
    run = settings.Run('hetero', device, dtype, torch.device('cpu'), getattr(torch, ane_dtype), ane_in_worker=True,
                       ane_programs=hg.ON_MAC, ane_batch_size=ane_batch)
    cores, here = worker.share_cores(gpu_on_cpu=device.type == 'cpu')
    torch.set_num_threads(here)  # (this process's threads and GIL switch interval, as training sets them)
    sys.setswitchinterval(worker.SWITCH_S)
    spec = hg.ane_spec(ane_cfg, run, threads or cores)
    w = worker.WorkerEngine(spec, hg.engine_from_spec, hg.LossScaler(1.0, 0, enabled=False))
    announce_segments(w.bufs.names.values())
    rand = lambda b: tuple(torch.randint(0, cfg.vocab_size, (b, cfg.block_size)) for _ in range(2))
    gb, ab = rand(gpu_batch), rand(ane_microbatch)
    w.load_weights(dict(model.named_parameters()))
    phase, exchanges = ['warm-up'], {}

    def timed(engine, batch, n, stop=None, seconds=0.0):  # n calls and `seconds`, or until stop is set
        out = []
        while len(out) < n or sum(out) < seconds or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            float(engine.loss_and_grads(*batch)[0])  # waits for the device (releases the GIL)
            out.append(time.perf_counter() - t0)
            if engine is w:
                exchanges.setdefault(phase[0], []).append(out[-1] - w.seconds)
            if stop is None and len(out) >= n and sum(out) >= seconds:
                break
        return out

    try:
        timed(gpu, gb, 3), timed(w, ab, 1)  # warm-up: kernels, the allocator, the worker's first call
        phase[0], res, power = 'alone', {}, {}
        for name, engine, batch, n in (('gpu', gpu, gb, gpu_iters), ('ane', w, ab, ane_iters)):
            meter = PowermetricsMeter() if watts else None
            try:  # the meter's sudo and powermetrics end however the timing ends
                t0, before = time.perf_counter(), dict(meter.parts) if meter else {}
                res[f'{name}_alone'] = timed(engine, batch, n, seconds=3.0 if meter else 0.0)  # (a dozen samples)
                if meter:
                    dt = time.perf_counter() - t0
                    power[f'{name}_alone_watts'] = {k: round((v - before.get(k, 0.0)) / dt, 2)
                                                    for k, v in meter.parts.items()}
            finally:
                if meter:
                    meter.close()
        phase[0] = 'beside'
        for busy, measured in (((w, ab), (gpu, gb, gpu_iters, 'gpu')), ((gpu, gb), (w, ab, ane_iters, 'ane'))):
            stop = threading.Event()
            bg = threading.Thread(target=busy_until, args=(timed, *busy, stop), daemon=True, name='beside')
            bg.start()
            try:
                time.sleep(0.5)  # the other engine well under way
                res[f'{measured[3]}_beside'] = timed(*measured[:3])
            finally:
                stop.set()  # the other engine's loop ends, however this one ended
            bg.join()
    finally:
        w.close()  # a call of the other engine under way fails, and its thread ends
        gpu.close()  # (MLX's: its thread and cache)
    out = {k: float(np.median(v)) for k, v in res.items()}
    out |= {f'{k}_spread': float(np.std(v) / np.median(v)) for k, v in res.items() if k.endswith('alone')}
    out |= {f'exchange_{k}': float(np.median(v)) for k, v in exchanges.items() if k != 'warm-up'}
    # the memory each side held, beside the estimate for a run of these sizes (to calibrate it)
    tcfg = hg.Config(**dataclasses.asdict(cfg), batch_size=gpu_batch, ane_batch_size=ane_batch)
    estimate = memory.memory_estimate(tcfg, 'hetero', device, dtype, hg.model_sizes(tcfg), ane_batch)
    mem = memory.measured(device, w, estimate)
    return out | power | dict(gpu_label=gpu.label, ane_label=w.label, memory=mem)


def main(cfg, B, T, out, gpu_batch, report, timeout, stages='', log=print, run_tokens=0, gpu_engine='torch'):
    """export_ane.py --check: every stage (or those named), then the report. Returns 0 if every
    stage that ran passed (a skipped one passes), 130 after Ctrl-C (the report holds the
    stages that finished), else 1. run_tokens: the tokens of the run the trainer starts with these flags.
    gpu_engine: the GPU engine the concurrency stage times beside the ANE, torch or mlx."""
    names = [n for n in stages.split(',') if n]
    if unknown := [n for n in names if n not in [s[0] for s in STAGES]]:
        raise hg.UserError(f"--stages {','.join(unknown)}: unknown; the stages are {', '.join(s[0] for s in STAGES)}")
    gpu_engine_class(gpu_engine)  # MLX missing: one line now, not a failed stage later
    ctx = dict(cfg=dataclasses.asdict(cfg), B=B, T=T, out=out, gpu_batch=gpu_batch, run_tokens=run_tokens,
               gpu_engine=gpu_engine)
    log(f"the self-check: programs for {cfg.n_layer} layers x {cfg.n_embd} wide, {B}x{T} tokens an ANE call, "
        f"exported and compiled into {out} (the trainer's folder for this run); Ctrl-C stops it and keeps the report")
    with progress.stop_signals():  # SIGTERM and SIGHUP stop it as Ctrl-C does
        records = run_all(ctx, [s for s in STAGES if not names or s[0] in names], timeout, log)
        with progress.hold_ctrl_c():  # the report is written whole
            _, written, how = write_report(records, ctx, report)
    md = os.path.splitext(written)[0] + '.md'
    stopped = next((r['name'] for r in records if r['status'] == 'interrupted'), None)
    if stopped:
        log(f"interrupted in stage {stopped}: the stages before it are in {md} ({how})")
        return progress.exit_code()
    log(f"wrote {md} (a verdict per stage) and {written} (everything: paste it into a bug report); {how}")
    bad = [n for n in (r['name'] for r in records if verdict_of(r)[0] in ('fail', 'failed', 'killed', 'timeout'))]
    for r in records:
        if verdict_of(r)[0] == 'warn':
            log(f"note, {r['name']}: {verdict_of(r)[1]}")
    if bad:
        log("FAILED: " + ', '.join(bad))
    return 1 if bad else 0
