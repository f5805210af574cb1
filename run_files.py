"""
What a training run keeps in its out_dir, and the rules that keep it safe:

    ckpt.pt        the latest checkpoint, written atomically (under a temporary name, then renamed)
    ckpt.prev.pt   the one before it, kept when a new one is written, so one bad write never leaves nothing
    metrics.jsonl  one JSON row per logged step; a resumed run first drops the rows past its checkpoint

A run never replaces what another one made: an out_dir that holds any of these needs
--resume (continue it) or --overwrite (delete it and start over).
"""
import json
import os
import warnings

import torch

import hetero_gpt as hg

RUN_FILES = ('ckpt.pt', 'ckpt.prev.pt', 'metrics.jsonl')
CKPT_KEYS = ('model', 'optimizer', 'model_args', 'iter_num', 'tokens', 'elapsed', 'best_val_loss', 'split',
             'loss_scales')


def check_out_dir(cfg):
    """The files of an earlier run in cfg.out_dir that this run is to delete (--overwrite),
    once everything else is checked; UserError if it holds a run and neither --resume nor
    --overwrite says what to do with it."""
    if cfg.resume and cfg.overwrite:
        raise hg.UserError("--resume continues the run in out_dir and --overwrite deletes it: give one of them")
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
    if found and not (cfg.resume or cfg.overwrite):
        raise hg.UserError(f"{cfg.out_dir} holds a run ({', '.join(found)}): pass --resume to continue it, "
                           "a new --out_dir, or --overwrite to start over")
    return [os.path.join(cfg.out_dir, f) for f in found] if cfg.overwrite else []


def save_checkpoint(path, obj):
    """Atomic: a crash mid-write leaves the previous checkpoint intact. That one is kept
    (renamed, not copied) as ckpt.prev.pt."""
    torch.save(obj, path + '.tmp')
    if os.path.exists(path):
        os.replace(path, prev_path(path))
    os.replace(path + '.tmp', path)


def prev_path(path):
    return path.removesuffix('.pt') + '.prev.pt'


def read_checkpoint(path, device):
    """The checkpoint at path; ValueError (why) if it is absent, damaged or not one of ours."""
    try:  # weights_only: plain data and tensors, never code from a foreign pickle
        with warnings.catch_warnings():  # (a foreign pickle's protocol draws a warning first)
            warnings.simplefilter('ignore')
            ck = torch.load(path, map_location=device, weights_only=True)
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
    """The checkpoint --resume starts from; else a UserError that names the file and what to
    do. If ckpt.prev.pt is usable where ckpt.pt is not, it says so, and changes nothing:
    the user decides whether to give up the damaged file."""
    try:
        return read_checkpoint(path, device)
    except ValueError as e:
        why = e
    try:
        hint = (f"{prev_path(path)} (step {read_checkpoint(prev_path(path), 'cpu')['iter_num']}) is usable: "
                f"`mv {prev_path(path)} {path}` and --resume again")
    except ValueError:
        hint = "start over with --overwrite or a new --out_dir"
    raise hg.UserError(f"--resume: cannot use {path} ({why}); {hint}")


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
