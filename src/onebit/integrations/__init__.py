"""Glue for the trainers that wrap the model in DDP themselves.

``onebit.integrations.transformers`` (needs ``transformers``): :class:`AttachCallback` for
Hugging Face ``Trainer``. Accelerate needs no glue (``onebit.attach(optimizer)`` after
``accelerator.prepare``) and Lightning none at all (it builds the optimizer after wrapping
the model, and the optimizer switches DDP's all-reduce off itself).
"""
