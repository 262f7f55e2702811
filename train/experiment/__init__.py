"""A whole run: ``loading`` (a config read and checked against the data and the models) and ``run``
(``run_experiment``: every scheme trained, evaluated and reported, over seeds). The top layer under the
command lines; imports every other subpackage.
"""
