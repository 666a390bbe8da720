"""Tree-attention kernel timings: the CPU path against a naive per-node gather (``cpu``, the default) and the
Triton kernel on a GPU against the bandwidth floor and vLLM's causal attention (``gpu``)."""
