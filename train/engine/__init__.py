"""What trains: ``models`` (the timm ViT with a vispos scheme on it), ``optim`` and ``schedule`` (timm's
optimiser, the warm-up + cosine schedule shared with the benchmarks), ``checkpoint`` and ``sharded`` (single
file and DCP checkpoints), ``trainer`` (one scheme's training, exact resume) and ``finetune``
(fine-tune-at-target). Imports every layer below: ``train.evaluation``, ``train.data``, ``train.runtime``,
``train.config``.
"""
