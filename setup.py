"""apex_lite build script.

Pure Python by default: without the flags below no compiler is touched and torch is not
imported. The native kernels (one extension, ``apex_lite._C``) are built by
torch.utils.cpp_extension with ninja when asked, apex style:

    pip install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" .
    pip install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" \
        --config-settings "--build-option=--cuda_ext" .
    pip install -v --no-build-isolation --global-option=--cpp_ext .        # older pip
    APEX_LITE_CPP_EXT=1 pip install -v --no-build-isolation .              # or APEX_LITE_CUDA_EXT=1
    MAX_JOBS=1 APEX_LITE_CPP_EXT=1 python setup.py build_ext --inplace     # development

``--cpp_ext`` builds the CPU kernels; ``--cuda_ext`` adds the CUDA kernels (and implies
``--cpp_ext``). TORCH_CUDA_ARCH_LIST and MAX_JOBS are honoured (by torch.utils.cpp_extension).

The CPU kernels are vectorised with at::vec::Vectorized for the instruction set chosen at build
time: AVX2 when the building machine has AVX2, FMA and F16C (x86-64), else the portable default.
APEX_LITE_CPU_ARCH=default|avx2 overrides the choice (use "default" for a build that must run on
other, older CPUs). The loader refuses an AVX2 build on a CPU without AVX2 instead of crashing.

Supported torch: TORCH_FLOOR or newer, for the pure install and for the native build alike
(checked before anything is built, from the installed torch's metadata: torch is not imported
for a pure install). The build needs setuptools, and ``wheel`` where setuptools is older than
70.1 (pip's ``--no-build-isolation`` uses what the environment has).
``apex_lite/_build_info.py`` (the record of a native build that the loader reads) is written only
after the extension was built: into the checkout for ``build_ext --inplace``, into the wheel
otherwise; a pure build ships none.
"""
import glob
import importlib.util
import os
import re
import subprocess
import sys

import setuptools
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO_NAME = "_build_info.py"

# The oldest torch apex_lite runs on, pure or built. Older ones lack what it calls: torch 2.4 has
# no public Module.register_load_state_dict_pre_hook / register_state_dict_post_hook (amp's
# hooks on the model), torch 2.3 also no CPU fused optimizer kernels, _foreach_norm(dtype=),
# torch.is_autocast_enabled(device) or torch.library.register_fake. CI checks this floor and the
# newest release its machines' pip serves (tools/check_torch_range.sh, .ci/run).
TORCH_FLOOR = (2, 5)
# setuptools from this version carries bdist_wheel itself; before it, the wheel package does.
SETUPTOOLS_OWN_BDIST_WHEEL = (70, 1)


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _take_flag(flag):
    """True when ``flag`` is among the arguments; removes it so setuptools never sees it."""
    found = flag in sys.argv
    while flag in sys.argv:
        sys.argv.remove(flag)
    return found


def _say(message):
    # setup.py talks to the person running the build; pip shows this with -v.
    print(f"apex_lite setup: {message}", flush=True)


def _stop(message):
    sys.exit(f"apex_lite setup: error: {message}")


def _version_tuple(text):
    """(major, minor) of a version string such as '2.5.1+cu124', or None."""
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _installed_version(distribution):
    """The installed version of ``distribution`` from its metadata (nothing is imported), or
    None when it is not installed."""
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_torch_version(version, native):
    """Stops when ``version`` (the installed torch's, None when torch is not installed yet) is
    older than TORCH_FLOOR; ``native`` says which build was asked for, for the message."""
    found = _version_tuple(version)
    if version is None or found is None or found >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    what = "the native kernels (--cpp_ext/--cuda_ext)" if native else "apex_lite"
    _stop(f"torch {version} is installed, but {what} need torch {floor} or newer (torch "
          f"{found[0]}.{found[1]} lacks APIs apex_lite calls; see TORCH_FLOOR in setup.py). "
          f"Install torch>={floor} first (pip install 'torch>={floor}'), then build again.")


# The setuptools commands that run bdist_wheel: pip's metadata step (dist_info) and its builds.
WHEEL_COMMANDS = ("bdist_wheel", "dist_info", "editable_wheel")


def check_wheel_tool(argv, setuptools_version, wheel_importable):
    """Stops before a wheel build that setuptools cannot make: bdist_wheel (which pip's metadata
    step and build run) needs the ``wheel`` package with setuptools older than 70.1, and pip's
    --no-build-isolation does not install it (without this check: "invalid command
    'bdist_wheel'")."""
    if wheel_importable or not any(command in argv for command in WHEEL_COMMANDS):
        return
    if (_version_tuple(setuptools_version) or (0, 0)) >= SETUPTOOLS_OWN_BDIST_WHEEL:
        return
    _stop(f"building a wheel (what pip install does) with setuptools {setuptools_version} needs "
          f"the 'wheel' package, which is not installed here (pip's --no-build-isolation uses "
          f"the environment's build tools as they are). Run: pip install wheel (or "
          f"pip install 'setuptools>=70.1'), then install again.")


def _cuda_version_tuple(text):
    match = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _check_cuda_toolchain(torch, cpp_extension):
    """Stops before compiling when --cuda_ext cannot work; returns (nvcc path, nvcc version)."""
    if torch.version.cuda is None:
        _stop(f"--cuda_ext was requested but the installed torch {torch.__version__} is a "
              f"CPU-only build (torch.version.cuda is None). Install a CUDA build of torch "
              f"(https://pytorch.org/get-started/locally/) or drop --cuda_ext / "
              f"APEX_LITE_CUDA_EXT to build the CPU kernels only.")
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if not nvcc or not os.path.exists(nvcc):
        _stop(f"--cuda_ext was requested but nvcc was not found (CUDA_HOME={cuda_home!r}). "
              f"Install the CUDA toolkit {torch.version.cuda} matching torch, and set CUDA_HOME "
              f"or put nvcc on PATH; or drop --cuda_ext to build the CPU kernels only.")
    output = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", output)
    nvcc_version = found.group(1) if found else "unknown"
    nvcc_tuple = _cuda_version_tuple(nvcc_version)
    torch_tuple = _cuda_version_tuple(torch.version.cuda)
    if nvcc_tuple is None:
        _stop(f"could not read the CUDA version of {nvcc} (`nvcc --version` said: {output!r})")
    if nvcc_tuple[0] != torch_tuple[0]:
        _stop(f"CUDA major version mismatch: nvcc at {nvcc} is CUDA {nvcc_version} but torch "
              f"{torch.__version__} was built with CUDA {torch.version.cuda}. Point CUDA_HOME at "
              f"a CUDA {torch_tuple[0]}.x toolkit or install a torch built for CUDA "
              f"{nvcc_tuple[0]}.x.")
    if nvcc_tuple[1] != torch_tuple[1]:
        _say(f"warning: CUDA minor version mismatch: nvcc {nvcc_version}, torch built with "
             f"{torch.version.cuda}; this usually works, a matching toolkit is safer.")
    return nvcc, nvcc_version


def cpu_arch():
    """"avx2" or "default": the instruction set the CPU kernels are compiled for."""
    chosen = os.environ.get("APEX_LITE_CPU_ARCH", "").strip().lower()
    if chosen:
        if chosen not in ("avx2", "default"):
            _stop(f"APEX_LITE_CPU_ARCH={chosen!r}; use 'avx2' or 'default'")
        return chosen
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return "default"
    return "avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "default"


def cpu_arch_flags(arch):
    """Compiler flags for ``arch``: at::vec picks its AVX2 specialisations from these macros."""
    if arch == "avx2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def cxx_flags(arch):
    """C++ flags of the CPU kernels (the JIT path in apex_lite/multi_tensor/_jit.py uses them too).

    -fopenmp: at::parallel_for opens its OpenMP region in code inlined from ATen's headers, so
    without it every call runs on one thread. -ffp-contract=off: a*x + b*y must round twice, as
    the Python reference does (-mfma only makes FMA instructions available; with contraction off
    the compiler never forms them)."""
    if sys.platform == "win32":
        return ["/O2", "/fp:precise", "/openmp"]
    return ["-O3", "-fopenmp", "-ffp-contract=off"] + cpu_arch_flags(arch)


# Linking libgomp by its soname binds to the copy torch has already loaded.
LINK_FLAGS = [] if sys.platform == "win32" else ["-fopenmp"]
NVCC_FLAGS = ["-O3", "--fmad=false"]


def _write_build_info(path, torch, with_cuda, nvcc_version, arch):
    # Generated file (git-ignored): lets the loader name a torch version mismatch as such.
    with open(path, "w") as f:
        f.write('"""Generated by setup.py when apex_lite._C was built; do not edit."""\n')
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write(f"TORCH_CUDA_VERSION = {torch.version.cuda!r}\n")
        f.write(f"WITH_CUDA = {with_cuda!r}\n")
        f.write(f"NVCC_VERSION = {nvcc_version!r}\n")
        f.write(f"CPU_ARCH = {arch!r}\n")


def _extensions(cpp_ext, cuda_ext):
    """([extension], cmdclass) for the requested build; ([], {}) for a pure-Python install."""
    if not cpp_ext:
        _say("configuration: pure Python (no --cpp_ext/--cuda_ext, APEX_LITE_CPP_EXT and "
             "APEX_LITE_CUDA_EXT unset); the multi-tensor ops use torch foreach kernels")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        _stop(f"--cpp_ext/--cuda_ext need torch importable at build time ({exc}). Install torch "
              f"first and build with pip's --no-build-isolation.")
    check_torch_version(torch.__version__, True)

    nvcc, nvcc_version = (None, None)
    if cuda_ext:
        nvcc, nvcc_version = _check_cuda_toolchain(torch, cpp_extension)

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    if cuda_ext:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    arch = "default" if sys.platform == "win32" else cpu_arch()
    extra_compile_args = {"cxx": cxx_flags(arch)}
    if cuda_ext:
        extra_compile_args["nvcc"] = NVCC_FLAGS
    make = cpp_extension.CUDAExtension if cuda_ext else cpp_extension.CppExtension
    extension = make("apex_lite._C", sources, extra_compile_args=extra_compile_args,
                     extra_link_args=LINK_FLAGS, include_dirs=[os.path.join(HERE, "csrc")])

    ninja = cpp_extension.is_ninja_available()
    _say("configuration:")
    _say(f"  extension    apex_lite._C with CPU kernels{' and CUDA kernels' if cuda_ext else ''}")
    _say(f"  torch        {torch.__version__} (CUDA {torch.version.cuda})")
    _say(f"  sources      {len(sources)}: {' '.join(sources)}")
    _say(f"  cpu arch     {arch} (APEX_LITE_CPU_ARCH={os.environ.get('APEX_LITE_CPU_ARCH', '')!r})")
    _say(f"  cxx flags    {' '.join(extra_compile_args['cxx'])}")
    if cuda_ext:
        _say(f"  nvcc         {nvcc} (CUDA {nvcc_version}), flags "
             f"{' '.join(extra_compile_args['nvcc'])}")
        _say(f"  arch list    TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '')!r} "
             f"(empty: the visible GPUs', else torch's default list)")
    _say(f"  ninja        {'yes' if ninja else 'NOT FOUND: pip install ninja (falls back to a slow serial build)'}")
    _say(f"  MAX_JOBS     {os.environ.get('MAX_JOBS', '(unset: ninja decides)')}")
    base = cpp_extension.BuildExtension.with_options(use_ninja=ninja)

    class BuildAndRecord(base):
        """torch's build_ext, then the record of what was built (only once it was built: a
        failed build leaves no record that would call a later pure install 'built')."""

        def run(self):
            super().run()
            folder = (os.path.join(HERE, "apex_lite") if self.inplace
                      else os.path.join(self.build_lib, "apex_lite"))
            _write_build_info(os.path.join(folder, BUILD_INFO_NAME), torch, cuda_ext,
                              nvcc_version, arch)

    return [extension], {"build_ext": BuildAndRecord}


class BuildPyWithoutRecords(build_py):
    """build_py that ships no record of a native build: build_ext writes the wheel's own (a
    checkout's apex_lite/_build_info.py is the record of its in-place build). For a pure build it
    also removes a native build's leftovers from the build folder (pip builds in the checkout's
    build/, which a native build filled), which the wheel would otherwise take along."""

    def run(self):
        super().run()
        folder = os.path.join(self.build_lib, "apex_lite")
        leftovers = [os.path.join(folder, BUILD_INFO_NAME)]
        if not self.distribution.ext_modules:
            leftovers += glob.glob(os.path.join(folder, "_C.*"))
        for path in leftovers:
            if os.path.exists(path):
                os.remove(path)


def main():
    # Read (and remove) both flags before setuptools looks at sys.argv.
    cuda_ext = _take_flag("--cuda_ext") | _env_flag("APEX_LITE_CUDA_EXT")
    cpp_ext = _take_flag("--cpp_ext") | _env_flag("APEX_LITE_CPP_EXT") | cuda_ext
    check_wheel_tool(sys.argv, setuptools.__version__,
                     importlib.util.find_spec("wheel") is not None)
    check_torch_version(_installed_version("torch"), cpp_ext)
    ext_modules, cmdclass = _extensions(cpp_ext, cuda_ext)
    cmdclass["build_py"] = BuildPyWithoutRecords
    setup(
        name="apex_lite",
        version="0.1.0",
        description="Mixed-precision training for PyTorch with apex.amp's API",
        packages=find_packages(include=["apex_lite", "apex_lite.*"]),
        python_requires=">=3.9",
        # numpy: torch warns "Failed to initialize NumPy" at import without it.
        install_requires=[f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}", "numpy"],
        extras_require={
            "plot": ["matplotlib"],   # --plot of examples/ and bench/
            # The Sphinx site under docs/ (sphinx-build -W --keep-going -b html docs ...).
            "docs": ["sphinx>=7", "myst-parser>=2", "furo>=2023.9"],
        },
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )


# pip and setuptools run this file as __main__; tests import it to check the toolchain logic.
if __name__ == "__main__":
    main()
