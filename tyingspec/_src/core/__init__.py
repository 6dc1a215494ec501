"""What every kind shares: the case format, the two-path gradient and its references, the
rounding bound, the diagnosis and its labels, rendering, files and options.
"""
