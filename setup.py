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
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(HERE, "apex_lite", "_build_info.py")


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


def _write_build_info(torch, with_cuda, nvcc_version, arch):
    # Generated file (git-ignored): lets the loader name a torch version mismatch as such.
    with open(BUILD_INFO, "w") as f:
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
    _write_build_info(torch, cuda_ext, nvcc_version, arch)
    cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=ninja)}
    return [extension], cmdclass


def main():
    # Read (and remove) both flags before setuptools looks at sys.argv.
    cuda_ext = _take_flag("--cuda_ext") | _env_flag("APEX_LITE_CUDA_EXT")
    cpp_ext = _take_flag("--cpp_ext") | _env_flag("APEX_LITE_CPP_EXT") | cuda_ext
    ext_modules, cmdclass = _extensions(cpp_ext, cuda_ext)
    setup(
        name="apex_lite",
        version="0.1.0",
        description="Mixed-precision training for PyTorch with apex.amp's API",
        packages=find_packages(include=["apex_lite", "apex_lite.*"]),
        python_requires=">=3.9",
        # numpy: torch warns "Failed to initialize NumPy" at import without it.
        install_requires=["torch>=2.3", "numpy"],
        extras_require={"plot": ["matplotlib"]},   # --plot of examples/ and bench/
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )


# pip and setuptools run this file as __main__; tests import it to check the toolchain logic.
if __name__ == "__main__":
    main()
