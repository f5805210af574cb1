"""The Core ML program, built and saved on Linux, read back from disk and evaluated op by
op in NumPy in its own precision (fp16), against fp64 autograd."""
import numpy as np
import pytest
import torch

import export_ane
import hetero_gpt as hg

pytest.importorskip('coremltools')  # (the machines that lend a GPU may not have it)

# vocabulary 20000 > 16384: two chunks; T = 7: not a power of two; 4 heads
CFG = hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=32)
B, T = 3, 7


@pytest.fixture(scope='module')
def package(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('ane') / 'tiny.mlpackage')
    export_ane.export_coreml(CFG, B, T, path)
    return path


def reference(seed=0):
    torch.manual_seed(seed)
    model = hg.GPT(CFG).double()
    idx, targets = (torch.randint(0, CFG.vocab_size, (B, T)) for _ in range(2))
    _, loss = model(idx, targets)
    loss.backward()
    return model, idx, targets, loss.item()


def test_saved_program_matches_autograd(package):
    # fp16 program (unit roundoff 4.9e-4): the loss, a mean of log-sum-exps of ~10, within
    # 1e-2 relative; gradients compared by direction (cosine >= 0.999), all finite.
    model, idx, targets, ref_loss = reference()
    engine = hg.CoreMLEngine(package, config=CFG, microbatch=(B, T), scaler=hg.LossScaler(1024.0, 0))
    assert not engine.holds_gil  # the NumPy evaluator, not Core ML
    engine.load_weights(dict(model.named_parameters()))
    loss, grads = engine.loss_and_grads(idx, targets)
    assert abs(loss.item() - ref_loss) / ref_loss < 1e-2
    assert hg.grads_finite(grads)
    for k, p in model.named_parameters():
        assert grads[k].shape == p.shape
        cos = torch.nn.functional.cosine_similarity(grads[k].double().flatten(), p.grad.flatten(), dim=0).item()
        assert cos >= 0.999, (k, cos)


def test_program_is_ane_shaped(package):
    r = export_ane.program_report(export_ane.load_coreml_program(package), CFG, B, T)
    assert not set(r['op_types']) & {'gather', 'gather_nd', 'one_hot', 'scatter', 'scatter_nd', 'concat', 'gelu'}
    assert r['off_ane'] == []
    assert r['largest_dim'] <= hg.ANE_MAX_DIM and r['max_rank'] <= 5
    # every matmul of the derivation and nothing else: the exact analytic count; the sums and
    # means are matmuls with a constant vector too (the ANE's reduce_sum is fp16), counted apart
    assert r['matmul_flops'] == r['analytic_matmul_flops']
    assert not {'reduce_sum', 'reduce_mean'} & set(r['op_types']) and 0 < r['sum_flops'] < 0.05 * r['matmul_flops']
    # fp16 in and out: 2 bytes per element of every input and output
    shapes = hg.dense_input_shapes(CFG, B, T)
    n_in = sum(int(np.prod(s)) for s in shapes.values())
    assert r['bytes_in'] == 2 * n_in
    assert r['bytes_out'] == 2 * (n_in - 1 + 1)  # a gradient per input but loss_scale, plus the (1, 1) loss


def test_flops_for_gpt2_124m_analytic_within_2_percent():
    # the analytic count for GPT-2 124M at B=4, T=1024 against the usual 6*N*params + attention
    exact, estimate = export_ane.analytic_flops(hg.GPTConfig(), 4, 1024)
    assert abs(exact / estimate - 1) < 0.02


def test_package_for_other_shapes_is_refused(package):
    other = hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=3, n_head=4, n_embd=32)
    with pytest.raises(hg.UserError, match='export_ane.py'):
        hg.CoreMLEngine(package, config=other)
    with pytest.raises(hg.UserError, match='microbatch 3x7'):
        hg.CoreMLEngine(package, microbatch=(4, 7))
    engine = hg.CoreMLEngine(package, predict=lambda inputs: pytest.fail('must not run'))
    engine.load_weights(dict(reference()[0].named_parameters()))
    with pytest.raises(hg.UserError, match='re-export'):
        engine.loss_and_grads(torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))


def test_weights_of_another_model_are_refused(package):
    engine = hg.CoreMLEngine(package, predict=lambda inputs: pytest.fail('must not run'))
    other = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=20000, n_layer=2, n_head=4, n_embd=64))
    with pytest.raises(hg.UserError, match='export_ane.py'):
        engine.load_weights(dict(other.named_parameters()))


def test_not_a_package(tmp_path):
    with pytest.raises(hg.UserError, match='no Core ML package'):
        hg.CoreMLEngine(str(tmp_path / 'missing.mlpackage'))
    (tmp_path / 'junk.mlpackage').mkdir()
    with pytest.raises(hg.UserError, match='not a HeteroEngine Core ML package'):
        hg.CoreMLEngine(str(tmp_path / 'junk.mlpackage'))


def test_custom_predict_and_input_lifetime(package):
    # a test's own predict (here: the NumPy evaluator wrapped) receives the inputs by the
    # program's names, in fp32 (which coremltools wraps without converting), in the engine's
    # persistent buffers (Core ML frees its inputs late: these are never freed under it)
    seen = {}
    evaluate = export_ane.numpy_predict(export_ane.load_coreml_program(package))

    def predict(inputs):
        seen.update(inputs)
        return evaluate(inputs)
    engine = hg.CoreMLEngine(package, predict=predict)
    model, idx, targets, ref_loss = reference(1)
    engine.load_weights(dict(model.named_parameters()))
    engine.loss_and_grads(idx, targets)
    assert set(seen) == set(hg.dense_input_shapes(CFG, B, T))
    assert all(v.dtype == np.float32 for v in seen.values())
    assert all(seen[k] is engine.inputs[k] for k in seen)


def test_export_cli_refuses_too_many_tokens(tmp_path, capsys):
    rc = export_ane.main(['--n_layer', '1', '--n_head', '1', '--n_embd', '8', '--block_size', '1024',
                          '--vocab_size', '50', '--microbatch', '17', '--out', str(tmp_path / 'x.mlpackage')])
    assert rc == 2 and 'at most 16384' in capsys.readouterr().err


def test_trainer_exports_once_and_reuses(tmp_path):
    # what --mode ane/hetero does on macOS: export for the run's shapes, reuse it next time,
    # export again when the shapes change
    said = []
    cfg, _ = hg.parse_args(['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '8',
                            '--vocab_size', '100', '--batch_size', '2', '--out_dir', str(tmp_path)])
    path = export_ane.ensure_package(cfg, log=said.append)
    spec = tmp_path / 'ane_B2_T8.mlpackage' / 'Data' / 'com.apple.CoreML' / 'model.mlmodel'
    stamp = spec.stat().st_mtime_ns
    assert export_ane.ensure_package(cfg, log=said.append) == path and len(said) == 1
    assert spec.stat().st_mtime_ns == stamp
    cfg.n_layer = 2  # same file name, other model: exported again
    export_ane.ensure_package(cfg, log=said.append)
    assert 'other shapes' in said[1] and hg.CoreMLEngine(path).cfg.n_layer == 2


def test_program_without_biases(tmp_path):
    # nanoGPT's bias=False: the program has no bias inputs or outputs, and its fp16
    # gradients point where fp64 autograd's do (cosine >= 0.999, as above); a package
    # exported with biases is refused for these weights
    cfg = hg.GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=16, bias=False)
    path = str(tmp_path / 'nobias.mlpackage')
    export_ane.export_coreml(cfg, 2, 5, path)
    names = set(hg.dense_input_shapes(cfg, 2, 5))
    biases = {'lnf_b'} | {f'h{l}_{k}' for l in range(2) for k in ('ln1_b', 'bq', 'bk', 'bv', 'bo', 'ln2_b', 'bfc', 'bpr')}
    assert not names & biases and 'h0_wq' in names and 'lnf_w' in names
    assert set(hg.dense_input_shapes(hg.GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=16),
                                     2, 5)) == names | biases
    torch.manual_seed(0)
    model = hg.GPT(cfg).double()
    idx, targets = (torch.randint(0, cfg.vocab_size, (2, 5)) for _ in range(2))
    _, loss = model(idx, targets)
    loss.backward()
    engine = hg.CoreMLEngine(path, config=cfg, microbatch=(2, 5), scaler=hg.LossScaler(1024.0, 0))
    engine.load_weights(dict(model.named_parameters()))
    l, grads = engine.loss_and_grads(idx, targets)
    assert abs(l.item() - loss.item()) / loss.item() < 1e-2
    assert set(grads) == {k for k, _ in model.named_parameters()}
    for k, p in model.named_parameters():
        cos = torch.nn.functional.cosine_similarity(grads[k].double().flatten(), p.grad.flatten(), dim=0).item()
        assert cos >= 0.999, (k, cos)
    with_bias = str(tmp_path / 'bias.mlpackage')
    export_ane.export_coreml(hg.GPTConfig(block_size=8, vocab_size=300, n_layer=2, n_head=2, n_embd=16), 2, 5, with_bias)
    with pytest.raises(hg.UserError, match='export_ane.py'):
        hg.CoreMLEngine(with_bias, config=cfg)


def test_trainer_builds_the_core_ml_engine_as_on_macos(tmp_path, monkeypatch):
    # what build_engines does on macOS, with the NumPy evaluator for Core ML's predict: the
    # package for the run's shapes, the engine checked against the run's model, one step
    monkeypatch.setattr(hg, 'ON_MAC', True)
    monkeypatch.setattr(hg, 'coreml_predict_fn', lambda path: export_ane.numpy_predict(export_ane.load_coreml_program(path)))
    cfg, _ = hg.parse_args(['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--block_size', '8',
                            '--vocab_size', '100', '--batch_size', '2', '--out_dir', str(tmp_path)])
    model = hg.GPT(hg.model_config(cfg))
    engines = hg.build_engines(cfg, model, torch.device('cpu'), torch.float32, 'ane', log=lambda s: None)
    eng = engines['ane']
    assert isinstance(eng, hg.CoreMLEngine) and eng.cfg == model.config and eng.scaler.enabled
    eng.load_weights(dict(model.named_parameters()))
    loss, grads = eng.loss_and_grads(*(torch.randint(0, 100, (2, 8)) for _ in range(2)))
    assert 0 < loss.item() < 10 and set(grads) == {k for k, _ in model.named_parameters()}
