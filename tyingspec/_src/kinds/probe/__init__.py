"""The model and kernel kinds (the probe model): the registry of built-in targets, the correct
implementations and the mutant zoo.
"""
