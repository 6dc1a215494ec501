"""The front ends: the command line, the one-call API, the pytest plugin with its suite and
baseline gate, and the kill matrix.
"""
