"""ddtree-diag: is this speculative-decoding deployment healthy?"""

__version__ = "0.1.0"
