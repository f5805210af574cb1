"""Shared fixtures: a tiny text data set, tokenized by prepare_data.py, made once per test run."""
import pytest

import prepare_data


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp('data')
    text = root / 'tiny.txt'
    lines = [f"The {w} of the {v} is {n} and the {v} is {w}." for n in range(40)
             for w, v in (('king', 'crown'), ('queen', 'court'), ('fool', 'jest'))]
    text.write_text('\n'.join(lines * 3) + '\n')
    prepare_data.prepare('tiny', data_dir=str(root), input_path=str(text))
    return str(root)


class CtrlC:
    """Makes training raise KeyboardInterrupt, as Ctrl-C would, when it reaches step k."""

    def __init__(self, monkeypatch):
        import hetero_gpt
        self.hg, self.mp, self.real = hetero_gpt, monkeypatch, hetero_gpt.step_batches

    def at(self, k):
        def batches(cfg, data, it):
            if it == k:
                raise KeyboardInterrupt
            return self.real(cfg, data, it)
        self.mp.setattr(self.hg, 'step_batches', batches)

    def off(self):
        self.mp.setattr(self.hg, 'step_batches', self.real)


@pytest.fixture
def ctrl_c(monkeypatch):
    return CtrlC(monkeypatch)
