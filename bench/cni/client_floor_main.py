"""A frozen Python program that does nothing: the least a Python plugin process costs (the
bootloader, the interpreter's start-up; it leaves as tabby's binaries do, without the
interpreter's teardown), built by ``bench/cni/client_floor.py``."""

import os

os._exit(0)
