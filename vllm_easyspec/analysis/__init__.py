"""Offline analyses of fuzzy drafting on transformers models (EasySpec Table 4)."""
