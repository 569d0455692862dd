"""Models: the built-in character tokenizer and tiny Llama (tiny.py), its cached supervised
warm start (warmstart.py), loading Hugging Face checkpoint directories (loading.py), the policy
a run starts from (policy.py) and the device it lives on (device.py, `model.device`).

The package itself imports nothing, so that a generation backend can load a checkpoint
(loading.py) without pulling in the warm start, which samples with a generator.
"""
