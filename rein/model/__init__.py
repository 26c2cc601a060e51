"""What a model is and how it is loaded: its files and tokenizer, its spec (family, sizes,
layer shapes), the implementation chosen (rein's native code or the Transformers backend),
its KV-cache capacity, quantized weights, the model code and the tensor-parallel layers.

The engine (rein.engine) asks `rein.model.loader.load_model` for a runnable model and steps
it; nothing here schedules, samples or knows about requests.
"""
