"""Package layout: ``vllm_easyspec`` (the runtime plugin, its Triton kernels in ``vllm_easyspec/kernels``)
and ``vllm_easyspec_train`` (EAGLE head training; its third-party needs are the ``[train]`` extra)."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["vllm_easyspec", "vllm_easyspec.*", "vllm_easyspec_train",
                                      "vllm_easyspec_train.*"]))
