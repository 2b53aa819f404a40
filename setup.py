"""apex_lite build script: pure Python by default."""
from setuptools import find_packages, setup

setup(
    name="apex_lite",
    version="0.1.0",
    description="Mixed-precision training for PyTorch with apex.amp's API",
    packages=find_packages(include=["apex_lite", "apex_lite.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.3"],
)
