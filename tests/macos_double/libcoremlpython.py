"""
The double of coremltools' native module, coremltools.libcoremlpython: the pybind11
bindings of Core ML (coremlpython/CoreMLPython.mm, CoreMLPythonArray.mm and
CoreMLPythonUtils.mm in apple/coremltools, tags 8.3 and 9.0). Its classes and methods are
the ones PYBIND11_PLUGIN(libcoremlpython) declares; each behaviour cites what it follows.
coremltools' Python (CompiledMLModel, MLModel, utils.compile_model, compute_plan) runs
above it unchanged. Core ML itself is imitated by the project's NumPy evaluator of MIL
programs, in its ANE mode (plumbing.programs.numpy_predict(ane=True)); CPU_ONLY runs it plainly.
"""
import collections
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref

import numpy as np


def _macos():
    return tuple(int(v) for v in os.environ.get('MACOS_DOUBLE_VERSION', '15.5').split('.'))


def _note(*words):
    """One line in MACOS_DOUBLE_LOG/coreml.log: what Core ML was asked to do (tests read it)."""
    folder = os.environ.get('MACOS_DOUBLE_LOG')
    if folder:
        with open(os.path.join(folder, 'coreml.log'), 'a') as f:
            f.write(' '.join(str(w) for w in (os.getpid(),) + words) + '\n')


def _nserror(description):
    """A Core ML failure as coremltools raises it: Utils::handleError formats the NSError's
    userInfo with %@, a dictionary over several lines (CoreMLPythonUtils.mm)."""
    return RuntimeError('{\n    NSLocalizedDescription = "' + description + '";\n}')


def _is_compiled_path(path):  # Utils::isCompiledModelPath: the name ends in .mlmodelc
    return path.rstrip('/').endswith('.mlmodelc')


def _compile(source):
    """[MLModel compileModelAtURL:] compiles into a new .mlmodelc under the temporary folder
    and returns it (Model::compileModel); coremltools moves it to a destination itself
    (models/utils.py compile_model: shutil.move). This double's .mlmodelc holds the spec
    (coremldata.bin) and the weights."""
    from coremltools.models import MLModel
    try:
        model = MLModel(source, skip_model_load=True)
        spec = model.get_spec()
    except Exception as e:  # Model::Model's wording for a failed compile
        raise RuntimeError(f'Error compiling model: "{e}".') from None
    name = os.path.basename(source.rstrip('/')).rsplit('.', 1)[0] + '.mlmodelc'
    dest = os.path.join(tempfile.mkdtemp(prefix='coreml-double-'), name)
    os.makedirs(dest)
    if model.weights_dir:
        shutil.copytree(model.weights_dir, os.path.join(dest, 'weights'))
    with open(os.path.join(dest, 'coremldata.bin'), 'wb') as f:
        f.write(spec.SerializeToString())
    _note('compile', source)
    return dest


def _load_program(compiled):
    """The MIL program of a compiled model; a damaged one fails to load as Core ML's does,
    with the error's description (Utils::handleError raises it as a RuntimeError)."""
    from coremltools.converters.mil.frontend.milproto.load import load
    from coremltools.proto import Model_pb2
    try:
        spec = Model_pb2.Model()
        with open(os.path.join(compiled, 'coremldata.bin'), 'rb') as f:
            spec.ParseFromString(f.read())
        return load(spec, specification_version=spec.specificationVersion,
                    file_weights_dir=os.path.join(compiled, 'weights'))
    except Exception as e:
        raise _nserror(f"Error opening the compiled model at {compiled}: {type(e).__name__}") from None


class _LateRelease:
    """Core ML keeps predict's input arrays and releases them about a second later, on its
    own queue, without the GIL (coremltools PRs #2827, #2829). Where that release drops the
    last reference, CPython frees the array off the GIL and the heap is corrupted: the
    double makes that a certain crash (SIGSEGV) instead of a possible one."""

    def __init__(self):
        self.held, self.lock, self.thread = collections.deque(), threading.Lock(), None

    def check_not_held(self, name, a):
        """An object Core ML still holds, passed again: two threads then change its reference
        count, the caller's with the GIL and Core ML's queue without it (PR #2827)."""
        with self.lock:
            if any(a is b for _, arrays in self.held for b in arrays.values()):
                sys.stderr.write(f"macOS double: input {name!r} is still held by Core ML from an earlier call: its "
                                 "reference count races with Core ML's late release (coremltools PR #2827)\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSEGV)

    def hold(self, arrays):
        with self.lock:
            self.held.append((time.monotonic() + 1.0, arrays))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name='MLE5ExecutionStream')
                self.thread.start()

    def _run(self):
        while True:
            time.sleep(0.05)
            with self.lock:
                due = []
                while self.held and self.held[0][0] <= time.monotonic():
                    due.append(self.held.popleft()[1])
            for arrays in due:
                names = {k: weakref.ref(a) for k, a in arrays.items()}
                arrays.clear()  # Core ML's release: was it the last reference?
                for name, ref in names.items():
                    if ref() is None:
                        sys.stderr.write(f"macOS double: Core ML released input {name!r} after the caller had freed "
                                         "it: off the GIL that frees it (coremltools PRs #2827, #2829)\n")
                        sys.stderr.flush()
                        os.kill(os.getpid(), signal.SIGSEGV)


_RELEASE = _LateRelease()


class _MLModelProxy:
    """Model in CoreMLPython.mm."""

    def __init__(self, path, compute_units, function_name, optimization_hints, asset=None):
        if asset is not None:
            raise RuntimeError("the macOS double loads models from paths only")
        if compute_units == 'CPU_AND_NE' and _macos() < (13, 0):  # setComputeUnit
            raise RuntimeError("MLComputeUnitsCPUAndNeuralEngine is only available on macOS >= 13.0")
        # a path that is not a .mlmodelc is compiled to a temporary one, deleted with the model
        self.delete = not _is_compiled_path(path)
        self.compiled = _compile(path) if self.delete else path
        self.units, self.last_ns, self.predicts = compute_units, None, 0
        t0 = time.perf_counter_ns()
        self.program = _load_program(self.compiled)
        on_ane = compute_units in ('CPU_AND_NE', 'ALL')
        if on_ane and os.environ.get('MACOS_DOUBLE_FAIL') == 'load':
            raise _nserror(f"Failed to build the model execution plan for the Neural Engine using {self.compiled}: "
                           "the ANE compiler service failed (the double's MACOS_DOUBLE_FAIL=load)")
        if on_ane:  # the ANE compile happens at load, and can take minutes (coremltools #1900)
            time.sleep(float(os.environ.get('MACOS_DOUBLE_LOAD_SECONDS', '0')))
        # a program the ANE compiler gives up on runs on the CPU, without an error (#2758; coreml_and_ane.md section 1)
        self.on_cpu = not on_ane or _falls_back(self.program)
        from plumbing import programs  # the project's NumPy evaluator stands for Core ML's execution
        self.run = programs.numpy_predict(self.program, ane=not self.on_cpu)
        self.load_ns = time.perf_counter_ns() - t0
        _note('load', self.compiled, compute_units, 'CPU' if self.on_cpu and on_ane else '')

    def __del__(self):  # ~Model: a model compiled at load deletes its temporary .mlmodelc
        if getattr(self, 'delete', False):
            shutil.rmtree(os.path.dirname(self.compiled), ignore_errors=True)

    def predict(self, data, state=None):
        if state is not None:
            raise RuntimeError("the macOS double has no stateful models")
        if self.units in ('CPU_AND_NE', 'ALL') and os.environ.get('MACOS_DOUBLE_FAIL') == 'sigkill' and not self.predicts:
            os.kill(os.getpid(), signal.SIGKILL)  # coremltools #2758: the load "succeeded"
        self.predicts += 1
        f = self.program.functions['main']
        features = {}
        for name, v in data.items():  # Utils::dictToFeatures converts every entry
            if isinstance(v, np.ndarray):
                _RELEASE.check_not_held(name, v)
            features[name] = _feature(name, v)
        held, wrapped = {}, {}
        for name, var in f.inputs.items():
            if features.get(name) is None:  # Core ML checks the inputs against the model's description
                raise _nserror(f"Required input feature not passed to the model: {name}")
            if not isinstance(features[name], np.ndarray):
                raise _nserror(f"The input feature {name} is a {type(features[name]).__name__}; the model "
                               "description specifies a MultiArray")
            if features[name].shape != tuple(var.shape):
                raise _nserror(f"MultiArray shape {features[name].shape} of input {name} does not match the shape "
                               f"{tuple(var.shape)} specified in the model description")
            held[name], wrapped[name] = data[name], features[name]  # wrapped without a copy (deallocator:nil)
        t0 = time.perf_counter_ns()
        out = self.run(wrapped)  # converts each input to the program's declared type (fp16)
        if self.on_cpu:  # the CPU's pace against the ANE's: no source gives it for these programs
            time.sleep((time.perf_counter_ns() - t0) / 1e9 * (float(os.environ.get('MACOS_DOUBLE_CPU_SLOWDOWN', '1')) - 1))
        self.last_ns = time.perf_counter_ns() - t0
        _RELEASE.hold(held)
        # fp16 outputs come back as new fp32 arrays (CoreMLPythonUtils.mm convertArrayToPython)
        return {k: np.array(v, dtype=np.float32) if v.dtype == np.float16 else np.array(v) for k, v in out.items()}

    def batchPredict(self, batch):
        return [self.predict(d) for d in batch]

    def get_compiled_model_path(self):
        return self.compiled

    def get_load_duration_in_nano_seconds(self):
        return self.load_ns

    def get_last_predict_duration_in_nano_seconds(self):
        return self.last_ns

    @staticmethod
    def compileModel(path):
        if not os.path.exists(path):  # compileModelAtURL's error, through handleError
            raise _nserror(f"no model at {path}")
        return _compile(path)

    @staticmethod
    def maximum_supported_specification_version():  # the SDK's newest, fixed at build time (9.0: macOS 15)
        return 9

    @staticmethod
    def auto_set_specification_version(spec):
        return spec

    @staticmethod
    def get_compute_plan(path, compute_units):
        """Model::getComputePlan: MLComputePlan needs macOS 14.4; its Python objects are
        coremltools' own classes, built as toPythonObject builds them."""
        if _macos() < (14, 4):
            raise RuntimeError("MLComputePlan is only available on macOS >= 14.4")
        from coremltools.models import compute_plan as cp
        program = _load_program(path)
        f = program.functions['main']
        typed = lambda names: [cp.MLModelStructureProgramNamedValueType(n, cp.MLModelStructureProgramValueType())
                               for n in names]
        ops = [cp.MLModelStructureProgramOperation({}, op.op_type, typed(o.name for o in op.outputs), [],
                                                   _MLModelStructureProgramOperationProxy(op.op_type))
               for op in f.operations]
        block = cp.MLModelStructureProgramBlock(typed(f.inputs), ops, [v.name for v in f.outputs])
        structure = cp.MLModelStructure(None, cp.MLModelStructureProgram(
            {'main': cp.MLModelStructureProgramFunction(typed(f.inputs), block)}), None)
        # the plan of a fallen-back program says CPU, unless the switch hides it
        hidden = os.environ.get('MACOS_DOUBLE_ANE_FALLBACK') == 'hidden'
        fell = compute_units in ('CPU_AND_NE', 'ALL') and _falls_back(program) and not hidden
        units = 'CPU_ONLY' if fell else compute_units
        return cp.MLComputePlan(_MLComputePlanProxy(structure, units, sum(op.op_type != 'const' for op in f.operations)))

    @staticmethod
    def get_model_structure(path):
        return _MLModelProxy.get_compute_plan(path, 'ALL').model_structure

    @staticmethod
    def get_available_compute_devices():
        return _devices()

    @staticmethod
    def get_all_compute_devices():
        return _devices()

    @staticmethod
    def create_model_asset_from_path(path):
        raise RuntimeError("the macOS double has no model assets")

    @staticmethod
    def create_model_asset_from_memory(spec, blobs):
        raise RuntimeError("the macOS double has no model assets")


def _feature(name, v):
    """What Utils::convertValueToObjC makes of one entry (coremltools 9.0 CoreMLPythonUtils.mm):
    a Python int, float, str or dict is a feature of its own type; a list or tuple becomes
    nil, so the entry is dropped; an object with the buffer protocol is wrapped as an
    MLMultiArray (PybindCompatibleArray, CoreMLPythonArray.mm), else "value type not
    convertible". The wrapper takes the type from dtype kind and itemsize alone: int32,
    float32 in either byte order (a byte-swapped one is read as native floats, garbage), and
    float64; it needs mutable_data(), so a read-only array fails; each stride is divided as an
    unsigned size_t, so a negative one becomes ~2^62 elements."""
    if isinstance(v, (bool, int, float, str, bytes)) and not isinstance(v, np.generic) or isinstance(v, np.float64):
        return v
    if isinstance(v, dict):
        return v
    if isinstance(v, (list, tuple)):
        return None
    if isinstance(v, np.ndarray) and v.ndim > 0 and v.flags.writeable and (
            (v.dtype.kind, v.dtype.itemsize) in (('i', 4), ('f', 4), ('f', 8))):
        if any(st < 0 for st in v.strides):
            sys.stderr.write(f"macOS double: input {name!r} has a negative stride, which CoreMLPythonArray.mm "
                             "turns into ~2^62 elements: Core ML reads far outside the array\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSEGV)
        return v if v.dtype.isnative else v.view(v.dtype.newbyteorder('='))  # the bytes, read as native
    print("Error: value type not convertible:")
    print(repr(v)[:200])
    raise RuntimeError("value type not convertible")


def _cpu_ops():
    """The op types the compute plan puts on the CPU: those the ANE has no unit for (gather,
    scatter, one_hot: coreml_and_ane.md section 2, from ANEForge's op catalog and
    hollance/neural-engine), and MACOS_DOUBLE_CPU_OPS."""
    known = {'gather', 'gather_nd', 'gather_along_axis', 'scatter', 'scatter_nd', 'scatter_along_axis', 'one_hot'}
    return known | {t for t in os.environ.get('MACOS_DOUBLE_CPU_OPS', '').split(',') if t}


def _falls_back(program):
    """Whether a CPU_AND_NE load of this program runs it all on the CPU, silently: one whose
    live memory passes the ANE's address space (coreml_and_ane.md section 1, from
    smpanaro/more-ane-transformers), by the project's own estimate; or any, under
    MACOS_DOUBLE_ANE_FALLBACK=1 (the ANE compiler's failures have no public list). With
    MACOS_DOUBLE_ANE_FALLBACK=hidden the compute plan still says the Neural Engine: whether a
    real plan shows a failed ANE compile is not documented, so only the time can tell."""
    from plumbing import programs
    return (os.environ.get('MACOS_DOUBLE_ANE_FALLBACK') in ('1', 'hidden')
            or programs.live_bytes(program.functions['main']) > programs.ANE_MEMORY)


class _MLCPUComputeDeviceProxy:
    pass


class _MLGPUComputeDeviceProxy:
    pass


class _MLNeuralEngineComputeDeviceProxy:
    def get_total_core_count(self):
        return 16


def _devices():
    """The compute devices as coremltools' classes (MLComputeDevice needs macOS 14.0)."""
    if _macos() < (14, 0):
        raise RuntimeError("MLComputeDevice is only available on macOS >= 14.0")
    from coremltools.models import compute_device as cd
    return [cd.MLCPUComputeDevice(_MLCPUComputeDeviceProxy()), cd.MLGPUComputeDevice(_MLGPUComputeDeviceProxy()),
            cd.MLNeuralEngineComputeDevice(_MLNeuralEngineComputeDeviceProxy())]


class _MLModelStructureProgramOperationProxy:
    def __init__(self, op_type):
        self.op_type = op_type


class _MLModelStructureNeuralNetworkLayerProxy:
    pass


class _MLComputePlanProxy:
    """ComputePlan: each op's device (_cpu_ops() on the CPU, the rest on the Neural Engine;
    CPU_ONLY, or a program that falls back, all on the CPU) and an equal share of the
    estimated cost."""

    def __init__(self, structure, compute_units, n_ops):
        self.model_structure, self.units, self.n_ops = structure, compute_units, n_ops

    def get_compute_device_usage_for_mlprogram_operation(self, operation):
        from coremltools.models import compute_plan as cp
        op_type = operation.__proxy__.op_type
        if op_type == 'const':
            return None
        cpu, _, ane = _devices()
        on_cpu = self.units == 'CPU_ONLY' or op_type in _cpu_ops()
        return cp.MLComputePlanDeviceUsage(cpu if on_cpu else ane, [cpu] if self.units == 'CPU_ONLY' else [cpu, ane])

    def get_compute_device_usage_for_neuralnetwork_layer(self, layer):
        return None

    def get_estimated_cost_for_mlprogram_operation(self, operation):
        from coremltools.models import compute_plan as cp
        return None if operation.__proxy__.op_type == 'const' else cp.MLComputePlanCost(1.0 / self.n_ops)


class _State:
    pass


class _MLModelAssetProxy:
    pass
