import os
import re

from setuptools import find_packages, setup


def _version() -> str:
    """The one version string, sacpass/_version.py's __version__ (read as text: setup.py never imports torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sacpass", "_version.py")
    with open(path) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


setup(
    name="sacpass",
    version=_version(),
    description="Selective activation checkpointing under torch.compile, decided in the AOTAutograd joint graph",
    packages=find_packages(include=["sacpass", "sacpass.*", "glm52_model", "glm52_model.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",  # CustomPartitionerFn and the checkpoint tags sacpass sets; newer releases warn until tested
        "numpy",  # only to silence torch's "Failed to initialize NumPy" warning at import; sacpass never uses it
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # the README's test command runs two workers (-n 2 --dist loadfile)
            "hypothesis>=6",  # property-based tests of the pass (tests/test_fuzz.py)
            "expecttest==0.3.0",  # golden graphs, inline (assertExpectedInline) and in files (sacpass.testing)
            "transformers==5.24.0",  # the checks on its GLM-5 DSA model (tests/test_discrete.py)
            "matplotlib>=3.8",  # the results page's plots, drawn and checked by tests/test_results_page.py
        ],
        "cuda": ["tilelang==0.1.15"],  # TileLang kernels for the H200 (built in CI, run on the GPU)
        # sacpass.integrations.torchtitan (docs/torchtitan.md); triton: its MoE imports it, also without a GPU
        "torchtitan": ["torchtitan==0.3.0", "triton==3.9.0"],
    },
    entry_points={
        "torch_dynamo_backends": ["sacpass = sacpass.compiler:sacpass_backend"],
        "console_scripts": ["sacpass = sacpass.__main__:main"],
    },
)
