"""A kernel adapter: the piece llm.c-style code and fused loss kernels implement.

    tyingspec check examples.kernel.combine:combine --kind kernel

It combines the upstream gradient of the looked-up rows dx [N, d] (s_in already applied), the
hidden states h [N, d] and the logit gradient g [N, V] into the tied matrix's gradient [V, d].
"""

import numpy as np


def combine(tokens, dx, h, g, vocab_size):
    dE = g.T @ h                                    # output path
    np.add.at(dE, np.asarray(tokens).reshape(-1), dx)   # input path: repeated tokens add
    return dE
