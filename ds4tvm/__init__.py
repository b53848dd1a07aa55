"""ds4tvm: compile the DS4 model families with Apache TVM and run them with speculative decoding.

Importing this package must stay cheap: TVM is imported lazily, inside the commands that need it.
"""

__version__ = "0.7.0"
