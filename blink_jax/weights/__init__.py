"""Weights: our checkpoint format and catalog (`checkpoint`) and the converters from GGUF,
Hugging Face safetensors and Gemma Flax checkpoints (`convert`)."""
