"""Inference engines behind one interface (`Engine`): `hf` (transformers) today."""
