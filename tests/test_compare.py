"""compare.py: its statistics against known values, and the whole comparison end to end on
a tiny CPU configuration (a data set the test writes)."""
import argparse
import contextlib
import io
import json
import math
import os

import numpy as np
import torch
import pytest

import hetero_gpt as hg
import helpers
from conftest import CtrlC
from tools import compare

# ---- the Student-t distribution


def test_t_cdf_known_values():
    for df in (1, 2, 5, 30, 1e4):
        assert compare.t_cdf(0.0, df) == 0.5
    assert compare.t_cdf(2.228138851986, 10) == pytest.approx(0.975, abs=1e-6)  # t_(0.975, 10)
    assert compare.t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)             # Cauchy: 1/2 + atan(t)/pi
    assert compare.t_cdf(-1.0, 1) == pytest.approx(0.25, abs=1e-12)
    assert compare.t_cdf(1.959964, 1e6) == pytest.approx(0.975, abs=1e-6)      # -> the normal CDF
    assert compare.t_cdf(math.inf, 3) == 1.0 and compare.t_cdf(-math.inf, 3) == 0.0
    for t in (-30.0, -3.0, -0.4, 0.05, 1.7, 12.0):
        assert compare.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-10)
        assert compare.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-10)
        assert compare.t_cdf(t, 7) + compare.t_cdf(-t, 7) == pytest.approx(1.0, abs=1e-14)
    with pytest.raises(ValueError):
        compare.t_cdf(1.0, 0)


def test_t_ppf_inverts_t_cdf():
    assert compare.t_ppf(0.975, 10) == pytest.approx(2.228138851986, abs=1e-8)
    assert compare.t_ppf(0.5, 4) == pytest.approx(0.0, abs=1e-10)
    for df in (1, 2, 3.5, 10, 200):
        for p in (1e-6, 0.025, 0.3, 0.9, 0.999):
            assert compare.t_cdf(compare.t_ppf(p, df), df) == pytest.approx(p, rel=1e-8)
    with pytest.raises(ValueError):
        compare.t_ppf(1.0, 5)


def test_summarize():
    s = compare.summarize([1.0, 2.0, 3.0])  # mean 2, sd 1, CI 2 +- t_(0.975, 2) / sqrt(3)
    h = 4.302652729911275 / math.sqrt(3)
    assert (s['n'], s['mean'], s['sd']) == (3, 2.0, 1.0)
    assert s['ci'] == pytest.approx([2 - h, 2 + h], rel=1e-9)
    with pytest.raises(ValueError):
        compare.summarize([1.0])

# ---- the tests on paired perplexities


def test_tost_equivalent_when_ratios_are_tight_around_one():
    ratios = [1.001, 0.999, 1.0005, 0.9995, 1.0]
    r = compare.tost_paired(ratios, [1.0] * 5, margin=0.01, alpha=0.05)
    assert r['equivalent'] and r['p'] < 1e-3
    assert r['ci'][0] > 0.99 and r['ci'][1] < 1.01 and r['ci_level'] == pytest.approx(0.9)
    assert r['p'] == max(r['p_lower'], r['p_upper'])
    # only the ratio matters: scaling both perplexities changes nothing
    s = compare.tost_paired(np.array(ratios) * 40, [40.0] * 5)
    assert s['p'] == pytest.approx(r['p'], rel=1e-6)


def test_tost_not_equivalent_when_off_or_noisy():
    off = compare.tost_paired([1.03, 1.031, 1.029, 1.0305], [1.0] * 4, margin=0.01)
    assert not off['equivalent'] and off['p_upper'] > 0.99 and off['p_lower'] < 0.01
    noisy = compare.tost_paired([1.03, 0.97, 1.0], [1.0] * 3, margin=0.01)  # mean ~1, spread +-3%
    assert not noisy['equivalent'] and noisy['p'] > 0.2
    assert noisy['ci'][0] < 0.99 < 1.01 < noisy['ci'][1]


def test_tost_identical_runs():
    same = compare.tost_paired([1.002] * 3, [1.0] * 3)  # se = 0, inside the margin
    assert same['equivalent'] and same['p'] == 0.0
    outside = compare.tost_paired([1.02] * 3, [1.0] * 3)
    assert not outside['equivalent'] and outside['p'] == 1.0


def test_paired_ttest():
    rng = np.random.default_rng(0)
    shifted = np.exp(0.02 + 0.002 * rng.standard_normal(5))  # ANE-like: 2% worse, little noise
    r = compare.paired_ttest(30 * shifted, [30.0] * 5)
    assert r['p'] < 0.05 and r['direction'] == 'higher' and r['significant']
    same = compare.paired_ttest(np.exp([0.01, -0.01, 0.005, -0.005]), [1.0] * 4)  # symmetric noise
    assert same['p'] > 0.05 and not same['significant']
    # d = [1, 2, 3]: mean 2, sd 1, t = 2 sqrt(3), df 2; for df 2, cdf(t) = 1/2 + t / (2 sqrt(2 + t^2))
    h = compare.paired_ttest(np.exp([1.0, 2.0, 3.0]), [1.0] * 3)
    t = 2 * math.sqrt(3)
    assert h['t'] == pytest.approx(t) and h['df'] == 2
    assert h['p'] == pytest.approx(2 * (0.5 - t / (2 * math.sqrt(2 + t * t))), rel=1e-10)  # 0.0742
    assert h['p'] == pytest.approx(0.0742, abs=1e-4)
    assert compare.paired_ttest([5.0, 6.0], [5.0, 6.0])['p'] == 1.0
    with pytest.raises(ValueError):
        compare.paired_ttest([1.0], [1.0])
    with pytest.raises(ValueError):
        compare.tost_paired([1.0, -1.0], [1.0, 1.0])

# ---- end to end

# 2 microbatches of 4 sequences, 6 steps, validation at 3 and 6; the fp16 stand-in, half of
# hetero's microbatches (fp32 would give GPU-only's perplexities to the bit here, as Adam's first
# steps are nearly g / |g|: the statistics would see no spread), and a rate of 1e-2, so that its
# rounding moves each seed's losses apart by more than fp32's last bits (at 1e-3 both seeds'
# hetero/GPU ratios were the same 2^-18); compare sets --eval_iters itself
COMPARE = helpers.TINY | dict(batch_size=4, max_iters=6, eval_interval=3, ane_dtype='float16', ane_fraction=0.5,
                              learning_rate=1e-2, eval_iters=None)


def tiny(data_dir, out_dir, *extra):
    return ['--seeds', '2', '--out_dir', str(out_dir)] + helpers.flags(data_dir, None, COMPARE) + list(extra)


@pytest.fixture(scope='module')
def comparison(data_dir, tmp_path_factory):
    """A comparison stopped by Ctrl-C at step 4 of its first run (a checkpoint is saved at
    step 3), then the same command again: (out_dir, what each call printed, the summary)."""
    out, said = tmp_path_factory.mktemp('compare') / 'cmp', []
    with pytest.MonkeyPatch.context() as m:
        ctrl_c = CtrlC(m)
        ctrl_c.at(4)
        with contextlib.redirect_stdout(io.StringIO()) as o, contextlib.redirect_stderr(io.StringIO()) as e:
            with pytest.raises(SystemExit) as stop:
                compare.main(tiny(data_dir, out))
        said.append((stop.value.code, o.getvalue(), e.getvalue()))
        ctrl_c.off()
        with contextlib.redirect_stdout(io.StringIO()) as o:
            summary = compare.main(tiny(data_dir, out))
        said.append((0, o.getvalue(), ''))
    return out, said, summary


def cauchy_cdf(t):  # Student's t with 1 degree of freedom (2 seeds)
    return 0.5 + math.atan(t) / math.pi


def test_compare_end_to_end(comparison):
    out, said, summary = comparison
    printed = said[1][1]
    saved = json.loads((out / 'summary.json').read_text())
    assert set(saved['modes']) == {'gpu', 'ane', 'hetero'}
    ppl = {}
    for m, s in saved['modes'].items():
        rows = {seed: compare.read_metrics(out / f'{m}_s{seed}' / 'metrics.jsonl') for seed in (1, 2)}
        assert all([r['step'] for r in rows[seed] if 'val_ppl' in r] == [3, 6] for seed in (1, 2))
        ppl[m] = np.array([rows[seed][-1]['val_ppl'] for seed in (1, 2)])  # the runs' own last rows
        assert s['final_val_ppl'] == ppl[m].tolist() and all(math.isfinite(p) and p > 1 for p in ppl[m])
        # mean, sd, and the 95% CI mean +- t_(0.975, 1) sd / sqrt(2), t_(0.975, 1) = tan(0.475 pi)
        mean, sd = ppl[m].mean(), ppl[m].std(ddof=1)
        h = math.tan(0.475 * math.pi) * sd / math.sqrt(2)
        assert (s['n'], s['mean'], s['sd']) == (2, pytest.approx(mean, rel=1e-12), pytest.approx(sd, rel=1e-9))
        assert s['ci'] == pytest.approx([mean - h, mean + h], rel=1e-9) and s['tokens_per_s'] > 0
    # the tests on the paired ratios, by hand: d = ln(test / ref), se = sd(d) / sqrt(2), df 1
    d = np.log(ppl['hetero'] / ppl['gpu'])
    se = d.std(ddof=1) / math.sqrt(2)
    assert se > 0, d  # the seeds' ratios differ (the fp16 stand-in): else the p-values divide by 0
    tost = saved['tost_hetero_vs_gpu']
    assert tost['p_lower'] == pytest.approx(1 - cauchy_cdf((d.mean() - math.log(0.99)) / se), rel=1e-6, abs=1e-12)
    assert tost['p_upper'] == pytest.approx(cauchy_cdf((d.mean() - math.log(1.01)) / se), rel=1e-6, abs=1e-12)
    assert tost['p'] == max(tost['p_lower'], tost['p_upper'])
    d = np.log(ppl['ane'] / ppl['gpu'])
    assert d.std(ddof=1) > 0, d
    t = d.mean() / (d.std(ddof=1) / math.sqrt(2))
    assert saved['ttest_ane_vs_gpu']['p'] == pytest.approx(2 * cauchy_cdf(-abs(t)), rel=1e-6)
    assert 'paired TOST' in printed and 'paired t-test' in printed
    # hetero with the fp16 stand-in is GPU-only up to fp16 rounding (1e-5 of the perplexity): equivalent
    assert saved['tost_hetero_vs_gpu']['equivalent']
    try:
        import matplotlib  # noqa: F401
        assert saved['plot'] and (out / 'compare.png').stat().st_size > 0
    except ImportError:
        assert saved['plot'] is None and 'pip install matplotlib' in printed


def test_interrupted_comparison_resumes(data_dir, comparison, tmp_path):
    # Ctrl-C at step 4 of the first run: compare stopped and said to run it again, which
    # continued that run with --resume, to the perplexity of the run straight through (bit
    # for bit on the CPU)
    out, said, summary = comparison
    assert said[0][0] == 2 and 'run the same command again' in said[0][2] and 'resumed from' in said[1][1]
    assert said[1][1].count('finished run found, reused') == 0
    straight = compare.run_one(helpers.flags(data_dir, None, COMPARE), 'gpu', 1, str(tmp_path), drop_checkpoint=True)
    assert straight[-1]['val_ppl'] == summary['modes']['gpu']['final_val_ppl'][0]
    # --drop_checkpoints: a finished run keeps its metrics, not its checkpoint
    assert (tmp_path / 'gpu_s1' / 'metrics.jsonl').exists() and not (tmp_path / 'gpu_s1' / 'ckpt.pt').exists()


def test_the_same_command_again_retrains_nothing(data_dir, comparison, capsys):
    out, said, summary = comparison
    stamp = os.path.getmtime(out / 'gpu_s1' / 'metrics.jsonl')
    again = compare.main(tiny(data_dir, out))
    assert capsys.readouterr().out.count('finished run found, reused') == 6
    assert os.path.getmtime(out / 'gpu_s1' / 'metrics.jsonl') == stamp
    assert again['modes'] == summary['modes']

    # other settings in the same out_dir are refused, not mixed in
    with pytest.raises(SystemExit) as e:
        compare.main(tiny(data_dir, out, '--learning_rate', '2e-2'))
    assert e.value.code == 2 and 'other settings' in capsys.readouterr().err
    # --drop_checkpoints on finished runs that are reused: they drop theirs too
    assert len(list(out.glob('*/ckpt.pt'))) == 6
    compare.main(tiny(data_dir, out, '--drop_checkpoints'))
    assert capsys.readouterr().out.count('finished run found, reused') == 6
    assert not list(out.glob('*/ckpt.pt'))


def test_bad_arguments(data_dir, tmp_path, capsys):
    for extra, message in ((['--seeds', '1'], 'at least 2 seeds'),
                           (['--seed', '5'], 'sets --seed itself'),
                           (['--mode', 'gpu'], 'sets --mode itself'),
                           (['--margin', '0'], '--margin')):
        with pytest.raises(SystemExit) as e:
            compare.main(tiny(data_dir, tmp_path / 'x', *extra))
        assert e.value.code == 2 and message in capsys.readouterr().err, extra
    assert not (tmp_path / 'x').exists()


def test_seed_lists():
    # a count means 1..N; lists and ranges let two machines run disjoint seeds of one comparison
    assert compare.seed_list('3') == [1, 2, 3]
    assert compare.seed_list('1-4,9') == [1, 2, 3, 4, 9]
    assert compare.seed_list('5,7') == [5, 7]
    for bad in ('0-2', '1,1', 'a', '2-x', '', '5-3'):
        with pytest.raises(argparse.ArgumentTypeError):
            compare.seed_list(bad)


def test_timed_evaluations(data_dir, tmp_path, ctrl_c, monkeypatch):
    # tools.compare's --eval_seconds 1 (its hook): an evaluation each time the training time passes a multiple of 1 s.
    # The trainer's clock is the test's: each step takes 0.25 s, so steps 4 and 8 evaluate
    # (and only steps 5 and 10 are due by --eval_interval); a run stopped at step 6 and
    # resumed evaluates at step 8 once more, as the run straight through does
    clock = helpers.Clock()
    real_step = hg.HeteroStep.__call__
    real_mb = hg.AutogradEngine.loss_and_grads
    monkeypatch.setattr(hg, 'time', clock)  # each thread's, moved only here: 0.25 s a step, however often it is read
    monkeypatch.setattr(hg.HeteroStep, '__call__', lambda self, mbs: (real_step(self, mbs), clock.advance(0.25))[0])
    monkeypatch.setattr(hg.AutogradEngine, 'loss_and_grads', lambda *a: (clock.advance(0.125), real_mb(*a))[1])
    timed = dict(max_iters=10, log_interval=100)

    def train(out_dir, start=0.0, **settings):
        cfg, given = hg.parse_args(helpers.flags(data_dir, out_dir, **timed, **settings))
        hg.train(cfg, given, on_step=compare.TimedEvals(1.0, start))
        return helpers.rows(out_dir)
    straight = train(tmp_path / 'a')
    assert [(r['step'], r.get('eval_at_seconds')) for r in straight] == [(4, 1.0), (5, None), (8, 2.0), (10, None)]
    assert all('val_loss' in r for r in straight) and [r['elapsed'] for r in straight] == [1.0, 1.25, 2.0, 2.5]
    ctrl_c.at(6)
    train(tmp_path / 'b')
    ctrl_c.off()
    start = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)['elapsed']  # as compare reads it
    resumed = train(tmp_path / 'b', start, resume=True)
    assert [(r['step'], r.get('eval_at_seconds'), r['elapsed']) for r in resumed] == [
        (r['step'], r.get('eval_at_seconds'), r['elapsed']) for r in straight]
    assert [r['val_loss'] for r in resumed] == [r['val_loss'] for r in straight]
