"""Observing one target on one case (call, validate, reference, precision, judge, second call),
and the worker process user code runs in.
"""
