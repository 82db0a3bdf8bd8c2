"""tabby: a Calico-style pod network (CNI plugin, block IPAM, operator CLI)."""

__version__ = "0.1.0"
