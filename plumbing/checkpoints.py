"""
What a training run keeps in its out_dir, and the rules that keep it safe:

    ckpt.pt        the latest checkpoint: there and loadable at every moment, even if the run is killed mid-save
    ckpt.prev.pt   the one before it; --resume falls back to it when ckpt.pt is missing or damaged
    best.pt        the checkpoint of the lowest validation loss so far (what sample.py reads)
    metrics.jsonl  one JSON row per logged step; a resumed run first drops the rows past its checkpoint

A run never replaces what another one made: an out_dir that holds any of these needs
--resume (continue it) or --overwrite (delete it and start over).
"""
import dataclasses
import json
import os
import shutil
import sys
import warnings

import torch

from . import distributed
from .progress import defer_ctrl_c
from .settings import UserError

RUN_FILES = ('ckpt.pt', 'ckpt.prev.pt', 'best.pt', 'ckpt.unusable.pt', 'metrics.jsonl')
CKPT_KEYS = ('model', 'optimizer', 'model_args', 'iter_num', 'tokens', 'elapsed', 'best_val_loss', 'split',
             'loss_scales')


# the loop's Progress, by the names a checkpoint keeps (nanoGPT's iter_num, best_val_loss)
KEYS = dict(it='iter_num', tokens='tokens', elapsed='elapsed', best_val='best_val_loss', since_best='evals_since_best',
            joules='joules')


def check_out_dir(cfg):
    """The files of an earlier run in cfg.out_dir that this run is to delete (--overwrite),
    once everything else is checked; UserError if it holds a run and neither --resume nor
    --overwrite says what to do with it."""
    top = os.path.abspath(cfg.out_dir)  # the out_dir, or the folder it will be made in
    while not os.path.exists(top):
        top = os.path.dirname(top)
    if not (os.path.isdir(top) and os.access(top, os.W_OK)):
        raise UserError(f"--out_dir {cfg.out_dir}: {top} is not a folder this user can write in")
    if cfg.resume and cfg.overwrite:
        raise UserError("--resume continues the run in out_dir and --overwrite deletes it: give one of them")
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
    if found and not (cfg.resume or cfg.overwrite):
        raise UserError(f"{cfg.out_dir} holds a run ({', '.join(found)}): pass --resume to continue it, "
                           "a new --out_dir, or --overwrite to start over")
    left = [f + '.tmp' for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f + '.tmp'))]  # a killed save's
    return [os.path.join(cfg.out_dir, f) for f in found + left] if cfg.overwrite else []


def delete(paths):
    """--overwrite: the earlier run's files, once everything else is checked."""
    for path in paths:
        os.remove(path)


# What --resume takes from the run it continues, unless a flag given says otherwise.
RESUMED = ('block_size vocab_size n_layer n_head n_embd bias dataset batch_size gradient_accumulation_steps max_iters '
           'learning_rate min_lr warmup_iters weight_decay beta1 beta2 grad_clip mode dtype ane_dtype ane_fraction '
           'ane_batch_size ane_programs eval_interval eval_iters log_interval patience seed preset').split()
MODEL = ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'bias')


def restore(cfg, given, path, rank=0, log=print):
    """--resume: (cfg with the settings of the run in path (RESUMED) where no flag was given,
    the names of those). A model flag given that disagrees with the run's is an error now,
    before any engine starts; another flag given wins, said in one line."""
    if not cfg.resume:
        return cfg, set()
    saved = None
    if rank == 0:
        for p in (path, prev_path(path)):  # (the one resume() will load; it reports a damaged one)
            try:
                saved = read_checkpoint(p, 'cpu').get('config')
                break
            except ValueError:
                continue
    saved = distributed.from_rank0(saved)
    if not saved:  # none there (resume() says so), or one saved without its settings
        return cfg, set()
    if wrong := [k for k in MODEL if k in given and k in saved and getattr(cfg, k) != saved[k]]:
        raise UserError(f"--resume: {path} holds a model of " + ', '.join(f'{k}={saved[k]}' for k in MODEL if k in saved)
                        + "; leave out " + ' '.join(f'--{k}' for k in wrong) + " (its size comes from the "
                        "checkpoint), or start over with --overwrite or a new --out_dir")
    changed = [f"--{k} {getattr(cfg, k)} (was {saved[k]})" for k in RESUMED
               if k in given and k in saved and getattr(cfg, k) != saved[k]]
    restored = {k for k in RESUMED if k in saved and k not in given}
    kept = [f"{k}={saved[k]}" for k in RESUMED if k in restored and getattr(cfg, k) != saved[k]]
    cfg = dataclasses.replace(cfg, **{k: saved[k] for k in restored})
    if rank == 0:
        log(f"--resume: continuing the run in {cfg.out_dir} with its own settings"
            + (f" ({' '.join(kept)} unlike the defaults)" if kept else '')
            + (f"; given here instead: {', '.join(changed)}" if changed else ''))
    return cfg, restored


def state(cfg, model, optimizer, split, engines, prog):
    """What a checkpoint holds: weights, AdamW, the run's config, split and loss scales, and
    the run's Progress by the names on disk (KEYS)."""
    return dict(model=model.state_dict(), optimizer=optimizer.state_dict(), model_args=dataclasses.asdict(model.config),
                config=dataclasses.asdict(cfg), split=split.state_dict(),
                loss_scales={n: e.scaler.scale for n, e in engines.items()},
                **{key: getattr(prog, name) for name, key in KEYS.items()})


def save(path, cfg, model, optimizer, split, engines, prog, best=False):
    """The run's state (state()) into ckpt.pt, and best.pt if best (save_checkpoint)."""
    save_checkpoint(path, state(cfg, model, optimizer, split, engines, prog), best)


def save_checkpoint(path, obj, best=False):
    """ckpt.pt is there and whole at every moment: the new checkpoint is written to a
    temporary file and synced to disk; the current one gets a second name, ckpt.prev.pt;
    then os.replace, atomic, gives the new one the name ckpt.pt. best: best.pt names it
    first (a run killed before ckpt.pt does replays to the same best). Ctrl-C meanwhile
    waits for the save: torch.save cut mid-write raises an error of its own."""
    with defer_ctrl_c():
        with open(path + '.tmp', 'wb') as f:
            torch.save(obj, f)
            durable(f)
        if best:
            link(path + '.tmp', best_path(path))
        if os.path.exists(path):
            link(path, prev_path(path))
        os.replace(path + '.tmp', path)


def durable(f):
    f.flush()
    os.fsync(f.fileno())  # (macOS: to the drive's cache; F_FULLFSYNC would reach the platter)


def link(src, dst):
    """dst becomes a second name of src's file, atomically; a copy where hard links fail."""
    if os.path.exists(dst + '.tmp'):  # left by a killed save
        os.remove(dst + '.tmp')
    try:
        os.link(src, dst + '.tmp')
    except OSError:  # a file system without hard links
        with open(src, 'rb') as a, open(dst + '.tmp', 'wb') as b:
            shutil.copyfileobj(a, b)
            durable(b)
    os.replace(dst + '.tmp', dst)


def prev_path(path):
    return path.removesuffix('.pt') + '.prev.pt'


def best_path(path):
    return os.path.join(os.path.dirname(path), 'best.pt')


def closing_sample(model, ckpt_path, tokens, device, autocast):
    """The run's best weights (best.pt) into model, then `tokens` of text sampled from them. Training has
    succeeded: a tokenizer or a best.pt that cannot load is one 'no sample:' line, the weights left as they are."""
    import prepare_data  # (the tokenizer's loader: a module of the root that imports nothing of ours)
    try:
        enc = prepare_data.get_encoding()
        best = read_checkpoint(best_path(ckpt_path), 'cpu')
    except (prepare_data.DataError, ValueError) as e:
        return print(f"no sample: {e}" + (' (best.pt)' if isinstance(e, ValueError) else ''), file=sys.stderr)
    model.load_state_dict(best['model'])
    with autocast:
        ids = model.generate(torch.tensor([enc.encode('\n')], device=device), tokens, vocab=enc.n_vocab)
    print(f"---- sample from best.pt (step {best['iter_num']}, validation loss {best['best_val_loss']:.4f}) ----\n"
          + enc.decode(ids[0].tolist()))


def read_checkpoint(path, device):
    """The checkpoint at path; ValueError (why) if it is absent, damaged or not one of ours."""
    try:  # weights_only: plain data and tensors, never code from a foreign pickle
        with warnings.catch_warnings():  # (a foreign pickle's protocol draws a warning first)
            warnings.simplefilter('ignore')
            ck = torch.load(path, map_location=device, weights_only=True, mmap=True)  # (mmap: read as used)
    except Exception as e:  # absent, empty, truncated, random bytes, another kind of pickle
        if isinstance(e, FileNotFoundError):
            raise ValueError('no checkpoint there') from None
        first = str(e).strip().split('. ')[0].splitlines()[0][:100] if str(e).strip() else 'empty'
        raise ValueError(f"not a readable checkpoint: {type(e).__name__}: {first}") from None
    missing = [k for k in CKPT_KEYS if k not in ck] if isinstance(ck, dict) else ['every key']
    if missing:
        raise ValueError(f"not a checkpoint of this trainer: it lacks {', '.join(missing)}")
    return ck


def load_checkpoint(path, device):
    """The checkpoint --resume starts from: ckpt.pt, or ckpt.prev.pt if ckpt.pt is missing or
    damaged (said in one line; a damaged one is kept as ckpt.unusable.pt, so that the next save
    keeps ckpt.prev.pt); else a UserError that says what to do."""
    try:
        return read_checkpoint(path, device)
    except ValueError as e:
        why = e
    try:
        ck = read_checkpoint(prev_path(path), device)
    except ValueError as e:
        raise UserError(f"--resume: cannot use {path} ({why}) nor {prev_path(path)} ({e}); start over with "
                        "--overwrite or a new --out_dir") from None
    if os.path.exists(path):  # renamed, not deleted
        os.replace(path, path.removesuffix('.pt') + '.unusable.pt')
        why = f"{why}; kept as ckpt.unusable.pt"
    print(f"--resume: {path} is unusable ({why}): resuming from {prev_path(path)} (step {ck['iter_num']}) instead")
    return ck


def truncate_metrics(path, step):
    """Keeps the rows of metrics.jsonl up to `step`: a run resumed from that step logs the
    later ones again (a half-written last line goes too). Atomic, as save_checkpoint."""
    def upto(line):
        try:
            return json.loads(line)['step'] <= step
        except (ValueError, KeyError, TypeError):
            return False
    if os.path.exists(path):
        with open(path) as f, open(path + '.tmp', 'w') as out:
            out.writelines(line for line in f if upto(line))
        os.replace(path + '.tmp', path)


def resume(cfg, given, model, optimizer, split, engines, rank):
    """The loop's counters to start from, by KEYS' names: none for a new run (an earlier one's
    files deleted under --overwrite), or with --resume the checkpoint's (its weights, optimizer
    state, split and loss scales loaded). Rank 0
    alone reads the checkpoint (the others may be on machines without it) and under torchrun
    every rank starts from its state: the checkpoint, or rank 0's fresh weights."""
    path = os.path.join(cfg.out_dir, 'ckpt.pt')
    if rank == 0:
        delete(check_out_dir(cfg))  # --overwrite: the earlier run's files
    ck = load_checkpoint(path, 'cpu') if cfg.resume and rank == 0 else None
    if distributed.world()[1] > 1:
        ck = distributed.from_rank0(ck or dict(model={k: v.cpu() for k, v in model.state_dict().items()}))
    try:  # this run's model and its optimizer's state, or one clear line
        if cfg.resume and ck['model_args'] != dataclasses.asdict(model.config):
            raise ValueError(f"a model of {ck['model_args']}, not this run's {dataclasses.asdict(model.config)}")
        if ck:
            model.load_state_dict(ck['model'])
        if cfg.resume:
            optimizer.load_state_dict(ck['optimizer'])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} does not fit this run ({' '.join(str(e).split())[:300]}): give the "
                        "flags of its model, or a new --out_dir") from None
    if not cfg.resume:
        return {}
    if 'ane_fraction' in given and cfg.mode == 'hetero':
        print(f"--ane_fraction {cfg.ane_fraction} given: it replaces the checkpoint's split of the microbatches")
    else:
        split.load_state_dict(ck['split'])
    for n, e in engines.items():  # rank 0's loss scales for every rank, unless given or unused
        flag = {'gpu': 'loss_scale', 'ane': 'ane_loss_scale'}[n]
        if flag in given and e.scaler.enabled:
            print(f"--{flag} {getattr(cfg, flag)} given: it replaces the checkpoint's loss scale")
        elif e.scaler.enabled and ck['loss_scales'].get(n, 1.0) > 1.0:  # (a bf16/fp32 run saved 1.0)
            e.scaler.scale = ck['loss_scales'][n]
    if rank == 0:
        truncate_metrics(os.path.join(cfg.out_dir, 'metrics.jsonl'), ck['iter_num'])
    print(f"resumed from the checkpoint of step {ck['iter_num']}")
    return {name: ck[key] for name, key in KEYS.items() if key in ck}  # (older ones lack some)


def diverged(cfg, it, bad, loss, engines, path):
    """The error that stops a run after `bad` steps in a row without a usable gradient."""
    floor = ', '.join(n for n, e in engines.items() if e.scaler.enabled and e.scaler.scale <= 1.0)
    return UserError(f"step {it}: {bad} steps in a row without a usable gradient (loss {loss}): "
                     f"diverged, likely as --learning_rate {cfg.learning_rate} is too high"
                     + (f" (fp16 overflows at the loss scale's floor of 1: {floor})" if floor else '')
                     + (f"; lower it and --resume from {path}, the last good step's" if
                        os.path.exists(path) else "; lower it and start over with --overwrite"))
