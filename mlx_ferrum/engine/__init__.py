"""Engine: requests -> scheduler -> executor -> sampler -> detokenizer."""
