"""Images to batches: ``datasets`` (what every dataset gives: images in memory or in files, the bundle, the
data errors), ``sources`` (Fashion-MNIST, folder trees, ``build_data``), ``grid_tasks`` (the generated
position tasks), ``transforms`` (normalisation, the protocols' geometry, augmentation) and ``loaders``
(training and evaluation batches). Imports ``train.runtime`` and ``train.config``.
"""
