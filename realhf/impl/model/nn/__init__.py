"""The ReaLModel transformer: attention, KV cache, sampling, generation, the chunked output head, CPU kernels."""
