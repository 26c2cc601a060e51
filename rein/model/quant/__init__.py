"""Quantized weights in rein's engine: what is quantized at load (methods), and how checkpoints' quantized
formats are repacked into rein.kernels.quantized.QuantizedWeight (gguf_blocks)."""
