"""Graph keys, length buckets, CUDA-graph capture/replay and torch.compile per bucket."""
