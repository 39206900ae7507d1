"""Studies over the RL parts: the mismatch study, sparse guidance's calibration and bytes, and
the comparison of arms (with the post-training quantization arms' evaluation)."""
