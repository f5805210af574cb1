"""
HeteroEngine: train GPT-2 on two accelerators at once.

Apple Silicon has a GPU and a Neural Engine (ANE) on one chip, sharing one memory.
PyTorch trains on the GPU only; the ANE is reachable only through Core ML, which runs
programs but has no autograd. So this file:

  1. defines GPT-2 (nanoGPT's layout, so checkpoints load),
  2. derives its backward pass by hand, once, over a tiny vocabulary of tensor ops,
  3. runs that derivation eagerly in PyTorch, or records it as a Core ML program,
  4. trains with both engines at once: every batch is split into microbatches, the GPU
     (autograd) and the ANE (the Core ML program) each run forward+backward on their
     share from the same weights, the gradients are averaged, one AdamW step follows.

Off a Mac the "ANE" engine is the same derivation run eagerly by PyTorch in fp16: the
ANE's arithmetic without the ANE. Everything macOS-only sits behind `coreml_predict_fn`.

Sections, in the order data flows: 1 config, 2 model, 3 the hand-derived step and its
PyTorch backend, 4 the Core ML programs, 5 the engines, 6 the concurrent step, 7 the
training loop. plumbing/ holds what this file uses (it never imports this file). tools/
holds what is built on it: the self-check, the gradient gate, the off-Mac speed, the quality study.
"""
import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import prepare_data  # defines: load (checked token arrays), DataError
from plumbing import checkpoints  # defines: resume, save, diverged, closing_sample
from plumbing import distributed  # defines: rank0_first, rank_share, sum_over_ranks,
#   check_same_weights, from_rank0, leave, exit_naming_stopped
from plumbing import energy  # defines: EnergyMeter (joules from NVML, RAPL or powermetrics), spent
from plumbing import memory  # defines: preflight (refuses a run that will not fit)
from plumbing import pretrained  # defines: load (OpenAI's GPT-2 in this layout)
from plumbing import progress  # defines: logger, header, Metrics, Display, with_val, defer_ctrl_c,
#   stop_run, ctrl_c_exits, say_plot_command
from plumbing import programs  # defines: ensure, read_meta, load_compiled, load_summary,
#   numpy_programs, check_shapes, coreml_predict, peaks
from plumbing import settings  # defines: parse_args, import_coremltools, one_line,
#   machine_defaults
from plumbing import startup  # defines: resolve (the run's final settings, once),
#   machine_settings
from plumbing import worker  # defines: WorkerEngine (the ANE engine in its own process),
#   set_process_threads
from plumbing.programs import ANE_MAX_DIM, ANE_OVERFLOW  # defines: ANE_MAX_DIM, ANE_OVERFLOW
from plumbing.settings import ON_MAC, UserError, check_batch, setting  # defines: ON_MAC,
#   UserError, check_batch, setting

# -----------------------------------------------------------------------------
# 1. Configuration: each setting with its default and a line of help.
# `python hetero_gpt.py --name value` overrides any of them.
# --help lists them all.
# GPTConfig holds the model's fields. Config adds the run's.

@dataclass
class GPTConfig:  # defaults are GPT-2 124M's
    block_size: int = setting(1024, "context length in tokens")
    vocab_size: int = setting(50257, "GPT-2 BPE vocabulary")
    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention heads per block")
    n_embd: int = setting(768, "embedding width")
    bias: bool = setting(True, "biases in linear layers and LayerNorms, as GPT-2 "
                               "(False: nanoGPT's bias=False)")


def model_config(cfg):
    """The GPTConfig part of a Config."""
    return GPTConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)})


@dataclass
class Config(GPTConfig):
    # data
    dataset: str = setting('shakespeare', "data set under data/<name>/ "
                                          "(prepare_data.py makes it)")
    data_dir: str = setting('data', "folder that holds the prepared data sets")
    # optimisation
    batch_size: int = setting(8, "sequences per microbatch")
    gradient_accumulation_steps: int = setting(4, "microbatches per optimizer step "
                                                  "(hetero splits these)")
    max_iters: int = setting(1000, "optimizer steps "
                                   "(0: none; a resumed run stops at this step too)")
    learning_rate: float = setting(3e-4, "peak learning rate")
    min_lr: float = setting(3e-5, "learning rate at the end of the cosine decay")
    warmup_iters: int = setting(100, "linear warm-up steps")
    weight_decay: float = setting(0.1, "AdamW weight decay (2-D weights only)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the averaged gradient's norm to this (0: off)")
    # engines
    mode: str = setting('auto', "gpu | ane | hetero | auto "
                                "(hetero on macOS, gpu elsewhere)")
    device: str = setting('auto', "GPU engine device: auto (mps > cuda > cpu), "
                                  "cpu, cuda, cuda:1, mps")
    dtype: str = setting('auto', "GPU engine precision: auto (bf16 on CUDA, fp32 else), "
                                 "float32, bfloat16, float16")
    ane_device: str = setting('auto', "off macOS, device of the eager stand-in for the ANE "
                                      "(auto: the GPU engine's)")
    ane_dtype: str = setting('float16', "off macOS, precision of the eager stand-in "
                                        "(float16 = the ANE's)")
    ane_fraction: str = setting('auto', "share of microbatches for the ANE: "
                                        "a number in [0,1] or auto (rebalance)")
    ane_batch_size: int = setting(0, "sequences per ANE call; a divisor of batch_size "
                                     "(0: the largest up to 4)")
    ane_programs: str = setting('', "folder of the ANE's Core ML programs "
                                    "(default: out_dir/ane_B{ane_batch_size}_T{block_size})")
    ane_worker: bool = setting(True, "run the ANE engine in a worker process "
                                     "(on macOS; off it, when it is on the CPU)")
    ane_evaluator: str = setting('eager', "off macOS, the ANE programs' runner: "
                                          "eager (PyTorch) or numpy (slow)")
    ane_load_timeout: float = setting(3600.0, "seconds the ANE worker may take "
                                              "to start and compile its programs")
    loss_scale: float = setting(1024.0, "GPU engine's initial fp16 loss scale (dynamic: "
                                        "x2 after scale_window finite steps, /2 on overflow)")
    ane_loss_scale: float = setting(4096.0, "ANE engine's initial loss scale "
                                           "(keeps gradients above fp16's subnormals); "
                                           "grows only far from fp16's max")
    scale_window: int = setting(200, "finite steps before the fp16 loss scale grows")
    compile: bool = setting(False, "torch.compile the GPU engine's model")
    # evaluation, logging and checkpoints
    eval_interval: int = setting(100, "evaluate validation loss and save a checkpoint "
                                      "every this many steps")
    eval_iters: int = setting(20, "validation batches per evaluation "
                                  "(0: the full validation split)")
    log_interval: int = setting(10, "print and log training metrics every this many steps")
    wandb_log: bool = setting(False, "also log metrics.jsonl's rows to Weights & Biases")
    wandb_project: str = setting('heteroengine', "wandb project (nanoGPT's: owt)")
    wandb_run_name: str = setting('gpt2', "wandb run name")
    out_dir: str = setting('out', "checkpoints and metrics.jsonl go here")
    resume: bool = setting(False, "resume from out_dir/ckpt.pt")
    init_from: str = setting('scratch', "scratch, or GPT-2's weights: gpt2, gpt2-medium, "
                                        "gpt2-large, gpt2-xl (from the Hugging Face hub) "
                                        "or a local folder of them")
    patience: int = setting(3, "stop once this many evaluations in a row "
                               "did not lower the best validation loss (0: never)")
    overwrite: bool = setting(False, "start over in an out_dir that holds a run "
                                     "(deletes its checkpoints and metrics)")
    max_bad_steps: int = setting(10, "stop after this many steps in a row "
                                     "without a usable gradient (0: never)")
    sample_tokens: int = setting(200, "tokens of text sampled at the end (0: none)")
    seed: int = setting(1337, "seed for weights and batch order")
    quiet: bool = setting(False, "no progress bar (off a terminal: a line per logged step)")
    preset: str = setting('', "gpt2: the paper's GPT-2 124M run on this machine too "
                              "(default: its own defaults)")
    dist_timeout: float = setting(600.0, "under torchrun, seconds a rank waits for the others "
                                         "before it stops the run")


# without an accelerator, a model that learns within a minute on 2 cores
CPU_DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=8,
                    gradient_accumulation_steps=2, max_iters=300, learning_rate=1e-3,
                    min_lr=1e-4, warmup_iters=20, eval_interval=100, eval_iters=10)
# on a Mac, a 30M GPT-2 at its best within an hour on a base chip
MAC_DEFAULTS = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=8,
                    gradient_accumulation_steps=4, max_iters=600, learning_rate=1e-3,
                    min_lr=1e-4, warmup_iters=50, eval_interval=50)
MAC_GPT2 = dict(batch_size=2, gradient_accumulation_steps=16)  # --preset gpt2 fits 124M in 16 GB


# -----------------------------------------------------------------------------
# 2. The model: GPT-2 as published, with nanoGPT's state-dict keys.
# Learned positions and pre-LayerNorm with bias.
# A tanh-GELU MLP, and an LM head tied to the embedding.
# bias=False drops every bias, as nanoGPT's option does.
# No dropout, as the hand-derived backward below does not model it.

class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused attention
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate='tanh'))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} is longer than "
                             f"block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        # under autocast the log-softmax inside cross_entropy runs in fp32
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=200, vocab=None):
        # vocab is the tokenizer's size, where the model's is padded
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :vocab] / temperature
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float('inf')
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), 1)), dim=1)
        return idx


def gpt_param_shapes(cfg):
    """GPT's parameters by name, as meta tensors: their shapes, without memory."""
    with torch.device('meta'):
        return dict(GPT(cfg).named_parameters())

# -----------------------------------------------------------------------------
# 3. The hand-derived training step.
#
# Derivation's methods write it once over a few primitive ops.
# Each backend provides these ops.
#   binary       matmul + - * / maximum
#   unary        exp log tanh rsqrt softmax
#   reductions   sum mean max over one axis
#   layout       reshape transpose
#   constants    causal_mask pad_mask
# TorchOps runs them eagerly. MILOps records them as a Core ML program.
# Each layer is a forward/backward pair.
# The backward takes the forward's cache.
# A faster backend overrides a whole pair, cache and all.
# Every op runs on the ANE; none gathers, scatters, concatenates or splits.
# host_weights, host_batch and host_grads do the sparse work around it.
#
# B sequences of T tokens make N = B*T rows.
# C = n_embd, and H heads have D = C/H each.
# Rows are (N, C) matrices; attention runs per head on (B, H, T, D).
# Not Apple's (B, C, 1, S) layout of 1x1 convs, as weights are program inputs.
# A conv with a runtime weight compiles only at batch 1 (coreml_and_ane.md section 3).
#
# Core ML names each program input and output by this scheme.
#   x0              the embeddings wte[idx] + wpe
#   h{l}_{k}        block l's weight k in BLOCK_PARAMS
#   wte_{j}         vocabulary chunk j of the LM head
#   wte_tgt         the target rows wte[targets]
#   lnf_w lnf_b     the final layernorm
#   loss_scale      the loss scale
#   x y             a block piece's input and output
#   dy              the gradient of y
#   d_{name}        the gradient of input name
#   peaks           matmul results' largest |value|s

GELU_K = math.sqrt(2.0 / math.pi)
PROBS_UP = 16.0  # the LM head's softmax, scaled up in its backward's matmuls
DS_UP = 64.0  # attention's dS, likewise

# weight name -> (nanoGPT's name under transformer.h.{l}, third of c_attn's rows)
# The host slices the (3C, C) c_attn in thirds, so programs need no split or concat.
BLOCK_PARAMS = {
    'ln1_w': ('ln_1.weight', None), 'ln1_b': ('ln_1.bias', None),
    'wq': ('attn.c_attn.weight', 0),
    'wk': ('attn.c_attn.weight', 1),
    'wv': ('attn.c_attn.weight', 2),
    'bq': ('attn.c_attn.bias', 0), 'bk': ('attn.c_attn.bias', 1), 'bv': ('attn.c_attn.bias', 2),
    'wo': ('attn.c_proj.weight', None), 'bo': ('attn.c_proj.bias', None),
    'ln2_w': ('ln_2.weight', None), 'ln2_b': ('ln_2.bias', None),
    'wfc': ('mlp.c_fc.weight', None), 'bfc': ('mlp.c_fc.bias', None),
    'wpr': ('mlp.c_proj.weight', None), 'bpr': ('mlp.c_proj.bias', None),
}


class Derivation:
    """GPT-2's forward, loss and backward, each layer a pair of methods over self's ops."""
    recompute_attention = False  # True remakes P in the backward instead of caching it

    # ---- linear layer: y = x W^T + b, x (N, Cin), W (Cout, Cin)
    def linear_forward(self, x, w, b):  # b is None under bias=False
        y = self.matmul(x, w, tb=True)
        return y if b is None else y + b

    def linear_backward(self, dy, x, w):
        # dL/dx = dy W
        # dL/dW = dy^T x
        # dL/db = sum over rows of dy
        return self.matmul(dy, w), self.matmul(dy, x, ta=True), self.sum(dy, 0, keep=False)

    # ---- layernorm over the last axis: y = xhat * w + b
    # xhat = (x - mean) * rstd
    def layernorm_forward(self, x, w, b, eps=1e-5):
        xc = x - self.mean(x, -1)
        rstd = self.rsqrt(self.mean(xc * xc, -1) + eps)  # 1/sqrt(var + eps)
        xhat = xc * rstd
        y = xhat * w
        if b is not None:
            y = y + b
        return y, (xhat, rstd)

    def layernorm_backward(self, dy, w, cache):
        # g = dy * w
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
        # dw = sum over rows of dy * xhat
        # db = sum over rows of dy
        xhat, rstd = cache
        g = dy * w
        dx = (g - self.mean(g, -1) - xhat * self.mean(g * xhat, -1)) * rstd
        return dx, self.sum(dy * xhat, 0, keep=False), self.sum(dy, 0, keep=False)

    # ---- GELU, tanh form: y = x/2 (1 + tanh(u)), u = k (x + 0.044715 x^3)
    # written out because the ANE's gelu is a coarse table (coreml_and_ane.md section 2)
    def gelu_forward(self, x):
        t = self.tanh((x + 0.044715 * x * x * x) * GELU_K)
        return self.gelu_output((x, t)), (x, t)

    def gelu_output(self, cache):  # remakes y in one multiply-add, so y is not kept
        x, t = cache
        return 0.5 * x * (1.0 + t)

    def gelu_backward(self, dy, cache):
        # dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 * 0.044715 x^2)
        x, t = cache
        return dy * (0.5 * (1.0 + t)
                     + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3 * 0.044715 * x * x))

    # ---- causal self-attention: y = P v, with q, k, v and y each (N, C)
    def heads(self, x, B, T, H):  # (N, C) -> (B, H, T, D)
        return self.transpose(self.reshape(x, (B, T, H, -1)), (0, 2, 1, 3))

    def merge_heads(self, x, B, T):  # (B, H, T, D) -> (N, C)
        return self.reshape(self.transpose(x, (0, 2, 1, 3)), (B * T, -1))

    def attention_probs(self, q, k, T):
        # P = softmax(q k^T / sqrt(D) + mask) is (B, H, T, T)
        scores = self.matmul(q, k, tb=True) * (1.0 / math.sqrt(q.shape[-1]))
        return self.softmax(scores + self.causal_mask(T), -1)

    def attention_forward(self, q, k, v, B, T, H):
        q, k, v = (self.heads(t, B, T, H) for t in (q, k, v))
        att = self.attention_probs(q, k, T)
        y = self.merge_heads(self.matmul(att, v), B, T)
        return y, (q, k, v, None if self.recompute_attention else att)

    def attention_backward(self, dy, cache, B, T, H):
        # dv = P^T dy and dP = dy v^T
        # dS = P * (dP - rowsum(dP * P)), the softmax backward
        # dq = dS k * scale and dk = dS^T q * scale
        # The mask is a constant, so it has no gradient.
        dy = self.heads(dy, B, T, H)
        q, k, v, att = cache
        scale = 1.0 / math.sqrt(q.shape[-1])
        if att is None:
            att = self.attention_probs(q, k, T)
        dv = self.matmul(att, dy, ta=True)
        datt = self.matmul(dy, v, tb=True)
        # dS enters the matmuls times DS_UP, their results divided by it: its values are
        # products of probabilities, below fp16's normal range, which an ANE matmul may flush
        ds = att * (datt - self.sum(datt * att, -1)) * (scale * DS_UP)
        dq = self.matmul(ds, k) * (1.0 / DS_UP)
        dk = self.matmul(ds, q, ta=True) * (1.0 / DS_UP)
        return self.merge_heads(dq, B, T), self.merge_heads(dk, B, T), self.merge_heads(dv, B, T)

    # ---- QKV projection: q = a Wq^T + bq, and likewise k and v
    # three (C, C) matmuls on the sliced c_attn
    def qkv_forward(self, a, w):
        return tuple(self.linear_forward(a, w['w' + c], w.get('b' + c)) for c in 'qkv'), a

    def qkv_backward(self, dq, dk, dv, w, cache):
        da = None
        d = {}
        for c, dc in zip('qkv', (dq, dk, dv)):
            dac, d['w' + c], d['b' + c] = self.linear_backward(dc, cache, w['w' + c])
            da = dac if da is None else da + dac
        return da, d

    # ---- transformer block: x += attn(ln_1(x)), then x += mlp(ln_2(x))
    # w maps BLOCK_PARAMS names to weights.
    # bias=False leaves the biases out of w.
    def block_forward(self, x, w, B, T, H):
        a, ln1 = self.layernorm_forward(x, w['ln1_w'], w.get('ln1_b'))
        (q, k, v), qkv = self.qkv_forward(a, w)
        y, attn = self.attention_forward(q, k, v, B, T, H)
        x = x + self.linear_forward(y, w['wo'], w.get('bo'))
        m, ln2 = self.layernorm_forward(x, w['ln2_w'], w.get('ln2_b'))
        h = self.linear_forward(m, w['wfc'], w.get('bfc'))
        g, gelu = self.gelu_forward(h)
        x = x + self.linear_forward(g, w['wpr'], w.get('bpr'))
        return x, (ln1, qkv, y, attn, m, ln2, gelu)  # no g, as gelu_output remakes it

    def block_backward(self, dx, w, cache, B, T, H):
        # the forward's calls in reverse
        # a residual add passes dx through unchanged
        ln1, qkv, y, attn, m, ln2, gelu = cache
        d = {}
        dg, d['wpr'], d['bpr'] = self.linear_backward(dx, self.gelu_output(gelu), w['wpr'])
        dh = self.gelu_backward(dg, gelu)
        dm, d['wfc'], d['bfc'] = self.linear_backward(dh, m, w['wfc'])
        dmx, d['ln2_w'], d['ln2_b'] = self.layernorm_backward(dm, w['ln2_w'], ln2)
        dx = dx + dmx
        dy, d['wo'], d['bo'] = self.linear_backward(dx, y, w['wo'])
        dq, dk, dv = self.attention_backward(dy, attn, B, T, H)
        da, dqkv = self.qkv_backward(dq, dk, dv, w, qkv)
        dax, d['ln1_w'], d['ln1_b'] = self.layernorm_backward(da, w['ln1_w'], ln1)
        grads = {k: v for k, v in (d | dqkv).items() if k in w}  # none for an absent bias
        return dx + dax, grads

    # ---- log-sum-exp over the last axis: lse = m + log sum_v exp(z_v - m)
    # m = max_v z_v makes the largest term exp(0) = 1, so exp never overflows
    def logsumexp_forward(self, z):
        m = self.max(z, -1)
        return m + self.log(self.sum(self.exp(z - m), -1))

    # ---- tied LM head and mean cross-entropy: loss = mean_n (lse_n - z_n[target_n])
    # z = x W^T and lse_n = log sum_v exp(z_nv)
    # 50257 rows exceed the ANE's limit of 16384, so W arrives in chunks.
    # lse is the log-sum-exp of the chunks' own log-sum-exps lse_c.
    # The target logit is x_n . W[target_n]; the host gathers those rows as w_tgt.
    # The last chunk's `pad` zero rows get a -1e4 logit bias.
    # exp() then makes them 0 in the softmax and every gradient.
    def lm_head_forward(self, x, chunks, w_tgt, N, pad=0):
        Vc = chunks[-1].shape[0]
        biases = [None] * (len(chunks) - 1) + [self.pad_mask(Vc, Vc - pad) if pad else None]
        z = [self.linear_forward(x, w, b) for w, b in zip(chunks, biases)]  # (N, Vc) each
        lse_c = [self.logsumexp_forward(zc) for zc in z]  # (N, 1) each
        m = lse_c[0]
        for lc in lse_c[1:]:
            m = self.maximum(m, lc)
        s = None
        for lc in lse_c:
            sc = self.exp(lc - m)
            s = sc if s is None else s + sc
        lse = m + self.log(s)  # (N, 1)
        # (lse - z_target) / N before the sum, as N losses of ~10 overflow fp16
        loss = self.sum((lse - self.sum(x * w_tgt, -1)) * (1.0 / N), 0)  # (1, 1)
        return loss, (x, z, lse_c, lse)

    def lm_head_backward(self, chunks, w_tgt, cache, dloss):
        # dloss = loss_scale / N is dL/dloss_n
        # dz = dloss * (softmax(z) - onehot(target))
        # In chunk c, dloss * exp(z - lse) = softmax_c(z) * r
        # r = dloss * exp(lse_c - lse) is one number per row
        # dW_c = softmax_c^T (r x) and dx_c = r (softmax_c W_c)
        # r scales the (N, C) operands, 16x fewer numbers than the (N, Vc) matrix
        # onehot adds -dloss W[target] to dx and -dloss x to the target rows
        # The softmax enters the matmuls times PROBS_UP, and their results are divided by it.
        # A probability of a 12608-row chunk, 1/12608 on average, is near fp16's smallest
        # normal number 2^-14, which an ANE matmul may flush to 0 (coreml_and_ane.md section 2).
        x, z, lse_c, lse = cache
        dx = None
        dws = []
        for w, zc, lc in zip(chunks, z, lse_c):
            probs = self.exp(zc - (lc - math.log(PROBS_UP)))  # softmax_c(z) * PROBS_UP, (N, Vc)
            r = self.exp(lc - lse) * dloss  # (N, 1)
            dws.append(self.matmul(probs, x * r, ta=True) * (1.0 / PROBS_UP))
            dxc = self.matmul(probs, w) * (r * (1.0 / PROBS_UP))
            dx = dxc if dx is None else dx + dxc
        return dx - w_tgt * dloss, dws, -x * dloss

    # ---- the head: loss = lm_head(ln_f(x)), forward and backward
    def head_forward_backward(self, cfg, B, T, inp):
        """(loss, grads) from inp: x (N, C), the last block's output; lnf_w, lnf_b; the vocabulary
        chunks wte_j; the target rows wte_tgt; loss_scale. grads go by the same names."""
        rows, spans = vocab_chunks(cfg.vocab_size)
        chunks = [inp[f'wte_{j}'] for j in range(len(spans))]
        pad = len(spans) * rows - cfg.vocab_size
        xf, lnf = self.layernorm_forward(inp['x'], inp['lnf_w'], inp.get('lnf_b'))
        loss, head = self.lm_head_forward(xf, chunks, inp['wte_tgt'], B * T, pad=pad)
        grads = {}
        dloss = inp['loss_scale'] * (1.0 / (B * T))
        dxf, dws, grads['wte_tgt'] = self.lm_head_backward(chunks, inp['wte_tgt'], head, dloss)
        grads.update({f'wte_{j}': dw for j, dw in enumerate(dws)})
        grads['x'], grads['lnf_w'], dlnf_b = self.layernorm_backward(dxf, inp['lnf_w'], lnf)
        if 'lnf_b' in inp:
            grads['lnf_b'] = dlnf_b
        return loss, grads

    # ---- the whole dense step
    def dense_forward_backward(self, cfg, B, T, inp):
        """GPT-2's forward, loss and backward between the embedding lookup and the target pick,
        from dense inputs by name (dense_input_shapes). Returns the true mean loss and grads by the
        same names, times inp['loss_scale'], so that fp16 weight gradients do not flush to zero."""
        H = cfg.n_head
        L = cfg.n_layer
        blocks = [{k: inp[f'h{l}_{k}'] for k in BLOCK_PARAMS if f'h{l}_{k}' in inp}
                  for l in range(L)]
        x = inp['x0']
        caches = []
        for l in range(L):
            x, c = self.block_forward(x, blocks[l], B, T, H)
            caches.append(c)
        loss, grads = self.head_forward_backward(cfg, B, T, inp | {'x': x})
        dx = grads.pop('x')
        for l in reversed(range(L)):  # backward through the blocks
            dx, d = self.block_backward(dx, blocks[l], caches[l], B, T, H)
            grads.update({f'h{l}_{k}': v for k, v in d.items()})
        grads['x0'] = dx
        return loss, grads


class TorchOps(Derivation):
    """PyTorch backend of the derivation: eager, no autograd, any device and dtype."""
    # P (B, H, T, T) is the largest eager cache, so the backward remakes it
    recompute_attention = True

    def __init__(self, dtype, device):
        self.dtype = dtype
        self.device = torch.device(device)

    def matmul(self, a, b, ta=False, tb=False):
        if ta:
            a = a.mT
        if tb:
            b = b.mT
        if self.dtype == torch.float16 and self.device.type == 'cpu':
            # CPUs have no fast fp16 GEMM; fp32 sums match the ANE and tensor cores
            return (a.float() @ b.float()).half()
        return a @ b

    def exp(self, x): return torch.exp(x)
    def log(self, x): return torch.log(x)
    def tanh(self, x): return torch.tanh(x)
    def rsqrt(self, x): return torch.rsqrt(x)
    def maximum(self, a, b): return torch.maximum(a, b)

    def sum(self, x, axis, keep=True): return x.sum(axis, keepdim=keep)
    def mean(self, x, axis): return x.mean(axis, keepdim=True)
    def max(self, x, axis): return x.amax(axis, keepdim=True)
    def softmax(self, x, axis): return torch.softmax(x, axis)
    def reshape(self, x, shape): return x.reshape(shape)
    def transpose(self, x, perm): return x.permute(perm)

    def causal_mask(self, T):
        # an additive mask: 0 on and below the diagonal and -1e4 above
        # not -inf, as -inf - -inf = nan
        # exp(-1e4) is 0 in any dtype (coreml_and_ane.md section 2)
        return torch.full((T, T), -1e4, dtype=self.dtype, device=self.device).triu(1)

    def pad_mask(self, n, valid):  # an (n,) bias: 0 on the first `valid` columns and -1e4 after
        return torch.where(torch.arange(n, device=self.device) < valid, 0.0, -1e4).to(self.dtype)


def vocab_chunks(V):
    """(rows, [(start, end)]): the vocabulary in n chunks of `rows` <= ANE_MAX_DIM rows, a
    multiple of 64 (aligned, for tensor cores and the ANE); the last padded, masked out."""
    n = -(-V // ANE_MAX_DIM)
    rows = (-(-V // n) + 63) // 64 * 64  # ceil(V / n), rounded up to a multiple of 64
    return rows, [(j * rows, min(V, (j + 1) * rows)) for j in range(n)]


def model_sizes(cfg):
    """(parameter count, the tied LM head once; vocabulary rows, padded as the ANE's head
    takes them)."""
    rows, spans = vocab_chunks(cfg.vocab_size)
    shapes = gpt_param_shapes(model_config(cfg))
    n_params = sum(p.numel() for k, p in shapes.items() if k != 'lm_head.weight')
    return n_params, rows * len(spans)


def dense_input_shapes(cfg, B, T):
    """Name -> shape of every input of the dense step (the weights as host_weights makes
    them, from meta tensors), the microbatch's rows and the loss scale."""
    weights = host_weights(gpt_param_shapes(cfg), cfg)
    return {k: tuple(v.shape) for k, v in weights.items()} | {
        'x0': (B * T, cfg.n_embd), 'wte_tgt': (B * T, cfg.n_embd), 'loss_scale': (1, 1)}


# ---- the host side: the sparse work around the dense step
def host_weights(params, cfg):
    """The dense step's weight inputs from nanoGPT's names: the same tensors, with c_attn
    sliced into q/k/v rows and the (tied) embedding into vocabulary chunks."""
    inp = {'lnf_w': params['transformer.ln_f.weight']}
    if 'transformer.ln_f.bias' in params:  # none under bias=False
        inp['lnf_b'] = params['transformer.ln_f.bias']
    for l in range(cfg.n_layer):
        for k, (name, third) in BLOCK_PARAMS.items():
            if f'transformer.h.{l}.{name}' in params:
                w = params[f'transformer.h.{l}.{name}']
                inp[f'h{l}_{k}'] = w if third is None else w.chunk(3, 0)[third]
    rows, spans = vocab_chunks(cfg.vocab_size)
    wte = params['transformer.wte.weight']
    for j, (a, b) in enumerate(spans):  # the last chunk padded with zero rows to `rows`
        inp[f'wte_{j}'] = F.pad(wte[a:b], (0, 0, 0, rows - (b - a)))
    return inp


def host_batch(wte, wpe, cfg, idx, targets, loss_scale):
    """The dense step's per-microbatch inputs: the embeddings x0 = wte[idx] + wpe[:T], the target
    rows wte_tgt = wte[targets], the loss scale as a (1, 1) tensor."""
    T = idx.shape[1]
    scale = torch.full((1, 1), float(loss_scale), dtype=wte.dtype, device=wte.device)
    return {'x0': (wte[idx] + wpe[:T]).reshape(-1, cfg.n_embd),
            'wte_tgt': wte[targets.reshape(-1)],
            'loss_scale': scale}


def host_grads(g, cfg, idx, targets, loss_scale, out_dtype):
    """Parameter gradients (nanoGPT names) from the dense step's outputs: scatter-add the
    embedding rows' gradients, sum positions over the batch, join q/k/v, unscale."""
    B, T = idx.shape
    g = {k: v.to(out_dtype) for k, v in g.items()}
    spans = vocab_chunks(cfg.vocab_size)[1]
    dwte = torch.cat([g[f'wte_{j}'][:b - a] for j, (a, b) in enumerate(spans)], 0)
    dwte.index_add_(0, idx.reshape(-1), g['x0'])           # d wte[idx[n]] += dx0[n]
    dwte.index_add_(0, targets.reshape(-1), g['wte_tgt'])  # d wte[target[n]] += dwte_tgt[n]
    dwpe = torch.zeros(cfg.block_size, cfg.n_embd, dtype=out_dtype, device=dwte.device)
    dwpe[:T] = g['x0'].reshape(B, T, -1).sum(0)            # every sequence uses wpe's first T rows
    grads = {'transformer.wte.weight': dwte, 'transformer.wpe.weight': dwpe,
             'transformer.ln_f.weight': g['lnf_w']}
    if 'lnf_b' in g:  # a gradient for every input the step had
        grads['transformer.ln_f.bias'] = g['lnf_b']
    for l in range(cfg.n_layer):
        for k, (name, third) in BLOCK_PARAMS.items():
            if f'h{l}_{k}' in g and third is None:
                grads[f'transformer.h.{l}.{name}'] = g[f'h{l}_{k}']
            elif f'h{l}_{k}' in g and third == 0:  # q's third, joined with k's and v's
                thirds = [g[f'h{l}_{k[0]}{c}'] for c in 'qkv']
                grads[f'transformer.h.{l}.{name}'] = torch.cat(thirds, 0)
    if loss_scale != 1.0:
        for grad in grads.values():
            grad.div_(loss_scale)
    return grads


def eager_loss_and_grads(ops, cfg, w, idx, targets, loss_scale):
    """(loss, grads) by the derivation on backend ops (a TorchOps): weights `w` by nanoGPT's
    names, already in its dtype on its device; grads unscaled, fp32 for fp16/bf16 runs
    (unscaling in fp16 would flush small ones). Non-finite values come back as they are."""
    with torch.no_grad():
        wte = w['transformer.wte.weight']
        wpe = w['transformer.wpe.weight']
        inp = host_weights(w, cfg) | host_batch(wte, wpe, cfg, idx, targets, loss_scale)
        loss, g = ops.dense_forward_backward(cfg, idx.shape[0], idx.shape[1], inp)
        out_dtype = torch.float32 if ops.dtype in (torch.float16, torch.bfloat16) else ops.dtype
        loss = loss.reshape(()).to(out_dtype)
        return loss, host_grads(g, cfg, idx, targets, loss_scale, out_dtype)


# -----------------------------------------------------------------------------
# 4. The Core ML programs: the same derivation, recorded by coremltools' MIL builder.
#
# MILOps' ops add ops to a MIL program instead of computing.
# A whole model compiles for tens of minutes or fails (coreml_and_ane.md section 1).
# One block compiles in a second, so the host chains three programs (CoreMLEngine).
# Blocks share shapes and take weights as inputs, so each compiles once.
#   block_forward   x and the block's weights         -> y                      L calls
#   head            x_L, ln_f, vocabulary chunks, target rows and loss scale
#                                                     -> loss, d_x and d_<its weights>
#   block_backward  x, dy and the block's weights     -> d_x and d_<weights>    L calls
# block_backward recomputes its block's forward from x.
# A cache would cross the host twice as fp32 (coreml_and_ane.md section 1).
# Opset macOS13 takes fp16 in and out.
# export_ane.py --whole_step makes one 'step' program instead.
ANE_PIECES = ('block_forward', 'head', 'block_backward')


@dataclass
class MILTensor:
    """A MIL variable whose + - * / record MIL ops; Python floats become fp16 constants."""
    var: object

    @property
    def shape(self):
        return tuple(self.var.shape)

    def binary(self, op, other, swap=False):
        from coremltools.converters.mil import Builder as mb
        other = other.var if isinstance(other, MILTensor) else np.float16(other)
        if swap:  # other op self, as in 1.0 - x
            return MILTensor(getattr(mb, op)(x=other, y=self.var))
        return MILTensor(getattr(mb, op)(x=self.var, y=other))

    def __add__(self, o): return self.binary('add', o)
    def __radd__(self, o): return self.binary('add', o, swap=True)
    def __sub__(self, o): return self.binary('sub', o)
    def __rsub__(self, o): return self.binary('sub', o, swap=True)
    def __mul__(self, o): return self.binary('mul', o)
    def __rmul__(self, o): return self.binary('mul', o, swap=True)
    def __truediv__(self, o): return self.binary('real_div', o)
    def __rtruediv__(self, o): return self.binary('real_div', o, swap=True)
    def __neg__(self): return self.binary('mul', -1.0)


class MILOps(Derivation):
    """MIL backend of the derivation, every op one the ANE runs (coreml_and_ane.md section 2)."""

    def __init__(self):
        self.mb = settings.import_coremltools().converters.mil.Builder

    def unary(self, op, x, **kw):
        return MILTensor(getattr(self.mb, op)(x=x.var, **kw))

    def matmul(self, a, b, ta=False, tb=False):
        return MILTensor(self.mb.matmul(x=a.var, y=b.var, transpose_x=ta, transpose_y=tb))

    def exp(self, x): return self.unary('exp', x)
    def log(self, x): return self.unary('log', x)
    def tanh(self, x): return self.unary('tanh', x)
    def rsqrt(self, x): return self.unary('rsqrt', x)
    def maximum(self, a, b): return a.binary('maximum', b)

    def max(self, x, axis): return self.unary('reduce_max', x, axes=[axis], keep_dims=True)
    def softmax(self, x, axis): return self.unary('softmax', x, axis=axis)
    def reshape(self, x, shape): return self.unary('reshape', x, shape=list(shape))
    def transpose(self, x, perm): return self.unary('transpose', x, perm=list(perm))

    # The ANE's reduce_sum accumulates in fp16 (coreml_and_ane.md section 2).
    # Its matmul accumulates wider, so a sum is a matmul by a constant c.
    # x @ c sums over the last axis and c^T x over rows.
    # c = 1 sums; c = 1/n means, so no partial sum leaves fp16's range.
    def sum_as_matmul(self, x, axis, c):
        if axis == 0:
            vec = MILTensor(self.mb.const(val=np.full((1, x.shape[0]), c, np.float16)))
            return self.matmul(vec, x)
        vec = MILTensor(self.mb.const(val=np.full((x.shape[axis], 1), c, np.float16)))
        return self.matmul(x, vec)

    def sum(self, x, axis, keep=True):
        s = self.sum_as_matmul(x, axis, 1.0)
        if keep:
            return s
        return self.reshape(s, [d for i, d in enumerate(x.shape) if i != axis % len(x.shape)])

    def mean(self, x, axis): return self.sum_as_matmul(x, axis, 1.0 / x.shape[axis])

    def layernorm_forward(self, x, w, b, eps=1e-5):
        # fp16 squares overflow past 256 (coreml_and_ane.md section 2).
        # GPT-2's residual rows pass it, so each row is first divided by s = max |xc|.
        # s is at least 2^-14, so a constant row gives 0 and not 0/0.
        # xs = xc/s and e = sqrt(eps)/s
        # xhat = xs r with r = rsqrt(mean(xs^2) + e^2), and rstd = r/s
        # The cache is the derivation's (xhat, rstd), so its layernorm_backward serves.
        xc = x - self.mean(x, -1)
        s = self.maximum(self.max(self.unary('abs', xc), -1), 2.0 ** -14)
        xs = xc / s
        e = math.sqrt(eps) / s
        r = self.rsqrt(self.mean(xs * xs, -1) + e * e)
        xhat = xs * r
        y = xhat * w
        if b is not None:
            y = y + b
        return y, (xhat, r / s)

    def causal_mask(self, T):  # program constants equal to TorchOps' masks
        return MILTensor(self.mb.const(val=np.triu(np.full((T, T), -1e4, np.float16), 1)))

    def pad_mask(self, n, valid):
        mask = np.where(np.arange(n) < valid, 0, -1e4).astype(np.float16)
        return MILTensor(self.mb.const(val=mask))


def piece_input_shapes(cfg, B, T, piece):
    """Name -> shape of each input of a program: one of ANE_PIECES, or 'step'."""
    shapes = dense_input_shapes(cfg, B, T)
    if piece == 'step':
        return shapes
    x = {'x': (B * T, cfg.n_embd)}
    if piece == 'head':
        return x | {k: v for k, v in shapes.items()
                    if k.startswith(('lnf_', 'wte_')) or k == 'loss_scale'}
    dy = {'dy': x['x']} if piece == 'block_backward' else {}
    return x | dy | {k: shapes[f'h0_{k}'] for k in BLOCK_PARAMS if f'h0_{k}' in shapes}


def run_piece(ops, cfg, B, T, piece, inp):
    """A program's outputs by name from its inputs, on backend ops: what MILOps records as the
    program is what TorchOps runs as its stand-in. The gradient of input k is 'd_' + k."""
    if piece == 'step':
        loss, g = ops.dense_forward_backward(cfg, B, T, inp)
    elif piece == 'head':
        loss, g = ops.head_forward_backward(cfg, B, T, inp)
    else:
        w = {k: inp[k] for k in BLOCK_PARAMS if k in inp}
        y, cache = ops.block_forward(inp['x'], w, B, T, cfg.n_head)
        if piece == 'block_forward':
            return {'y': y}
        dx, g = ops.block_backward(inp['dy'], w, cache, B, T, cfg.n_head)
        return {'d_x': dx} | {'d_' + k: v for k, v in g.items()}
    return {'loss': loss} | {'d_' + k: v for k, v in g.items()}


def mil_program(fn, shapes):
    """A MIL Program of fn(MILOps(), **fp16 inputs of these shapes) -> {name: MILTensor}."""
    ct = settings.import_coremltools()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types
    placeholders = {k: mb.placeholder(shape=s, dtype=types.fp16) for k, s in shapes.items()}
    with Function(placeholders, opset_version=ct.target.macOS13) as f:
        out = fn(MILOps(), **{k: MILTensor(v) for k, v in f.inputs.items()})
        f.set_outputs([mb.identity(x=v.var, name=k) for k, v in out.items()])
    prog = Program()
    prog.add_function('main', f)
    return prog


def build_coreml_program(cfg, B, T, piece='step'):
    """run_piece(MILOps) as a MIL Program: fp16 inputs piece_input_shapes(cfg, B, T, piece),
    fp16 outputs by run_piece's names, and 'peaks', the overflow check of programs.peaks."""
    programs.check_shapes(B, T, cfg.block_size)

    def fn(ops, **inp):
        out = run_piece(ops, cfg, B, T, piece, inp)
        peaks = programs.peaks([v.var for v in out.values()], piece)
        return out | {k: MILTensor(v) for k, v in peaks.items()}
    return mil_program(fn, piece_input_shapes(cfg, B, T, piece))


def coreml_predict_fn(path, pieces):
    """The macOS seam: predict(piece, inputs) -> outputs, by Core ML on CPU + Neural Engine.
    Each program is compiled once, into a cache beside it (an .mlpackage would compile again
    at every load, coreml_and_ane.md section 1). Off macOS the saved programs run in the NumPy
    evaluator; everything else in this file runs anywhere."""
    if not ON_MAC:
        return programs.numpy_programs(path, pieces)
    ct = settings.import_coremltools()

    def load(compiled):
        return ct.models.CompiledMLModel(compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    models = {}
    for piece in pieces:
        try:
            models[piece] = programs.load_compiled(path, piece, load)
        except Exception as e:  # a failed compile or load, named in one line
            raise UserError(f"Core ML could not compile or load the program {piece} "
                            f"({settings.one_line(e)})") from None
    return lambda piece, inputs: programs.coreml_predict(models[piece], inputs)


# -----------------------------------------------------------------------------
# 5. The engines, and which ones a mode builds.
# AutogradEngine runs on the GPU. CoreMLEngine runs the ANE's programs.
# EagerEngine runs the derivation in PyTorch: the ANE's stand-in off a Mac.


class Engine:
    """What the step (HeteroStep) needs of an engine, which runs in a thread of its own:
    - loss_and_grads(idx, targets) -> (0-dim loss, {param name: gradient}) of one microbatch,
      fp32 tensors (fp64 in fp64 runs) that the caller owns;
    - load_weights(params), once per step;
    - close(), at the run's end;
    - name ('gpu' or 'ane'), label, device, scaler (a LossScaler)."""
    def load_weights(self, params):
        pass

    def close(self):
        pass


class LossScaler:
    """Dynamic loss scaling for an fp16 engine: the backward is seeded with `scale`, so small
    gradients stay above zero, and the host divides it out. The scale is
    - halved (down to 1) after a non-finite step;
    - doubled (up to 2^24) after `window` finite steps, unless 2 x `peak` > `limit`."""

    def __init__(self, scale, window, enabled=True, limit=math.inf):
        self.scale = float(scale) if enabled else 1.0
        self.window = window
        self.enabled = enabled
        self.good = 0  # finite steps in this window
        self.limit = limit
        self.peak = 0.0  # the window's largest |value|

    def update(self, finite):
        if self.enabled and not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good = 0
            self.peak = 0.0
        elif self.enabled:
            self.good += 1
            if self.good >= self.window:
                if 2 * self.peak < self.limit:  # doubled, the peak stays under limit
                    self.scale = min(self.scale * 2, 2.0 ** 24)
                self.good = 0
                self.peak = 0.0


class AutogradEngine(Engine):
    """The GPU engine. Its model is the master copy of the weights, so it loads none."""
    name = 'gpu'

    def __init__(self, model, device, dtype, compile=False, scaler=None):
        self.model = model
        self.device = device
        self.forward = torch.compile(model) if compile else model
        self.params = list(model.named_parameters())
        # bf16 and fp16 autocast over fp32 master weights
        # fp32 and fp64 run as they are
        self.autocast = contextlib.nullcontext()
        if dtype in (torch.bfloat16, torch.float16):
            self.autocast = torch.autocast(device.type, dtype=dtype)
        # fp16 autocast needs a loss scale; bf16 and fp32 don't
        self.scaler = LossScaler(1.0, 0, enabled=False)
        if dtype == torch.float16 and scaler:
            self.scaler = scaler
        self.label = f"autograd on {device} ({str(dtype).replace('torch.', '')})"

    def loss_and_grads(self, idx, targets):
        # idx and targets are contiguous and live until the step's wait.
        # So the copies need not wait; an MPS copy reads them when it runs.
        idx = idx.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with self.autocast:  # the forward only, as backward ops take their forward's dtypes
            _, loss = self.forward(idx, targets)
        self.model.zero_grad(set_to_none=True)  # after queuing the forward, so the device is busy
        if self.scaler.enabled:  # fp16 seeds the backward with the scale, then divides it out
            (loss * self.scaler.scale).backward()
            grads = {n: p.grad / self.scaler.scale for n, p in self.params}
        else:
            loss.backward()
            grads = {n: p.grad for n, p in self.params}
        self.model.zero_grad(set_to_none=True)  # the caller owns the gradients
        return loss.detach(), grads


class EagerEngine(Engine):
    """The derivation, eagerly, on its own copy of the weights in its dtype."""
    name = 'ane'

    def __init__(self, cfg, device, dtype, scaler):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.scaler = scaler
        self.ops = TorchOps(dtype, device)
        self.w = None  # the weights, made at the first load_weights
        self.label = f"eager derivation on {device} ({str(dtype).replace('torch.', '')})"

    @torch.no_grad()
    def load_weights(self, params):
        if self.w is None:  # buffers made once, refreshed in place
            self.w = {k: torch.empty(p.shape, dtype=self.dtype, device=self.device)
                      for k, p in params.items()}
        for k, p in params.items():
            self.w[k].copy_(p)

    def loss_and_grads(self, idx, targets):
        idx = idx.to(self.device)
        targets = targets.to(self.device)
        return eager_loss_and_grads(self.ops, self.cfg, self.w, idx, targets, self.scaler.scale)


class CoreMLEngine(Engine):
    """The ANE engine: its programs, chained by the host around the sparse work. predict(piece,
    inputs) -> outputs runs one, by Core ML (coreml_predict_fn), the NumPy evaluator or an eager
    stand-in: the one function to replace. A call takes any multiple of B sequences. It runs in
    a worker process (plumbing/worker.py) or here, where on a Mac predict holds the GIL."""
    name = 'ane'
    device = torch.device('cpu')

    def __init__(self, cfg, B, T, predict, pieces=ANE_PIECES, scaler=None, label='Core ML'):
        programs.check_shapes(B, T, cfg.block_size)
        self.cfg = cfg
        self.B = B
        self.T = T
        self.predict = predict
        self.pieces = tuple(pieces)
        self.scaler = scaler or LossScaler(1.0, 0, enabled=False)
        self.label = label
        self.shapes = {k: tuple(p.shape) for k, p in gpt_param_shapes(cfg).items()}
        # fp32 buffers made once, since coremltools wraps fp32 arrays as they are
        # but copies each fp16 one into a new fp32 array (coreml_and_ane.md section 1)
        rows = (B * T, cfg.n_embd)  # an (N, C) activation
        L = cfg.n_layer
        self.inputs = {k: np.zeros(s, np.float32) for k, s in dense_input_shapes(cfg, B, T).items()}
        # xs[l] is block l's input, and xs[L] the head's
        self.xs = [self.inputs['x0']] + [np.zeros(rows, np.float32) for _ in range(L)]
        self.dy = np.zeros(rows, np.float32)
        self.head = {k: self.inputs[k] for k in piece_input_shapes(cfg, B, T, 'head') if k != 'x'}
        block = [k for k in piece_input_shapes(cfg, B, T, 'block_forward') if k != 'x']
        self.blocks = [{k: self.inputs[f'h{l}_{k}'] for k in block} for l in range(L)]

    def load_weights(self, params):
        if {k: tuple(p.shape) for k, p in params.items()} != self.shapes:
            raise UserError(f"the ANE programs were exported for another model ({self.cfg}): "
                            "re-export them with export_ane.py for this one")
        for k, v in host_weights({k: p.detach() for k, p in params.items()}, self.cfg).items():
            np.copyto(self.inputs[k], v.float().cpu().numpy())
        self.wte = params['transformer.wte.weight'].detach().float().cpu()
        self.wpe = params['transformer.wpe.weight'].detach().float().cpu()

    def loss_and_grads(self, idx, targets):
        b, t = idx.shape
        if t != self.T or b % self.B:
            raise UserError(f"the ANE programs take calls of {self.B}x{self.T} tokens: "
                            f"they cannot run a microbatch of {b}x{t}; export them with "
                            f"export_ane.py --ane_batch_size B, B dividing {b}")
        idx = idx.cpu()
        targets = targets.cpu()
        calls = b // self.B
        loss = 0.0
        grads = None
        for i in range(0, b, self.B):  # the mean of equal-sized means is the mean
            l, g = self._call(idx[i:i + self.B], targets[i:i + self.B])
            loss += l
            grads = g if grads is None else {k: v.add_(g[k]) for k, v in grads.items()}
        if calls > 1:
            for v in grads.values():
                v.div_(calls)
        return torch.tensor(loss / calls), grads

    def _call(self, idx, targets):
        """One chain of programs on B sequences: (loss, unscaled gradients by nanoGPT name)."""
        batch = host_batch(self.wte, self.wpe, self.cfg, idx, targets, self.scaler.scale)
        for k, v in batch.items():
            np.copyto(self.inputs[k], v.numpy())
        peaks = []

        def call(piece, inputs):  # one program, noting each output's largest |value|
            out = self.predict(piece, inputs)
            peaks.extend(float(np.max(np.abs(v))) for v in out.values())
            return {k: v for k, v in out.items() if k != 'peaks'}
        if self.pieces == ('step',):  # export_ane.py --whole_step
            out = call('step', self.inputs)
        else:
            out = self._chain(call)
        peak = float(np.max(peaks))  # nan if any output holds a nan
        self.scaler.peak = max(self.scaler.peak, peak)
        g = {k[2:]: torch.from_numpy(np.asarray(v, np.float32))
             for k, v in out.items() if k.startswith('d_')}
        # Any output or peak past ANE_OVERFLOW makes the loss inf.
        # The step then drops these gradients and lowers the loss scale.
        loss = math.inf
        if peak < ANE_OVERFLOW:
            loss = float(np.asarray(out['loss']).reshape(-1)[0])
        return loss, host_grads(g, self.cfg, idx, targets, self.scaler.scale, torch.float32)

    def _chain(self, call):
        """Forward through the blocks, keeping each one's input; the head; backward through the
        blocks, each recomputing its forward from its input: 2L + 1 calls of three programs."""
        L = self.cfg.n_layer
        for l in range(L):
            y = call('block_forward', {'x': self.xs[l]} | self.blocks[l])['y']
            np.copyto(self.xs[l + 1], y)
        out = call('head', {'x': self.xs[L]} | self.head)
        np.copyto(self.dy, out.pop('d_x'))
        for l in reversed(range(L)):
            d = call('block_backward', {'x': self.xs[l], 'dy': self.dy} | self.blocks[l])
            np.copyto(self.dy, d.pop('d_x'))
            out |= {f'd_h{l}_{k[2:]}': v for k, v in d.items()}
        return out | {'d_x0': self.dy}


@dataclass(frozen=True)
class AneSpec:
    """What builds the ANE engine (ane_engine): plain values that a worker process can take."""
    cfg: GPTConfig
    T: int  # tokens a sequence
    max_batch: int  # sequences a call may take
    dtype: torch.dtype = torch.float32  # the eager derivation's, where there are no programs
    programs: str = None  # the exported programs' folder; None: the eager derivation
    evaluator: str = 'eager'  # 'coreml' on a Mac, else 'numpy'; 'eager' without programs
    threads: int = 1  # the worker process's CPU threads

    @property
    def shapes(self):  # each weight's, for the worker's buffers
        return {k: tuple(p.shape) for k, p in gpt_param_shapes(self.cfg).items()}


def programs_path(cfg, run):
    """The folder of the ANE's programs: --ane_programs, or one in out_dir named by their shape."""
    name = f'ane_B{run.ane_batch_size}_T{cfg.block_size}'
    return cfg.ane_programs or os.path.join(cfg.out_dir, name)


def export_programs(cfg, run, log=print):
    """The ANE's Core ML programs for this run, exported unless they are there already."""
    path = programs_path(cfg, run)
    given = bool(cfg.ane_programs)  # a folder given must hold programs of this model
    B = run.ane_batch_size
    programs.ensure(path, model_config(cfg), B, cfg.block_size, build_coreml_program, ANE_PIECES,
                    given, log)


def ane_spec(cfg, run, threads=1):
    """The run's AneSpec: its exported programs (export_programs), or the derivation."""
    mcfg = model_config(cfg)
    if not run.ane_programs:
        return AneSpec(mcfg, cfg.block_size, cfg.batch_size, run.ane_dtype, threads=threads)
    evaluator = 'coreml' if ON_MAC else cfg.ane_evaluator
    return AneSpec(mcfg, cfg.block_size, cfg.batch_size, run.ane_dtype, programs_path(cfg, run),
                   evaluator, threads)


def coreml_engine(path, scaler=None):
    """A CoreMLEngine on the programs exported to path: Core ML on a Mac, else NumPy."""
    meta = programs.read_meta(path)
    cfg = GPTConfig(**{f.name: meta[f.name] for f in dataclasses.fields(GPTConfig)})
    predict = coreml_predict_fn(path, meta['pieces'])  # on a Mac this loads them, timed
    if ON_MAC:
        label = f"Core ML programs {path} ({programs.load_summary()})"
    else:
        label = f"Core ML programs {path} (NumPy evaluator)"
    scaler = scaler or LossScaler(1.0, 0, enabled=False)
    return CoreMLEngine(cfg, meta['ane_batch_size'], meta['seq_len'], predict, meta['pieces'],
                        scaler, label)


def engine_from_spec(spec, scaler=None):
    """The ANE engine an AneSpec describes, here or in the worker process."""
    scaler = scaler or LossScaler(1.0, 0, enabled=False)
    if spec.programs:
        return coreml_engine(spec.programs, scaler)
    return EagerEngine(spec.cfg, torch.device('cpu'), spec.dtype, scaler)


def ane_engine(cfg, run, scaler, eager_engine=EagerEngine, threads=1, log=print):
    """The ANE engine. Its programs run by Core ML on a Mac, by NumPy off it under
    --ane_evaluator numpy; else the eager derivation stands in for them. With
    run.ane_in_worker it runs in a worker process, out of this one's GIL."""
    if run.ane_in_worker:
        spec = ane_spec(cfg, run, threads)
        return worker.WorkerEngine(spec, engine_from_spec, scaler, log,
                                   load_timeout=cfg.ane_load_timeout)
    if run.ane_programs:  # in this process, GIL-bound on a Mac
        return coreml_engine(programs_path(cfg, run), scaler)
    return eager_engine(model_config(cfg), run.ane_device, run.ane_dtype, scaler)


def build_engines(cfg, model, run, log=print, eager_engine=EagerEngine, ane_threads=1,
                  gpu_engine=AutogradEngine):
    """The engines run.mode needs: {'gpu': ..., 'ane': ...}."""
    engines = {}
    if run.mode in ('gpu', 'hetero'):
        scaler = LossScaler(cfg.loss_scale, cfg.scale_window)
        engines['gpu'] = gpu_engine(model, run.device, run.dtype, cfg.compile, scaler)
    if run.mode in ('ane', 'hetero'):
        fp16 = run.ane_dtype == torch.float16
        scaler = LossScaler(cfg.ane_loss_scale, cfg.scale_window, fp16, limit=ANE_OVERFLOW / 2)
        engines['ane'] = ane_engine(cfg, run, scaler, eager_engine, ane_threads, log)
        if not ON_MAC:
            log(f"not on macOS: the ANE engine is the {engines['ane'].label}")
    return engines


# -----------------------------------------------------------------------------
# 6. The concurrent step: both engines, one AdamW update.


class Split:
    """How many of a step's microbatches go to the ANE engine (ane_share): a fixed fraction,
    or (auto) shares in proportion to each engine's measured speed, so both finish together."""

    def __init__(self, microbatches, fraction=None):  # None: auto
        self.microbatches = microbatches
        self.auto = fraction is None
        if self.auto:
            self.ane_share = microbatches // 2  # until both engines are timed
        else:
            self.ane_share = round(fraction * microbatches)
        self.sec_per_microbatch = {}  # engine name -> seconds, smoothed
        self.steps = 0

    def next_share(self, alive):
        """The ANE's share of the next step, given which engines are alive."""
        self.steps += 1
        if alive == {'gpu'}:
            return 0
        if alive == {'ane'}:
            return self.microbatches
        return self.ane_share

    def observe(self, shares, ane_share):
        """A step's shares: each engine's seconds per microbatch; in auto mode, the new share."""
        if len(shares) < 2:
            return
        for name, share in shares.items():
            s = share.seconds / share.n
            self.sec_per_microbatch[name] = 0.5 * self.sec_per_microbatch.get(name, s) + 0.5 * s
        if self.auto:
            gpu_speed = 1 / self.sec_per_microbatch['gpu']
            ane_speed = 1 / self.sec_per_microbatch['ane']
            k = round(self.microbatches * ane_speed / (gpu_speed + ane_speed))
            self.ane_share = min(self.microbatches, max(0, k))

    def state_dict(self):
        return dict(microbatches=self.microbatches, ane_share=self.ane_share, steps=self.steps,
                    sec_per_microbatch=self.sec_per_microbatch)

    def load_state_dict(self, s):
        """The speeds; the share too, if it was of as many microbatches (ranks may differ)."""
        if s['microbatches'] == self.microbatches:
            self.ane_share = s['ane_share']
        self.sec_per_microbatch = s['sec_per_microbatch']
        self.steps = s['steps']


class ProbingSplit(Split):
    """The auto split, which also tries the GPU engine alone. Two engines share one chip's
    memory and heat, so the GPU alone may make the faster step. In auto mode:
    - at step RETIME_AT, then every RETIME_EVERY steps, the GPU engine runs alone, timed;
    - while it alone made the faster step, it keeps running alone;
    - every PROBE_EVERY steps an engine left idle by its share gets one microbatch, to be
      timed again (a probe step runs the proportional share, not the GPU alone)."""
    PROBE_EVERY = 20
    RETIME_EVERY = 100
    RETIME_AT = 10

    def __init__(self, microbatches, fraction=None):
        super().__init__(microbatches, fraction)
        self.step_sec = {}  # 'alone' or 'both' -> a step's seconds per microbatch, smoothed

    def worth_probing(self, idle, busy):
        # one microbatch of the idle engine costs at most two steps of the busy one
        idle_sec = self.sec_per_microbatch.get(idle, 0)
        return idle_sec <= 2 * self.microbatches * self.sec_per_microbatch.get(busy, 0)

    def next_share(self, alive):
        k = super().next_share(alive)
        n = self.microbatches
        if not self.auto or len(alive) < 2 or n < 2:
            return k
        probe = self.steps % self.PROBE_EVERY == 0
        retime = self.steps % self.RETIME_EVERY == self.RETIME_AT
        alone_faster = self.step_sec.get('alone', math.inf) < self.step_sec.get('both', 0.0)
        if k == 0 and probe and self.worth_probing('ane', 'gpu'):
            return 1
        if k == n and probe and self.worth_probing('gpu', 'ane'):
            return n - 1
        if 0 < k < n and (retime or alone_faster and not probe):
            return 0
        return k

    def observe(self, shares, ane_share):
        super().observe(shares, ane_share)
        if ane_share < self.microbatches:  # the GPU engine ran, alone or beside the ANE
            key = 'both' if ane_share else 'alone'
            s = max(share.seconds for share in shares.values()) / self.microbatches
            self.step_sec[key] = 0.5 * (self.step_sec.get(key, s) + s)

    def state_dict(self):
        return super().state_dict() | dict(step_sec=self.step_sec)

    def load_state_dict(self, s):
        super().load_state_dict(s)
        self.step_sec = s.get('step_sec', {})


@dataclass
class Share:
    """One engine's part of a step: its microbatches' summed loss and gradients."""
    loss: torch.Tensor  # 0-dim, on the engine's device (the CPU once timed)
    grads: dict  # param name -> summed gradient
    n: int  # microbatches
    seconds: float

    def __add__(self, other):  # a second run of one engine, redoing a failed share
        grads = {k: g + other.grads[k] for k, g in self.grads.items()}
        return Share(self.loss + other.loss, grads, self.n + other.n, self.seconds + other.seconds)


class Interrupted(Exception):
    """An engine's share, stopped between microbatches by Ctrl-C."""


def sum_grads(engine, microbatches, stop=None):
    """Forward and backward of each microbatch: (summed loss, summed gradients).
    stop: an Event that ends the share before its next microbatch."""
    loss = 0.0
    grads = None
    l = None
    for idx, targets in microbatches:
        if l is not None:  # the device ends the microbatch before, then gets this one:
            float(l)  # no more is queued, so Ctrl-C waits for one microbatch, not the share
        if stop is not None and stop.is_set():
            raise Interrupted
        l, g = engine.loss_and_grads(idx, targets)
        loss = loss + l.float()
        if grads is None:
            grads = g  # each call's tensors are its own
        else:
            for k in grads:
                grads[k] += g[k]
    return loss, grads


def run_engine(engine, microbatches, timed, stop=None):
    """Thread body: one engine's share. timed: it waits for its device, so that its seconds
    are its own (for the split). The other engine works meanwhile, so the wait costs nothing."""
    t0 = time.perf_counter()
    loss, grads = sum_grads(engine, microbatches, stop)
    if timed:
        loss = loss.cpu()  # waits for the device
    return Share(loss, grads, len(microbatches), time.perf_counter() - t0)


def grads_finite(grads):
    """Whether every gradient is finite (a wait for their device)."""
    return all(bool(g.isfinite().all()) for g in grads.values())


@dataclass
class StepResult:
    """What one step did."""
    loss: float  # mean over the microbatches used; nan if none
    n: int  # microbatches whose gradients were averaged, every rank's
    used: list  # the engines whose shares were averaged
    grad_norm: float  # of the mean gradient, before clipping
    ane_share: int  # microbatches given to the ANE engine
    shares: dict  # engine name -> Share


class HeteroStep:
    """One optimizer step over a list of microbatches, on one or both engines.
    - Each engine runs its share in its own thread, from the same weights.
    - The mean gradient: the shares' summed gradients over their microbatches.
    - A share with non-finite values is left out, so the mean stays unbiased.
    - An engine that raises is retired; the other runs its share too.
    - Under torchrun, the ranks' sums and counts are added first."""

    def __init__(self, model, engines, split, log=print, optimizer=None):
        self.model = model
        self.engines = engines
        self.split = split
        self.log = log
        self.optimizer = optimizer
        self.params = dict(model.named_parameters())
        self.device = next(iter(self.params.values())).device  # where the mean gradient goes
        self.alive = set(engines)
        # one long-lived thread per engine, as CUDA sets up each new thread
        self.threads = {name: ThreadPoolExecutor(1, thread_name_prefix=name) for name in engines}
        self.dropped = {name: 0 for name in engines}  # steps an engine's share was left out
        self.skipped = 0  # steps without an update
        self.inputs = None  # this step's microbatches, kept until its one wait
        self.reader = ThreadPoolExecutor(1, thread_name_prefix='reader')  # waits for the device
        self.stop = threading.Event()  # set by Ctrl-C: the engines stop between microbatches

    def __call__(self, microbatches):
        """Forward and backward on both engines; the mean gradient into p.grad."""
        try:
            return self.one_step(microbatches)
        except KeyboardInterrupt:  # each engine stops after its microbatch
            self.stop.set()
            raise

    def one_step(self, microbatches):
        k = self.split.next_share(self.alive)
        # the GPU engine's copies read these host tensors until the wait below
        self.inputs = [(x.contiguous(), y.contiguous()) for x, y in microbatches]
        shares = self.run_shares(self.inputs[:k], self.inputs[k:])
        if len(self.alive) == 2:  # both engines still alive: timed
            self.split.observe(shares, k)
        used = sorted(shares)
        n, loss, norm = self.average(shares, used)
        if not math.isfinite(loss + norm):  # a share overflowed: average the others
            used = [name for name in used if self.finite(shares[name])]
            n, loss, norm = self.average(shares, used)
        self.inputs = None
        for name in shares:  # a left-out share lowers its engine's loss scale
            self.engines[name].scaler.update(name in used)
            self.dropped[name] += name not in used
        if n == 0 or not math.isfinite(norm):  # finite shares can still sum past fp32's range
            self.skipped += 1
            return StepResult(math.nan, 0, [], norm, k, shares)
        return StepResult(loss, n, used, norm, k, shares)

    def run_shares(self, ane_mbs, gpu_mbs):
        """{engine name: Share} of the engines with microbatches, each run in its thread."""
        todo = {'ane': ane_mbs, 'gpu': gpu_mbs}
        todo = {name: mbs for name, mbs in todo.items() if name in self.alive and mbs}
        if 'ane' in todo:
            self.engines['ane'].load_weights(self.params)  # this step's weights
        timed = len(self.alive) == 2
        futures = {}
        for name, mbs in todo.items():  # on a Mac only the GPU engine queues MPS work
            engine = self.engines[name]
            futures[name] = self.threads[name].submit(run_engine, engine, mbs, timed, self.stop)
        shares = {}
        errors = {}
        for name, future in futures.items():
            try:
                shares[name] = future.result()
            except Exception as e:  # training goes on with the other engine
                errors[name] = e
        self.alive -= set(errors)
        for name, error in errors.items():
            self.retire(name, error, todo[name], shares)
        return shares

    def retire(self, name, error, microbatches, shares):
        """An engine that raised is reported and retired; the other runs its share too."""
        self.dropped[name] += 1
        self.log(f"engine '{name}' ({self.engines[name].label}) failed: {error!r}; "
                 f"continuing with {sorted(self.alive) or 'nothing'}")
        if not self.alive:
            raise RuntimeError("both engines failed") from error
        other = next(iter(self.alive))
        if other == 'ane' and other not in shares:  # it has no weights of this step yet
            self.engines[other].load_weights(self.params)
        try:
            redo = self.threads[other].submit(run_engine, self.engines[other], microbatches, True)
            redo = redo.result()
        except Exception as e:
            raise RuntimeError("both engines failed") from e
        if other in shares:
            shares[other] = shares[other] + redo
        else:
            shares[other] = redo

    def average(self, shares, used):
        """The used shares' summed gradients over their microbatches into p.grad (under
        torchrun every rank's sums first). (microbatches, mean loss, the mean gradient's
        norm): the host waits for the devices once, to read the last two."""
        n = sum(shares[name].n for name in used)
        loss = sum(shares[name].loss.to(self.device) for name in used)
        grads = {}
        for k, p in self.params.items():
            total = None
            for name in used:  # an engine elsewhere sends its gradients here
                g = shares[name].grads[k].to(p.device, p.dtype)
                total = g if total is None else total + g
            grads[k] = total
        grads, n, loss = distributed.sum_over_ranks(grads, n, loss, self.params)
        if n == 0:  # no usable share on any rank
            for p in self.params.values():
                p.grad = None
            return 0, math.nan, math.nan
        for k, p in self.params.items():
            p.grad = grads[k] / n
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params.values()])
        norm, loss = self.read(torch.stack([norm.float(), loss.float() / n]))  # the one wait
        return n, loss, norm

    def read(self, values):
        """values on the host. The reader thread waits for the device: a wait for MPS or CUDA
        is deaf to signals, and the main thread stays free for Ctrl-C."""
        return self.reader.submit(values.tolist).result()

    def finite(self, share):
        """Whether a share's loss and gradients are all finite (a wait for its device)."""
        def check():
            return math.isfinite(share.loss) and grads_finite(share.grads)
        return self.reader.submit(check).result()

    def update(self, result, grad_clip=0.0):
        """One AdamW step from the mean gradient, its norm clipped to grad_clip if > 0."""
        if result.n and 0 < grad_clip < result.grad_norm:
            for p in self.params.values():
                p.grad.mul_(grad_clip / (result.grad_norm + 1e-6))
        if result.n:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def close(self):
        """Ends the step's threads. After Ctrl-C mid-step a busy one stops after its
        microbatch, and the process does not wait for it (progress.exit_now_if_busy)."""
        for pool in [*self.threads.values(), self.reader]:
            pool.shutdown(wait=not self.stop.is_set(), cancel_futures=True)
        for engine in self.engines.values():  # the ANE worker's process
            engine.close()


# -----------------------------------------------------------------------------
# 7. The training loop.


def load_data(cfg):
    """train/val token arrays (uint16 memmaps), checked; a known data set is prepared first."""
    try:
        return prepare_data.load(cfg.data_dir, cfg.dataset, cfg.block_size, cfg.vocab_size)
    except prepare_data.DataError as e:
        raise UserError(str(e)) from None


def get_batch(data, n, T, rng):
    """n random windows of T+1 tokens: inputs and next-token targets, int64 on the CPU."""
    ix = rng.integers(0, len(data) - T - 1, n)
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def step_batches(cfg, data, it):
    """The step's microbatches, checked. Seeded by (seed, step), so every mode, split, resume
    and number of ranks sees the same batches at the same step."""
    n = cfg.batch_size * cfg.gradient_accumulation_steps
    x, y = get_batch(data, n, cfg.block_size, np.random.default_rng((cfg.seed, it)))
    microbatches = list(zip(x.split(cfg.batch_size), y.split(cfg.batch_size)))
    check_microbatches(cfg, microbatches)
    return microbatches


def check_microbatches(cfg, microbatches):
    """Bad data is the data's fault, not an engine's: one line, before any engine runs."""
    try:
        for idx, targets in microbatches:
            check_batch(cfg, idx, targets)
    except ValueError as e:
        raise UserError(f"a microbatch is no valid input ({e}): the data is at fault") from None


@torch.no_grad()
def evaluate(model, engine, cfg, data):
    """Mean validation loss: over eval_iters fixed random batches, or with eval_iters=0
    over the whole validation split in consecutive windows (every token predicted once)."""
    model.eval()
    T = cfg.block_size
    if cfg.eval_iters > 0:
        rng = np.random.default_rng((cfg.seed, 2**32 - 1))  # not a training step's seed
        batches = [get_batch(data, cfg.batch_size, T, rng) for _ in range(cfg.eval_iters)]
    else:
        xy = torch.from_numpy(data[:(len(data) - 1) // T * T + 1].astype(np.int64))
        x = xy[:-1].view(-1, T)
        y = xy[1:].view(-1, T)
        batches = list(zip(x.split(cfg.batch_size), y.split(cfg.batch_size)))
    total = 0.0
    count = 0
    for x, y in batches:
        with engine.autocast:
            _, loss = model(x.to(engine.device), y.to(engine.device))
        total += loss.float() * x.numel()
        count += x.numel()
    model.train()
    return float(total) / count


def get_lr(cfg, it):
    """Linear warm-up, then cosine decay to min_lr at max_iters."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    ratio = min(1.0, (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model, cfg):
    """AdamW, nanoGPT's groups: weight decay on 2-D weights, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{'params': decay, 'weight_decay': cfg.weight_decay},
              {'params': no_decay, 'weight_decay': 0.0}]
    # fused: one kernel for all weights, on CUDA, the CPU and (torch 2.4 on) MPS
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=True)


@dataclass(frozen=True)
class Classes:
    """The classes a run builds. A variant passes its subclasses here (tools/fast_standin.py)."""
    model: type = GPT
    gpu_engine: type = AutogradEngine
    eager_engine: type = EagerEngine
    step: type = HeteroStep
    split: type = ProbingSplit


def build_run(cfg, run, log=print, classes=Classes()):
    """What a training run (and each bench.py mode) needs: the model (fp32 master weights,
    fp64 under --dtype float64), AdamW, the mode's engines, the step, a meter."""
    memory.preflight(cfg, run, model_sizes(cfg), log)
    master = torch.float64 if run.dtype == torch.float64 else torch.float32
    model = classes.model(model_config(cfg)).to(run.device, master)
    optimizer = make_optimizer(model, cfg)
    if run.ane_programs and run.mode != 'gpu':  # the ANE's programs, exported once
        export_programs(cfg, run, log)
    ane_threads = worker.set_process_threads(run)  # this process's, and the ANE worker's
    engines = build_engines(cfg, model, run, log, classes.eager_engine, ane_threads,
                            classes.gpu_engine)
    n = len(distributed.rank_share(range(cfg.gradient_accumulation_steps)))  # this rank's
    fraction = {'gpu': 0.0, 'ane': 1.0}.get(run.mode, run.ane_fraction)
    step = classes.step(model, engines, classes.split(n, fraction), log=log, optimizer=optimizer)
    meter = energy.EnergyMeter({run.device} | {e.device for e in engines.values()})
    return model, optimizer, engines, step, meter


def setup(cfg, given, log=print):
    """(cfg, Run) on this machine, for a caller that is not a training run (bench.py)."""
    return startup.machine_settings(cfg, given, CPU_DEFAULTS, MAC_DEFAULTS, MAC_GPT2, log)


@dataclass
class Progress:
    """Where a run stands, as nanoGPT's iter_num and best_val_loss. A checkpoint keeps it."""
    it: int = 0  # steps taken
    tokens: int = 0  # tokens trained on, every rank's
    elapsed: float = 0.0  # training seconds, evaluations not counted
    joules: float = 0.0  # the energy meter's joules in those seconds
    best_val: float = math.inf  # the lowest validation loss
    since_best: int = 0  # evaluations since the best
    bad: int = 0  # steps in a row without a usable gradient

    def stepped(self, result, tokens, seconds, joules):
        self.it += 1
        self.tokens += tokens
        self.elapsed += seconds
        self.joules += joules
        self.bad = 0 if result.n else self.bad + 1  # n counts every rank's microbatches

    def evaluated(self, val):
        """A scheduled evaluation's loss counted: whether it is the run's best so far."""
        best = val < self.best_val
        self.best_val = min(self.best_val, val)
        self.since_best = 0 if best else self.since_best + 1
        return best

    def done(self, cfg):  # at max_iters, or past --patience
        return self.it >= cfg.max_iters or 0 < cfg.patience <= self.since_best


def train(cfg, given=frozenset(), classes=Classes(), on_step=None):
    """Trains as cfg says. on_step(prog, row, evaluate) -> row: a caller's own measures."""
    cfg, run, rank = startup.resolve(cfg, given, CPU_DEFAULTS, MAC_DEFAULTS, MAC_GPT2)
    data = distributed.rank0_first(lambda: load_data(cfg))  # rank 0 prepares a missing set
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir or '.', exist_ok=True)
    log = progress.logger(rank)
    model, optimizer, engines, step, meter = build_run(cfg, run, log, classes)
    if cfg.init_from != 'scratch' and rank == 0 and not cfg.resume:  # the others get rank 0's
        path = pretrained.load(model, cfg.init_from)
        print(f"fine-tuning from the weights in {path}")
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    prog = Progress(**checkpoints.resume(cfg, given, model, optimizer, step.split, engines, rank))
    print(progress.header(model, cfg.mode, engines, meter))
    eval_engine = engines.get('gpu') or AutogradEngine(model, run.device, run.dtype)
    tok_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    metrics = progress.Metrics(cfg, rank, engines, step, meter, prog)
    display = progress.Display(cfg, prog, rank, log)  # the bar, the first step's timer, the ETA

    def save(best=False):  # rank 0 writes ckpt.pt, and best.pt if best
        if rank == 0:
            checkpoints.save(ckpt_path, cfg, model, optimizer, step.split, engines, prog, best)

    if prog.done(cfg):  # a resumed run may be done
        print(f"step {prog.it}, {prog.since_best} evaluations past the best (--max_iters "
              f"{cfg.max_iters}, --patience {cfg.patience}): no steps to train")
    try:
        while not prog.done(cfg):
            lr = get_lr(cfg, prog.it)
            for group in optimizer.param_groups:
                group['lr'] = lr
            t0 = time.perf_counter()
            j0 = meter.joules()  # None without a meter
            microbatches = distributed.rank_share(step_batches(cfg, data['train'], prog.it))
            result = step(microbatches)  # both engines, the mean gradient into p.grad
            with progress.defer_ctrl_c():  # an update is made whole and counted, or not at all
                step.update(result, cfg.grad_clip)  # one AdamW step
                seconds = time.perf_counter() - t0
                prog.stepped(result, tok_per_step, seconds, energy.spent(meter, j0))
            if cfg.max_bad_steps and prog.bad >= cfg.max_bad_steps:  # diverged: no checkpoint
                raise checkpoints.diverged(cfg, prog.it, prog.bad, result.loss, engines, ckpt_path)
            last = prog.it == cfg.max_iters
            evaluating = prog.it % cfg.eval_interval == 0 or last
            row = {}
            if prog.it % cfg.log_interval == 0 or last:
                row = metrics.row(prog, lr, result)
            if evaluating:
                distributed.check_same_weights(model, prog.it)
                val = evaluate(model, eval_engine, cfg, data['val'])
                val = distributed.from_rank0(val)  # one stop decision for all ranks
                row = progress.with_val(row, prog, val)
            if on_step:
                row = on_step(prog, row, lambda: evaluate(model, eval_engine, cfg, data['val']))
            with progress.defer_ctrl_c():  # the log, the best and the checkpoint agree
                metrics.write(row)  # the log first, so a resumed run never lacks a row
                if evaluating and (prog.bad == 0 or last):  # not after a dropped step
                    save(best=prog.evaluated(val))
            display.stepped(prog, row, result)
    except KeyboardInterrupt:  # saved, in one line; main exits 130
        display.close()  # before the line
        progress.stop_run(save, f"saved step {prog.it} in {ckpt_path}")
        return model
    finally:
        display.close()
        step.close()
        meter.close()
        metrics.close()
        distributed.leave()  # torchrun's group, after an end or Ctrl-C
    if prog.it < cfg.max_iters:
        print(f"step {prog.it}: stopped early, {prog.since_best} evaluations without a "
              "lower validation loss (--patience)")
    if cfg.sample_tokens > 0 and rank == 0:
        # the run ends holding its best weights, and shows text from them
        checkpoints.closing_sample(model, ckpt_path, cfg.sample_tokens, run.device,
                                   eval_engine.autocast)
    if rank == 0:  # how to see the run as a picture
        progress.say_plot_command(cfg.out_dir)
    return model


def parse_args(argv=None, cls=Config, description="HeteroEngine: GPT-2 on GPU and ANE at once."):
    """(cls(...) from the flags, the names of the flags given)."""
    here = settings.machine_defaults(CPU_DEFAULTS, MAC_DEFAULTS, MAC_GPT2)
    return settings.parse_args(argv, cls, description, here)


def main(argv=None, job=train, cls=Config, description=None):
    """Parses the flags (of cls) and runs `job(cfg, given)`. A UserError is one line, exit 2;
    Ctrl-C is one line, exit 130 (SIGTERM 143, SIGHUP 129)."""
    if description:
        cfg, given = parse_args(argv, cls, description)
    else:
        cfg, given = parse_args(argv, cls)
    try:
        with progress.ctrl_c_exits():
            return job(cfg, given)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:  # under torchrun, one line names the stopped ranks
        distributed.exit_naming_stopped(e, cfg.dist_timeout)  # without torchrun it raises e


if __name__ == '__main__':
    main()
