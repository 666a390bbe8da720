"""Training EAGLE / EAGLE-3 draft heads for vLLM (the ``[train]`` extra of vllm-easyspec).

Model, reference checkpoint formats, self-distillation data, the broad corpus, features,
trainer, and the GPU flow. Nothing in the runtime package ``vllm_easyspec`` imports this
package except the ``vllm-easyspec train-eagle`` command.
"""

# Third-party modules this package imports that the runtime package does not. When one is
# missing, ``vllm-easyspec train-eagle`` says to install the extra instead of failing.
TRAIN_EXTRA_MODULES = ("tqdm", "safetensors")
TRAIN_EXTRA_INSTALL = 'pip install "vllm-easyspec[train]"'
