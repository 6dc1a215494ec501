"""The fused linear-cross-entropy kind: its reference, derivation, cases and judgement, call
and zoo.
"""
