"""embbench: which embedding-table placement is fastest for my tables, data and GPUs?"""

__version__ = "0.1.0"
