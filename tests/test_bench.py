"""bench.py's arms with the MLX engine (--gpu_engine mlx, both): every number it prints, for
engines of known speed on clocks of the test's; the headline's place; the cooldowns; the one
line it says where MLX is missing; and one real tiny run with MLX's CPU backend."""
import importlib.util
import math
import sys

import pytest

import bench
import hetero_gpt as hg
import helpers
from helpers import Clock
from tools import ane_check

ARM_WATTS = {'gpu-torch': 10.0, 'gpu-mlx': 12.0, 'ane': 4.0, 'hetero-mlx': 13.0, 'hetero-torch': 14.0}


class MLXStandIn(hg.AutogradEngine):
    """The GPU engine that --gpu_engine mlx builds, here autograd under another label."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.label = 'MLX stand-in'


def test_both_engines_arms_on_engines_of_known_speed(data_dir, capsys, monkeypatch):
    # --gpu_engine both, 4 microbatches of 2 x 16 tokens a step. A microbatch takes PyTorch's
    # engine 2 s, MLX's 1 s and the ANE's stand-in 3 s (each engine's own clock, in its thread),
    # and a step takes bench's clock as long as its slower engine's share: so gpu-torch 8 s a
    # step, gpu-mlx 4 s, ane 12 s; hetero-mlx gives the ANE 4 * (1/3) / (1 + 1/3) = 1 of 4 (3 s
    # each side), hetero-torch round(4 * (1/3) / (1/2 + 1/3)) = 2 of 4 (4 s and 6 s). The meter
    # draws ARM_WATTS on bench's clock, so J/token is watts over tokens/s. Arms run in the
    # order of the brief, each after a cooldown of 7 s but the first
    seconds = {hg.AutogradEngine: 2.0, MLXStandIn: 1.0, hg.EagerEngine: 3.0}
    engine_clock, bench_clock = Clock(), Clock()
    built, sleeps = [], []
    for cls in (hg.AutogradEngine, hg.EagerEngine):
        def timed(self, idx, targets, inner=cls.loss_and_grads):
            engine_clock.advance(seconds[type(self)])
            return inner(self, idx, targets)
        monkeypatch.setattr(cls, 'loss_and_grads', timed)

    def step(self, microbatches, inner=hg.HeteroStep.__call__):
        out = inner(self, microbatches)
        bench_clock.advance(max(s.seconds for s in out.shares.values()))
        return out

    class PowerMeter:
        name, missing, meters = 'constant power', [], [1]

        def __init__(self, devices):  # built in the arm the ticker last named
            self.watts = ARM_WATTS[built[-1]]

        def joules(self):  # read without moving the clock: the arm's watts times its seconds
            return self.watts * getattr(bench_clock.local, 't', 0.0)

        def close(self):
            pass

    def engine_class(name):
        return MLXStandIn if name == 'mlx' else hg.AutogradEngine

    def tick(what):  # each arm's ticker names it first: the arm being built
        built.append(what.split(':')[0].strip())
        return Ticker(what)
    Ticker = bench.progress.Ticker
    monkeypatch.setattr(bench.progress, 'Ticker', tick)
    monkeypatch.setattr(hg.HeteroStep, '__call__', step)
    monkeypatch.setattr(hg, 'time', engine_clock)
    monkeypatch.setattr(bench, 'time', bench_clock)
    monkeypatch.setattr(bench_clock, 'sleep', sleeps.append, raising=False)
    monkeypatch.setattr(hg.energy, 'EnergyMeter', PowerMeter)
    monkeypatch.setattr(bench.ane_check, 'gpu_engine_class', engine_class)
    cfg, given = hg.parse_args(helpers.flags(data_dir, bench_iters=2, bench_repeats=1, gradient_accumulation_steps=4,
                                             gpu_engine='both', cooldown=7), bench.BenchConfig)
    rows = bench.bench(cfg, given)
    assert built == list(bench.ARMS['both']) == list(rows)
    assert sleeps == [7.0] * 4
    step_s = {'gpu-torch': 8.0, 'gpu-mlx': 4.0, 'ane': 12.0, 'hetero-mlx': 3.0, 'hetero-torch': 6.0}
    for arm, s in step_s.items():
        # 128 tokens a step; fp64 sums of whole seconds: exact to 1e-12
        assert rows[arm]['tok_s'] == pytest.approx(128 / s, rel=1e-12), arm
        assert rows[arm]['ms_step'] == pytest.approx(1000 * s, rel=1e-12), arm
        assert rows[arm]['j_tok'] == pytest.approx(ARM_WATTS[arm] * s / 128, rel=1e-12), arm
    assert [rows[a]['split'] for a in rows] == ['-', '-', '-', '1/4', '2/4']
    assert rows['hetero-mlx']['ms_engines'] == {'gpu': 3000.0, 'ane': 3000.0}
    assert rows['hetero-torch']['ms_engines'] == {'gpu': 4000.0, 'ane': 6000.0}
    assert rows['gpu-mlx']['engines'] == rows['hetero-mlx']['engines'].split(' + ')[0] == 'MLX stand-in'
    assert rows['gpu-torch']['engines'] == rows['hetero-torch']['engines'].split(' + ')[0] == 'autograd on cpu (float32)'

    out = capsys.readouterr().out
    summary = out[out.index('\n\n') + 2:].splitlines()
    # the headline first: 128/3 against 128/4 tokens/s; J/token 13 * 3/128 against 12 * 4/128
    assert summary[0] == ("headline, both engines against MLX alone, float32: hetero-mlx / gpu-mlx = 1.333x "
                          "tokens/s (43 against 32), J/token 0.3047 against 0.375 (-18.8%)")
    assert summary[1] == ("MLX against PyTorch, each alone, float32: gpu-mlx / gpu-torch = 2.000x tokens/s "
                          "(32 against 16), J/token 0.375 against 0.625 (-40.0%)")
    assert summary[2] == ("the paper's ratio (1.419x on an M4 Pro), float32: hetero-torch / gpu-torch = 1.333x "
                          "tokens/s (21 against 16), J/token 0.6562 against 0.625 (+5.0%)")
    assert summary[3] == ("split (auto): hetero-mlx gives the ANE 1 of 4 microbatches; "
                          "hetero-torch gives the ANE 2 of 4 microbatches")
    assert summary[4] == f"machine: {ane_check.machine_line(ane_check.machine())}"
    assert summary[5] == ("settings: a 1-layer 16-wide GPT-2, microbatches of 2 x 16 tokens, 4 a step, the GPU "
                          "engines in float32; rounds: 1 of 2 steps an arm (the median reported); cooldowns: 7 s")
    assert summary[7].split() == ['arm', 'tokens/s', 'x', 'gpu-mlx', 'J/token', 'energy', 'vs', 'gpu-mlx', 'ANE',
                                  'share']
    table = {line.split()[0]: line.split()[1:] for line in summary[8:13]}
    # each arm against MLX alone: 32 tokens/s at 0.375 J/token
    assert table == {'gpu-torch': ['16', '0.500', '0.625', '+66.7%', '-'],
                     'gpu-mlx': ['32', '1.000', '0.375', '+0.0%', '-'],
                     'ane': ['11', '0.333', '0.375', '+0.0%', '-'],
                     'hetero-mlx': ['43', '1.333', '0.3047', '-18.8%', '1/4'],
                     'hetero-torch': ['21', '0.667', '0.6562', '+75.0%', '2/4']}
    # each hetero arm against its engines' summed speeds alone: 128/3 over 32 + 128/12; 128/6 over 16 + 128/12
    assert summary[13].startswith('hetero-mlx / (gpu-mlx + ane alone) = 1.000 ')
    assert summary[14].startswith('hetero-torch / (gpu-torch + ane alone) = 0.800 ')
    assert len(summary) == 15  # a meter here: no line about its absence


def rows_of(speeds, joules=None):
    """bench rows: {arm: tokens/s}, J/token from joules ({arm: J/token}) or none without a meter."""
    joules = joules or {}
    return {arm: dict(tok_s=s, j_tok=joules.get(arm), split='-') for arm, s in speeds.items()}


def test_the_headline_comes_first_and_each_ratio_needs_both_its_arms():
    # the paper's M4 Pro row with MLX at the public M4 Max ratio (1.75x PyTorch's fp32): the
    # headline (hetero with MLX against MLX) leads, then MLX against PyTorch, then the paper's
    # ratio; --gpu_engine mlx prints the headline alone, torch the paper's ratio alone. No meter:
    # J/token n/a. Ratios of given floats: fp64, printed to 3 decimals
    rows = rows_of({'gpu-torch': 1000.0, 'gpu-mlx': 1750.0, 'ane': 600.0, 'hetero-mlx': 1925.0,
                    'hetero-torch': 1419.0})
    lines = bench.headline(rows, 'bfloat16')
    assert [line.split(':')[0] for line in lines] == [
        'headline, both engines against MLX alone, bfloat16', 'MLX against PyTorch, each alone, bfloat16',
        "the paper's ratio (1.419x on an M4 Pro), bfloat16"]
    assert [line.split(' = ')[1].split('x')[0] for line in lines] == ['1.100', '1.750', '1.419']
    assert all(line.endswith('J/token n/a') for line in lines)
    mlx = {a: rows[a] for a in bench.ARMS['mlx']}
    assert [line.split(': ')[1].split(' =')[0] for line in bench.headline(mlx, 'float32')] == ['hetero-mlx / gpu-mlx']
    torch_rows = rows_of({'gpu': 1000.0, 'ane': 600.0, 'hetero': 1419.0}, {'gpu': 0.01, 'ane': 0.004, 'hetero': 0.00691})
    assert bench.headline(torch_rows, 'float32') == [
        "the paper's ratio (1.419x on an M4 Pro), float32: hetero / gpu = 1.419x tokens/s (1,419 against 1,000), "
        "J/token 0.00691 against 0.01 (-30.9%)"]
    assert bench.table(rows)[-1] == "J/token n/a: no energy meter here (on a Mac, powermetrics needs `sudo -v`)"


def test_an_auto_split_that_gives_the_ane_nothing_is_a_result():
    # share 0 of 4 under auto: the GPU alone made the faster step (ProbingSplit), said as a
    # result; a fixed --ane_fraction of 0 is the user's choice and gets no such words
    rows = {'hetero-mlx': dict(split='0/4'), 'hetero-torch': dict(split='2/4')}
    assert bench.split_line(rows, auto=True) == (
        "split (auto): hetero-mlx gives the ANE 0 of 4 microbatches (here the GPU alone makes the faster step: "
        "a result, not a fault); hetero-torch gives the ANE 2 of 4 microbatches")
    assert bench.split_line(rows, auto=False) == (
        "split (--ane_fraction): hetero-mlx gives the ANE 0 of 4 microbatches; hetero-torch gives the ANE 2 of 4 "
        "microbatches")


def test_cooldown_is_30_s_on_a_mac_and_none_elsewhere(monkeypatch):
    assert bench.cooldown_seconds('auto') == 0.0 and bench.cooldown_seconds('2.5') == 2.5
    monkeypatch.setattr(hg, 'ON_MAC', True)
    assert bench.cooldown_seconds('auto') == 30.0 == bench.MAC_COOLDOWN_S and bench.cooldown_seconds('0') == 0.0
    for bad in ('-1', 'nan', 'inf', 'soon'):
        with pytest.raises(hg.UserError, match=f"--cooldown {bad}: use auto or a number of seconds >= 0"):
            bench.cooldown_seconds(bad)


@pytest.mark.parametrize('engine', ['mlx', 'both'])
def test_without_mlx_it_says_how_to_install_it_before_anything_runs(data_dir, capsys, monkeypatch, engine):
    # MLX not installed, as tools/mlx_engine.py finds it then: one line, exit 2, nothing run
    mlx_engine = pytest.importorskip('tools.mlx_engine')
    monkeypatch.setattr(mlx_engine, 'mx', None)
    with pytest.raises(SystemExit) as e:
        hg.main(helpers.flags(data_dir, gpu_engine=engine), job=bench.bench, cls=bench.BenchConfig)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == '' and err == f"error: {mlx_engine.INSTALL}\n"
    assert 'pip install' in mlx_engine.INSTALL


def test_the_mlx_arms_refuse_float16_before_any_arm_runs(data_dir, capsys):
    # the MLX engine trains in float32 or bfloat16 (no loss scaling): said at once, not after
    # PyTorch's arm (which takes fp16) has run
    pytest.importorskip('mlx.core')
    pytest.importorskip('tools.mlx_engine')
    with pytest.raises(SystemExit) as e:
        hg.main(helpers.flags(data_dir, gpu_engine='both', dtype='float16'), job=bench.bench, cls=bench.BenchConfig)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and 'building' not in out
    assert err == "error: --gpu_engine both: the MLX engine trains in float32 or bfloat16, not float16\n"


def test_without_the_mlx_engine_file_it_says_so(data_dir, capsys, monkeypatch):
    # a fork that deleted tools/mlx_engine.py (None in sys.modules: its import fails as a
    # missing file's does)
    import tools
    monkeypatch.delattr(tools, 'mlx_engine', raising=False)
    monkeypatch.setitem(sys.modules, 'tools.mlx_engine', None)
    with pytest.raises(SystemExit) as e:
        hg.main(helpers.flags(data_dir, gpu_engine='mlx'), job=bench.bench, cls=bench.BenchConfig)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --gpu_engine mlx needs tools/mlx_engine.py, which is absent\n"


def test_a_gpu_engine_bench_does_not_know_is_one_line(data_dir, capsys):
    with pytest.raises(SystemExit) as e:
        hg.main(helpers.flags(data_dir, gpu_engine='metal'), job=bench.bench, cls=bench.BenchConfig)
    assert e.value.code == 2 and capsys.readouterr().err == "error: --gpu_engine metal: use torch, mlx or both\n"


def test_the_machine_line():
    # what bench prints of machine(): the chip, its GPU cores, memory, OS and power source, then
    # the versions; MLX's TF32 switch only where MLX is installed and the switch is set
    info = dict(chip='Apple M4 Pro', gpu_cores=20, memory_gib=48.0, os='macOS 15.5', power='AC Power',
                python='3.12.4', torch='2.13.0', mlx='0.32.4', coremltools='9.0', mlx_enable_tf32='0')
    assert ane_check.machine_line(info) == ("Apple M4 Pro, 20 GPU cores, 48 GiB, macOS 15.5, AC Power; Python 3.12.4, "
                                            "torch 2.13.0, mlx 0.32.4, coremltools 9.0, MLX_ENABLE_TF32=0")
    info |= dict(chip=None, gpu_cores=None, power=None, os='Linux', mlx=None, memory_gib=23.5)
    assert ane_check.machine_line(info) == "unknown chip, 23.5 GiB, Linux; Python 3.12.4, torch 2.13.0, coremltools 9.0"
    here = ane_check.machine()
    assert here['gpu_cores'] is None and here['power'] is None and not math.isnan(here['memory_gib'])


@pytest.mark.skipif(importlib.util.find_spec('mlx') is None or importlib.util.find_spec('tools.mlx_engine') is None,
                    reason="needs MLX (pip install 'mlx[cpu]') and tools/mlx_engine.py")
def test_both_engines_for_real(data_dir, capsys, monkeypatch):
    # one real run of every arm on the CPU, MLX's included, on the tiny model; bench's clock ticks
    # a second a reading, so each warm-up is its 5 steps. Every arm trains the same batches from
    # the same weights, so it is the engines that differ: MLX's label in its arms
    monkeypatch.setattr(bench, 'time', Clock(tick=1.0))
    cfg, given = hg.parse_args(helpers.flags(data_dir, bench_iters=1, bench_repeats=1, gpu_engine='both',
                                             ane_fraction=0.5), bench.BenchConfig)
    rows = bench.bench(cfg, given)
    assert list(rows) == list(bench.ARMS['both'])
    assert 'MLX' in rows['gpu-mlx']['engines'] and 'MLX' in rows['hetero-mlx']['engines'].split(' + ')[0]
    assert 'autograd' in rows['gpu-torch']['engines'] and rows['hetero-mlx']['split'] == '1/2'
    out = capsys.readouterr().out
    assert out[out.index('\n\n') + 2:].startswith('headline, both engines against MLX alone, float32: ')


# ---- the self-check's concurrency stage with MLX (export_ane.py --check --gpu_engine mlx)

def test_the_concurrency_stage_times_the_gpu_engine_it_is_named(monkeypatch):
    # the stage's GPU engine is the one its context names: autograd by default, MLX's with
    # gpu_engine 'mlx' (export_ane.py passes --gpu_engine there); measured beside the worker
    import types
    got = []
    monkeypatch.setattr(ane_check, 'overlap', lambda *a, **k: got.append(k['gpu_engine']) or {})
    import tools
    engine = types.SimpleNamespace(MLXEngine=MLXStandIn, require_mlx=lambda: None)
    monkeypatch.setitem(sys.modules, 'tools.mlx_engine', engine)
    monkeypatch.setattr(tools, 'mlx_engine', engine, raising=False)  # (where the real one was imported)
    ctx = dict(cfg=dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100), gpu_batch=2, B=2, out='p')
    ane_check.concurrency(ctx)
    ane_check.concurrency(ctx | dict(gpu_engine='mlx'))
    assert got == [hg.AutogradEngine, MLXStandIn]


@pytest.mark.slow  # a worker process and seconds of each engine beside the other
def test_overlap_times_the_gpu_engine_it_is_given():
    # the engines alone and beside each other, off a Mac (the worker runs the eager derivation):
    # the GPU engine given is the one timed, and its label is in the record
    cfg = hg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)
    r = ane_check.overlap(cfg, 2, 2, hg.torch.device('cpu'), gpu_iters=2, ane_iters=1, gpu_engine=MLXStandIn)
    assert r['gpu_label'] == 'MLX stand-in' and r['gpu_alone'] > 0 and r['gpu_beside'] > 0


def test_the_self_check_without_mlx_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    # before any stage runs: one line, exit 2, no report written
    import export_ane
    mlx_engine = pytest.importorskip('tools.mlx_engine')
    monkeypatch.setattr(mlx_engine, 'mx', None)
    report = tmp_path / 'check.json'
    code = export_ane.main(['--n_layer', '1', '--n_head', '2', '--n_embd', '32', '--block_size', '32', '--check',
                            '--gpu_engine', 'mlx', '--check_report', str(report), '--out', str(tmp_path / 'p')])
    out, err = capsys.readouterr()
    assert code == 2 and err == f"error: {mlx_engine.INSTALL}\n"
    assert not report.exists() and 'stage' not in out
