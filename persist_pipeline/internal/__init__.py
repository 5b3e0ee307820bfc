"""Internals: the state model, pure transitions, the Spine, codecs and the CaS loop.

Nothing here is public API; import from :mod:`persist_pipeline` instead.
"""
