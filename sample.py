"""
Sample text from a trained model: a run of hetero_gpt.py (its best.pt, else its ckpt.pt),
or OpenAI's GPT-2 itself (--init_from gpt2, or a local folder in Hugging Face's layout).

    python sample.py --out_dir out --start "ROMEO:" --num_samples 3
    python sample.py --init_from gpt2 --start FILE:prompt.txt --max_new_tokens 100
"""
import os
import sys
from dataclasses import dataclass

import torch

import hetero_gpt as hg  # defines: GPT, GPTConfig
import prepare_data  # defines: get_encoding, DataError
from plumbing import checkpoints, pretrained, settings  # defines: read_checkpoint; state_dict; parse_args
from plumbing.settings import UserError, setting


@dataclass
class SampleConfig:
    out_dir: str = setting('out', "the run to sample from: its best.pt, else its ckpt.pt")
    init_from: str = setting('', "instead of a run: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a Hugging Face folder")
    start: str = setting('\n', "the prompt, or FILE:path for a file's text")
    num_samples: int = setting(3, "samples to draw")
    max_new_tokens: int = setting(200, "tokens generated per sample")
    temperature: float = setting(0.8, "1: the model's distribution; lower: more likely tokens")
    top_k: int = setting(200, "sample among the k most likely tokens only")
    seed: int = setting(1337, "seed of the sampling")
    device: str = setting('auto', "auto (mps > cuda > cpu), cpu, cuda, cuda:1, mps")


def load_model(cfg):
    """(GPT with the weights cfg names, where they came from); UserError (one line) if none fit."""
    if cfg.init_from:
        path = pretrained.folder(cfg.init_from)
        model = hg.GPT(hg.GPTConfig(**pretrained.model_args(path)))
        return model, pretrained.load(model, cfg.init_from)
    why = []
    for path in (os.path.join(cfg.out_dir, 'best.pt'), os.path.join(cfg.out_dir, 'ckpt.pt')):
        try:
            ck = checkpoints.read_checkpoint(path, 'cpu')
            model = hg.GPT(hg.GPTConfig(**ck['model_args']))
            model.load_state_dict(ck['model'])
            return model, f"{path} (step {ck['iter_num']})"
        except (ValueError, TypeError, RuntimeError) as e:  # absent, damaged, another model's
            why.append(f"{path}: {' '.join(str(e).split())[:150]}")
    raise UserError(f"{'; '.join(why)}; train with `python hetero_gpt.py --out_dir {cfg.out_dir}` or pass "
                    "--init_from gpt2")


def check(cfg):
    for flag, ok in (('num_samples', cfg.num_samples >= 1), ('max_new_tokens', cfg.max_new_tokens >= 1),
                     ('top_k', cfg.top_k >= 1), ('temperature', 0.01 <= cfg.temperature <= 100)):
        if not ok:  # (a temperature under 0.01 overflows the softmax: --top_k 1 picks the likeliest)
            raise UserError(f"--{flag} {getattr(cfg, flag)}: must be "
                            + ('from 0.01 to 100' if flag == 'temperature' else '1 or more'))


def prompt(cfg, enc, block_size):
    """The prompt's token ids: --start, or the text of the file it names after FILE:."""
    text = cfg.start
    if text.startswith('FILE:'):
        try:
            with open(text[5:], encoding='utf-8') as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--start {cfg.start}: cannot read it ({e})") from None
    ids = enc.encode(text, allowed_special={'<|endoftext|>'})
    if not 1 <= len(ids) <= block_size:
        raise UserError(f"--start is {len(ids)} tokens; the model reads 1 to {block_size} (its block_size)")
    return ids


def main(argv=None):
    cfg, _ = settings.parse_args(argv, SampleConfig, "Sample text from a checkpoint or from GPT-2.")
    try:
        check(cfg)
        device = settings.resolve_device(cfg.device)
        enc = prepare_data.get_encoding()
        model, source = load_model(cfg)
        ids = prompt(cfg, enc, model.config.block_size)
    except (UserError, prepare_data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"sampling from {source}", file=sys.stderr)
    torch.manual_seed(cfg.seed)
    model.to(device).eval()
    x = torch.tensor([ids], device=device)
    for _ in range(cfg.num_samples):
        y = model.generate(x, cfg.max_new_tokens, cfg.temperature, cfg.top_k, vocab=enc.n_vocab)
        print(enc.decode(y[0].tolist()) + '\n---------------')


if __name__ == '__main__':
    main()
