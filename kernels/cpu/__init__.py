"""C++ CPU kernels (JIT-built with torch's extension tooling) and the code that picks them.

Import-light: nothing here builds or imports torch until a backend asks for an op.
"""
