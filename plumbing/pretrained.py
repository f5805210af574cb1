"""
OpenAI's GPT-2 weights, from the Hugging Face hub or a local folder in its layout
(config.json and model.safetensors, as `save_pretrained` writes them), in this
project's layout: nanoGPT's keys, so `GPT.load_state_dict` takes them.

Hugging Face's GPT-2 stores its linear layers as `Conv1D`, whose weight is (in, out);
nn.Linear's is (out, in), so those four weights per block are transposed.
"""
import dataclasses
import json
import os

import torch

from .settings import UserError

HUB = {name: f'openai-community/{name}' for name in ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')}
CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
MODEL_FLAGS = ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'bias')
# GPT-2's architecture as Hugging Face's config.json states it (other values: another model)
GPT2_ARCH = dict(model_type='gpt2', activation_function='gelu_new', layer_norm_epsilon=1e-5, n_inner=None,
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                 tie_word_embeddings=True, add_cross_attention=False)
WEIGHTS = ('model.safetensors', 'model*.safetensors', 'model.safetensors.index.json')  # one file, or shards


def folder(init_from, files=('config.json',)):
    """The local folder of --init_from: the folder itself, or the hub model's `files` downloaded
    (and cached by huggingface_hub: later runs read the cache). A hub name always means the hub;
    a folder of that name is ./gpt2."""
    if init_from not in HUB:
        if os.path.isdir(init_from):
            return init_from
        raise UserError(f"--init_from {init_from!r}: use {', '.join(HUB)}, or a folder in Hugging Face's layout "
                        "(config.json, model.safetensors)")
    try:
        import huggingface_hub  # only here: training from scratch needs neither package
        import safetensors  # noqa: F401
    except ImportError as e:
        raise UserError(f"--init_from {init_from} needs {e.name}: pip install huggingface_hub safetensors") from None
    try:
        return huggingface_hub.snapshot_download(HUB[init_from], allow_patterns=list(files))
    except Exception as e:  # offline, refused, disk full
        raise UserError(f"--init_from {init_from}: cannot fetch {HUB[init_from]} from the Hugging Face hub "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); offline, pass a folder that "
                        "holds its config.json and model.safetensors") from None


def model_args(path):
    """GPTConfig's fields of the GPT-2 in folder `path`, with its context as block_size."""
    try:
        with open(os.path.join(path, 'config.json')) as f:
            hf = json.load(f)
        args = dict(block_size=hf['n_positions'], **{k: hf[k] for k in MODEL_FLAGS if k != 'bias'}, bias=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--init_from {path}: no GPT-2 config.json there ({type(e).__name__}: {e})") from None
    other = {k: hf.get(k, v) for k, v in GPT2_ARCH.items() if hf.get(k, v) != v}
    if other:
        raise UserError(f"--init_from {path}: not GPT-2's architecture ({other}); this model is GPT-2 only")
    return args


def configure(cfg, given):
    """(cfg with --init_from's model, the flags it fixed); (cfg, set()) for scratch. A model flag given that disagrees is an error; a shorter --block_size keeps the
    first positions (as nanoGPT's crop_block_size), a longer one is an error."""
    if cfg.init_from == 'scratch':
        return cfg, set()
    path = folder(cfg.init_from)  # config.json alone: the weights once the run is checked (load)
    args = model_args(path)
    for k in MODEL_FLAGS:
        if k in given and getattr(cfg, k) != args[k]:
            raise UserError(f"--{k} {getattr(cfg, k)} disagrees with --init_from {cfg.init_from} ({k}={args[k]}): "
                            "leave it out, the model's size comes from the checkpoint")
    cfg = dataclasses.replace(cfg, **{k: args[k] for k in MODEL_FLAGS})
    if cfg.block_size <= args['block_size']:
        return cfg, set(MODEL_FLAGS)
    if 'block_size' in given:
        raise UserError(f"--block_size {cfg.block_size}: --init_from {cfg.init_from} has {args['block_size']} "
                        "positions; a shorter context keeps the first ones")
    cfg = dataclasses.replace(cfg, block_size=args['block_size'])
    return cfg, set(MODEL_FLAGS) | {'block_size'}


def state_dict(path, block_size):
    """The weights in folder `path` under nanoGPT's names, positions cropped to block_size."""
    from safetensors.torch import load_file
    index = os.path.join(path, 'model.safetensors.index.json')  # a sharded save: which file holds what
    files = sorted(set(json.load(open(index))['weight_map'].values())) if os.path.exists(index) else WEIGHTS[:1]
    sd = {}
    for name in files:
        for k, v in load_file(os.path.join(path, name)).items():
            k = k.removeprefix('transformer.')  # the hub's files lack it; save_pretrained's have it
            if k.endswith(('.attn.bias', '.attn.masked_bias')) or k == 'lm_head.weight':  # masks; the tied head
                continue
            sd['transformer.' + k] = v.t().contiguous() if k.endswith(CONV1D) else v
    sd['transformer.wpe.weight'] = sd['transformer.wpe.weight'][:block_size]
    sd['lm_head.weight'] = sd['transformer.wte.weight']  # tied, as GPT-2's
    return sd


def load(model, init_from):
    """model gets --init_from's weights (fetched now, if from the hub); UserError if they do not fit."""
    path = folder(init_from, ('config.json',) + WEIGHTS)
    try:
        model.load_state_dict(state_dict(path, model.config.block_size))
    except ImportError:
        raise UserError("--init_from needs safetensors to read model.safetensors: pip install safetensors") from None
    except Exception as e:  # absent or damaged files; weights that config.json does not describe
        raise UserError(f"--init_from {init_from}: its weights do not load ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]})") from None
    return path
