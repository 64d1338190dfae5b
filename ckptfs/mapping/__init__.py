"""Mapping core: Cerebras checkpoint tensors and params -> Hugging Face tensors and config, lazily.

Modules: ``ops`` (virtual-tensor operations), ``floats`` (torch-exact element arithmetic), ``pattern``
and ``expr`` (the YAML's key patterns and expressions), ``spec`` (YAML loading/validation), ``registry``
(finds ``mappings/*.yaml``; ``list_models``), ``params`` (finds the CS params), ``config`` (CS -> HF
config), ``rules`` (the tensor rule engine), ``hfmodel`` (``HFModel`` and ``map_model``, the one path from CS
tensors to an HF model folder), ``components`` (multi-component checkpoints), ``detect`` (``detect_family``) and
``convert`` (``to_hf``).
"""
