"""Quantized weights in rein's engine: the `--quantization` names (names, torch-free), what is
quantized at load (methods), how checkpoints' quantized formats are repacked into
rein.kernels.quantized.QuantizedWeight (gguf_blocks), and the getters that hand them to a model
(checkpoint)."""
