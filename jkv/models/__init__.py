"""Small decoders with random weights that run end to end on jkv's caches: a Llama-style
GQA model (:mod:`jkv.models.llama`) and a DeepSeek-style MLA model
(:mod:`jkv.models.deepseek`). Each has a no-cache full recompute (the ground truth) and a
cached decode path; tests and ``python -m jkv`` check one against the other."""
