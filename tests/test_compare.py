"""compare.py: its statistics against known values, and the whole comparison end to end on
a tiny CPU configuration (a data set the test writes)."""
import argparse
import json
import math
import os

import numpy as np
import pytest

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


def tiny(data_dir, out_dir, *extra):
    return ['--seeds', '2', '--out_dir', str(out_dir), '--dataset', 'tiny', '--data_dir', data_dir,
            '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '16', '--batch_size', '4',
            '--gradient_accumulation_steps', '2', '--max_iters', '6', '--eval_interval', '3',
            '--warmup_iters', '2', '--device', 'cpu', '--ane_dtype', 'float32', '--ane_fraction', '0.5'] + list(extra)


def test_compare_end_to_end_and_reuse(data_dir, tmp_path, capsys):
    out = tmp_path / 'cmp'
    summary = compare.main(tiny(data_dir, out))
    printed = capsys.readouterr().out
    saved = json.loads((out / 'summary.json').read_text())
    assert set(saved['modes']) == {'gpu', 'ane', 'hetero'}
    for m, s in saved['modes'].items():
        assert len(s['final_val_ppl']) == 2 and all(math.isfinite(p) and p > 1 for p in s['final_val_ppl'])
        assert s['ci'][0] <= s['mean'] <= s['ci'][1] and s['tokens_per_s'] > 0
        rows = compare.read_metrics(out / f'{m}_s1' / 'metrics.jsonl')
        assert [r['step'] for r in rows if 'val_ppl' in r] == [3, 6]
    for test in ('tost_hetero_vs_gpu', 'ttest_ane_vs_gpu'):
        assert 0.0 <= saved[test]['p'] <= 1.0
    assert 0.0 <= saved['tost_hetero_vs_gpu']['p_lower'] <= 1.0
    assert 'paired TOST' in printed and 'paired t-test' in printed
    # hetero with an fp32 stand-in for the ANE is GPU-only up to rounding: equivalent
    assert saved['tost_hetero_vs_gpu']['equivalent']
    assert summary['modes']['gpu']['final_val_ppl'] == saved['modes']['gpu']['final_val_ppl']
    try:
        import matplotlib  # noqa: F401
        assert saved['plot'] and (out / 'compare.png').stat().st_size > 0
    except ImportError:
        assert saved['plot'] is None and 'pip install matplotlib' in printed

    # the same command again retrains nothing
    stamp = os.path.getmtime(out / 'gpu_s1' / 'metrics.jsonl')
    again = compare.main(tiny(data_dir, out))
    assert capsys.readouterr().out.count('finished run found, reused') == 6
    assert os.path.getmtime(out / 'gpu_s1' / 'metrics.jsonl') == stamp
    assert again['modes'] == summary['modes']

    # other settings in the same out_dir are refused, not mixed in
    with pytest.raises(SystemExit) as e:
        compare.main(tiny(data_dir, out, '--learning_rate', '1e-2'))
    assert e.value.code == 2 and 'other settings' in capsys.readouterr().err


def test_interrupted_comparison_resumes(data_dir, tmp_path, capsys, ctrl_c):
    # Ctrl-C at step 4 of the first run (a checkpoint is saved at step 3): compare stops,
    # and the same command continues that run with --resume, giving the same perplexity as
    # the run straight through (bit for bit on the CPU)
    straight = compare.main(tiny(data_dir, tmp_path / 'a'))
    ctrl_c.at(4)
    with pytest.raises(SystemExit) as e:
        compare.main(tiny(data_dir, tmp_path / 'b'))
    assert e.value.code == 2 and 'run the same command again' in capsys.readouterr().err
    ctrl_c.off()
    resumed = compare.main(tiny(data_dir, tmp_path / 'b', '--drop_checkpoints'))
    assert 'resumed from' in capsys.readouterr().out
    # --drop_checkpoints: finished runs keep their metrics, not their checkpoints
    assert not list((tmp_path / 'b').glob('*/ckpt.pt')) and len(list((tmp_path / 'a').glob('*/ckpt.pt'))) == 6
    compare.main(tiny(data_dir, tmp_path / 'a', '--drop_checkpoints'))  # reused runs drop theirs too
    assert capsys.readouterr().out.count('finished run found, reused') == 6
    assert not list((tmp_path / 'a').glob('*/ckpt.pt'))
    for m in ('gpu', 'ane', 'hetero'):
        assert resumed['modes'][m]['final_val_ppl'] == pytest.approx(straight['modes'][m]['final_val_ppl'], rel=1e-9)


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
