"""
A double of macOS for the tests: only what Linux lacks, installed in every Python process
that has this folder on PYTHONPATH and HETERO_MACOS_DOUBLE=1 (spawned children included,
since they inherit both).

- The OS identity: sys.platform 'darwin' (what coremltools' models/utils.py _is_macos and
  _deps/__init__.py, the project's settings.ON_MAC and multiprocessing read),
  platform.mac_ver() (coremltools' _deps reads the version there), sw_vers (utils.py
  _macos_version runs `sw_vers -productVersion`) and sysctl on PATH.
- Core ML's native runtime under coremltools: the module coremltools.libcoremlpython
  (libcoremlpython.py beside this file). coremltools' own Python runs above it unchanged.
- powermetrics and sudo on PATH (bin/).
- PyTorch's MPS backend, installed once torch is imported (torch_mps.py): the GPU engine on the CPU.

Switches, all environment variables:
  MACOS_DOUBLE_VERSION   the macOS version (default 15.5)
  MACOS_DOUBLE_MACHINE   arm64 (default) or x86_64 (an Intel Mac)
  MACOS_DOUBLE_ROSETTA   1: with x86_64, an Apple Silicon Mac running this Python under Rosetta
  MACOS_DOUBLE_NATIVE    0: no libcoremlpython, as coremltools installed from its sdist
  MACOS_DOUBLE_CPU_OPS   op types the compute plan puts on the CPU, comma-separated, besides
                         those the ANE has no unit for (gather, scatter, one_hot)
  MACOS_DOUBLE_FAIL      load: the Neural Engine compile fails at load with an exception;
                         sigkill: the load succeeds and the first predict kills the process
  MACOS_DOUBLE_LOAD_SECONDS  seconds each Neural Engine load takes (its compile)
  MACOS_DOUBLE_ANE_FALLBACK  1: a Neural Engine load runs the program on the CPU, silently
  MACOS_DOUBLE_CPU_SLOWDOWN  a program on the CPU predicts this many times slower (default 1)
  MACOS_DOUBLE_SUDO      1: sudo -n has rights (default: none, as on most Macs)
  MACOS_DOUBLE_WATTS     CPU,GPU,ANE milliwatts powermetrics reports (default 3000,9000,1500)
  MACOS_DOUBLE_LOG       a folder: the double notes compiles, loads and powermetrics there
  MACOS_DOUBLE_MPS       0: no MPS (torch.backends.mps.is_available() False, as on Linux)
  MACOS_DOUBLE_MPS_COPY  retain: non-blocking copies keep their source (the fixed Copy.mm)
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class NativeFinder(importlib.abc.MetaPathFinder):
    """Serves coremltools.libcoremlpython from libcoremlpython.py here: Linux wheels of
    coremltools ship libmilstoragepython and libmodelpackage but not the Core ML bindings."""

    def find_spec(self, name, path=None, target=None):
        if name == 'coremltools.libcoremlpython':
            return importlib.util.spec_from_file_location(name, os.path.join(HERE, 'libcoremlpython.py'))
        return None


class AfterTorch(importlib.abc.MetaPathFinder):
    """Imports torch as usual, then installs the MPS double on it (torch_mps.py)."""

    def find_spec(self, name, path=None, target=None):
        if name != 'torch':
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch_mps
            torch_mps.install()
        spec.loader.exec_module = exec_module
        return spec


def install():
    # Two stdlib modules load macOS-only parts when sys.platform is darwin: urllib.request
    # (_scproxy) and sysconfig (_sysconfigdata__darwin_*); load them under the real identity
    import sysconfig
    import urllib.request  # noqa: F401
    sysconfig.get_config_vars()
    sys.platform = 'darwin'
    version, machine = os.environ.get('MACOS_DOUBLE_VERSION', '15.5'), os.environ.get('MACOS_DOUBLE_MACHINE', 'arm64')
    platform.mac_ver = lambda release='', versioninfo=('', '', ''), machine_='': (version, ('', '', ''), machine)
    bin_dir = os.path.join(HERE, 'bin')
    if not os.environ['PATH'].startswith(bin_dir + os.pathsep):
        os.environ['PATH'] = bin_dir + os.pathsep + os.environ['PATH']
    if os.environ.get('MACOS_DOUBLE_NATIVE', '1') == '1':
        sys.meta_path.insert(0, NativeFinder())
    if os.environ.get('MACOS_DOUBLE_MPS', '1') == '1':
        sys.meta_path.insert(0, AfterTorch())


if os.environ.get('HETERO_MACOS_DOUBLE') == '1':
    install()
