"""
Settings as flags, and their checks. Each field of a settings dataclass is a --flag, typed
and documented by the field. check() refuses any value a run could not use, in one line that
names the flag, before anything is written. The trainer holds the settings; this file parses
and checks them, as nanoGPT's configurator.py does.
"""
import argparse
import dataclasses
import math
import os
import platform
import re
import subprocess
import sys

import torch

# The one check for macOS in the project (the tests' macOS double sets sys.platform).
ON_MAC = sys.platform == 'darwin'


class UserError(Exception):
    """Something the user can fix: printed as one line, no traceback."""


def check_batch(cfg, idx, targets):
    """A ValueError if the model (cfg) cannot take this batch: shapes, length, token ids."""
    if idx.dim() != 2 or idx.shape != targets.shape:
        raise ValueError(f"idx and targets must both be (B, T); got {tuple(idx.shape)} and {tuple(targets.shape)}")
    if idx.shape[1] > cfg.block_size:
        raise ValueError(f"sequence length {idx.shape[1]} is longer than block_size {cfg.block_size}")
    if idx.dtype != torch.long or targets.dtype != torch.long or idx.device != targets.device:
        raise ValueError(f"idx and targets must be int64 token ids on one device; got {idx.dtype} on {idx.device} "
                         f"and {targets.dtype} on {targets.device}")
    if idx.numel():  # the four bounds read at once: one wait where the batch is on a device
        bounds = torch.stack([idx.min(), idx.max(), targets.min(), targets.max()]).tolist()
        for name, (lo, hi) in (('idx', bounds[:2]), ('targets', bounds[2:])):
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(f"{name} has token ids outside [0, {cfg.vocab_size})")


def one_line(e):
    """An exception in one line. Core ML's errors reach Python as an NSError's userInfo as
    Foundation prints it, a dictionary over several lines (coremltools' Utils::handleError):
    of that, the NSLocalizedDescription, which says what happened."""
    text = str(e)
    m = re.search(r'^ {4}NSLocalizedDescription = (?:"(.*)"|(.*));$', text, re.M)
    if m:  # quoted when it holds spaces, with \" and \\ escaped
        text = re.sub(r'\\(["\\])', r'\1', m.group(1) if m.group(1) is not None else m.group(2))
    else:
        text = ' '.join(text.split())
    return f"{type(e).__name__}: {text}"


# What each numeric setting allows: setup() checks them all, before anything is written.
LIMITS = (('> 0', lambda v: 0 < v < math.inf, 'batch_size gradient_accumulation_steps eval_interval log_interval '
                                              'scale_window loss_scale ane_loss_scale dist_timeout ane_load_timeout'),
          ('>= 0', lambda v: 0 <= v < math.inf, 'max_iters warmup_iters eval_iters sample_tokens seed max_bad_steps '
                                                'learning_rate min_lr weight_decay grad_clip ane_batch_size'),
          ('in [0, 1)', lambda v: 0 <= v < 1, 'beta1 beta2'))


def add_flags(parser, cls, skip=(), here=None):
    """One --flag per field of the dataclass cls, typed and documented by the field. A subclass's
    own fields come first, in a group of their own. here: machine_defaults(...), so that --help
    shows this machine's defaults beside the fields' own."""
    defaults, where, gpt2 = here or ({}, '', {})
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    parent = cls.__mro__[1]  # a script's settings over the trainer's (bench.py): its own flags first
    base = set()
    if dataclasses.is_dataclass(parent):
        base = {f.name for f in dataclasses.fields(parent)}
    if parent.__module__ != cls.__module__ and any(f.name not in base for f in fields):
        script = getattr(sys.modules.get(cls.__module__), '__file__', None) or cls.__name__
        own = parser.add_argument_group(f"{os.path.basename(script)}'s own flags")
        rest = parser.add_argument_group("the trainer's flags (hetero_gpt.py)")
        ours = [(own, f) for f in fields if f.name not in base]
        fields = ours + [(rest, f) for f in fields if f.name in base]
    else:
        fields = [(parser, f) for f in fields]
    for group, f in fields:
        text = f.metadata['help']
        if f.name in defaults:
            preset = gpt2.get(f.name, f.default)
            text += (f" (default {where}: {defaults[f.name]}; with --preset gpt2: {preset}; "
                     "with a CUDA GPU: %(default)s)")
        if f.type in (bool, 'bool'):
            group.add_argument(f'--{f.name}', type=parse_bool, nargs='?', const=True,
                               default=f.default, help=text)
        else:
            typ = {'int': int, 'float': float, 'str': str}.get(f.type, f.type)
            group.add_argument(f'--{f.name}', type=typ, default=f.default, help=text)


def machine_defaults(cpu_defaults, mac_defaults, mac_gpt2):
    """(the defaults for flags not given on this machine, its name, --preset gpt2's there),
    as check() picks them."""
    try:
        device = resolve_device('auto')
    except UserError:
        return {}, '', {}
    if device.type == 'cpu':
        return cpu_defaults, 'here, no GPU', {}
    if ON_MAC:
        return mac_defaults, 'on this Mac', mac_gpt2
    return {}, '', {}


def setting(default, help):
    """A dataclass field that is also a --flag: its default and a one-line help."""
    return dataclasses.field(default=default, metadata={'help': help})


def parse_args(argv, cls, description, here=None):
    """(cls(...), the names of the flags the user gave). here: see add_flags."""
    if here and here[0]:
        description += (f" The defaults shown are this machine's ({here[1]}): the flags not given take them in "
                        "place of GPT-2 124M's, which apply with a CUDA GPU or --preset gpt2.")
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(parser, cls, here=here)
    args = parser.parse_args(argv)
    given = {a.split('=')[0][2:] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith('--')}
    return cls(**vars(args)), given


def parse_bool(s):
    if s.lower() in ('1', 'true', 'yes'):
        return True
    if s.lower() in ('0', 'false', 'no'):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def resolve_device(name, flag='--device'):
    """The torch.device `name` means here; flag: the flag that gave it, named in an error
    (None: a command without one, whose error names none)."""
    if name == 'auto':
        if torch.backends.mps.is_available():
            return torch.device('mps')
        if ON_MAC and torch.backends.mps.is_built():  # not silently a small CPU run
            raise mps_missing(name, flag)
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        dev = torch.device(name)
        if dev.type not in ('cpu', 'cuda', 'mps'):
            raise RuntimeError
    except RuntimeError:
        raise UserError(f"{flag} {name!r}: unknown device; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == 'cuda' and (dev.index or 0) >= torch.cuda.device_count():
        raise UserError(f"{flag} {name}: PyTorch sees {torch.cuda.device_count()} CUDA GPU(s) here")
    if dev.type == 'mps' and not torch.backends.mps.is_available():
        if ON_MAC and torch.backends.mps.is_built():
            raise mps_missing(name, flag)
        raise UserError(f"{flag} {name}: MPS is not available here")
    return dev


def mps_missing(name, flag):
    """A Mac whose torch has MPS built in but cannot use it: torch 2.10 and newer need macOS 14
    (coreml_and_ane.md section 6); a virtual machine or a sandbox has none either. flag None:
    a command without --device, so no advice to give one."""
    here = f"torch {torch.__version__} on macOS {platform.mac_ver()[0]}"
    if version(platform.mac_ver()[0]) < (14,):
        fixes = ["; torch 2.10 and newer need macOS 14 for MPS): update macOS to 14 or newer",
                 "pip install 'torch<2.10'"]
    else:
        fixes = [", as in a virtual machine or a sandbox): run on the Mac itself"]
    if flag:
        fixes.append("give --device cpu for a small run on the CPU")
    named = f"{flag} {name}: " if flag else ''
    return UserError(f"{named}MPS is not available here ({here}{', or '.join(fixes)}")


def resolve_dtype(name, device, flag='--dtype'):
    if name == 'auto':
        return torch.bfloat16 if device.type == 'cuda' else torch.float32
    dtypes = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16,
              'float64': torch.float64}
    if name not in dtypes:
        raise UserError(f"{flag} {name!r}: unknown dtype; use auto or one of {', '.join(dtypes)}")
    return dtypes[name]


def version(text):
    """'2.6.0+cpu' -> (2, 6): the release's first two numbers."""
    return tuple(int(''.join(c for c in part if c.isdigit()) or 0) for part in text.split('.')[:2])


def check_mps(dtype, compile, torch_version=torch.__version__, macos=None, head_size=64, T=64):
    """What PyTorch's MPS backend can do (coreml_and_ane.md section 6): no float64; bf16
    autocast from torch 2.6 on macOS 14 (on 2.5 it silently runs fp32); torch.compile from 2.8.
    fp16 and bf16 only where causal attention in that dtype hides later tokens (the probe, at
    the run's head size, as the kernel MPS picks depends on it)."""
    macos = version(macos or platform.mac_ver()[0] or '0')
    if dtype == torch.float64:
        raise UserError("--dtype float64: MPS has no float64; use float32")
    if dtype == torch.bfloat16 and (version(torch_version) < (2, 6) or macos < (14, 0)):
        raise UserError(f"--dtype bfloat16 on MPS needs torch 2.6 or newer on macOS 14 or newer (this is torch "
                        f"{torch_version} on macOS {'.'.join(map(str, macos))}): use --dtype float16 or float32")
    if compile and version(torch_version) < (2, 8):
        raise UserError(f"--compile on MPS needs torch 2.8 or newer (this is {torch_version}): upgrade torch "
                        "or leave out --compile")
    half = dtype in (torch.float16, torch.bfloat16)
    mps = torch.device('mps')
    if half and torch.backends.mps.is_available() and not causal_attention_sound(mps, dtype, T, head_size):
        name = str(dtype).replace('torch.', '')
        raise UserError(f"--dtype {name} on MPS: this torch ({torch_version}) computes causal attention "
                        f"in {name} that sees later tokens (pytorch #195910): use --dtype float32")


def causal_attention_sound(device, dtype, T=64, head_size=64):
    """Whether scaled_dot_product_attention(is_causal=True) on device in dtype hides later
    positions: values from position p on are raised by 1e4, and no output before p may move by
    more than 0.5. A sound kernel's masked weights are exactly 0, so it moves them by 0 (0.5 is
    30 bf16 ulps at |y| < 4, room for a reordered sum). A leak moves a row by 1e4 x its weight
    on the later positions: for these seeded inputs and a mask per group of four, over 30.
    p odd (T-1, T/2+1): a mask applied per group of any even size leaks into row p-1."""
    F = torch.nn.functional
    T = min(T, 256)  # the run's context, or enough of it to show a leak
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, head_size, generator=g) for _ in range(3))
    for p in (T - 1, T // 2 + 1):
        later = v.clone()
        later[:, :, p:] += 1e4
        y = [F.scaled_dot_product_attention(*(t.to(device, dtype) for t in (q, k, x)), is_causal=True)
             for x in (v, later)]
        moved = (y[0][:, :, :p].float() - y[1][:, :, :p].float()).abs().max().item()
        if not moved <= 0.5:  # (NaN fails)
            return False
    return True


class _Untested:  # a logging filter: coremltools' "Torch version ... has not been tested"
    @staticmethod
    def filter(record):
        return 'has not been tested with coremltools' not in record.getMessage()


def import_coremltools():
    """coremltools, quiet where its words do not apply here. Its warning that this torch is newer than
    it was tested with concerns converting torch models, which this project never does: its programs
    are written in MIL directly. Its MIL pass pipelines' progress bars (tqdm, with no switch of its own:
    coremltools issues #1144, #1815) are off. Off macOS, its warning that Core ML's runtime is missing."""
    import functools
    import logging
    logger = logging.getLogger('coremltools')
    if not any(isinstance(f, _Untested) for f in logger.filters):
        logger.addFilter(_Untested())
    if not ON_MAC:
        logger.setLevel(logging.ERROR)
    import coremltools
    from coremltools.converters.mil.mil.passes import pass_pipeline
    import tqdm
    if not isinstance(pass_pipeline.tqdm, functools.partial):
        pass_pipeline.tqdm = functools.partial(tqdm.tqdm, disable=True)
    return coremltools


def check_coreml():
    """On a Mac: coremltools 8.3 or newer with its Core ML bindings (docs/coreml_and_ane.md
    section 1). Python 3.14 gets an sdist without them, so ct.convert and predict fail."""
    try:
        ct = import_coremltools()
    except ImportError:
        raise UserError("the ANE engine needs coremltools: pip install -r requirements.txt, or train on the GPU alone (`python hetero_gpt.py --mode gpu`)") from None
    if version(ct.__version__) < (8, 3):
        raise UserError(f"coremltools {ct.__version__} is too old for the ANE engine: pip install 'coremltools>=8.3', "
                        "or train on the GPU alone (`python hetero_gpt.py --mode gpu`)")
    try:
        import coremltools.libcoremlpython  # noqa: F401
    except ImportError:
        raise UserError(f"coremltools {ct.__version__} has no Core ML runtime (libcoremlpython): pip found no macOS "
                        f"wheel for Python {platform.python_version()}; use Python 3.9 to 3.13 (3.13: coremltools 9 or newer), or `python hetero_gpt.py --mode gpu`") from None


def check_wandb():
    """--wandb_log needs wandb: found at start, not at the first logged step."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("--wandb_log needs wandb: pip install wandb, "
                        "or leave --wandb_log out") from None


def mac_without_ane():
    """On a Mac: why this Python cannot reach the Neural Engine ('' if it can). Under Rosetta
    an Apple Silicon Mac reports x86_64, and sysctl.proc_translated is 1 (Apple, "About the
    Rosetta translation environment"); an Intel Mac has no such name or says 0."""
    if platform.mac_ver()[2] in ('arm64', ''):
        return ''
    try:
        rosetta = subprocess.run(['sysctl', '-n', 'sysctl.proc_translated'], stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=10).stdout.strip() == '1'
    except OSError:
        rosetta = False
    if rosetta:
        return ("this Python is an x86_64 build running under Rosetta on Apple Silicon, and the ANE engine "
                "needs an arm64 Python (python3 -c 'import platform; print(platform.machine())' says which)")
    return f"this Mac is {platform.mac_ver()[2]} (Intel), and the Neural Engine needs Apple Silicon"


def check_ane_alignment(cfg, T):
    """On a Mac: every contraction of the ANE's programs a multiple of 32 (T, and so B*T;
    n_embd; the head size): public ANE work saw silent zeros otherwise (coreml_and_ane.md section 2)."""
    if why := mac_without_ane():
        raise UserError(f"{why}: train on the GPU alone, `python hetero_gpt.py --mode gpu`")
    for name, n in (('--block_size (tokens a sequence)', T), ('--n_embd', cfg.n_embd),
                    ('the head size (--n_embd / --n_head)', cfg.n_embd // cfg.n_head)):
        if n % 32:
            raise UserError(f"{name} is {n}: the ANE's programs need a multiple of 32 here")


ANE_BATCH = 4  # the ANE's default sequences a call: its programs' live memory well inside its own


def ane_batch_size(cfg):
    """Sequences per ANE call: --ane_batch_size, or the largest divisor of batch_size up to ANE_BATCH."""
    return cfg.ane_batch_size or max(b for b in range(1, min(cfg.batch_size, ANE_BATCH) + 1) if cfg.batch_size % b == 0)


def check_model(cfg):
    """The model's sizes: each at least 1, and n_embd a multiple of n_head."""
    if min(cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd) < 1:
        raise UserError(f"every model size must be at least 1: {cfg}")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")


@dataclasses.dataclass(frozen=True)
class Run:
    """What the settings resolve to on this machine, computed once (check). The engines, the
    split, the preflight and the "not used" warnings all read it."""
    mode: str  # gpu, ane or hetero
    device: torch.device  # the GPU engine's
    dtype: torch.dtype
    ane_device: torch.device  # where the ANE's stand-in runs, off a Mac
    ane_dtype: torch.dtype
    ane_in_worker: bool  # the ANE engine in a process of its own
    ane_programs: bool  # the ANE engine runs exported programs, not the eager derivation
    ane_batch_size: int  # sequences an ANE call, where it runs programs
    ane_fraction: float = None  # the ANE's share in mode hetero; None: auto


def machine_defaults_now(device, cpu_defaults, mac_defaults):
    """(the defaults for flags not given on this device, why, in a few words)."""
    if device.type == 'cpu':
        return cpu_defaults, "no GPU: small model and short run for the CPU"
    if not ON_MAC:
        return {}, ''
    if 'n_layer' in mac_defaults:
        return mac_defaults, "on a Mac: a run sized for an hour on a base chip (--preset gpt2: GPT-2 124M)"
    return mac_defaults, "on a Mac: GPT-2 124M in microbatches that fit a 16 GB one"


def check(cfg, given, cpu_defaults, mac_defaults, log=print, kept=frozenset()):
    """Checks every setting and resolves what 'auto' means on this machine: (cfg, Run), cfg a
    new Config (the one given is left as it is). On a machine without an accelerator,
    cpu_defaults replace the settings not given; on a Mac, mac_defaults. kept: settings that
    --resume or --init_from fixed, which keep their values too."""
    device = resolve_device(cfg.device)
    defaults, why = machine_defaults_now(device, cpu_defaults, mac_defaults)
    changed = {k: v for k, v in defaults.items() if k not in given and k not in kept}
    if changed:  # one line names every default this machine changes
        log(f"{why} (any flag overrides): " + ' '.join(f'{k}={v}' for k, v in changed.items()))
    if cfg.mode == 'auto':
        no_ane = ON_MAC and mac_without_ane()
        changed['mode'] = 'hetero' if ON_MAC and not no_ane else 'gpu'
        if no_ane:
            log(f"mode auto: gpu alone ({no_ane})")
    cfg = dataclasses.replace(cfg, **changed)
    if cfg.mode not in ('gpu', 'ane', 'hetero'):
        raise UserError(f"unknown --mode {cfg.mode!r}: use gpu, ane or hetero")
    fraction = None  # auto
    if cfg.ane_fraction != 'auto':
        try:
            fraction = float(cfg.ane_fraction)
        except ValueError:
            pass
        if fraction is None or not 0.0 <= fraction <= 1.0:
            raise UserError(f"--ane_fraction must be auto or a number in [0, 1], got {cfg.ane_fraction!r}")
    for allowed, ok, names in LIMITS:
        for k in names.split():
            if not ok(getattr(cfg, k)):
                raise UserError(f"--{k} {getattr(cfg, k)}: must be a finite number {allowed}")
    check_model(cfg)
    if cfg.ane_batch_size and cfg.batch_size % cfg.ane_batch_size:
        raise UserError(f"--ane_batch_size {cfg.ane_batch_size} must divide --batch_size {cfg.batch_size}: the ANE "
                        "engine runs each microbatch in calls of that many sequences")
    if cfg.ane_evaluator not in ('eager', 'numpy'):
        raise UserError(f"--ane_evaluator {cfg.ane_evaluator!r}: use eager or numpy")
    if cfg.gradient_accumulation_steps < int(os.environ.get('WORLD_SIZE', 1)):  # under torchrun
        raise UserError(f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} counts all ranks' "
                        f"microbatches: use {os.environ['WORLD_SIZE']} or more")
    dtype = resolve_dtype(cfg.dtype, device)
    ane_dev = device if cfg.ane_device == 'auto' or ON_MAC else resolve_device(cfg.ane_device, '--ane_device')
    ane_dtype = torch.float16 if ON_MAC else resolve_dtype(cfg.ane_dtype, ane_dev, '--ane_dtype')
    in_worker = cfg.ane_worker and (ON_MAC or ane_dev.type == 'cpu')  # out of this process's GIL
    run = Run(cfg.mode, device, dtype, ane_dev, ane_dtype, ane_in_worker=in_worker,
              ane_programs=ON_MAC or cfg.ane_evaluator == 'numpy', ane_batch_size=ane_batch_size(cfg), ane_fraction=fraction)
    if device.type == 'mps' and cfg.mode != 'ane':
        check_mps(dtype, cfg.compile, head_size=cfg.n_embd // cfg.n_head, T=cfg.block_size)
    if ON_MAC and cfg.mode != 'gpu':
        check_coreml()
        check_ane_alignment(cfg, cfg.block_size)
    if cfg.wandb_log:
        check_wandb()
    # the settings given that this run does not use, said once: a flag is never a silent no-op
    gpu16 = dtype == torch.float16 and cfg.mode != 'ane'  # which engines scale their loss
    ane16 = cfg.mode != 'gpu' and ane_dtype == torch.float16
    fp16 = gpu16 or ane16
    worker = cfg.mode != 'gpu' and in_worker
    programs = cfg.mode != 'gpu' and run.ane_programs  # exported programs
    moot = dict(ane_programs=not programs, ane_batch_size=not programs,
                ane_fraction=cfg.mode != 'hetero', loss_scale=not gpu16, ane_loss_scale=not ane16,
                scale_window=not fp16, compile=(ON_MAC or worker) and cfg.mode == 'ane',
                ane_worker=cfg.mode == 'gpu', ane_load_timeout=not worker,
                ane_evaluator=ON_MAC or cfg.mode == 'gpu')
    moot |= dict.fromkeys(('ane_device', 'ane_dtype'), ON_MAC or cfg.mode == 'gpu')
    moot |= dict.fromkeys(('wandb_project', 'wandb_run_name'), not cfg.wandb_log)
    if unused := [f'--{k}' for k in moot if moot[k] and k in given]:
        log(f"not used by this run (mode {cfg.mode}{', macOS' if ON_MAC else ''}{'' if fp16 else ', no fp16 engine'}): "
            + ', '.join(unused))
    return cfg, run
