"""Vision-language models: the model-side protocol the engine drives (`base`), the image
processor that turns a prompt's images into token ids and encoder inputs (`processor`), and the
families rein runs (Qwen2-VL / Qwen2.5-VL: `qwen2_vl`)."""
