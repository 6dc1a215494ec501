"""tyingspec: verify tied-embedding gradients row by row."""
