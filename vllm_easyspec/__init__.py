"""vllm-easyspec: lossless speculative decoding extensions for vLLM 0.32 / 0.33 (EasySpec fuzzy layer-parallel
drafting with bonus calibration, EAGLE heads, token trees)."""

__version__ = "0.1.0"
