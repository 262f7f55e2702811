"""What a trained model scores and how it is written down: ``accuracy`` (top-1 per protocol and size),
``results`` (the typed results and results.json, means over seeds) and ``report`` (results.md and
accuracy.png). Imports ``train.data``, ``train.runtime`` and ``train.config``; the engine imports it for its
accuracy and its training summary.
"""
