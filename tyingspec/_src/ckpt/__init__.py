"""``tyingspec ckpt``: a checkpoint's tie read, inspected and converted.
"""
