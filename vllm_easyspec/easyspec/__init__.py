"""EasySpec (Wu et al., NeurIPS 2025) as pure, engine-free code.

* :mod:`.config`: the plugin's user options (``additional_config["easyspec"]``), validated.
* :mod:`.layer_grouping`: which draft attention layers share one stale hidden state (section 3.1.1).
* :mod:`.fuzzy_forward`: the fuzzy decoder forward, the paper's Algorithm 2.
* :mod:`.calibration`: bonus calibration, i.e. which draft forward of a step runs exact.

The vLLM side (draft model instances, the proposer) lives in :mod:`vllm_easyspec.integration`.
"""
