"""The adapter kinds: ``table`` names each kind and loads it on first use; each kind lives in
its own folder and imports no other kind's modules.
"""
