"""realhf package. `pip install -e .` installs the CPU core; `pip install -e .[gpu]` adds GPU-only parts."""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))


def read_requirements():
    with open(os.path.join(here, "requirements.txt")) as f:
        return [l.split("#")[0].strip() for l in f if l.split("#")[0].strip()]


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
        # Imported lazily; never needed on CPU.
        "gpu": ["flash-attn>=2.5", "vllm", "megatron-core>=0.8"],
        "sglang": ["sglang"],
        "ray": ["ray>=2.9"],
    },
)
