"""``phalanx bench`` targets: each runs phalanx and the PyTorch baseline in one invocation."""
