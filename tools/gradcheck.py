"""
Judge gradients against a reference by direction and by size, tensor by tensor, and by the
parts that a whole-tensor cosine averages away: the q, k and v thirds of attention's c_attn.

At GPT-2's initialisation the q and k thirds of c_attn's gradient hold about 1% of the v
third's norm, so a wrong q or k gradient leaves the whole tensor's cosine near 1. A cosine
is blind to scale, so each part's norm ratio is judged too. Used by test_grads.py, the tests
and the self-check's gradient gate (tools/ane_check.py).
"""
from __future__ import annotations  # `int | None` on Python 3.9 (a Mac's system Python)

import dataclasses
import re

import torch

# tolerances from the arithmetic: (least cosine, largest |norm ratio - 1|)
TOLERANCE = {
    # unit roundoff 1.1e-16; sums of a few thousand terms stay near 1e-13 relative
    torch.float64: (1 - 1e-12, 1e-10),
    # unit roundoff 6e-8; dot products of ~1e3 terms, n*u = 6e-5, with a margin
    torch.float32: (1 - 1e-8, 1e-4),
    # unit roundoff 4.9e-4; elementwise errors of 1e-3..1e-2 are normal, so directions
    # are judged; a norm sums many independent roundings, which mostly cancel: 2%
    torch.float16: (0.999, 0.02),
    # unit roundoff 3.9e-3, 8x fp16's; norms measured within 0.7%, directions within 1e-4
    torch.bfloat16: (0.995, 0.05),
}


@dataclasses.dataclass
class Part:
    name: str  # parameter name, with [q], [k] or [v] for a third of c_attn
    layer: int | None  # the block's index, None outside the blocks
    cosine: float
    norm_ratio: float  # |got| / |reference|
    finite: bool


def parts(name, g):
    """[(label, tensor)]: a third of c_attn each for q, k and v; the tensor itself otherwise.
    The key bias's exact gradient is 0 (it adds one constant to a row of scores, which
    softmax ignores), so it has no direction or size to judge and is left out."""
    if '.attn.c_attn.' not in name:
        return [(name, g)]
    thirds = zip('qkv', g.chunk(3, 0))
    return [(f'{name}[{c}]', t) for c, t in thirds if not (c == 'k' and name.endswith('bias'))]


def layer_of(name):
    m = re.search(r'\.h\.(\d+)\.', name)
    return int(m.group(1)) if m else None


def compare(got, ref):
    """[Part] for every tensor of ref (and each of its parts), against got of the same names."""
    out = []
    for name, r in ref.items():
        for (label, a), (_, b) in zip(parts(name, got[name]), parts(name, r)):
            a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
            na, nb = a.norm().item(), b.norm().item()
            cos = (a @ b).item() / (na * nb) if na and nb else float(na == nb)
            ratio = na / nb if nb else (1.0 if na == 0 else float('inf'))
            out.append(Part(label, layer_of(name), cos, ratio, bool(torch.isfinite(a).all())))
    return out


def failures(rows, min_cosine, max_norm_error):
    """The parts outside the tolerances (a NaN fails every comparison)."""
    return [p for p in rows if not (p.finite and p.cosine >= min_cosine and abs(p.norm_ratio - 1) <= max_norm_error)]


def by_layer(rows):
    """{layer: (worst cosine, worst |norm ratio - 1|)}: a lookup table's error shows in every
    layer alike, a derivation bug in one kind of part."""
    out = {}
    for p in rows:
        c, n = out.get(p.layer, (1.0, 0.0))
        out[p.layer] = (min(c, p.cosine), max(n, abs(p.norm_ratio - 1)))
    return out


def check(got, ref, dtype):
    """Assert-ready: a message naming every failing part, or '' when all pass at dtype's tolerances."""
    bad = failures(compare(got, ref), *TOLERANCE[dtype])
    return '; '.join(f'{p.name}: cosine {p.cosine:.6f}, norm ratio {p.norm_ratio:.5f}' for p in bad[:6])
