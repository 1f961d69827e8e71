from setuptools import find_packages, setup

setup(
    name="sacpass",
    version="0.1.0",
    description="Selective activation checkpointing under torch.compile, decided in the AOTAutograd joint graph",
    packages=find_packages(include=["sacpass", "sacpass.*", "glm52_model", "glm52_model.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy"],
    extras_require={
        # transformers: the checks on its GLM-5 DSA model (tests/test_discrete.py)
        "test": ["pytest>=8", "hypothesis>=6", "expecttest==0.3.0", "transformers==5.24.0"],
        "cuda": ["tilelang==0.1.15"],  # TileLang kernels for the H200 (built in CI, run on the GPU)
    },
    entry_points={
        "torch_dynamo_backends": ["sacpass = sacpass.backend:sacpass_backend"],
        "console_scripts": ["sacpass = sacpass.__main__:main"],
    },
)
