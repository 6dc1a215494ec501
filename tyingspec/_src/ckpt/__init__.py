"""``tyingspec ckpt``: inspect the tie in a checkpoint, convert between tied and untied.

Real bugs in this class: the tie source picked by key order (an embedding loaded from
``lm_head.weight``), a tied head missing from the file and left at its random init, safetensors
refusing shared tensors, a config saying ``tie_word_embeddings`` over two different matrices.

Files are read only through ``safetensors`` and ``torch.load(weights_only=True)``: nothing
else is ever unpickled (a GGUF file is named and refused).  A sharded checkpoint (an index
JSON with a ``weight_map``) is read as one.  Which tensors are tied is read from the classes
transformers installs (``ckpt.pairs``: each model's ``_tied_weights_keys``); names that cannot
be paired are bad input, never a tie.  Every write goes to a temporary file beside OUT and is
renamed over it, so an interrupted run leaves no half-written OUT; the input is never
overwritten.  SIGTERM removes that temporary file before the process ends; a failed write (a
full disk) leaves the previous OUT whole; OUT keeps the mode of the file it replaces; a device
or pipe, or one of the command's own streams (``/dev/stdout``, also when it is redirected to a
file), is written in place, as a stream, never replaced by a regular file.  An output that
names an input, by any path or hard link, is refused.

Exit codes: 0 tied or consistent, 1 only a tie that is wrong (two different matrices under a
config that ties them, a lost key the config needs, ``--policy refuse`` refusing), 2 bad input
or usage, one line naming the file or option, what was expected and what was found.  The file
is untrusted input: whatever its parser raises (torch's zip reader, the weights-only
unpickler, the JSON reader) is such a line, never a traceback.  So is whatever the user's
``--evaluate`` factory raises, ``sys.exit`` included.
"""
