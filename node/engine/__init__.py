"""Inference engines behind one interface (:class:`Engine`), chosen by :func:`create_engine`.

* ``base.py`` — :class:`Engine`, :class:`Generation`, :class:`SamplingParams`.
* ``hf.py`` — :class:`TransformersEngine`: batched KV-cache generation on CPU or GPU.
* ``vllm_engine.py`` — the vLLM engine (optional extra ``gpu``, imported lazily).
"""

from node.engine.base import Engine, Generation, SamplingParams, create_engine

__all__ = ["Engine", "Generation", "SamplingParams", "create_engine"]
