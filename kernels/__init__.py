"""Device-specific compute behind one import boundary.

Import-light on purpose: transformers imports any top-level `kernels` package it finds
(to read its version), so nothing here may raise or pull in optional GPU libraries.
"""
