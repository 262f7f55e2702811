"""The experiment configuration, the layer every other one reads: ``schema`` (strict dataclasses from YAML
and ``key=value`` overrides, with errors that name what is accepted), ``entries`` (scheme entries, their
shorthand and the run config; shared with ``benchmarks.seq1d``), ``sections`` (the experiment's sections:
model, data, train, eval, finetune) and ``validation`` (the checks across fields and against vispos's
registry). Imports nothing of the trainer.
"""
