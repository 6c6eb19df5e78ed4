"""Pallas kernels for the exact chunked delta family (DeltaNet, Gated DeltaNet, KDA) on GPU and TPU."""
