"""Package layout: the Triton kernels live in the top-level ``kernels/`` folder and install as
``vllm_easyspec.kernels``; everything else is found under ``vllm_easyspec/``."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["vllm_easyspec", "vllm_easyspec.*"]) + ["vllm_easyspec.kernels"],
    package_dir={"vllm_easyspec.kernels": "kernels"},
)
