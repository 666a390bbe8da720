"""The seam inventory of vllm-easyspec and its check against a vLLM tree (tools/seams/README.md)."""
