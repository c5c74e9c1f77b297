"""The user's model and inputs on fake tensors: shapes and dtypes, no memory, never the real weights.

* ``request.py`` — what to estimate: the model's source, the inputs, the loss;
* ``convert.py`` — the model and inputs made fake; ``known_values.py`` — real values kept beside small fake tensors;
* ``frameworks.py`` — what libraries of models do differently on fake tensors; ``scripted.py`` — TorchScript modules;
* ``quantize.py`` and ``lora.py`` — quantized weights and LoRA adapters on fake tensors.
"""
