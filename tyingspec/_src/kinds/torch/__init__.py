"""The torch kind: a model's tie found, every use of it observed, the path that trains checked,
and the built-in torch models.
"""
