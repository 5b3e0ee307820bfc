"""Protobuf wire formats (``persist.proto``) and their generated Python module."""
