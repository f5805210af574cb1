"""plumbing/energy.py, the meters behind joules per token: powermetrics' text parsed from a
capture, RAPL's counters and their wrap-around in a powercap tree the test writes, and one
meter per device. (The live powermetrics, through sudo: test_macos.py.)"""
import pytest
import torch

from plumbing import energy

# The text `powermetrics --samplers cpu_power,gpu_power,ane_power -i 200 -b 1` prints on Apple
# Silicon (the layout of published captures, docs/coreml_and_ane.md section 6): a preamble, then
# per sample a header with its own elapsed time, the processor block (CPU, GPU, ANE and
# Combined Power) and the GPU block, which repeats GPU Power. The samples ran past -i 200.
CAPTURE = """Machine model: Mac16,8
OS version: 24F74
Boot arguments:
Boot time: Mon Jun  2 09:12:40 2025



*** Sampled system activity (Mon Jun  2 10:01:02 2025 +0200) (240.50ms elapsed) ***


**** Processor usage ****

E-Cluster HW active frequency: 1208 MHz
E-Cluster idle residency:  79.60%
P0-Cluster HW active frequency: 3852 MHz
P0-Cluster idle residency:  12.40%

CPU Power: 3000 mW
GPU Power: 9000 mW
ANE Power: 1500 mW
Combined Power (CPU + GPU + ANE): 13500 mW

**** GPU usage ****

GPU HW active frequency: 1578 MHz
GPU HW active residency:  97.21% (1578 MHz:  97%)
GPU idle residency:   2.79%
GPU Power: 9000 mW


*** Sampled system activity (Mon Jun  2 10:01:02 2025 +0200) (250.00ms elapsed) ***


**** Processor usage ****

CPU Power: 1000 mW
GPU Power: 0 mW
ANE Power: 2000 mW
Combined Power (CPU + GPU + ANE): 3000 mW

**** GPU usage ****

GPU HW active frequency: 0 MHz
GPU Power: 0 mW
"""


def test_powermetrics_text_is_watts_times_each_samples_time():
    # joules of each part: its mW times its sample's own elapsed ms, each part once a sample:
    # CPU 3 W x 0.2405 s + 1 W x 0.25 s, GPU 9 W x 0.2405 s (not twice), ANE 1.5 x 0.2405 + 2 x 0.25.
    # Sums of a few products of short decimals: fp64, 1e-15 relative
    seen = []
    parts = energy.read_samples(CAPTURE.splitlines(keepends=True), dict(CPU=0.0, GPU=0.0, ANE=0.0),
                                lambda: seen.append(1))
    assert parts == pytest.approx(dict(CPU=0.9715, GPU=2.1645, ANE=0.86075), rel=1e-15)
    assert len(seen) == 6  # a power line counted: 3 a sample
    # a sample cut off by the end of the text counts what it printed, nothing more
    half = CAPTURE[:CAPTURE.index('ANE Power: 2000')]
    assert energy.read_samples(half.splitlines(True), dict(CPU=0.0, GPU=0.0, ANE=0.0)) == pytest.approx(
        dict(CPU=0.9715, GPU=2.1645, ANE=0.36075), rel=1e-15)


def write_zone(root, name, energy_uj, max_uj=2**32 - 1):
    zone = root / name
    zone.mkdir(exist_ok=True)
    (zone / 'energy_uj').write_text(f"{energy_uj}\n")
    (zone / 'max_energy_range_uj').write_text(f"{max_uj}\n")


def test_rapl_counts_each_package_once_across_wraps(tmp_path):
    # two packages; package 0's core part (intel-rapl:0:0) and its second view through MMIO
    # (intel-rapl-mmio:0) are not added again. A counter runs 0..max_energy_range_uj and then 0
    # again: from max - 5 to 10 it moved 5 + 1 + 10 = 16 uJ
    write_zone(tmp_path, 'intel-rapl:0', 100, max_uj=999_999)
    write_zone(tmp_path, 'intel-rapl:0:0', 50)
    write_zone(tmp_path, 'intel-rapl:1', 7000)
    write_zone(tmp_path, 'intel-rapl-mmio:0', 100, max_uj=999_999)
    m = energy.RaplMeter(root=str(tmp_path))
    assert m.name == 'RAPL (2 CPU packages)' and m.joules() == 0.0
    write_zone(tmp_path, 'intel-rapl:0', 999_994, max_uj=999_999)  # +999,894 uJ
    write_zone(tmp_path, 'intel-rapl:1', 9000)                       # +2,000 uJ
    write_zone(tmp_path, 'intel-rapl:0:0', 10**9)
    write_zone(tmp_path, 'intel-rapl-mmio:0', 999_994, max_uj=999_999)
    assert m.joules() == pytest.approx((999_894 + 2000) / 1e6, rel=1e-15)
    write_zone(tmp_path, 'intel-rapl:0', 10, max_uj=999_999)  # wrapped: + 16 uJ
    assert m.joules() == pytest.approx((999_894 + 2000 + 16) / 1e6, rel=1e-15)


def test_rapl_unreadable_is_a_missing_meter(tmp_path, monkeypatch):
    # energy_uj is root's alone on recent kernels: the meter cannot start, and the run's
    # meter says which one is missing and why (the trainer prints it), without stopping
    write_zone(tmp_path, 'intel-rapl:0', 100)
    (tmp_path / 'intel-rapl:0' / 'energy_uj').unlink()
    (tmp_path / 'intel-rapl:0' / 'energy_uj').mkdir()  # (root reads any file: unreadable as a folder)
    with pytest.raises(OSError):
        energy.RaplMeter(root=str(tmp_path))

    class Rapl(energy.RaplMeter):
        def __init__(self):
            super().__init__(root=str(tmp_path))
    monkeypatch.setattr(energy, 'RaplMeter', Rapl)
    m = energy.EnergyMeter({torch.device('cpu')})
    assert m.meters == [] and m.name == 'none' and m.joules() is None
    assert len(m.missing) == 1 and m.missing[0].startswith('Rapl: ') and 'energy_uj' in m.missing[0]


def test_one_meter_per_device(monkeypatch):
    # --device cuda beside --ane_device cuda:0 is one GPU: one NVML meter, not two; cuda:1 is
    # another; the CPU's RAPL meter once; the sum of their joules
    made = []

    class Nvml:
        def __init__(self, index):
            self.index, self.name = index, f'NVML (GPU {index})'
            made.append(index)

        def joules(self):
            return 10.0 * (self.index + 1)

    class Rapl:
        name = 'RAPL (1 CPU packages)'

        def __init__(self):
            made.append('rapl')

        def joules(self):
            return 1.5
    monkeypatch.setattr(energy, 'NvmlMeter', Nvml)
    monkeypatch.setattr(energy, 'RaplMeter', Rapl)
    m = energy.EnergyMeter({torch.device('cuda'), torch.device('cuda', 0), torch.device('cuda', 1),
                            torch.device('cpu')})
    assert sorted(made, key=str) == [0, 1, 'rapl'] and m.joules() == 10.0 + 20.0 + 1.5
    assert m.name == 'NVML (GPU 0) + NVML (GPU 1) + RAPL (1 CPU packages)' and m.missing == []
