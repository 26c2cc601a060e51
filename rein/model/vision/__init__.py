"""Vision-language models: the model-side protocol the engine drives (`base`), the image
processor that turns a prompt's images into token ids and encoder inputs (`processor`), and the
families rein runs (Qwen2-VL / Qwen2.5-VL: `qwen2_vl`).

Adding a family (LLaVA, Idefics3 / SmolVLM, Gemma 3, ...) touches these places, nothing in the
engine:

* rein/model/spec.py -- its architecture name in SUPPORTED_ARCHITECTURES and its family in
  VISION_FAMILIES (the text fields are read from `text_config`; the whole config.json is kept in
  ModelSpec.vision_config for the vision tower);
* rein/model/architectures/__init__.py -- NATIVE_MODELS: family -> the model class, which
  implements rein.model.vision.base.VisionLanguageModel (`image_token_id`,
  `image_tokens_whole_chunk`, `encode_images`, `embed_input_ids`, `forward(..., inputs_embeds=)`,
  `mrope_positions` returning None for 1-D positions) and loads both checkpoint key layouts
  (rein.model.vision.base.checkpoint_prefixes helps);
* processor.py -- PROCESSORS: model_type -> a VisionProcessor subclass (`placeholder`,
  `image_token_id`, `count_tokens`, `tokens_of`, `replacement`, `pixel_inputs`, `grid`);
* rein/fixtures/tiny_vision.py -- FAMILIES: a builder writing the tiny checkpoint, tokenizer
  special tokens, chat template placeholder and processor files.

tests/unit/test_vision_engine.py shows the checks a family passes (greedy parity with
transformers' generate() under chunking, prefix caching and preemption).
"""
