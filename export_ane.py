"""
Export HeteroEngine's training step (forward + loss + backward of GPT-2) as the Core ML
programs the ANE engine chains (a block's forward, a block's backward, the head), and
report what is in them.

    python export_ane.py                          # the trainer's Mac default, into out/ane_B4_T256
    python export_ane.py --preset gpt2 --ane_batch_size 4          # GPT-2 124M, 4x1024 tokens a call
    python export_ane.py --n_layer 4 --n_head 4 --n_embd 128 --block_size 64 --ane_batch_size 8 --out tiny
    python export_ane.py --whole_step --out ane_step               # the whole step as one program
    python export_ane.py ... --check                               # on macOS: on the ANE

The report (any OS), per program: calls per ANE call of the trainer, ops, FLOPs, bytes in and
out, an estimate of its largest live memory, the largest tensor dimension, ops known to fall
off the ANE; per call: FLOPs against the analytic count. Programs past the ANE's limits are
refused. --check runs the staged self-check (tools/ane_check.py) and writes ane_check.json.
"""
import argparse
import dataclasses
import os
import sys
import time

import hetero_gpt as hg
from plumbing import progress  # defines: ctrl_c_exits (one line and 130 at Ctrl-C)
from plumbing import programs  # defines: export_programs (saved atomically, checked against the ANE's limits)
from plumbing import settings  # defines: add_flags, ane_batch_size, check_model, check_coreml, check_ane_alignment
from tools import ane_check  # defines: main (the self-check), step_report (a call through every program)


def export_programs(cfg, B, T, path, whole_step=False):
    """The programs (the three pieces, or with whole_step the step as one) saved in the folder
    path, checked against the ANE's limits: {piece: report}."""
    return programs.export_programs(cfg, B, T, path, hg.build_coreml_program, ('step',) if whole_step else hg.ANE_PIECES)


def print_report(reports, cfg, B, T):
    """One line per program, then one microbatch of B sequences through all of them."""
    print(f"{'program':<15}{'calls':>6}{'ops':>6}{'GFLOP':>9}{'MiB in':>9}{'MiB out':>9}{'MiB live':>10}"
          f"{'largest dim':>13}  off the ANE")
    st = ane_check.step_report(reports, cfg, B, T)
    for p, r in reports.items():
        print(f"{p:<15}{st['calls'][p]:>6}{r['ops']:>6}{r['flops'] / 1e9:>9.2f}{r['bytes_in'] / 2**20:>9.1f}"
              f"{r['bytes_out'] / 2**20:>9.1f}{r['live_bytes'] / 2**20:>10.1f}{r['largest_dim']:>13}  "
              + (', '.join(r['off_ane']) or 'none'))
    print(f"per microbatch of {B}x{T} tokens: {st['flops'] / 1e9:.1f} GFLOP, of which {st['matmul_flops'] / 1e9:.1f} "
          f"in the derivation's matmuls and {st['sum_flops'] / 1e9:.2f} in sums as matmuls; "
          f"{st['bytes_in'] / 2**20:.0f} MiB in, {st['bytes_out'] / 2**20:.0f} MiB out (fp16)")
    print(f"  analytic matmul count {st['analytic_matmul_flops'] / 1e9:.1f} GFLOP: ratio "
          f"{st['matmul_flops'] / st['analytic_matmul_flops']:.3f}" + (
              " (the block backward recomputes its forward)" if 'block_backward' in reports else '')
          + f"; 6*params*tokens + attention {st['estimate_flops'] / 1e9:.1f} GFLOP (ratio of all FLOPs "
          f"{st['flops'] / st['estimate_flops']:.3f})")
    print(f"largest live memory {st['live_bytes'] / 2**20:.0f} MiB (ANE limit ~{programs.ANE_MEMORY / 2**30:.2f} GiB); "
          f"largest dimension {st['largest_dim']} (ANE limit {programs.ANE_MAX_DIM})")


def trainer_config(a, given):
    """The Config the trainer runs on a Mac with these flags: its Mac defaults (MAC_DEFAULTS,
    or under --preset gpt2 GPT-2 124M's with MAC_GPT2), then the flags given."""
    mac = hg.MAC_GPT2 if a.preset == 'gpt2' else hg.MAC_DEFAULTS
    model = {f.name: getattr(a, f.name) for f in dataclasses.fields(hg.GPTConfig) if f.name in given}
    tcfg = hg.Config(**(mac | model))
    if a.ane_batch_size:
        tcfg.ane_batch_size = a.ane_batch_size
    if a.gpu_batch:
        tcfg.batch_size = a.gpu_batch
    return tcfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_flags(p, hg.GPTConfig)  # the model's flags, as hetero_gpt.py's
    p.add_argument('--preset', default='', help="gpt2: GPT-2 124M, as the trainer's --preset gpt2 (default: the "
                   "trainer's Mac default, a 6-layer 384-wide GPT-2 of 256 tokens)")
    p.add_argument('--ane_batch_size', type=int, default=0, help="sequences per ANE call (B), as the trainer's flag "
                   "(default: the trainer's on a Mac)")
    p.add_argument('--out', default='', help="the folder of the programs (default: the trainer's, "
                   "out/ane_B{B}_T{T}: the trainer finds them there, compiled)")
    p.add_argument('--whole_step', action='store_true', help="the whole step as one program, to compare")
    p.add_argument('--check', action='store_true', help="the staged self-check: what the ANE path does here")
    p.add_argument('--gpu_batch', type=int, default=0, help="with --check: the GPU engine's microbatch (default: the trainer's on a Mac)")
    p.add_argument('--check_report', default=os.path.join('out', 'ane_check.json'),
                   help="with --check: the report (and its .md summary)")
    p.add_argument('--stage_timeout', type=float, default=3600.0, help="with --check: seconds a stage may take")
    p.add_argument('--gpu_engine', default='torch', help="with --check: the GPU engine the concurrency stage "
                   "times beside the ANE: torch (PyTorch's autograd) or mlx (tools/mlx_engine.py)")
    p.add_argument('--stages', default='', help="with --check: only these stages, comma-separated (default: all); "
                   "merged into an earlier report of the same model")
    a = p.parse_args(argv)
    given = {x.split('=')[0][2:] for x in (argv if argv is not None else sys.argv[1:]) if x.startswith('--')}
    try:
        tcfg = trainer_config(a, given)
        cfg = hg.model_config(tcfg)
        settings.check_model(cfg)
        B = settings.ane_batch_size(tcfg)
        T = cfg.block_size
        out = a.out or os.path.join('out', f'ane_B{B}_T{T}')
        if settings.ON_MAC:  # (a coremltools without its native libraries cannot save a program either)
            settings.check_coreml()
            settings.check_ane_alignment(cfg, T)
        programs.check_shapes(B, T, cfg.block_size)
        if a.check:  # the programs are exported by its own stage, in a process of their own
            if tcfg.batch_size % B:
                raise settings.UserError(f"--ane_batch_size {B} must divide --gpu_batch {tcfg.batch_size}: the worker runs "
                                         "the GPU's microbatch in calls of that many sequences")
            tokens = tcfg.max_iters * tcfg.batch_size * tcfg.gradient_accumulation_steps * T
            return ane_check.main(cfg, B, T, out, tcfg.batch_size, a.check_report, a.stage_timeout, a.stages,
                                  run_tokens=tokens, gpu_engine=a.gpu_engine)
        t0 = time.perf_counter()
        reports = export_programs(cfg, B, T, out, a.whole_step)
        print(f"saved {out} ({cfg}, {B}x{T} tokens a call) in {time.perf_counter() - t0:.1f} s")
        print_report(reports, cfg, B, T)
    except settings.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    with progress.ctrl_c_exits():  # Ctrl-C, SIGTERM, SIGHUP: one line, 130, 143, 129
        sys.exit(main())
