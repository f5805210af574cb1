"""
What a training run starts from, resolved in one call (resolve): the ranks joined under
torchrun, the settings of the run that --resume continues, the model that --init_from
names, and this machine's defaults for the flags not given.
"""
import os

import torch

from . import checkpoints, distributed, pretrained, settings


def defaults_here(cfg, cpu_defaults, mac_defaults, mac_gpt2):
    """(CPU defaults, Mac defaults) for the flags not given. GPT-2's own model (--preset gpt2,
    --init_from) keeps GPT-2's settings on a Mac, in microbatches that fit 16 GB."""
    gpt2_model = cfg.preset == 'gpt2' or cfg.init_from != 'scratch'
    cpu = {} if cfg.preset == 'gpt2' else cpu_defaults
    mac = mac_gpt2 if gpt2_model else mac_defaults
    return cpu, mac


def resolve(cfg, given, cpu_defaults, mac_defaults, mac_gpt2, log=print):
    """(cfg, Run, rank): the settings this run trains with, checked, on this machine.
    - Under torchrun, this process joins the other ranks.
    - --resume takes the saved run's settings, except the flags given.
    - --init_from fixes the model's size to the pretrained one's.
    - The flags not given take this machine's defaults.
    - The out_dir must hold no other run, unless --resume or --overwrite says what to do."""
    cfg, rank, _ = distributed.join_ranks(cfg)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    cfg, restored = checkpoints.restore(cfg, given, ckpt_path, rank, log)
    # rank 0 downloads the pretrained model, then the others read it
    cfg, fixed = distributed.rank0_first(lambda: pretrained.configure(cfg, given | restored))
    cfg, run = machine_settings(cfg, given, cpu_defaults, mac_defaults, mac_gpt2, log,
                                restored | fixed)
    checkpoints.check_out_dir(cfg)
    return cfg, run, rank


def machine_settings(cfg, given, cpu_defaults, mac_defaults, mac_gpt2, log=print,
                     kept=frozenset()):
    """(cfg, Run): the settings checked, this machine's defaults for the flags not given
    (nor kept), 'auto' resolved here (settings.check)."""
    cpu, mac = defaults_here(cfg, cpu_defaults, mac_defaults, mac_gpt2)
    cfg, run = settings.check(cfg, given, cpu, mac, log, kept)
    if run.device.type == 'cuda':  # fp32 matmuls on tensor cores (TF32), as nanoGPT
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return cfg, run
